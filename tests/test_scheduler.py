"""The scheduler's decisions, without threads or a model: admission under the running, KV-byte and
prefill-token bounds; a job alone in its step; prefills in parts (several at once) continued before
anything is admitted; background work when nothing waits and, while busy, at least once in N steps,
never twice before a waiting request's first token; the running sequences' decode step put off while
prefills run, until one of them has waited `max_decode_stall_ms`; a request's lifecycle (its status,
changed by the scheduler's own methods only, the transitions checked)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from runtime.config import SchedulerConfig
from runtime.jobs import Job
from runtime.scheduler import Scheduler, Status, StepOutput


@dataclass(eq=False)
class Req:
    num_prompt_tokens: int = 100
    kv_bytes: int = 10
    t_last_token: float = 0.0
    is_cancelled: bool = False
    status: Status = Status.WAITING


def job() -> Job:
    loop = asyncio.new_event_loop()
    try:
        return Job(lambda j: None, loop, loop.create_future())
    finally:
        loop.close()


def scheduler(**config) -> Scheduler:
    """A decode step in every step unless a test sets a stall bound (the decisions apart from it)."""
    return Scheduler(SchedulerConfig(**{"max_decode_stall_ms": 0, **config}))


def add(s: Scheduler, *works):
    for work in works:
        assert s.add(work)
    return works[0] if len(works) == 1 else works


def report(s: Scheduler, step, prefill_s: float | None = None) -> list:
    """Report `step` as the loop does when every prefill in it ends: their prompts in, they decode."""
    return s.update_from_output(StepOutput({g: Status.RUNNING for g in step.prefills}, prefill_s))


def finish(s: Scheduler, *reqs) -> list:
    return s.update_from_output(StepOutput({r: Status.FINISHED_LENGTH for r in reqs}))


def test_waiting_requests_are_admitted_together_and_decode_with_the_running_ones():
    s = scheduler(max_running=8)
    running = add(s, Req())
    report(s, s.schedule())
    waiting = add(s, *(Req() for _ in range(3)))
    step = s.schedule()
    assert step.admitted == list(waiting) and step.decode == [running, *waiting] and s.num_waiting == 0
    assert running.status is Status.RUNNING and all(r.status is Status.PREFILLING for r in waiting)


def test_admission_stops_at_max_running_and_resumes_when_a_sequence_ends():
    s = scheduler(max_running=2)
    a, b, c = add(s, Req(), Req(), Req())
    step = s.schedule()
    assert step.admitted == [a, b] and s.num_waiting == 1
    report(s, step)
    assert s.schedule().admitted == []  # full: c waits, a and b decode
    assert finish(s, a) == [a]  # a finished
    assert s.schedule().admitted == [c]


def test_kv_bytes_bound_admission_but_one_request_always_runs():
    s = scheduler(max_running=8, max_running_kv_bytes=100 << 20)
    big, small = add(s, Req(kv_bytes=500 << 20), Req(kv_bytes=60 << 20))
    step = s.schedule()
    assert step.admitted == [big]  # alone it runs, however large
    report(s, step)
    assert s.schedule().admitted == []  # small would pass the bound beside it
    finish(s, big)
    assert s.schedule().admitted == [small]


def test_prefill_token_budget_per_step_and_at_least_one_prefill():
    s = scheduler(max_running=8, max_prefill_tokens=250)
    reqs = add(s, *[Req(num_prompt_tokens=100) for _ in range(3)], Req(num_prompt_tokens=1000))
    step = s.schedule()
    assert step.admitted == list(reqs[:2])
    report(s, step)
    step = s.schedule()
    assert step.admitted == [reqs[2]]  # 100 + 1000 > 250: the long one goes next step
    report(s, step)
    assert s.schedule().admitted == [reqs[3]]  # alone, over the budget: admitted all the same


def test_a_job_runs_alone_in_its_step_in_queue_order():
    s = scheduler()
    a, j, b = add(s, Req(), job(), Req())
    step = s.schedule()
    assert step.admitted == [a] and step.job is None  # the job waits for the next step
    report(s, step)
    step = s.schedule()
    assert step.job is j and step.admitted == [] and step.decode == [a] and s.is_busy
    report(s, step)  # the job is done
    assert s.schedule().admitted == [b]


def test_prefills_in_parts_all_go_on_before_anything_is_admitted():
    """Two long prefills admitted in one step, each cut into parts: both go on, a part each per step,
    until each is in (the hang: a scheduler that held one prefill in parts lost the other)."""
    s = scheduler()
    running = add(s, Req())
    report(s, s.schedule())
    long_a, long_b = add(s, Req(num_prompt_tokens=1000), Req(num_prompt_tokens=1000))
    step = s.schedule()
    assert step.admitted == [long_a, long_b]
    assert s.update_from_output(StepOutput()) == []  # each ran a part and has more
    nxt = add(s, Req())
    step = s.schedule()
    assert step.continued == [long_a, long_b] and step.admitted == [] and step.decode == [running]
    s.update_from_output(StepOutput({long_a: Status.RUNNING}))  # a's prompt is in; b has a part left
    step = s.schedule()
    assert step.continued == [long_b] and step.admitted == [] and step.decode == [running, long_a]
    s.update_from_output(StepOutput({long_b: Status.RUNNING}))
    assert s.schedule().admitted == [nxt]
    assert s.num_running == 4 and s.num_prefilling == 1


def test_a_request_changes_status_only_along_its_lifecycle():
    s = scheduler()
    a, b, c = add(s, Req(), Req(), Req())
    assert (a.status, s.num_waiting, s.num_running) == (Status.WAITING, 3, 0)
    s.schedule()
    assert {r.status for r in (a, b, c)} == {Status.PREFILLING} and s.num_running == 3
    # a decodes, b's first token was its last, c has parts left
    assert s.update_from_output(StepOutput({a: Status.RUNNING, b: Status.FINISHED_STOPPED})) == [b]
    assert (a.status, b.status, c.status) == (Status.RUNNING, Status.FINISHED_STOPPED, Status.PREFILLING)
    assert s.num_running == 2 and list(s.work()) == [c, a]
    with pytest.raises(ValueError, match="a finished_stopped request cannot become running"):
        s.update_from_output(StepOutput({b: Status.RUNNING}))  # reported twice: refused, nothing moved
    with pytest.raises(ValueError, match="a running request cannot become prefilling"):
        s.update_from_output(StepOutput({a: Status.PREFILLING}))
    assert list(s.work()) == [c, a]
    waiting, queued_job = add(s, Req(), job())
    c.is_cancelled = True  # its client left between two parts
    queued_job.cancel()
    assert s.abort_cancelled() == [queued_job, c] and c.status is Status.FINISHED_ABORTED
    assert s.abort_all() == [waiting, a]  # shutdown
    assert waiting.status is a.status is Status.FINISHED_ABORTED
    assert s.num_waiting == s.num_running == 0 and list(s.work()) == []


def test_the_queues_are_bounded():
    s = scheduler(max_queue=2, max_background=1)
    assert s.add(Req()) and s.add(job()) and not s.add(Req())
    assert s.num_waiting == 2
    assert s.add_background(lambda: None) and not s.add_background(lambda: None)
    assert s.add_background(lambda: None, is_bounded=False)  # a caller waits for it: never refused
    assert len(s.drop_background()) == 2 and s.add_background(lambda: None)


def test_background_runs_when_idle_and_is_not_starved_while_busy():
    s = scheduler(background_every_steps=3)
    units = [lambda: None for _ in range(3)]
    for unit in units:
        s.add_background(unit)
    assert s.schedule().background is units[0]  # nothing else to do
    add(s, Req())
    step = s.schedule()  # busy: a request admitted
    assert step.background is None
    report(s, step)
    assert s.schedule().background is units[1]  # decoding, nothing waiting: not busy
    for _ in range(2):  # busy: a request admitted each step
        add(s, Req())
        step = s.schedule()
        assert step.background is None
        report(s, step)
    add(s, Req())
    assert s.schedule().background is units[2]  # the third busy step runs one anyway


def test_a_request_awaiting_its_first_token_waits_through_one_background_unit_at_most():
    """The TTFT bound (issue 23: an upload costs a chat one chunk's precompute at most): once a unit ran
    while a request waited, no other runs before that request's first token; then units resume."""
    s = scheduler(max_running=1, background_every_steps=1)  # paced every busy step: only the bound holds units
    for _ in range(10):
        s.add_background(lambda: None)
    first = add(s, Req())
    report(s, s.schedule())  # `first` decodes; full: the waiting ones stay waiting
    a, b = add(s, Req(), Req())
    assert s.schedule().background is not None  # a and b wait through this one
    for _ in range(3):
        assert s.schedule().background is None
    c = add(s, Req())  # has not waited through one, but a and b are still waiting
    assert s.schedule().background is None
    finish(s, first)
    step = s.schedule()
    assert step.admitted == [a] and step.background is None  # b still waits
    report(s, step)
    assert s.schedule().background is None
    finish(s, a)
    step = s.schedule()
    assert step.admitted == [b] and step.background is None and list(s.work()) == [c, b]
    report(s, step)
    step = s.schedule()  # b has its first token; c waits but waited through none: not starved
    assert step.admitted == [] and step.background is not None
    assert s.schedule().background is None  # now c has


def test_decode_waits_for_prefills_until_a_running_sequence_has_stalled_max_decode_stall_ms():
    s = scheduler(max_running=8, max_decode_stall_ms=2000)
    early, late = add(s, Req(), Req())
    report(s, s.schedule(now=0.0))
    early.t_last_token, late.t_last_token = 10.0, 11.0
    a, b = add(s, Req(num_prompt_tokens=3000), Req(num_prompt_tokens=3000))  # one prefill a step
    step = s.schedule(now=11.5)  # early has waited 1.5 s: a's prefill runs alone
    assert step.admitted == [a] and step.decode == [] and step.is_decode_deferred
    report(s, step)
    a.t_last_token = 12.0  # its first token; early has still waited the longest
    step = s.schedule(now=12.0)  # 2 s since early's last token: the prefill, then one decode step
    assert step.admitted == [b] and step.decode == [early, late, a, b] and not step.is_decode_deferred


def test_the_stall_bound_counts_the_prefill_work_the_step_is_about_to_run():
    s = scheduler(max_running=8, max_decode_stall_ms=2000)
    running = add(s, Req())
    # the last step's prefill work: the next is expected to take as long
    report(s, s.schedule(now=0.0), prefill_s=0.7)
    running.t_last_token = 10.0
    add(s, *[Req(num_prompt_tokens=3000) for _ in range(3)])
    assert s.schedule(now=11.2).is_decode_deferred  # 1.2 s + 0.7 s: still under 2 s after the prefill
    s.update_from_output(StepOutput(prefill_s=0.7))  # a part ran; more to come
    step = s.schedule(now=11.4)  # 1.4 s + 0.7 s: over it by then, so this step decodes
    assert not step.is_decode_deferred and step.continued and running in step.decode


def test_decode_is_never_put_off_without_prefills_or_without_a_bound():
    s = scheduler(max_running=8, max_decode_stall_ms=2000)
    running = add(s, Req())
    report(s, s.schedule(now=0.0))
    running.t_last_token = 10.0
    step = s.schedule(now=10.1)  # nothing to prefill: decode
    assert step.decode == [running] and not step.is_decode_deferred
    long = add(s, Req(num_prompt_tokens=5000))
    assert s.schedule(now=10.1).decode == []
    s.update_from_output(StepOutput(prefill_s=0.0))  # a part ran; more to come
    step = s.schedule(now=10.1)  # a part continued counts as a prefill
    assert step.continued == [long] and step.decode == []
    s = scheduler(max_running=8, max_decode_stall_ms=0)  # no bound: decode after every step
    running = add(s, Req())
    report(s, s.schedule(now=0.0))
    nxt = add(s, Req())
    assert s.schedule(now=10.1).decode == [running, nxt]


@pytest.mark.parametrize("name", ["max_running", "max_queue", "max_prefill_tokens", "prefill_chunk_tokens"])
def test_config_refuses_zero(name):
    with pytest.raises(ValueError, match=name):
        SchedulerConfig(**{name: 0})


def test_config_refuses_a_negative_stall_bound():
    with pytest.raises(ValueError, match="max_decode_stall_ms"):
        SchedulerConfig(max_decode_stall_ms=-1)
