"""nginx (Debian's package) in front of replicas on loopback, with deploy/nginx.conf, the file
docker-compose.yml mounts: only its upstream servers and listen address are swapped for loopback
ones, and its pid, logs and temp files go to a temporary directory."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx

from tests.redis_server import stop_process

CONFIG = Path(__file__).resolve().parent.parent / "deploy" / "nginx.conf"


def find_nginx() -> str | None:
    return shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.access(p, os.X_OK)), None)


def loopback_config(upstreams: list[str], port: int, workdir: Path) -> str:
    """deploy/nginx.conf with `upstreams` ("127.0.0.1:PORT") and 127.0.0.1:`port`."""
    text = CONFIG.read_text()
    servers = "".join(f"        server {u} max_fails=3 fail_timeout=10s;\n" for u in upstreams)
    text, num_upstreams = re.subn(r"(?:        server ragblend-\w:8000[^\n]*\n)+", servers, text)
    text, num_listens = re.subn(r"listen 8000;", f"listen 127.0.0.1:{port};", text)
    if (num_upstreams, num_listens) != (1, 1):
        raise ValueError("deploy/nginx.conf changed shape: update tests/nginx_server.py")
    paths = (f"    client_body_temp_path {workdir}/body;\n    proxy_temp_path {workdir}/proxy;\n"
             f"    fastcgi_temp_path {workdir}/fastcgi;\n    uwsgi_temp_path {workdir}/uwsgi;\n"
             f"    scgi_temp_path {workdir}/scgi;\n    access_log off;\n")
    return text.replace("http {\n", "http {\n" + paths, 1)


class NginxServer:
    def __init__(self, upstreams: list[str], port: int, workdir: Path):
        self.binary = find_nginx()
        if self.binary is None:
            raise FileNotFoundError("nginx is not installed (CI installs it from Debian: apt-get install nginx)")
        self.port, self.workdir = port, workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.config_path = workdir / "nginx.conf"
        self.config_path.write_text(loopback_config(upstreams, port, workdir))
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 10.0) -> None:
        directives = f"daemon off; pid {self.workdir}/nginx.pid; error_log {self.workdir}/error.log;"
        if os.geteuid() == 0:
            directives += " user root;"  # its workers write the temp dirs made here
        self._proc = subprocess.Popen([self.binary, "-p", str(self.workdir), "-c", str(self.config_path),
                                       "-g", directives], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode(errors="replace") if self._proc.stderr else ""
                raise RuntimeError(f"nginx exited with {self._proc.returncode}: {err[-800:]}")
            try:
                httpx.get(f"{self.url}/healthz", timeout=1)
                return
            except httpx.TransportError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"nginx did not answer on port {self.port} within {timeout_s}s")

    def stop(self) -> None:
        stop_process(self._proc)
        self._proc = None
