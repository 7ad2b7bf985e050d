"""Black-box shutdown harness: `ragblend serve` as a real child process (`python -m app.cli serve`,
this checkout on PYTHONPATH), driven over HTTP into a state, then sent SIGTERM; it must exit within a
bound, with its shutdown steps run (uvicorn's "Application shutdown complete") and no task left for
uvicorn to cancel by force. Nothing here knows how the server is built inside."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from app.testing import free_port, wait_ready

REPO = Path(__file__).resolve().parents[1]
CONFIG = """\
model: {name: "random:tiny-llama", device: cpu}
retrieval: {chunk_tokens: 64, chunk_overlap: 0, min_score: -1.0}  # no floor: questions asked mid-ingest run
store: {max_memory_bytes: 0}
scheduler: {max_running: 1}  # one answer decodes at a time: a second question waits in the queue
"""


class ServeProcess:
    def __init__(self, data_dir: Path, log_path: Path, config: str = CONFIG):
        self.data_dir, self.log_path, self.port = data_dir, log_path, free_port()
        self.config_path = log_path.with_suffix(".yaml")
        self.config_path.write_text(config)
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self, port: int | None = None) -> list[str]:
        return [sys.executable, "-m", "app.cli", "serve", "--port", str(port or self.port), "--data-dir",
                str(self.data_dir), "--config", str(self.config_path), "--log-level", "info"]

    @staticmethod
    def env() -> dict[str, str]:
        path = os.environ.get("PYTHONPATH")
        return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{path}" if path else str(REPO),
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

    def start(self, timeout_s: float = 300.0) -> ServeProcess:
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.argv(), cwd=REPO, env=self.env(), stdout=log,
                                            stderr=subprocess.STDOUT)
        wait_ready(self.url, self._check_alive, timeout_s, poll_s=0.2)
        return self

    def _check_alive(self) -> None:
        if self.process.poll() is not None:
            raise RuntimeError(f"server exited during start-up ({self.process.returncode}): {self.log()[-2000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def terminate(self, bound_s: float) -> float:
        """SIGTERM; the seconds it took to exit (killed, and an AssertionError, past `bound_s`)."""
        start = time.monotonic()
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(bound_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(30)
            raise AssertionError(f"still running {bound_s:.0f} s after SIGTERM; log tail:\n{self.log()[-3000:]}")
        return time.monotonic() - start

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
        return float(match.group(1)) if match else 0.0

    def wait_for(self, what: str, predicate, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"never saw {what}; log tail:\n{self.log()[-2000:]}")
            time.sleep(0.05)


def in_background(fn, *args) -> threading.Thread:
    """Run a client call in a thread; whatever it meets at shutdown (an answer, an error) is fine."""
    def run() -> None:
        try:
            fn(*args)
        except (httpx.HTTPError, OSError):
            pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread
