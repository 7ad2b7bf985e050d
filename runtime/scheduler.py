"""What the engine runs next: the one place that decides (nano-vllm's `Scheduler`, vLLM's in spirit).

Each step, in this order:
1. a prefill in parts (a long one: token chunks or groups of layers) runs its next part (nothing else
   is admitted meanwhile);
   otherwise, from the head of the queue (FIFO): an exclusive job (a delete, the start-up measurement)
   runs alone, or requests are admitted while the running sequences and their KV bytes stay under
   their bounds and the step's prompt tokens under the prefill budget (one request is always admitted
   when none runs, whatever its size, so nothing waits for good);
2. one batched decode step for every running sequence (those admitted this step included); where
   `max_decode_stall_ms` is set (off by default: docs/decisions/0016), a step that runs prefill work
   (a part continued, requests admitted) puts it off as long as the running sequence longest without
   a token stays under the bound after this step's prefill work (estimated by the last step's,
   `observe_prefill`): queued prefills then run back to back and later decode steps batch more rows,
   while a running answer's gap between two tokens stays near the bound (over it by the estimate's
   error); at most `max_running` prefills run so, since admission stops once the batch is full;
3. one background unit (KV repair, backfill, an ingest's precompute) when nothing waits; while busy,
   once in `background_every_steps` busy steps, and only if no request still awaiting its first token
   has waited through one already: a question's TTFT grows by one unit (one chunk's precompute) at
   most, and background work is never starved for good (it runs again once those requests have their
   first token; requests that arrive later have not waited through one).
A new request therefore waits for the prefills ahead of it and at most one step, never for another
request's whole answer. No threads and no model here: `EngineLoop` runs what `schedule()` returns.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Generic, Protocol, TypeVar

from runtime.config import SchedulerConfig
from runtime.jobs import Job


class Schedulable(Protocol):
    """A request as the scheduler sees it."""

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def kv_bytes(self) -> int:
        """Bytes its caches hold now (running) or are expected to hold (waiting)."""
        ...

    @property
    def t_last_token(self) -> float:
        """When (time.perf_counter) it last had a token: its decode stall starts there (running only)."""
        ...


G = TypeVar("G", bound=Schedulable)
BackgroundTask = Callable[[], None]


@dataclass
class Step(Generic[G]):
    """What one step runs."""

    continued_prefill: G | None = None  # a prefill in parts: its next part
    admitted: list[G] = field(default_factory=list)  # prefills to run (then they decode)
    job: Job | None = None  # an exclusive job, alone in its step
    decode: list[G] = field(default_factory=list)  # the running sequences' batched decode step
    background: BackgroundTask | None = None
    delayed: list[G] = field(default_factory=list)  # requests awaiting their first token when it runs
    is_decode_deferred: bool = False  # the running sequences skip this step's decode (the stall bound)

    @property
    def is_idle(self) -> bool:
        return (self.continued_prefill is None and not self.admitted and self.job is None and not self.decode
                and self.background is None)


class Scheduler(Generic[G]):
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.waiting: deque[G | Job] = deque()
        self.running: list[G] = []  # decoding
        self.prefilling: G | None = None  # a prefill in parts, between two of them
        self.background: deque[BackgroundTask] = deque()
        self._num_steps_without_background = 0
        self._last_prefill_s = 0.0  # the last step's prefill work (the estimate of the next one's)
        # requests awaiting their first token that a background unit ran before (by id; the dict keeps
        # them alive, so an id is not reused while it is here)
        self._delayed: dict[int, G] = {}

    # --- queues (the loop holds its lock around these) --------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running) + (self.prefilling is not None)

    @property
    def running_kv_bytes(self) -> int:
        return sum(g.kv_bytes for g in self.running) + (self.prefilling.kv_bytes if self.prefilling else 0)

    def can_queue(self) -> bool:
        return len(self.waiting) < self.config.max_queue

    def can_queue_background(self) -> bool:
        return len(self.background) < self.config.max_background

    # --- the decision -----------------------------------------------------------------------------
    def schedule(self, now: float | None = None) -> Step[G]:
        """The next step; `now` (time.perf_counter, read here when not given) for the decode stall bound."""
        now = time.perf_counter() if now is None else now
        step: Step[G] = Step()
        if self.prefilling is not None:
            step.continued_prefill = self.prefilling
        else:
            self._admit(step)
        step.is_decode_deferred = self._defers_decode(step, now)
        if not step.is_decode_deferred:
            step.decode = [*self.running, *step.admitted]
        is_busy = bool(self.waiting) or step.job is not None or bool(step.admitted) or step.continued_prefill
        # awaiting their first token when this step's unit would run (one admitted now has it by then,
        # unless its prefill runs in parts: counted, to be safe)
        awaiting = {id(g): g for g in (*self.waiting, step.continued_prefill, *step.admitted)
                    if g is not None and not isinstance(g, Job)}
        self._delayed = {key: g for key, g in self._delayed.items() if key in awaiting}
        is_paced = self._num_steps_without_background + 1 >= self.config.background_every_steps
        if self.background and (not is_busy or (is_paced and not self._delayed)):
            step.background = self.background.popleft()
            self._delayed = awaiting
            step.delayed = list(awaiting.values())
        self._num_steps_without_background = 0 if step.background or not self.background else (
            self._num_steps_without_background + 1)
        return step

    def observe_prefill(self, seconds: float) -> None:
        """The prefill work of the step that just ran (its parts and admitted prefills, in seconds)."""
        self._last_prefill_s = seconds

    def _defers_decode(self, step: Step[G], now: float) -> bool:
        """Whether this step's prefill runs without a decode step after it: some prefill runs, and no
        running sequence will have gone `max_decode_stall_ms` without a token once it has run."""
        is_prefilling = step.continued_prefill is not None or bool(step.admitted)
        if not (is_prefilling and self.running and self.config.max_decode_stall_ms > 0):
            return False
        stall_after_s = now - min(g.t_last_token for g in self.running) + self._last_prefill_s
        return stall_after_s * 1000 < self.config.max_decode_stall_ms

    def _admit(self, step: Step[G]) -> None:
        config, num_tokens = self.config, 0
        num_running, kv_bytes = len(self.running), self.running_kv_bytes
        while self.waiting:
            head = self.waiting[0]
            if isinstance(head, Job):
                if not step.admitted:  # a job runs alone; one admitted before it runs next step
                    step.job = self.waiting.popleft()
                return
            if num_running >= config.max_running:
                return
            is_first = num_running == 0 and not step.admitted
            if not is_first and (kv_bytes + head.kv_bytes > config.max_running_kv_bytes
                                 or (step.admitted and num_tokens + head.num_prompt_tokens > config.max_prefill_tokens)):
                return
            step.admitted.append(self.waiting.popleft())
            num_running, num_tokens, kv_bytes = num_running + 1, num_tokens + head.num_prompt_tokens, kv_bytes + head.kv_bytes
