"""The engine loop: one thread runs the engine, a step at a time, as the `Scheduler` decides.

Requests' generations are prefilled (in parts, one per step, when long) and then decode together,
one batched forward per step for every running sequence (`BlendEngine.decode_step`): a request waits
for the prefills ahead of it and at most one step, never for another's whole answer. Exclusive jobs (a
delete, the start-up measurement) run alone in a step; background units (KV repair, backfill, an
ingest's precompute through `call_background`) run when nothing waits, or once in a few busy steps.
The event loop only awaits futures and async queues, so it never blocks on the model; a client that
goes away (its stream's `cancel()`) leaves the batch at the next step."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Generator, Protocol

from blend_engine.types import Delta, FinishReason
from runtime.config import SchedulerConfig
from runtime.executor import PrefillExecutor, PrefillOutcome
from runtime.jobs import END, Emit, Job, JobCancelled, JobStream, QueueFull, emitter, new_job
from runtime.scheduler import Scheduler, Step
from runtime.types import DoneEvent, PrefillRequest, Timings, TokenEvent, Usage

if TYPE_CHECKING:
    from blend_engine.engine import BlendEngine
    from blend_engine.sequence import DecodeSequence

logger = logging.getLogger(__name__)


class LoopObserver(Protocol):
    """What the loop reports as it runs (the app's metrics implement it)."""

    def observe_step(self, batch_size: int) -> None: ...

    def observe_inter_token(self, seconds: float) -> None: ...

    def observe_done(self, event: DoneEvent) -> None: ...


@dataclass
class LoopStats:
    num_completed: int = 0
    num_failed: int = 0
    num_cancelled: int = 0
    num_rejected: int = 0
    num_prefill_parts: int = 0  # prefill parts that handed the step back before their prompt was in
    num_decode_steps_mid_prefill: int = 0  # batched decode steps run between the parts of another's prefill
    num_decode_steps_deferred: int = 0  # steps whose prefill ran without the running sequences' decode step


@dataclass(eq=False)
class Generation:
    """One request's generation: waiting, prefilling, then decoding in the batch."""

    request: PrefillRequest
    job: Job
    emit: Emit
    num_prompt_tokens: int
    expected_kv_bytes: int  # before its prefill: what its caches will hold (the admission bound)
    t_start: float  # the request's arrival (perf_counter): TTFT and total count from it
    t_submit: float
    timings: Timings
    prefill_steps: Generator[PrefillOutcome | None, None, None] | None = None
    outcome: PrefillOutcome | None = None
    sequence: DecodeSequence | None = None
    usage: Usage = field(default_factory=Usage)
    t_last_token: float = 0.0
    is_done: bool = False

    @property
    def kv_bytes(self) -> int:
        return self.sequence.nbytes if self.sequence is not None else self.expected_kv_bytes


class _BlockingCall:
    """A background unit another thread waits for (`call_background`)."""

    def __init__(self, fn: Callable[[], Any]):
        self._fn, self._done = fn, threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None

    def __call__(self) -> None:
        try:
            self._result = self._fn()
        except BaseException as exc:  # handed to the waiting thread
            self._error = exc
        finally:
            self._done.set()

    def cancel(self) -> None:
        self._error = JobCancelled("the engine is shutting down")
        self._done.set()

    def wait(self) -> Any:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._result


class EngineLoop:
    def __init__(self, engine: BlendEngine | None, executor: PrefillExecutor | None, config: SchedulerConfig,
                 observer: LoopObserver | None = None, kv_bytes_per_token: int = 0):
        """`engine` and `executor` may be None for a loop that only runs jobs (tests, tools).
        `kv_bytes_per_token`: what a running sequence's caches hold per token (the KV admission bound)."""
        self.engine, self.executor, self.config, self.observer = engine, executor, config, observer
        self.kv_bytes_per_token = kv_bytes_per_token
        self.stats = LoopStats()
        self.scheduler: Scheduler[Generation] = Scheduler(config)
        self._cond = threading.Condition()
        self._current: Job | None = None
        self._is_closing = False
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    # --- what the app reads -------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def is_busy(self) -> bool:
        return self._current is not None or self.scheduler.num_running > 0

    # --- submitting work (from an event loop) -------------------------------------------------------
    def submit(self, fn: Callable[[Job], Any]) -> Job:
        """Queue an exclusive job `fn(job)`; await `job.future` for its result. QueueFull when full."""
        job = new_job(fn)
        self._enqueue(job)
        return job

    async def run(self, fn: Callable[[Job], Any]) -> Any:
        job = self.submit(fn)
        try:
            return await asyncio.shield(job.future)
        except asyncio.CancelledError:
            job.cancelled.set()
            raise

    def stream(self, fn: Callable[[Job, Emit], Any]) -> JobStream:
        """Queue an exclusive streaming job `fn(job, emit)`; iterate the result for what it emits."""
        items: asyncio.Queue[Any] = asyncio.Queue()
        emit = emitter(asyncio.get_running_loop(), items)

        def body(job: Job) -> Any:
            try:
                return fn(job, emit)
            finally:
                emit(END)

        job = self.submit(body)
        # a job cancelled before it started never runs `body`: only its settling can end the stream
        # (else a queued request whose client left awaits its items for ever, and holds shutdown)
        job.future.add_done_callback(lambda _: items.put_nowait(END))
        return JobStream(job, items)

    def generate(self, request: PrefillRequest, t_start: float, retrieval_ms: float = 0.0,
                 num_prompt_tokens: int | None = None) -> JobStream:
        """Queue a generation (QueueFull when full): TokenEvents, then one DoneEvent.
        `num_prompt_tokens`: the prompt's length where the caller counted it (else counted here)."""
        if self.executor is None:
            raise RuntimeError("this engine loop has no executor: it runs jobs only")
        items: asyncio.Queue[Any] = asyncio.Queue()
        job = new_job(lambda job: None)  # settled by the loop when the generation ends
        num_tokens = num_prompt_tokens or self.executor.num_prompt_tokens(request)
        generation = Generation(
            request, job, emitter(job.loop, items), num_tokens,
            (num_tokens + request.sampling.max_tokens) * self.kv_bytes_per_token, t_start, time.perf_counter(),
            Timings(retrieval_ms=retrieval_ms),
        )
        self._enqueue(generation)
        return JobStream(job, items)

    def _enqueue(self, work: Job | Generation) -> None:
        with self._cond:
            if self._is_closing:
                raise QueueFull("server is shutting down", self.config.retry_after_s)
            if not self.scheduler.can_queue():
                self.stats.num_rejected += 1
                raise QueueFull(f"engine queue full ({self.config.max_queue} waiting)", self.config.retry_after_s)
            self.scheduler.waiting.append(work)
            self._cond.notify()

    def submit_background(self, fn: Callable[[], None]) -> bool:
        """Queue a low-priority unit (any thread); False when the background queue is full or closed."""
        with self._cond:
            if self._is_closing or not self.scheduler.can_queue_background():
                return False
            self.scheduler.background.append(fn)
            self._cond.notify()
        return True

    def call_background(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the loop as a background unit and wait for it (from another thread: an ingest's
        precompute, so a chat waits for one chunk, never for a whole upload). JobCancelled at shutdown."""
        if threading.current_thread() is self._thread:
            return fn()
        call = _BlockingCall(fn)
        with self._cond:
            if self._is_closing:
                raise JobCancelled("the engine is shutting down")
            self.scheduler.background.append(call)  # not bounded: its caller waits for it
            self._cond.notify()
        return call.wait()

    def close(self, timeout_s: float = 60.0) -> bool:
        """Cancel everything (a job stops at its next check: an ingest after the document it is
        writing), drop background units, and wait for the thread. Returns whether it stopped: only
        then may the stores it writes be closed."""
        with self._cond:
            self._is_closing = True
            for task in self.scheduler.background:
                if isinstance(task, _BlockingCall):
                    task.cancel()
            self.scheduler.background.clear()
            for work in [self._current, *self.scheduler.waiting, *self.scheduler.running, self.scheduler.prefilling]:
                if work is not None:
                    (work if isinstance(work, Job) else work.job).cancelled.set()
            self._cond.notify_all()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.error("engine loop still busy after %.0f s at shutdown", timeout_s)
        return not self._thread.is_alive()

    # --- the loop -----------------------------------------------------------------------------------
    def _loop(self) -> None:
        while (step := self._next_step()) is not None:
            self._run_step(step)

    def _next_step(self) -> Step[Generation] | None:
        with self._cond:
            while True:
                self._drop_cancelled()
                if self._is_closing and not self.scheduler.running and self.scheduler.prefilling is None:
                    for work in self.scheduler.waiting:  # cancelled above; settle what is left
                        self._settle_cancelled(work)
                    self.scheduler.waiting.clear()
                    return None
                step = self.scheduler.schedule(time.perf_counter())
                if not step.is_idle:
                    self._current = step.job
                    return step
                if self.engine is not None and not self.scheduler.running:
                    self.engine.close_decode_batch()  # idle: a graphed batch's KV pool goes back
                self._cond.wait()

    def _drop_cancelled(self) -> None:
        """Requests whose client left: out of the queue and the batch (under the lock). Closing, every
        one is: those admitted in the step that ran while `close` was called too."""
        scheduler = self.scheduler
        if self._is_closing:
            for work in [*scheduler.waiting, *scheduler.running, scheduler.prefilling]:
                if work is not None:
                    (work if isinstance(work, Job) else work.job).cancelled.set()
        for work in [w for w in scheduler.waiting if (w if isinstance(w, Job) else w.job).cancelled.is_set()]:
            scheduler.waiting.remove(work)
            self._settle_cancelled(work)
        for generation in [g for g in scheduler.running if g.job.cancelled.is_set()]:
            scheduler.running.remove(generation)
            self._settle_cancelled(generation)
        if scheduler.prefilling is not None and scheduler.prefilling.job.cancelled.is_set():
            self._settle_cancelled(scheduler.prefilling)
            scheduler.prefilling = None

    def _settle_cancelled(self, work: Job | Generation) -> None:
        self.stats.num_cancelled += 1
        if isinstance(work, Generation):
            _abandon_prefill(work)
            work.is_done = True
            work.sequence = None  # its cache is freed now
            work.emit(END)
            work = work.job
        work.settle(None, JobCancelled("cancelled"))

    def _run_step(self, step: Step[Generation]) -> None:
        if step.job is not None:
            self._run_job(step.job)
        prefills = [g for g in (step.continued_prefill, *step.admitted) if g is not None]
        if prefills:
            start = time.perf_counter()
            for generation in prefills:
                self._prefill(generation)
            with self._cond:
                self.scheduler.observe_prefill(time.perf_counter() - start)
        if step.is_decode_deferred:
            self.stats.num_decode_steps_deferred += 1
        batch = [g for g in step.decode if g.sequence is not None and not g.is_done]
        if batch:
            if self.scheduler.prefilling is not None:
                self.stats.num_decode_steps_mid_prefill += 1
            self._decode(batch)
        if step.background is not None:
            start = time.perf_counter()
            self._run_background(step.background)
            background_ms = (time.perf_counter() - start) * 1000
            for generation in step.delayed:  # those still without a first token waited for it
                if generation.sequence is None and not generation.is_done:
                    generation.timings.background_ms += background_ms

    def _prefill(self, generation: Generation) -> None:
        """One prefill step of `generation`; when its prompt is in, its first token and a place in the batch."""
        if generation.job.cancelled.is_set():  # its client left after it was admitted: no work for nobody
            with self._cond:
                if self.scheduler.prefilling is generation:
                    self.scheduler.prefilling = None
                self._settle_cancelled(generation)
            return
        try:
            if generation.prefill_steps is None:
                generation.timings.queue_ms = (time.perf_counter() - generation.t_submit) * 1000
                generation.prefill_steps = self.executor.prefill_steps(generation.request)
            outcome = next(generation.prefill_steps)
            if outcome is None:  # a prefill in parts: its next part in the next step
                self.stats.num_prefill_parts += 1
                with self._cond:
                    self.scheduler.prefilling = generation
                return
            _abandon_prefill(generation)  # it ended: nothing to clean up, its frames freed now
            with self._cond:
                if self.scheduler.prefilling is generation:
                    self.scheduler.prefilling = None
            generation.outcome = outcome
            stats = outcome.result.stats
            generation.usage = Usage(stats.num_prompt_tokens, stats.num_reused_tokens, stats.num_recomputed_tokens,
                                     prefix_cached_tokens=stats.num_prefix_cached_tokens)
            generation.timings.kv_load_ms, generation.timings.prefill_ms = stats.kv_load_ms, stats.prefill_ms
            generation.sequence, first = self.engine.start_sequence(outcome.result, generation.request.sampling)
        except Exception as exc:  # the request's own failure goes back to it
            with self._cond:
                if self.scheduler.prefilling is generation:
                    self.scheduler.prefilling = None
            self._fail([generation], exc)
            return
        is_going_on = self._deliver(generation, first, time.perf_counter())
        self._keep(generation.outcome)  # its prompt's KV kept for later prompts, once the first token is out
        if not is_going_on:
            return
        try:  # its decode cache now, after the first token is out: not inside a shared decode step
            generation.sequence.prepare()
        except Exception as exc:
            self._fail([generation], exc)
            return
        with self._cond:
            self.scheduler.running.append(generation)

    def _keep(self, outcome: PrefillOutcome) -> None:
        try:  # by reference: no copy (runtime/executor.py)
            self.executor.keep(outcome)
        except Exception:  # the answer goes on without it
            logger.exception("keeping a prompt in the prefix cache failed")

    def _decode(self, batch: list[Generation]) -> None:
        try:
            deltas = self.engine.decode_step([g.sequence for g in batch])
        except Exception as exc:  # one forward for all: all of them fail
            with self._cond:
                for generation in batch:
                    if generation in self.scheduler.running:
                        self.scheduler.running.remove(generation)
            self._fail(batch, exc)
            return
        now = time.perf_counter()
        if self.observer is not None:
            self.observer.observe_step(len(batch))
        for generation, delta in zip(batch, deltas):
            if self.observer is not None:
                self.observer.observe_inter_token(now - generation.t_last_token)
            if not self._deliver(generation, delta, now):
                with self._cond:
                    self.scheduler.running.remove(generation)

    def _deliver(self, generation: Generation, delta: Delta, now: float) -> bool:
        """Emit a delta's text; on its last, the DoneEvent. Returns whether the sequence goes on."""
        if generation.usage.completion_tokens == 0 and delta.num_tokens > 0:
            generation.timings.ttft_ms = (now - generation.t_start) * 1000
        generation.usage.completion_tokens = delta.num_tokens
        generation.t_last_token = now
        if delta.text:
            generation.emit(TokenEvent(delta.text))
        if delta.finish_reason is None:
            return True
        self._finish(generation, delta.finish_reason)
        return False

    def _finish(self, generation: Generation, reason: FinishReason) -> None:
        generation.is_done = True
        generation.timings.total_ms = (time.perf_counter() - generation.t_start) * 1000
        stats = generation.outcome.result.stats
        done = DoneEvent(generation.usage, generation.timings, reason, stats.mode, stats.recompute_ratio,
                         stats.is_guarded, plan=generation.outcome.plan)
        if self.observer is not None:
            self.observer.observe_done(done)
        generation.emit(done)
        generation.emit(END)
        generation.job.settle(None, None)
        self.stats.num_completed += 1
        generation.sequence = None  # its decode cache is freed now, not when the client reads the end
        try:  # chunks streamed from disk or Redis: copied into memory for the next question
            self.executor.kv_store.promote(generation.outcome.handles)
        except Exception:
            logger.exception("promoting a finished answer's KV failed")

    def _fail(self, generations: list[Generation], error: Exception) -> None:
        logger.error("generation failed: %s", error, exc_info=error)
        for generation in generations:
            _abandon_prefill(generation)
            generation.is_done = True
            generation.sequence = None
            generation.emit(END)
            generation.job.settle(None, error)
            self.stats.num_failed += 1

    def _run_background(self, task: Callable[[], None]) -> None:
        try:
            task()
        except Exception:  # a background task's failure is its own business (it counts it)
            logger.exception("background engine task failed")

    def _run_job(self, job: Job) -> None:
        try:
            if job.cancelled.is_set():
                self.stats.num_cancelled += 1
                job.settle(None, JobCancelled("cancelled before start"))
                return
            try:
                result, error = job.fn(job), None
                self.stats.num_completed += 1
            except JobCancelled as exc:
                result, error = None, exc
                self.stats.num_cancelled += 1
            except Exception as exc:  # the job's own failure goes back to its request
                logger.exception("engine job failed")
                result, error = None, exc
                self.stats.num_failed += 1
            job.settle(result, error)
        finally:
            with self._cond:
                self._current = None


def _abandon_prefill(generation: Generation) -> None:
    """Close a generation's prefill generator (on the loop's thread, which runs it): a prefill left
    between its parts (its client left, shutdown, a failure) closes its KV source and stops the
    source's loader thread now, not whenever the garbage collector gets to it."""
    if generation.prefill_steps is None:
        return
    try:
        generation.prefill_steps.close()
    except Exception:  # a source that failed to close must not stop the loop (it runs under its lock)
        logger.exception("closing an abandoned prefill failed")
