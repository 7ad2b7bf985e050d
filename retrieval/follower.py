"""A replica's vector index following the shared (Postgres) document store: one thread LISTENs on the
store's change channel and catches the index up (retriever.catch_up) at each NOTIFY, and every
`poll_s` when none comes (a notification lost with a dropped connection, a proxy that drops them).
A lost connection is re-dialled; the index catches up from its last sequence number when it is back."""

from __future__ import annotations

import logging
import threading
from typing import Callable

import psycopg

from retrieval.pg_store import CHANNEL
from retrieval.retriever import CatchUp, Retriever
from retrieval.store_types import StoreUnavailableError

logger = logging.getLogger(__name__)


class IndexFollower:
    def __init__(self, retriever: Retriever, database_url: str, poll_s: float,
                 on_catch_up: Callable[[CatchUp], None] | None = None):
        self._retriever, self._url, self._poll_s = retriever, database_url, poll_s
        self._on_catch_up = on_catch_up
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="index-follower", daemon=True)

    def start(self) -> IndexFollower:
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the thread (within one poll interval)."""
        self._stop.set()
        self._thread.join(self._poll_s + 10)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with psycopg.connect(self._url, autocommit=True, connect_timeout=max(1, int(self._poll_s))) as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    self._catch_up()  # after LISTEN: a commit made meanwhile is in the log or notified
                    while not self._stop.is_set():
                        for _ in conn.notifies(timeout=self._poll_s, stop_after=1):
                            pass
                        self._catch_up()
            except psycopg.Error as exc:
                logger.warning("index follower lost the store (%s); retrying in %.1f s",
                               str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__,
                               self._poll_s)
                self._stop.wait(self._poll_s)
            except Exception:
                logger.exception("index follower failed; retrying in %.1f s", self._poll_s)
                self._stop.wait(self._poll_s)

    def _catch_up(self) -> None:
        try:
            result = self._retriever.catch_up()
        except StoreUnavailableError as exc:
            logger.warning("index follower: %s", exc)
            return
        if self._on_catch_up is not None and (result.num_added or result.num_removed or result.is_reconciled):
            self._on_catch_up(result)
