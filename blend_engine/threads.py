"""CPU threads for engine work: as many as the cores other processes leave idle.

The `ragblend` command lets OpenMP threads spin briefly before they sleep (app/cli.py): decode and the
reused prefill modes are thousands of small parallel regions, and a sleeping thread's wake-up costs more
than such a region. Spinning is only safe while every thread has a core of its own: on a 2-core
machine with one busy process beside it, two spinning threads decoded at 165 ms/token against 31 on
one thread (README). So before each engine job, and every `min_interval_s` during a decode, the count
is chosen from what the other processes used since the last look (/proc/stat less this process).
"""

from __future__ import annotations

import os
import time
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

PROC_STAT = Path("/proc/stat")
# fields of a /proc/stat cpu line (after its name) that are not busy time: idle, iowait, and guest /
# guest_nice, which user / nice already include
_NOT_BUSY_FIELDS = (3, 4, 8, 9)


@dataclass(frozen=True)
class CpuSample:
    """Cumulative CPU time at one moment, over this process's allowed CPUs."""

    busy_s: float  # every process's run time (steal included: a hypervisor's other guests compete too)
    own_s: float  # this process's (user + system)
    wall_s: float  # monotonic clock


def read_sample(stat_path: Path = PROC_STAT) -> CpuSample | None:
    """Now's sample, or None where /proc/stat is not there (not Linux): then the count stays fixed."""
    try:
        lines = stat_path.read_text().splitlines()
    except OSError:
        return None
    allowed = {f"cpu{i}" for i in _allowed_cpus()}  # a container pinned to some host CPUs
    ticks = 0
    for line in lines:
        name, *fields = line.split()
        if name in allowed:
            ticks += sum(int(v) for i, v in enumerate(fields) if i not in _NOT_BUSY_FIELDS)
    times = os.times()
    return CpuSample(ticks / os.sysconf("SC_CLK_TCK"), times.user + times.system, time.monotonic())


def num_free_threads(before: CpuSample, after: CpuSample, num_cores: int, max_threads: int) -> int:
    """Threads that fit on the `num_cores` the other processes left idle between two samples, in [1, max]."""
    elapsed = after.wall_s - before.wall_s
    if elapsed <= 0:
        return max_threads
    others = max((after.busy_s - before.busy_s) - (after.own_s - before.own_s), 0.0) / elapsed  # cores
    return min(max(round(num_cores - others), 1), max_threads)


def _allowed_cpus() -> set[int]:
    """The CPUs this process may run on (Linux's affinity; elsewhere all of them)."""
    if hasattr(os, "sched_getaffinity"):
        return os.sched_getaffinity(0)
    return set(range(os.cpu_count() or 1))


class ThreadGovernor:
    """The thread count of engine work on CPU: `num_fixed` when > 0, else chosen by `num_free_threads`
    (at most `max_threads`: by default torch's count when the governor is made), re-sampled at most
    every `min_interval_s`. `sampler` and `num_cores` default to this machine's (/proc/stat, the CPUs
    this process may use)."""

    def __init__(self, num_fixed: int = 0, min_interval_s: float = 0.25,
                 sampler: Callable[[], CpuSample | None] = read_sample, num_cores: int | None = None,
                 max_threads: int | None = None):
        if num_fixed < 0 or min_interval_s < 0 or (max_threads is not None and max_threads < 1):
            raise ValueError("num_fixed and min_interval_s must be >= 0, max_threads >= 1")
        self.num_fixed = num_fixed
        self.max_threads = torch.get_num_threads() if max_threads is None else max_threads
        self.min_interval_s = min_interval_s
        self.num_cores = len(_allowed_cpus()) if num_cores is None else num_cores
        self._sampler = sampler
        self._last = sampler()
        self._num_free: int | None = None  # None: no interval measured yet (the cap, max_threads)

    def num_threads(self) -> int:
        """The count for the next piece of work."""
        if self.num_fixed:
            return self.num_fixed
        if self._last is not None and time.monotonic() - self._last.wall_s >= self.min_interval_s:
            now = self._sampler()
            if now is not None:
                self._num_free = num_free_threads(self._last, now, self.num_cores, self.max_threads)
                self._last = now
        return self.max_threads if self._num_free is None else self._num_free

    @contextmanager
    def scope(self) -> Iterator[int]:
        """Runs the block on `num_threads` torch threads and restores the calling thread's count after
        (OpenMP's count is per thread; the server runs engine jobs one at a time on one worker thread)."""
        previous = torch.get_num_threads()
        count = self.num_threads()
        if count == previous:
            yield count
            return
        torch.set_num_threads(count)
        try:
            yield count
        finally:
            torch.set_num_threads(previous)


def pin_one_thread() -> None:
    """Make torch run on one thread in the calling (side) thread, for good.

    torch gives a thread its count at the thread's first op: the count some thread set last. A side
    thread whose first op falls inside a governed engine step (count 2) keeps 2 and, at its first
    parallel region, an OpenMP pool of its own; with more OpenMP threads than cores libgomp cuts every
    spin short, and a restarted server (whose KV is read from disk on such a thread) decoded at ~20
    tok/s instead of ~41 (README). So side threads that run torch call this before their first op."""
    torch.get_num_threads()  # torch's first-use set-up of this thread, now
    torch.set_num_threads(1)


def lower_to_idle_priority() -> bool:
    """Run the calling thread at the lowest CPU priority (Linux SCHED_IDLE): it gets a core only when
    no normal thread wants it. For a side thread whose work the engine's threads would otherwise be
    preempted for: on 2 cores, a pipelined loader's decode beside the engine's two OpenMP threads cost
    the prefill more than the decode's own time (every parallel region waits for its slowest thread).
    Returns False where the platform has no such policy or refuses it (the thread keeps its priority)."""
    if not hasattr(os, "SCHED_IDLE"):
        return False
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: the calling thread (a Linux task)
    except OSError:  # e.g. a seccomp profile that denies it
        return False
    return True


def governed(threads: ThreadGovernor | None) -> AbstractContextManager:
    """`threads.scope()`, or nothing where there is no governor (CUDA, or threads left to the caller)."""
    return nullcontext() if threads is None else threads.scope()


def single_threaded_default() -> int:
    """Make one thread torch's count for the calling thread and every thread that first runs torch
    outside a governed job (inside one it takes the job's count: side threads call `pin_one_thread`);
    returns the count it was (the engine's governor's cap).

    Why, in the server: libgomp gives each thread that starts a parallel region a pool of its own, and
    once the process holds more OpenMP threads than CPUs it cuts every spin to 100 turns. The model
    load and the embedder run on other threads than the engine worker, so with their own pools the
    worker's 2-thread decode took 50-68 ms/token against 26-28 with the worker's pool alone (85-token
    prompt, 2 cores, README). With this, only the engine's governed jobs run wide.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    return previous
