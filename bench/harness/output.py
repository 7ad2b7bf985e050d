"""A bench's summary out: one JSON line on stdout (the last line: what scripts and tests parse), and
the same object written to `--out` when given; the cells of its tables; its one-line errors."""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path
from typing import Any, Callable


def cpu_name() -> str:
    """The CPU's model name (what a summary says the figures were taken on)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def emit_summary(summary: dict[str, Any], out: str | Path | None, indent: int | None = None,
                 default: Callable[[Any], Any] | None = None) -> None:
    """Write `summary` to `out` (its folder made; `indent` for the file only), then print it on one line."""
    if out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=indent, default=default) + "\n")
    print(json.dumps(summary, default=default))


def fmt(value: float | None, digits: int = 1, suffix: str = "") -> str:
    """A table's cell: the value to `digits` places, "-" for none."""
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def refuse(command: str, message: object, code: int) -> int:
    """`ragblend bench COMMAND: MESSAGE` on stderr; returns `code` (the exit status to return)."""
    print(f"ragblend bench {command}: {message}", file=sys.stderr)
    return code
