"""A bench's summary out: one JSON line on stdout (the last line: what scripts and tests parse), and
the same object written to `--out` when given; its tables and their cells; its one-line errors."""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence


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


def table(header: Sequence[str], rows: Iterable[Sequence[object]], markdown: bool = False) -> str:
    """The rows under `header`, the first column left-aligned and the others (figures) right-aligned: each
    column as wide as its widest cell, or (`markdown`) as a markdown table. Cells print as str() gives them:
    format figures first (`fmt`)."""
    cells = [[str(c) for c in header], *([str(c) for c in row] for row in rows)]
    if markdown:
        lines = ["| " + " | ".join(row) + " |" for row in cells]
        return "\n".join([lines[0], "| --- |" + " ---: |" * (len(header) - 1), *lines[1:]])
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
                     for row in cells)


def refuse(command: str, message: object, code: int) -> int:
    """`ragblend bench COMMAND: MESSAGE` on stderr; returns `code` (the exit status to return)."""
    print(f"ragblend bench {command}: {message}", file=sys.stderr)
    return code
