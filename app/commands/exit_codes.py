"""Exit codes of the ragblend commands, the same for all of them."""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    FAILED = 1  # the server refused a request (an HTTP error) or some documents did not go in
    USAGE = 2  # bad arguments or input files (missing path, bad JSONL line, not UTF-8, nothing to ingest)
    UNREACHABLE = 3  # no server answers at --url (down, wrong address, timed out)
    CANNOT_START = 4  # serve: refused to start (public host without a key, port taken)
