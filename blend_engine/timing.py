"""Per-stage timers that tell the truth on every device.

On CPU ops run synchronously, so the host clock is exact and cheap. On CUDA the host only queues
work: a host clock would time the queueing. There, stages are timed with CUDA events, recorded
only when stats are asked for (`is_profiled`), and read after the prefill's one final sync.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

import torch


class StageTimer:
    def __init__(self, device: torch.device, is_profiled: bool):
        self._is_cuda = device.type == "cuda"
        self._is_on = is_profiled or not self._is_cuda
        self._host_ms: dict[str, float] = {}
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    @property
    def is_exact(self) -> bool:
        """Whether the stage splits are measured (always on CPU; on CUDA only when profiled)."""
        return self._is_on

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        if not self._is_on:
            yield
            return
        if self._is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((name, start, end))
            return
        t0 = time.perf_counter()
        yield
        self._host_ms[name] = self._host_ms.get(name, 0.0) + (time.perf_counter() - t0) * 1000

    def totals(self) -> dict[str, float]:
        """Milliseconds per stage; on CUDA, call after the device has finished the work (synchronize)."""
        totals = dict(self._host_ms)
        for name, start, end in self._events:
            totals[name] = totals.get(name, 0.0) + start.elapsed_time(end)
        return totals


def host_ms(start: float) -> float:
    return (time.perf_counter() - start) * 1000
