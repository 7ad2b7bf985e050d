"""A process's memory: its resident set (/proc/<pid>/status; anonymous + file pages + shared memory, all
counted), the mappings that hold it (smaps) and, for this process, what glibc's malloc holds free."""

from __future__ import annotations

import ctypes
import ctypes.util
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

MB = 1 << 20


@dataclass(frozen=True)
class Rss:
    """One reading, in MB."""

    rss_mb: float
    anon_mb: float
    file_mb: float
    shmem_mb: float
    peak_mb: float  # VmHWM: the largest RSS so far


def read_rss(pid: int | str = "self") -> Rss:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
            fields[key] = round(int(value.split()[0]) / 1024, 1)  # kB
    return Rss(fields["VmRSS"], fields["RssAnon"], fields["RssFile"], fields["RssShmem"], fields["VmHWM"])


def mappings(pid: int | str = "self", min_mb: float = 4.0) -> dict[str, float]:
    """Resident MB per mapping name (a file's path; '[heap]'; '[anonymous]' for nameless ones), the
    largest first, those of `min_mb` or more."""
    resident: Counter[str] = Counter()
    name = "[anonymous]"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header line
            name = " ".join(fields[5:]) or "[anonymous]"
        elif fields and fields[0] == "Rss:":
            resident[name] += int(fields[1])
    return {n: round(kb / 1024, 1) for n, kb in resident.most_common() if kb / 1024 >= min_mb}


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def malloc_mb() -> dict[str, float] | None:
    """This process's malloc, in MB: `used` (in its arenas and in blocks of their own), `free` (held in
    its arenas, resident or given back by a trim), or None without glibc's mallinfo2."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    return {"malloc_used_mb": round((info.uordblks + info.hblkhd) / MB, 1), "malloc_free_mb": round(info.fordblks / MB, 1)}
