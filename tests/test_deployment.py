"""docker-compose.yml and deploy/nginx.conf, checked without a container daemon: `docker compose config`
(or Debian's `docker-compose config`, which .ci/run installs: this machine's docker CLI has no compose
plugin) and the file's structure with PyYAML. The topology itself runs for real, without docker, in
tests/test_replicas.py (Postgres, Redis, two replicas, nginx with deploy/nginx.conf). The hardening:
Redis behind a password that reaches the replicas' redis_url, an unprivileged image user, a memory limit
per service, and nginx's per-address rate and concurrency limits, run for real here in front of a stub
upstream (429 in the API's error shape)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import yaml

from blend_engine.config import ModelConfig

ROOT = Path(__file__).resolve().parents[1]
REPLICAS = ("ragblend-a", "ragblend-b")
SECRETS = {"RAGBLEND_API_KEY": "k", "RAGBLEND_DB_PASSWORD": "p", "RAGBLEND_REDIS_PASSWORD": "r3dis-secret"}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def compose_command() -> list[str] | None:
    """A compose implementation that runs here: the docker CLI's plugin, else Debian's `docker-compose`
    (which .ci/run installs). `config` only parses, interpolates and validates: no daemon needed."""
    if shutil.which("docker") is not None:
        done = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True, timeout=30)
        if done.returncode == 0:
            return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") is not None else None


COMPOSE = compose_command()
needs_compose = pytest.mark.skipif(COMPOSE is None, reason="neither `docker compose` nor `docker-compose` here "
                                   "(.ci/run installs Debian's docker-compose)")


def compose_config(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*COMPOSE, "-f", str(ROOT / "docker-compose.yml"), "config", *args],
                          capture_output=True, text=True, env={"PATH": "/usr/bin:/bin:/usr/local/bin", **env},
                          timeout=60)


@needs_compose
def test_docker_compose_config_accepts_the_file():
    done = compose_config(SECRETS, "--quiet")
    assert done.returncode == 0, done.stderr


@needs_compose
@pytest.mark.parametrize("missing", sorted(SECRETS))
def test_docker_compose_config_refuses_a_missing_secret(missing):
    env = dict(SECRETS)
    del env[missing]
    done = compose_config(env, "--quiet")
    assert done.returncode != 0 and missing in done.stderr


@needs_compose
def test_the_redis_password_reaches_redis_and_the_replicas_url():
    """One secret, as Postgres's: Redis requires it, its health check's redis-cli sends it, and the
    replicas' redis_url carries it (the resolved file, as compose would run it)."""
    done = compose_config(SECRETS)
    assert done.returncode == 0, done.stderr
    services = yaml.safe_load(done.stdout)["services"]
    password = SECRETS["RAGBLEND_REDIS_PASSWORD"]
    command = services["redis"]["command"]
    assert command[command.index("--requirepass") + 1] == password
    assert services["redis"]["environment"]["REDISCLI_AUTH"] == password
    for name in REPLICAS:
        assert services[name]["environment"]["RAGBLEND_STORE__REDIS_URL"] == f"redis://:{password}@redis:6379/0"


