"""What the engine runs next: the one place that decides, and the one owner of the requests' state
(nano-vllm's `Scheduler`, vLLM's in spirit).

A request's lifecycle is its `Status`, which only the scheduler's own methods change: `add` queues it
(WAITING); `schedule` admits it (PREFILLING: its prefill runs, one part a step when long); the loop
reports each step's outcome (`update_from_output`): still PREFILLING after a part, RUNNING (decoding)
once its prompt is in, or FINISHED_* (a stop, its length, a failure); `abort_cancelled` / `abort_all`
take out those whose client left or everything (shutdown: FINISHED_ABORTED). Whatever finishes leaves
every queue and is handed back to the caller, whose one job is then to end its stream.

Each step, in this order:
1. the prefills in parts (long ones: token chunks or groups of layers) each run their next part
   (nothing else is admitted meanwhile; several admitted together go on together, so a step's prefill
   work stays within what their admission allowed);
   otherwise, from the head of the queue (FIFO): an exclusive job (a delete, the start-up measurement)
   runs alone, or requests are admitted while the running sequences and their KV bytes stay under
   their bounds and the step's prompt tokens under the prefill budget (one request is always admitted
   when none runs, whatever its size, so nothing waits for good);
2. one batched decode step for every running sequence (those admitted this step whose prefill ends in
   it included); where `max_decode_stall_ms` is set (off by default: docs/decisions/0016), a step that
   runs prefill work (parts continued, requests admitted) puts it off as long as the running sequence
   longest without a token stays under the bound after this step's prefill work (estimated by the last
   step's, `StepOutput.prefill_s`): queued prefills then run back to back and later decode steps batch
   more rows, while a running answer's gap between two tokens stays near the bound (over it by the
   estimate's error); at most `max_running` prefills run so, since admission stops once the batch is full;
3. one background unit (KV repair, backfill, an ingest's precompute) when nothing waits; while busy,
   once in `background_every_steps` busy steps, and only if no request still awaiting its first token
   has waited through one already: a question's TTFT grows by one unit (one chunk's precompute) at
   most, and background work is never starved for good (it runs again once those requests have their
   first token; requests that arrive later have not waited through one).
A new request therefore waits for the prefills ahead of it and at most one step, never for another
request's whole answer. No threads and no model here: `EngineLoop` runs what `schedule()` returns,
under its lock around every call.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Generic, Iterator, Protocol, TypeVar

from blend_engine.types import FinishReason
from runtime.config import SchedulerConfig
from runtime.jobs import Job


class Status(enum.Enum):
    """Where a request is in its lifecycle (set by the `Scheduler` only)."""

    WAITING = "waiting"  # queued
    PREFILLING = "prefilling"  # admitted: its prefill runs (between two parts of it, when long)
    RUNNING = "running"  # its prompt is in: decoding in the batch
    FINISHED_STOPPED = "finished_stopped"  # an EOS or a stop string
    FINISHED_LENGTH = "finished_length"  # max_tokens or the context's room
    FINISHED_ABORTED = "finished_aborted"  # its client left, or shutdown
    FINISHED_FAILED = "finished_failed"  # its prefill or a decode step raised

    @property
    def is_finished(self) -> bool:
        return self not in (Status.WAITING, Status.PREFILLING, Status.RUNNING)

    @classmethod
    def finished(cls, reason: FinishReason) -> Status:
        return cls.FINISHED_STOPPED if reason is FinishReason.STOP else cls.FINISHED_LENGTH

    @property
    def finish_reason(self) -> FinishReason | None:
        """What an answer that ended on its own reports (None: it did not)."""
        return {Status.FINISHED_STOPPED: FinishReason.STOP, Status.FINISHED_LENGTH: FinishReason.LENGTH}.get(self)


_FINISHED = frozenset(s for s in Status if s.is_finished)
# what each status may become: the lifecycle, checked at every change
_TRANSITIONS: dict[Status, frozenset[Status]] = {
    Status.WAITING: frozenset({Status.PREFILLING, Status.FINISHED_ABORTED}),
    Status.PREFILLING: frozenset({Status.RUNNING, *_FINISHED}),
    Status.RUNNING: _FINISHED,
    **{s: frozenset() for s in _FINISHED},
}


class Schedulable(Protocol):
    """A request as the scheduler sees it."""

    status: Status  # the scheduler's to set

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

    @property
    def is_cancelled(self) -> bool:
        """Its client left (or the server is closing)."""
        ...


G = TypeVar("G", bound=Schedulable)
BackgroundTask = Callable[[], None]


@dataclass
class Step(Generic[G]):
    """What one step runs."""

    continued: list[G] = field(default_factory=list)  # prefills in parts: the next part of each
    admitted: list[G] = field(default_factory=list)  # prefills to start
    job: Job | None = None  # an exclusive job, alone in its step
    # the batched decode step: the running sequences, and those admitted now whose prefill ends in this
    # step (the loop decodes those of them that are RUNNING once the step's prefills have run)
    decode: list[G] = field(default_factory=list)
    background: BackgroundTask | None = None
    delayed: list[G] = field(default_factory=list)  # requests awaiting their first token when it runs
    is_decode_deferred: bool = False  # the running sequences skip this step's decode (the stall bound)

    @property
    def prefills(self) -> list[G]:
        return [*self.continued, *self.admitted]

    @property
    def is_idle(self) -> bool:
        return (not self.continued and not self.admitted and self.job is None and not self.decode
                and self.background is None)


@dataclass
class StepOutput(Generic[G]):
    """What a step did, as the loop reports it (`Scheduler.update_from_output`)."""

    # the requests whose status the step changed, in the order it changed them: RUNNING (its prompt is
    # in, its first token out) or FINISHED_*; a prefill that ran a part and has more keeps PREFILLING
    statuses: dict[G, Status] = field(default_factory=dict)
    prefill_s: float | None = None  # the step's prefill work, when it ran some (the next one's estimate)

    def status_of(self, request: G) -> Status:
        """Its status once the step is reported."""
        return self.statuses.get(request, request.status)


class Scheduler(Generic[G]):
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self._waiting: deque[G | Job] = deque()
        self._prefilling: list[G] = []  # admitted, their prompt not in yet
        self._running: list[G] = []  # decoding
        self._background: deque[BackgroundTask] = deque()
        self._job: Job | None = None  # the exclusive job of the step in progress
        self._num_steps_without_background = 0
        self._last_prefill_s = 0.0  # the last step's prefill work (the estimate of the next one's)
        # requests awaiting their first token that a background unit ran before (by id; the dict keeps
        # them alive, so an id is not reused while it is here)
        self._delayed: dict[int, G] = {}

    # --- what the scheduler holds (read under the loop's lock) -------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_prefilling(self) -> int:
        return len(self._prefilling)

    @property
    def num_running(self) -> int:
        """The requests admitted and not finished: prefilling or decoding."""
        return len(self._prefilling) + len(self._running)

    @property
    def is_busy(self) -> bool:
        return self._job is not None or self.num_running > 0

    @property
    def running_kv_bytes(self) -> int:
        return sum(g.kv_bytes for g in (*self._prefilling, *self._running))

    def work(self) -> Iterator[G | Job]:
        """Everything it holds: the step's job, the queue, the prefilling and the running requests."""
        if self._job is not None:
            yield self._job
        yield from (*self._waiting, *self._prefilling, *self._running)

    # --- what changes it (the loop holds its lock around these) ------------------------------------
    def add(self, work: G | Job) -> bool:
        """Queue a request or an exclusive job (FIFO). False, nothing queued, when the queue is full."""
        if len(self._waiting) >= self.config.max_queue:
            return False
        if not isinstance(work, Job):
            work.status = Status.WAITING
        self._waiting.append(work)
        return True

    def add_background(self, task: BackgroundTask, is_bounded: bool = True) -> bool:
        """Queue a background unit. False when `is_bounded` and `max_background` units wait already."""
        if is_bounded and len(self._background) >= self.config.max_background:
            return False
        self._background.append(task)
        return True

    def drop_background(self) -> list[BackgroundTask]:
        """Take every queued background unit out (shutdown): they never run."""
        tasks = list(self._background)
        self._background.clear()
        return tasks

    def update_from_output(self, output: StepOutput[G]) -> list[G]:
        """Apply what the step did: its job is done, its prefills and decoded sequences move on. Returns
        the requests that finished, out of every queue now: the caller ends their streams."""
        self._job = None
        if output.prefill_s is not None:
            self._last_prefill_s = output.prefill_s
        for request, status in output.statuses.items():
            self._set_status(request, status)
        return [r for r, status in output.statuses.items() if status.is_finished]

    def abort_cancelled(self) -> list[G | Job]:
        """The queued jobs and the requests whose client left: out of the queue and the batch (a
        request FINISHED_ABORTED), for the caller to end. Between steps only."""
        return self._abort([w for w in self.work() if w.is_cancelled])

    def abort_all(self) -> list[G | Job]:
        """Everything it holds, out (shutdown), for the caller to end. Between steps only."""
        return self._abort(list(self.work()))

    def _abort(self, works: list[G | Job]) -> list[G | Job]:
        for work in works:
            if isinstance(work, Job):
                if work is self._job:
                    raise RuntimeError("a step's job cannot be aborted while it runs: report the step first")
                self._waiting.remove(work)
            else:
                self._set_status(work, Status.FINISHED_ABORTED)
        return works

    def _set_status(self, request: G, status: Status) -> None:
        """The one place a request's status changes: it moves between the queues with it."""
        if status not in _TRANSITIONS[request.status]:
            raise ValueError(f"a {request.status.value} request cannot become {status.value}")
        self._queue_of(request.status).remove(request)
        if not status.is_finished:
            self._queue_of(status).append(request)
        request.status = status

    def _queue_of(self, status: Status) -> deque[G | Job] | list[G]:
        return {Status.WAITING: self._waiting, Status.PREFILLING: self._prefilling,
                Status.RUNNING: self._running}[status]

    # --- the decision -----------------------------------------------------------------------------
    def schedule(self, now: float | None = None) -> Step[G]:
        """The next step; `now` (time.perf_counter, read here when not given) for the decode stall bound."""
        now = time.perf_counter() if now is None else now
        step: Step[G] = Step()
        if self._prefilling:
            step.continued = list(self._prefilling)
        else:
            self._admit(step)
        step.is_decode_deferred = self._defers_decode(step, now)
        if not step.is_decode_deferred:
            step.decode = [*self._running, *step.admitted]
        is_busy = bool(self._waiting) or step.job is not None or bool(step.prefills)
        # awaiting their first token when this step's unit would run (one admitted now has it by then,
        # unless its prefill runs in parts: counted, to be safe)
        awaiting = {id(g): g for g in (*self._waiting, *step.prefills) if not isinstance(g, Job)}
        self._delayed = {key: g for key, g in self._delayed.items() if key in awaiting}
        is_paced = self._num_steps_without_background + 1 >= self.config.background_every_steps
        if self._background and (not is_busy or (is_paced and not self._delayed)):
            step.background = self._background.popleft()
            self._delayed = awaiting
            step.delayed = list(awaiting.values())
        self._num_steps_without_background = 0 if step.background or not self._background else (
            self._num_steps_without_background + 1)
        return step

    def _defers_decode(self, step: Step[G], now: float) -> bool:
        """Whether this step's prefill runs without a decode step after it: some prefill runs, and no
        running sequence will have gone `max_decode_stall_ms` without a token once it has run."""
        if not (step.prefills and self._running and self.config.max_decode_stall_ms > 0):
            return False
        stall_after_s = now - min(g.t_last_token for g in self._running) + self._last_prefill_s
        return stall_after_s * 1000 < self.config.max_decode_stall_ms

    def _admit(self, step: Step[G]) -> None:
        config, num_tokens = self.config, 0
        num_running, kv_bytes = self.num_running, self.running_kv_bytes
        while self._waiting:
            head = self._waiting[0]
            if isinstance(head, Job):
                if not step.admitted:  # a job runs alone; one admitted before it runs next step
                    step.job = self._job = self._waiting.popleft()
                return
            if num_running >= config.max_running:
                return
            is_first = num_running == 0 and not step.admitted
            if not is_first and (kv_bytes + head.kv_bytes > config.max_running_kv_bytes
                                 or (step.admitted and num_tokens + head.num_prompt_tokens > config.max_prefill_tokens)):
                return
            self._set_status(head, Status.PREFILLING)
            step.admitted.append(head)
            num_running, num_tokens, kv_bytes = num_running + 1, num_tokens + head.num_prompt_tokens, kv_bytes + head.kv_bytes
