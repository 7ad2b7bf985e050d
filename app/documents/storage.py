"""A full disk, said as such: 507 with what is full and how much a write needs, a DELETE that frees
space even at 100%, and a start-up warning when the disk cannot hold what the configured bounds allow.

- `disk_full_error(exc, ...)`: an ENOSPC/EDQUOT OSError, or SQLite's "database or disk is full", as an
  InsufficientStorageError (507) naming the directory, its free bytes and the bytes the document needs.
- `DiskReserve`: `<data_dir>/reserve.bin`, `store.disk_reserve_bytes` of allocated blocks. SQLite needs
  room in its WAL even to delete, so a DELETE that meets a full disk releases the reserve, retries, and
  takes it back once there is room again.
- `check_free_space(settings)`: the start-up warning.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import sqlite3
from pathlib import Path
from typing import Callable, TypeVar

from app.errors import InsufficientStorageError
from configs.settings import Settings

logger = logging.getLogger(__name__)

T = TypeVar("T")
RESERVE_NAME = "reserve.bin"
SQLITE_BYTES_PER_TOKEN = 16  # a chunk's token ids as JSON, its text and index pages, roughly
_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}


def is_disk_full(exc: BaseException) -> bool:
    if isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS:
        return True
    if isinstance(exc, sqlite3.OperationalError) and "disk is full" in str(exc):  # SQLITE_FULL
        return True
    return any(is_disk_full(inner) for inner in (exc.__cause__, exc.__context__) if inner is not None
               and inner is not exc)


def free_bytes(path: Path) -> int:
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def megabytes(num_bytes: int) -> str:
    return f"{num_bytes / 1e6:.1f} MB"


def disk_full_error(directory: Path, what: str, num_needed: int) -> InsufficientStorageError:
    free = free_bytes(directory)
    return InsufficientStorageError(
        f"the disk holding {directory} is full ({megabytes(free)} free): {what} needs about "
        f"{megabytes(max(num_needed - free, num_needed))} more. Nothing was lost: free space there (DELETE "
        "documents, or lower store.max_disk_bytes) and re-send"
    )


class DiskReserve:
    """Blocks held back so that a DELETE can always run; `release()` gives them to the disk for it."""

    def __init__(self, data_dir: Path, num_bytes: int):
        self.path, self.num_bytes = data_dir / RESERVE_NAME, num_bytes

    @property
    def is_held(self) -> bool:
        return self.num_bytes > 0 and self.path.exists() and self.path.stat().st_size >= self.num_bytes

    def take(self) -> bool:
        """Allocate the reserve (real blocks, not a sparse file); False when the disk has no room."""
        if self.num_bytes <= 0 or self.is_held:
            return self.num_bytes <= 0 or self.is_held
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                os.posix_fallocate(fd, 0, self.num_bytes)
            finally:
                os.close(fd)
            return True
        except OSError as exc:
            self.path.unlink(missing_ok=True)
            if exc.errno in _FULL_ERRNOS:
                return False
            raise

    def release(self) -> None:
        self.path.unlink(missing_ok=True)

    def run_freeing(self, fn: Callable[[], T]) -> T:
        """`fn()` (a delete); if the disk is full, once more with the reserve released, then retaken."""
        try:
            return fn()
        except Exception as exc:
            if not is_disk_full(exc) or not self.is_held:
                raise
            logger.warning("the disk holding %s is full: the %s reserve is released for a delete",
                           self.path.parent, megabytes(self.num_bytes))
            self.release()
        result = fn()
        if not self.take():
            logger.warning("the disk holding %s still has no room for its %s reserve; it is retaken once "
                           "there is", self.path.parent, megabytes(self.num_bytes))
        return result


def check_free_space(settings: Settings, kv_bytes_used: int) -> str | None:
    """A warning when the data directory's disk cannot hold what the configured bounds let the server
    write (the disk KV tier up to store.max_disk_bytes, when it lives there); None when it can."""
    store = settings.store
    if not store.disk_enabled:
        return None
    kv_dir = store.disk_dir or settings.data_dir / "kv"
    free = free_bytes(kv_dir)
    num_assumed = max(store.max_disk_bytes - kv_bytes_used, 0)
    if free >= num_assumed:
        return None
    return (f"the disk holding {kv_dir} has {megabytes(free)} free, but store.max_disk_bytes lets the KV "
            f"store grow by {megabytes(num_assumed)} more ({megabytes(kv_bytes_used)} used of "
            f"{megabytes(store.max_disk_bytes)}): the disk will fill first and ingests will answer 507. "
            "Lower store.max_disk_bytes or free space")