def test_the_image_copies_every_package_the_project_installs():
    """`pip install .` in the Dockerfile installs what was copied: a package pyproject lists but the
    Dockerfile leaves out is missing from the image (the server then fails to import)."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {pattern.rstrip("*") for pattern in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = set(re.findall(r"^COPY (\S+) \./\1$", (ROOT / "Dockerfile").read_text(), re.M))
    assert packages <= copied, f"not copied into the image: {sorted(packages - copied)}"


def test_compose_topology_is_complete(compose):
    services = compose["services"]
    assert set(services) == {"postgres", "redis", *REPLICAS, "nginx"}
    for name, service in services.items():
        assert service["healthcheck"]["test"], f"{name} has no health check"
        assert service["restart"] == "unless-stopped"
    urls = set()
    for name in REPLICAS:
        replica = services[name]
        assert replica["build"] == "."
        assert {dep: c["condition"] for dep, c in replica["depends_on"].items()} == {
            "postgres": "service_healthy", "redis": "service_healthy"}
        env = replica["environment"]
        assert env["RAGBLEND_DATABASE__URL"].startswith("postgresql://ragblend:")
        assert "@postgres:5432/ragblend" in env["RAGBLEND_DATABASE__URL"]
        assert env["RAGBLEND_STORE__REDIS_URL"] == "redis://:${RAGBLEND_REDIS_PASSWORD:?set RAGBLEND_REDIS_PASSWORD}@redis:6379/0"
        assert ":?" in env["RAGBLEND_SERVER__API_KEY"]
        urls.add(env["RAGBLEND_DATABASE__URL"])
        assert "/readyz" in " ".join(replica["healthcheck"]["test"])
    assert len(urls) == 1  # one shared store
    data_volumes = [v.split(":")[0] for name in REPLICAS for v in services[name]["volumes"]]
    assert len(set(data_volumes)) == 2 and set(data_volumes) <= set(compose["volumes"])  # a data dir each
    assert ":?" in services["postgres"]["environment"]["POSTGRES_PASSWORD"]
    nginx = services["nginx"]
    assert {dep: c["condition"] for dep, c in nginx["depends_on"].items()} == dict.fromkeys(REPLICAS, "service_healthy")
    assert "./deploy/nginx.conf:/etc/nginx/nginx.conf:ro" in nginx["volumes"]


def test_nginx_config_balances_both_replicas_and_streams_unbuffered(compose):
    conf = (ROOT / "deploy" / "nginx.conf").read_text()
    assert re.findall(r"server (ragblend-\w):8000", conf) == list(REPLICAS)
    for directive in ("proxy_buffering off;", "proxy_http_version 1.1;", "listen 8000;"):
        assert directive in conf
    assert "8000:8000" in compose["services"]["nginx"]["ports"][0]
    if shutil.which("nginx") or Path("/usr/sbin/nginx").exists():  # nginx's own parser, where it is installed
        try:
            from tests.nginx_server import find_nginx, loopback_config
        except ImportError:
            from nginx_server import find_nginx, loopback_config
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "nginx.conf"
            path.write_text(loopback_config(["127.0.0.1:1", "127.0.0.1:2"], 8, Path(tmp)))
            directives = f"pid {tmp}/pid; error_log {tmp}/e.log;"
            done = subprocess.run([find_nginx(), "-t", "-p", tmp, "-c", str(path), "-g", directives],
                                  capture_output=True, text=True, timeout=30)
            assert done.returncode == 0, done.stderr


def _bytes(size: str) -> int:
    """'6g' / '256m' / '4gb' in bytes (docker's and Redis's units are powers of 1024)."""
    number, unit = re.fullmatch(r"(\d+)([kmg]?)b?", size.lower()).groups()
    return int(number) << {"": 0, "k": 10, "m": 20, "g": 30}[unit]


def test_redis_requires_a_password_and_drops_root(compose):
    redis_service = compose["services"]["redis"]
    command = redis_service["command"]
    # the image's entrypoint drops root for its `redis` user only when the command starts with redis-server
    assert command[0] == "redis-server"
    assert command[command.index("--requirepass") + 1].startswith("${RAGBLEND_REDIS_PASSWORD:?")
    assert redis_service["environment"]["REDISCLI_AUTH"].startswith("${RAGBLEND_REDIS_PASSWORD:?")


def test_every_service_has_a_memory_limit(compose):
    services = compose["services"]
    limits = {name: _bytes(service["mem_limit"]) for name, service in services.items()}
    assert set(limits) == set(services) and all(limit >= 128 << 20 for limit in limits.values())
    command = services["redis"]["command"]
    assert limits["redis"] > _bytes(command[command.index("--maxmemory") + 1])  # room above its KV bound


def test_the_image_runs_as_an_unprivileged_user():
    dockerfile = (ROOT / "Dockerfile").read_text()
    users = re.findall(r"^USER (\S+)", dockerfile, re.M)
    assert users and users[-1].split(":")[0] not in ("0", "root")  # the last USER is the one that serves
    uid = users[-1].split(":")[0]
    assert re.search(rf"useradd [^\n]*--uid {uid}\b", dockerfile)
    assert "chown ragblend:ragblend /data" in dockerfile  # its data volume is its own
    # the build installs the default model as that user, into the home it serves with
    assert dockerfile.index("USER ") < dockerfile.index(f"RUN ragblend models install {ModelConfig.name}\n")
    # and the embedder's ONNX export (the default runtime), into the cache the server reads
    assert dockerfile.index("USER ") < dockerfile.index("cache_dir=s.retrieval.embedder_cache_dir")


def test_the_images_warm_up_runs_and_fills_the_caches_the_server_reads(tmp_path):
    """The Dockerfile's build-time warm-up, run here as written (its `python -c` step under a fresh
    HOME): it must run (a renamed constructor once broke it unnoticed), and leave the embedder's ONNX export
    where a server started with that HOME looks for it. (The step before it, `ragblend models install`, is a
    1.1 GB download: tests/test_models_command.py holds what it does.)"""
    import sys

    dockerfile = (ROOT / "Dockerfile").read_text()
    step = re.search(r'^RUN python -c "(from configs\.settings.*?)"$', dockerfile, re.M | re.S)
    assert step, "the warm-up step is gone from the Dockerfile"
    code = step.group(1).replace("\\\n", "")  # the step's line continuations
    env = {**os.environ, "HOME": str(tmp_path), "PYTHONPATH": str(ROOT)}
    env.pop("XDG_CACHE_HOME", None)
    for name in [k for k in env if k.startswith("RAGBLEND_")]:
        env.pop(name)  # the image's defaults, not this shell's
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert list((tmp_path / ".cache" / "ragblend" / "embedder").glob("*/export.json"))


def test_nginx_config_limits_requests_and_connections_per_address():
    conf = (ROOT / "deploy" / "nginx.conf").read_text()
    assert re.search(r"limit_req_zone \$binary_remote_addr zone=(\w+):\d+m rate=\d+r/s;", conf)
    assert re.search(r"limit_conn_zone \$binary_remote_addr zone=\w+:\d+m;", conf)
    location = conf[conf.index("location / {"):conf.index("}", conf.index("location / {"))]
    assert re.search(r"limit_req zone=\w+ burst=\d+ nodelay;", location)
    assert re.search(r"limit_conn \w+ \d+;", location)
    assert "limit_req_status 429;" in conf and "limit_conn_status 429;" in conf


# ---- nginx's limits, for real (Debian's nginx, deploy/nginx.conf in front of a stub upstream) ------------

class _Upstream:
    """A stand-in replica: /slow holds its answer until released, anything else answers at once."""

    def __init__(self) -> None:
        release = self.release = threading.Event()
        arrived = self.arrived = threading.Semaphore(0)  # one release per /slow request received

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms delayed-ACK stall

            def do_GET(self):
                if self.path == "/slow":
                    arrived.release()
                    release.wait(60)
                body = b'{"status": "ok"}'
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.address = f"127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def limited_nginx(tmp_path):
    try:
        from tests.nginx_server import NginxServer, find_nginx
    except ImportError:
        from nginx_server import NginxServer, find_nginx
    from app.testing import free_port

    if find_nginx() is None:
        pytest.skip("nginx is not installed (CI installs it from Debian: apt-get install nginx)")
    upstream = _Upstream()
    server = NginxServer([upstream.address], free_port(), tmp_path / "nginx")
    try:
        server.start()
        yield server.url, upstream
    finally:
        server.stop()
        upstream.close()


def _assert_rate_limited(response) -> None:
    assert response.status_code == 429 and response.headers["retry-after"] == "1"
    error = response.json()["error"]
    assert error["type"] == "rate_limit_error" and "too many requests" in error["message"]


def test_nginx_answers_a_burst_past_its_rate_with_429(limited_nginx):
    url, _ = limited_nginx
    conf = (ROOT / "deploy" / "nginx.conf").read_text()
    rate = int(re.search(r"limit_req_zone [^;]* rate=(\d+)r/s;", conf).group(1))
    burst = int(re.search(r"limit_req zone=\w+ burst=(\d+) nodelay;", conf).group(1))
    start = time.monotonic()
    with httpx.Client(timeout=10) as http:
        responses = [http.get(f"{url}/healthz") for _ in range(200)]  # as fast as one client can
    elapsed = time.monotonic() - start
    passed = sum(r.status_code == 200 for r in responses)
    assert all(r.status_code == 200 for r in responses[:burst])  # the burst is served at once...
    assert passed <= burst + 1 + rate * elapsed + 2  # ...then no more than the rate lets through
    for refused in (r for r in responses if r.status_code != 200):
        _assert_rate_limited(refused)


def test_nginx_answers_requests_past_its_concurrency_with_429(limited_nginx):
    url, upstream = limited_nginx
    conf = (ROOT / "deploy" / "nginx.conf").read_text()
    at_once = int(re.search(r"limit_conn \w+ (\d+);", conf).group(1))
    held: list[int] = []
    threads = [threading.Thread(target=lambda: held.append(httpx.get(f"{url}/slow", timeout=90).status_code))
               for _ in range(at_once)]
    for thread in threads:
        thread.start()
    try:
        for _ in range(at_once):  # all of them in progress: nginx passed each on, the upstream holds it
            assert upstream.arrived.acquire(timeout=60), "the held requests did not all reach the upstream"
        _assert_rate_limited(httpx.get(f"{url}/healthz", timeout=10))  # one more is refused at once
    finally:
        upstream.release.set()
        for thread in threads:
            thread.join(90)
    assert held == [200] * at_once  # the requests in progress (an SSE stream is one) were served whole
