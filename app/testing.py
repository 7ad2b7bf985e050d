"""A live server on loopback for tests and benchmarks: uvicorn in a thread, real HTTP."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from app.main import create_app
from app.readiness import free_port, wait_ready
from app.server import Server, uvicorn_config
from configs.settings import Settings

if TYPE_CHECKING:
    from app.components import Components
    from blend_engine.engine import BlendEngine


class LiveServer:
    """`with LiveServer(settings) as server:` starts uvicorn and waits for /readyz; leaving stops it."""

    def __init__(
        self, settings: Settings, engine: BlendEngine | None = None, ready_timeout_s: float = 300.0, is_waiting: bool = True
    ):
        self.settings, self.engine, self.ready_timeout_s = settings, engine, ready_timeout_s
        self.is_waiting = is_waiting  # False: return once uvicorn listens, ready or not
        self.port = free_port()
        self.app = create_app(settings, engine)
        self._server = Server(uvicorn_config(self.app, settings, "127.0.0.1", self.port, "warning"))
        self._thread = threading.Thread(target=self._server.run, name="uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def components(self) -> Components | None:
        return self.app.state.components

    def __enter__(self) -> LiveServer:
        self._thread.start()
        if self.is_waiting:
            self.wait_ready()
        else:
            self._wait_listening()
        return self

    def _wait_listening(self) -> None:
        deadline = time.monotonic() + 60
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("server did not start listening")
            time.sleep(0.05)

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def wait_ready(self) -> None:
        wait_ready(self.url, self._check_alive, self.ready_timeout_s, poll_s=0.2)

    def _check_alive(self) -> None:
        if not self._thread.is_alive():
            raise RuntimeError("server thread exited during start-up")

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(60)
