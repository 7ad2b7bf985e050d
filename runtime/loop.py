"""The engine loop: one thread runs the engine, a step at a time, as the `Scheduler` decides.

Requests' generations are prefilled (in parts, one per step, when long) and then decode together,
one batched forward per step for every running sequence (`BlendEngine.decode_step`): a request waits
for the prefills ahead of it and at most one step, never for another's whole answer. Exclusive jobs (a
delete, the start-up measurement) run alone in a step; background units (KV repair, backfill, an
ingest's precompute through `call_background`) run when nothing waits, or once in a few busy steps.
The event loop only awaits futures and async queues, so it never blocks on the model; a client that
goes away (its stream's `cancel()`) leaves the batch at the next step.

A step is nano-vllm's `LLMEngine.step`: ask the scheduler what runs (`Scheduler.schedule`), run it, report
what became of each request (`Scheduler.update_from_output`), and end the streams of those that left.
The loop holds no request state of its own (a request's status and queue are the scheduler's), and
every request that leaves the scheduler, however (its answer done, a failure, its client gone, shutdown),
ends its stream in one place (`_end`)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Generator, Protocol

from blend_engine.types import Delta
from runtime.config import SchedulerConfig
from runtime.executor import PrefillExecutor, PrefillOutcome
from runtime.jobs import END, Emit, Job, JobCancelled, JobStream, QueueFull, emitter, new_job
from runtime.memory import release_idle_memory
from runtime.scheduler import Scheduler, Status, Step, StepOutput
from runtime.types import DoneEvent, GenerationEvent, PrefillRequest, Timings, TokenEvent, Usage

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
    num_idle_releases: int = 0  # times the allocator's free memory went back to the system (runtime/memory.py)


@dataclass(eq=False)
class Generation:
    """One request's generation: its request, its stream, and what the loop computed for it. Where it
    is (waiting, prefilling, decoding, finished) is its `status`, the scheduler's to set."""

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
    status: Status = Status.WAITING
    error: Exception | None = None  # what failed it (FINISHED_FAILED)

    @property
    def kv_bytes(self) -> int:
        return self.sequence.nbytes if self.sequence is not None else self.expected_kv_bytes

    @property
    def is_cancelled(self) -> bool:
        return self.job.is_cancelled

    def cancel(self) -> None:
        self.job.cancel()


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
        self._is_closing = False
        self._is_release_due = False  # work ran since the last idle release
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
        return self.scheduler.is_busy

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
            job.cancel()
            raise

    def stream(self, fn: Callable[[Job, Emit], Any]) -> JobStream[Any]:
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
                 num_prompt_tokens: int | None = None) -> JobStream[GenerationEvent]:
        """Queue a generation (QueueFull when full): TokenEvents, then one DoneEvent.
        `num_prompt_tokens`: the prompt's length where the caller counted it (else counted here)."""
        if self.executor is None:
            raise RuntimeError("this engine loop has no executor: it runs jobs only")
        items: asyncio.Queue[GenerationEvent | object] = asyncio.Queue()
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
            if not self.scheduler.add(work):
                self.stats.num_rejected += 1
                raise QueueFull(f"engine queue full ({self.config.max_queue} waiting)", self.config.retry_after_s)
            self._cond.notify()

    def submit_background(self, fn: Callable[[], None]) -> bool:
        """Queue a low-priority unit (any thread); False when the background queue is full or closed."""
        with self._cond:
            if self._is_closing or not self.scheduler.add_background(fn):
                return False
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
            self.scheduler.add_background(call, is_bounded=False)  # its caller waits for it
            self._cond.notify()
        return call.wait()

    def close(self, timeout_s: float = 60.0) -> bool:
        """Cancel everything (a job stops at its next check: an ingest after the document it is
        writing), drop background units, and wait for the thread, which ends every stream after the
        step in progress. Returns whether it stopped: only then may the stores it writes be closed."""
        with self._cond:
            self._is_closing = True
            for task in self.scheduler.drop_background():
                if isinstance(task, _BlockingCall):
                    task.cancel()
            for work in self.scheduler.work():
                work.cancel()
            self._cond.notify_all()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.error("engine loop still busy after %.0f s at shutdown", timeout_s)
        return not self._thread.is_alive()

    # --- the loop: nano-vllm's LLMEngine.step, a step at a time -----------------------------------
    def _loop(self) -> None:
        while (step := self._schedule()) is not None:
            output = self._run(step)
            with self._cond:
                finished = self.scheduler.update_from_output(output)
            self._end(finished)
            # not held while the loop waits: the last step's finished answers would keep their
            # prefill's cache (SmolLM2's fp32 cache: 46 kB a prompt token) until the next request
            del step, output, finished

    def _schedule(self) -> Step[Generation] | None:
        """The next step, once there is one; None once closing (everything it held ended)."""
        with self._cond:
            while True:
                # a client that left: out of the queue and the batch now, its cache freed
                self._end(self.scheduler.abort_all() if self._is_closing else self.scheduler.abort_cancelled())
                if self._is_closing:
                    return None
                step = self.scheduler.schedule(time.perf_counter())
                if not step.is_idle:
                    self._is_release_due = True
                    return step
                if self.engine is not None and not self.scheduler.num_running:
                    self.engine.close_decode_batch()  # idle: a graphed batch's KV pool goes back
                if self._is_release_due and self.config.idle_release_s > 0 and not self.scheduler.num_running:
                    if not self._cond.wait(self.config.idle_release_s):  # nothing came meanwhile
                        self._release_idle_memory()
                    continue
                self._cond.wait()

    def _release_idle_memory(self) -> None:
        """The allocator's free memory back to the system (called holding `_cond`, released meanwhile: a
        trim takes tens of ms, and `submit` must not wait for it)."""
        self._is_release_due = False
        self._cond.release()
        try:
            release_idle_memory()  # prefill runs on this thread: its scratch goes too
        finally:
            self._cond.acquire()
        self.stats.num_idle_releases += 1

    def _run(self, step: Step[Generation]) -> StepOutput[Generation]:
        """Run a step's work; what became of its requests, for the scheduler (no scheduler state here)."""
        output: StepOutput[Generation] = StepOutput()
        if step.job is not None:
            self._run_job(step.job)
        if step.prefills:
            start = time.perf_counter()
            for generation in step.prefills:
                if (status := self._prefill(generation)) is not Status.PREFILLING:
                    output.statuses[generation] = status
            output.prefill_s = time.perf_counter() - start
        if step.is_decode_deferred:
            self.stats.num_decode_steps_deferred += 1
        batch = [g for g in step.decode if output.status_of(g) is Status.RUNNING]
        if batch:
            if any(output.status_of(g) is Status.PREFILLING for g in step.prefills):
                self.stats.num_decode_steps_mid_prefill += 1
            output.statuses.update(self._decode(batch))
        if step.background is not None:
            start = time.perf_counter()
            self._run_background(step.background)
            background_ms = (time.perf_counter() - start) * 1000
            for generation in step.delayed:  # those still without a first token waited for it
                if output.status_of(generation) in (Status.WAITING, Status.PREFILLING):
                    generation.timings.background_ms += background_ms
        return output

    def _prefill(self, generation: Generation) -> Status:
        """One prefill step of `generation`: PREFILLING while parts remain; once its prompt is in, its
        first token and RUNNING; or how it ended (its first token the last, a failure, its client left)."""
        if generation.is_cancelled:  # its client left after it was admitted: no work for nobody
            return Status.FINISHED_ABORTED
        try:
            if generation.prefill_steps is None:
                generation.timings.queue_ms = (time.perf_counter() - generation.t_submit) * 1000
                generation.prefill_steps = self.executor.prefill_steps(generation.request)
            outcome = next(generation.prefill_steps)
            if outcome is None:  # a prefill in parts: its next part in the next step
                self.stats.num_prefill_parts += 1
                return Status.PREFILLING
            _abandon_prefill(generation)  # it ended: nothing to clean up, its frames freed now
            generation.outcome = outcome
            stats = outcome.result.stats
            generation.usage = outcome.usage
            generation.timings.kv_load_ms, generation.timings.prefill_ms = stats.kv_load_ms, stats.prefill_ms
            generation.sequence, first = self.engine.start_sequence(outcome.result, generation.request.sampling)
        except Exception as exc:  # the request's own failure goes back to it
            return self._failed([generation], exc)[generation]
        status = self._deliver(generation, first, time.perf_counter())
        self._keep(generation.outcome)  # its prompt's KV kept for later prompts, once the first token is out
        if status is Status.RUNNING:
            try:  # its decode cache now, after the first token is out: not inside a shared decode step
                generation.sequence.prepare()
            except Exception as exc:
                return self._failed([generation], exc)[generation]
        return status

    def _keep(self, outcome: PrefillOutcome) -> None:
        try:  # by reference: no copy (runtime/executor.py)
            self.executor.keep(outcome)
        except Exception:  # the answer goes on without it
            logger.exception("keeping a prompt in the prefix cache failed")

    def _decode(self, batch: list[Generation]) -> dict[Generation, Status]:
        """One batched decode step: the sequences it ended, with how."""
        try:
            deltas = self.engine.decode_step([g.sequence for g in batch])
        except Exception as exc:  # one forward for all: all of them fail
            return self._failed(batch, exc)
        now = time.perf_counter()
        if self.observer is not None:
            self.observer.observe_step(len(batch))
        ended = {}
        for generation, delta in zip(batch, deltas):
            if self.observer is not None:
                self.observer.observe_inter_token(now - generation.t_last_token)
            if (status := self._deliver(generation, delta, now)) is not Status.RUNNING:
                ended[generation] = status
        return ended

    def _deliver(self, generation: Generation, delta: Delta, now: float) -> Status:
        """Emit a delta's text: RUNNING while the sequence goes on, else how it finished."""
        if generation.usage.completion_tokens == 0 and delta.num_tokens > 0:
            generation.timings.ttft_ms = (now - generation.t_start) * 1000
        generation.usage.completion_tokens = delta.num_tokens
        generation.t_last_token = now
        if delta.text:
            generation.emit(TokenEvent(delta.text))
        return Status.RUNNING if delta.finish_reason is None else Status.finished(delta.finish_reason)

    @staticmethod
    def _failed(generations: list[Generation], error: Exception) -> dict[Generation, Status]:
        logger.error("generation failed: %s", error, exc_info=error)
        for generation in generations:
            generation.error = error
        return {generation: Status.FINISHED_FAILED for generation in generations}

    def _end(self, ended: list[Generation | Job]) -> None:
        """The one way out: whatever left the scheduler (finished, failed, aborted) ends here, its
        stream with it (a job left the queue only if cancelled)."""
        for work in ended:
            if isinstance(work, Generation):
                self._end_generation(work)
            else:
                self.stats.num_cancelled += 1
                work.settle(None, JobCancelled("cancelled"))

    def _end_generation(self, generation: Generation) -> None:
        _abandon_prefill(generation)
        generation.sequence = None  # its cache is freed now, not when the client reads the end
        if generation.status is Status.FINISHED_ABORTED:
            self.stats.num_cancelled += 1
            error: BaseException | None = JobCancelled("cancelled")
        elif generation.status is Status.FINISHED_FAILED:
            self.stats.num_failed += 1
            error = generation.error
        else:
            generation.timings.total_ms = (time.perf_counter() - generation.t_start) * 1000
            stats = generation.outcome.result.stats
            done = DoneEvent(generation.usage, generation.timings, generation.status.finish_reason, stats.mode,
                             stats.recompute_ratio, stats.is_guarded, plan=generation.outcome.plan)
            if self.observer is not None:
                self.observer.observe_done(done)
            generation.emit(done)
            self.stats.num_completed += 1
            error = None
        generation.emit(END)
        generation.job.settle(None, error)
        if error is None:
            try:  # chunks streamed from disk or Redis: copied into memory for the next question
                self.executor.kv_store.promote(generation.outcome.handles)
            except Exception:
                logger.exception("promoting a finished answer's KV failed")

    def _run_background(self, task: Callable[[], None]) -> None:
        try:
            task()
        except Exception:  # a background task's failure is its own business (it counts it)
            logger.exception("background engine task failed")

    def _run_job(self, job: Job) -> None:
        if job.is_cancelled:
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
