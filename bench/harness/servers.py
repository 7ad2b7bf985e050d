"""Servers a bench starts: `ragblend serve` children on free loopback ports over temporary data dirs (this
checkout's code, or another's under its own interpreter), or uvicorn threads in this process."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Iterator, Mapping, Sequence

import yaml

from app.readiness import free_port, wait_ready

# The checkout this bench runs from: the servers import the same code (PYTHONPATH), whatever the cwd.
REPO_ROOT = Path(__file__).resolve().parents[2]
STOP_TIMEOUT_S = 60.0
LOG_TAIL_CHARS = 3000


@dataclass
class LocalServer:
    """One `ragblend serve` child process; `env` is layered over this process's environment. `root` is
    the checkout whose code it runs and `python` the interpreter (one with that checkout's dependencies)."""

    name: str
    env: Mapping[str, str] = field(default_factory=dict)
    config: Path | None = None
    python: Path = Path(sys.executable)
    root: Path = REPO_ROOT
    port: int = 0
    process: subprocess.Popen | None = None
    _dir: tempfile.TemporaryDirectory | None = None
    _log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        if self._dir is None:
            raise RuntimeError(f"server {self.name} was never started")
        return Path(self._dir.name) / "server.log"

    def start(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix=f"ragblend-bench-{self.name}-")
        self.port = free_port()
        argv = [str(self.python), "-m", "app.cli", "serve", "--port", str(self.port), "--data-dir",
                str(Path(self._dir.name) / "data"), "--log-level", "warning"]
        if self.config is not None:
            argv += ["--config", str(self.config)]
        # Another checkout gets its own root alone: a module it lacks must not be found in this one's.
        inherited = os.environ.get("PYTHONPATH") if self.root == REPO_ROOT else None
        pythonpath = os.pathsep.join(p for p in (str(self.root), inherited) if p)
        env = {**os.environ, **self.env, "PYTHONPATH": pythonpath}
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=self.root)

    def wait_ready(self, timeout_s: float) -> None:
        try:
            wait_ready(self.url, self._check_alive, timeout_s, poll_s=0.2)
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"server {self.name} ({self.url}) did not start: {exc}\n{self.log_tail()}") from exc

    def _check_alive(self) -> None:
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(f"`ragblend serve` exited with code {self.process.returncode}")

    def log_tail(self) -> str:
        if self._log is not None:
            self._log.flush()
        text = self.log_path.read_text(errors="replace") if self._dir is not None else ""
        return f"--- last of {self.log_path} ---\n{text[-LOG_TAIL_CHARS:]}"

    def cpu_s(self) -> float | None:
        """CPU seconds (user + system) the server's process and its children have used so far; None when it
        is not running or the platform has no /proc."""
        if self.process is None or self.process.poll() is not None:
            return None
        return process_tree_cpu_s(self.process.pid)

    def stop(self) -> None:
        """SIGTERM (uvicorn's graceful shutdown), SIGKILL if it is not over in a minute; then the data dir goes."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(STOP_TIMEOUT_S)
        if self._log is not None:
            self._log.close()
        if self._dir is not None:
            self._dir.cleanup()


def process_tree_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` (all its threads) and its live descendants, from Linux's
    /proc; None where `pid` cannot be read there."""
    ticks = 0
    pending = [pid]
    while pending:
        current = pending.pop()
        try:
            stat = Path(f"/proc/{current}/stat").read_text()
        except OSError:  # gone (a child that just exited), or no /proc
            if current == pid:
                return None
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # from field 3 (state) on: the name may hold spaces
        ticks += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15
        with contextlib.suppress(OSError):  # children lists need CONFIG_PROC_CHILDREN
            for task in Path(f"/proc/{current}/task").iterdir():
                pending += [int(child) for child in (task / "children").read_text().split()]
    return ticks / os.sysconf("SC_CLK_TCK")


def child_summary(argv: Sequence[str], what: str, timeout_s: float | None = None) -> dict[str, Any]:
    """The summary a bench part run in a fresh interpreter (`python -m` ARGV, this checkout's code whatever the
    cwd) prints as its last line; RuntimeError naming `what`, with its stderr's tail, where it fails."""
    pythonpath = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, "-m", *argv], env={**os.environ, "PYTHONPATH": pythonpath},
                          capture_output=True, text=True, timeout=timeout_s)
    if done.returncode:
        raise RuntimeError(f"{what} failed ({done.returncode}):\n{done.stderr[-LOG_TAIL_CHARS:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def started(server: LocalServer, ready_timeout_s: float) -> Iterator[LocalServer]:
    """`server` started and ready; stopped (and its data dir removed) on exit, however it is left."""
    try:
        server.start()
        server.wait_ready(ready_timeout_s)
        yield server
    finally:
        server.stop()


def deep_merge(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """`base` with `top` laid over it, nested mappings merged key by key."""
    out = dict(base)
    for key, value in top.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, Mapping) and isinstance(out.get(key), Mapping) \
            else value
    return out


@contextlib.contextmanager
def started_server(name: str, overrides: Mapping[str, Any], config: Path | None, ready_timeout_s: float,
                   in_process: bool = False) -> Iterator[str]:
    """A fresh server with `overrides` over `config` (over the defaults), on an empty temporary data dir: a
    `ragblend serve` child, or uvicorn threads in this process (`in_process`); yields its URL once ready,
    stops it on exit."""
    with tempfile.TemporaryDirectory(prefix=f"ragblend-bench-{name}-") as tmp:
        if in_process:
            from app.testing import LiveServer
            from configs.settings import load_settings

            settings = load_settings(config, **deep_merge(overrides, {"data_dir": Path(tmp) / "data"}))
            with LiveServer(settings, ready_timeout_s=ready_timeout_s) as live:
                yield live.url
        else:
            base = yaml.safe_load(config.read_text()) if config else None
            merged = Path(tmp) / "config.yaml"
            merged.write_text(yaml.safe_dump(deep_merge(base or {}, overrides)))
            with started(LocalServer(name, config=merged), ready_timeout_s) as server:
                yield server.url
