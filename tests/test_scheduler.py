"""The scheduler's decisions, without threads or a model: admission under the running, KV-byte and
prefill-token bounds; a job alone in its step; a chunked prefill continued before anything is
admitted; background work when nothing waits and, while busy, at least once in N steps, never twice
before a waiting request's first token; the running sequences' decode step put off while prefills run,
until one of them has waited `max_decode_stall_ms`."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

import pytest

from runtime.config import SchedulerConfig
from runtime.jobs import Job
from runtime.scheduler import Scheduler


@dataclass(eq=False)
class Req:
    num_prompt_tokens: int = 100
    kv_bytes: int = 10
    t_last_token: float = 0.0


def job() -> Job:
    loop = asyncio.new_event_loop()
    try:
        return Job(lambda j: None, loop, loop.create_future())
    finally:
        loop.close()


def scheduler(**config) -> Scheduler:
    """A decode step in every step unless a test sets a stall bound (the decisions apart from it)."""
    return Scheduler(SchedulerConfig(**{"max_decode_stall_ms": 0, **config}))


def test_waiting_requests_are_admitted_together_and_decode_with_the_running_ones():
    s = scheduler(max_running=8)
    running = Req()
    s.running.append(running)
    waiting = [Req() for _ in range(3)]
    s.waiting.extend(waiting)
    step = s.schedule()
    assert step.admitted == waiting and step.decode == [running, *waiting] and not s.waiting


def test_admission_stops_at_max_running_and_resumes_when_a_sequence_ends():
    s = scheduler(max_running=2)
    a, b, c = Req(), Req(), Req()
    s.waiting.extend([a, b, c])
    step = s.schedule()
    assert step.admitted == [a, b] and list(s.waiting) == [c]
    s.running.extend(step.admitted)
    assert s.schedule().admitted == []  # full: c waits, a and b decode
    s.running.remove(a)  # a finished
    assert s.schedule().admitted == [c]


def test_kv_bytes_bound_admission_but_one_request_always_runs():
    s = scheduler(max_running=8, max_running_kv_bytes=100 << 20)
    big, small = Req(kv_bytes=500 << 20), Req(kv_bytes=60 << 20)
    s.waiting.extend([big, small])
    step = s.schedule()
    assert step.admitted == [big]  # alone it runs, however large
    s.running.append(big)
    assert s.schedule().admitted == []  # small would pass the bound beside it
    s.running.remove(big)
    assert s.schedule().admitted == [small]


def test_prefill_token_budget_per_step_and_at_least_one_prefill():
    s = scheduler(max_running=8, max_prefill_tokens=250)
    reqs = [Req(num_prompt_tokens=100) for _ in range(3)] + [Req(num_prompt_tokens=1000)]
    s.waiting.extend(reqs)
    assert s.schedule().admitted == reqs[:2]
    assert s.schedule().admitted == [reqs[2]]  # 100 + 1000 > 250: the long one goes next step
    assert s.schedule().admitted == [reqs[3]]  # alone, over the budget: admitted all the same


def test_a_job_runs_alone_in_its_step_in_queue_order():
    s = scheduler()
    a, j, b = Req(), job(), Req()
    s.waiting.extend([a, j, b])
    step = s.schedule()
    assert step.admitted == [a] and step.job is None  # the job waits for the next step
    s.running.append(a)
    step = s.schedule()
    assert step.job is j and step.admitted == [] and step.decode == [a]
    assert s.schedule().admitted == [b]


def test_a_chunked_prefill_goes_on_before_anything_is_admitted():
    s = scheduler()
    long, nxt, running = Req(num_prompt_tokens=5000), Req(), Req()
    s.prefilling, s.running = long, [running]
    s.waiting.append(nxt)
    step = s.schedule()
    assert step.continued_prefill is long and step.admitted == [] and step.decode == [running]
    s.prefilling = None
    assert s.schedule().admitted == [nxt]
    assert s.num_running == 1


def test_background_runs_when_idle_and_is_not_starved_while_busy():
    s = scheduler(background_every_steps=3)
    units = [lambda: None for _ in range(3)]
    s.background.extend(units)
    assert s.schedule().background is units[0]  # nothing else to do
    s.running.append(Req())  # decoding, nothing waiting: not busy
    assert s.schedule().background is units[1]
    for _ in range(2):  # busy: a request admitted each step
        s.waiting.append(Req())
        assert s.schedule().background is None
    s.waiting.append(Req())
    assert s.schedule().background is units[2]  # the third busy step runs one anyway


def test_a_request_awaiting_its_first_token_waits_through_one_background_unit_at_most():
    """The TTFT bound (issue 23: an upload costs a chat one chunk's precompute at most): once a unit ran
    while a request waited, no other runs before that request's first token; then units resume."""
    s = scheduler(max_running=1, background_every_steps=1)  # paced every busy step: only the bound holds units
    s.background.extend(lambda: None for _ in range(10))
    first = Req()
    s.running.append(first)  # full: the waiting ones stay waiting
    a, b = Req(), Req()
    s.waiting.extend([a, b])
    assert s.schedule().background is not None  # a and b wait through this one
    for _ in range(3):
        assert s.schedule().background is None
    c = Req()
    s.waiting.append(c)  # has not waited through one, but a and b are still waiting
    assert s.schedule().background is None
    s.running.clear()  # `first` ends; as the loop does, what a step admits then runs
    step = s.schedule()
    assert step.admitted == [a] and step.background is None  # b still waits
    s.running[:] = step.admitted
    assert s.schedule().background is None
    s.running.clear()
    step = s.schedule()
    assert step.admitted == [b] and step.background is None and s.waiting == deque([c])
    s.running[:] = step.admitted
    step = s.schedule()  # b has its first token; c waits but waited through none: not starved
    assert step.admitted == [] and step.background is not None
    assert s.schedule().background is None  # now c has


def test_decode_waits_for_prefills_until_a_running_sequence_has_stalled_max_decode_stall_ms():
    s = scheduler(max_running=8, max_decode_stall_ms=2000)
    early, late = Req(t_last_token=10.0), Req(t_last_token=11.0)
    s.running.extend([early, late])
    a, b = Req(num_prompt_tokens=3000), Req(num_prompt_tokens=3000)  # one prefill a step
    s.waiting.extend([a, b])
    step = s.schedule(now=11.5)  # early has waited 1.5 s: a's prefill runs alone
    assert step.admitted == [a] and step.decode == [] and step.is_decode_deferred
    s.running.append(a)
    a.t_last_token = 12.0  # its first token; early has still waited the longest
    step = s.schedule(now=12.0)  # 2 s since early's last token: the prefill, then one decode step
    assert step.admitted == [b] and step.decode == [early, late, a, b] and not step.is_decode_deferred


def test_the_stall_bound_counts_the_prefill_work_the_step_is_about_to_run():
    s = scheduler(max_running=8, max_decode_stall_ms=2000)
    s.running.append(running := Req(t_last_token=10.0))
    s.waiting.extend([Req(num_prompt_tokens=3000) for _ in range(3)])
    s.observe_prefill(0.7)  # the last step's prefill work: the next is expected to take as long
    assert s.schedule(now=11.2).is_decode_deferred  # 1.2 s + 0.7 s: still under 2 s after the prefill
    step = s.schedule(now=11.4)  # 1.4 s + 0.7 s: over it by then, so this step decodes
    assert not step.is_decode_deferred and running in step.decode


def test_decode_is_never_put_off_without_prefills_or_without_a_bound():
    s = scheduler(max_running=8, max_decode_stall_ms=2000)
    running = Req(t_last_token=10.0)
    s.running.append(running)
    step = s.schedule(now=10.1)  # nothing to prefill: decode
    assert step.decode == [running] and not step.is_decode_deferred
    s.prefilling = long = Req(num_prompt_tokens=5000)  # a part continued counts as a prefill
    step = s.schedule(now=10.1)
    assert step.continued_prefill is long and step.decode == []
    s = scheduler(max_running=8, max_decode_stall_ms=0)  # no bound: decode after every step
    s.running.append(running)
    s.waiting.append(nxt := Req())
    assert s.schedule(now=10.1).decode == [running, nxt]


@pytest.mark.parametrize("name", ["max_running", "max_queue", "max_prefill_tokens", "prefill_chunk_tokens"])
def test_config_refuses_zero(name):
    with pytest.raises(ValueError, match=name):
        SchedulerConfig(**{name: 0})


def test_config_refuses_a_negative_stall_bound():
    with pytest.raises(ValueError, match="max_decode_stall_ms"):
        SchedulerConfig(max_decode_stall_ms=-1)
