"""The CPU thread governor: how many threads engine work gets, from the load other processes put on
the cores (real /proc/stat on Linux), and that a step or a prefill runs on that count and restores the
caller's."""

import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from blend_engine.threads import (
    CpuSample, ThreadGovernor, num_free_threads, pin_one_thread, read_sample, single_threaded_default,
)
from blend_engine.types import PrefillMode
from configs.enums import WeightFormat
from configs.settings import load_settings
from engine_models import random_ids
from kv_store.prefetch import Prefetcher
from test_engine_blend import rag_prompt
from test_engine_weights import _quantized_engine

is_linux = Path("/proc/stat").exists()


@pytest.mark.parametrize("others_s, num_cores, max_threads, expected", [
    (0.0, 2, 2, 2),  # idle machine: every core
    (0.0, 16, 4, 4),  # never above the caller's count
    (1.0, 2, 2, 1),  # one busy process on two cores
    (0.4, 2, 2, 2),  # a light one: rounds to the cores left
    (0.6, 2, 2, 1),
    (5.0, 2, 2, 1),  # at least one
    (3.0, 16, 16, 13),
])
def test_free_threads_are_the_cores_others_left(others_s, num_cores, max_threads, expected):
    own_s = 1.5  # this process's own time never counts against it
    before, after = CpuSample(100.0, 10.0, 50.0), CpuSample(100.0 + others_s + own_s, 10.0 + own_s, 51.0)
    assert num_free_threads(before, after, num_cores, max_threads) == expected


def test_a_sample_counts_the_allowed_cpus_busy_fields_only(tmp_path, monkeypatch):
    stat = tmp_path / "stat"
    # name user nice system idle iowait irq softirq steal [guest guest_nice]: idle and iowait are not
    # busy, guest time is already in user and nice
    stat.write_text("cpu  900 0 0 900 900 0 0 0\ncpu0 100 10 20 500 400 1 2 3 7 7\ncpu1 200 0 0 900 9 0 0 0\n"
                    "cpu7 50 0 0 0 0 0 0 0\nintr 1 2 3\n")
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    ticks_per_s = __import__("os").sysconf("SC_CLK_TCK")
    sample = read_sample(stat)
    assert sample.busy_s == pytest.approx((100 + 10 + 20 + 1 + 2 + 3 + 200) / ticks_per_s)
    assert read_sample(tmp_path / "absent") is None  # not Linux: no sample, the count stays fixed


@pytest.mark.skipif(not is_linux, reason="needs /proc/stat")
def test_real_samples_see_this_process_and_a_busy_neighbour():
    before = read_sample()
    end = time.monotonic() + 0.3
    while time.monotonic() < end:  # this process busy on one core
        pass
    after = read_sample()
    assert after.own_s - before.own_s >= 0.15
    assert after.busy_s - before.busy_s >= (after.own_s - before.own_s) * 0.5
    governor = ThreadGovernor(min_interval_s=0.5)
    num_cores = governor.max_threads = governor.num_cores
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(1.0)
        assert governor.num_threads() <= max(num_cores - 1, 1)  # the neighbour holds a core
    finally:
        busy.kill()
        busy.wait()


def test_the_governor_resamples_and_fixed_counts_win():
    samples = iter([CpuSample(0.0, 0.0, 0.0), CpuSample(1.0, 0.0, 1.0), CpuSample(1.0, 0.0, 2.0)])
    governor = ThreadGovernor(min_interval_s=0.0, sampler=lambda: next(samples), num_cores=2, max_threads=2)
    assert governor.num_threads() == 1  # one core's worth of others' time in the first second
    assert governor.num_threads() == 2  # none in the next
    assert ThreadGovernor(num_fixed=3, num_cores=2).num_threads() == 3
    slow = ThreadGovernor(min_interval_s=3600.0, num_cores=2, max_threads=2)
    assert slow.num_threads() == 2  # no interval measured yet: the cap
    for bad in ({"num_fixed": -1}, {"max_threads": 0}):
        with pytest.raises(ValueError):
            ThreadGovernor(**bad)


def test_the_server_default_is_one_thread_and_the_cap_what_it_was():
    """`single_threaded_default`: threads that start later run torch on one thread (no OpenMP pool of
    their own), the calling thread too; the count it was comes back for the engine's governor."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert single_threaded_default() == 2 and torch.get_num_threads() == 1
        seen = []
        thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        assert seen == [1]
    finally:
        torch.set_num_threads(previous)


def _in_new_thread(fn):
    seen = []
    thread = threading.Thread(target=lambda: seen.append(fn()))
    thread.start()
    thread.join()
    return seen[0]


def test_a_pinned_side_thread_stays_on_one_thread_whatever_the_engine_sets():
    """A thread's torch count is set at its first op, to the count any thread set last: a side thread
    starting inside a governed engine step (2) would keep 2 and an OpenMP pool of its own. Pinned, it
    stays at 1, also when the engine's thread sets 2 again afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)  # as inside a governed engine step
    try:
        assert _in_new_thread(torch.get_num_threads) == 2  # the race pin_one_thread closes
        pinned, engine_set, seen = threading.Event(), threading.Event(), []

        def side():
            pin_one_thread()
            pinned.set()
            engine_set.wait(10)
            seen.append(torch.get_num_threads())

        thread = threading.Thread(target=side)
        thread.start()
        pinned.wait(10)
        torch.set_num_threads(2)  # the engine's next step
        engine_set.set()
        thread.join()
        assert seen == [1]
    finally:
        torch.set_num_threads(previous)


def test_the_kv_prefetch_thread_runs_torch_on_one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(2)  # a governed engine job is running when the first prefetch starts
    try:
        seen = []
        prefetcher = Prefetcher(lambda entry: seen.append(torch.get_num_threads()), max_bytes=1 << 20)
        assert prefetcher.submit(SimpleNamespace(key="a" * 64, num_bytes=1))
        prefetcher.wait()
        prefetcher.close()
        assert seen == [1]
    finally:
        torch.set_num_threads(previous)


def _counting(engine, governor):
    """Record the torch thread count each embedding (one per prefill or decode step) ran with."""
    seen, embed = [], engine.runner.embed
    engine.runner.embed = lambda ids: seen.append(torch.get_num_threads()) or embed(ids)
    engine.threads = governor
    return seen


def test_prefill_and_decode_steps_run_on_the_governed_count_and_restore_the_callers():
    engine = _quantized_engine(WeightFormat.INT4)
    segments = rag_prompt(engine)
    reference = engine.prefill(segments, PrefillMode.FULL, max_new_tokens=4)
    tokens = random_ids(3, 9)
    decoder = engine.decoder(reference)
    expected = torch.stack([decoder.step(t) for t in tokens[:2]])
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen = _counting(engine, ThreadGovernor(num_fixed=1))
        result = engine.prefill(segments, PrefillMode.FULL, max_new_tokens=4)
        decoder = engine.decoder(result)
        steps = torch.stack([decoder.step(t) for t in tokens[:2]])
        assert seen and set(seen) == {1} and torch.get_num_threads() == 2
        torch.testing.assert_close(result.logits, reference.logits, atol=1e-5, rtol=0)
        torch.testing.assert_close(steps, expected, atol=1e-5, rtol=0)
    finally:
        torch.set_num_threads(previous)


def test_cpu_threads_setting():
    assert load_settings().model.cpu_threads == 0  # auto
    assert load_settings(model={"cpu_threads": 2}).model.cpu_threads == 2
    with pytest.raises(Exception, match="greater than or equal to 0"):
        load_settings(model={"cpu_threads": -1})
