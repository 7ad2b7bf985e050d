"""The prefill copies' dtype on CPU is measured once per machine and kept (blend_engine/cpu_gemm.py)."""

from __future__ import annotations

import json
import threading
from dataclasses import asdict

import pytest
import torch

from blend_engine import cpu_gemm
from blend_engine.config import ModelConfig
from blend_engine.int4 import MAX_PACKED_ROWS, Int4Linear, gemm_dtype, widened
from blend_engine.loader import load_model


@pytest.fixture
def fresh(monkeypatch):
    """No answer resolved yet in this process, and a native-bf16 CPU as far as torch's flag says."""
    monkeypatch.setattr(cpu_gemm, "_resolved", {})
    monkeypatch.setattr(cpu_gemm, "_forced", [])
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)


def timing(fp32_ms: float, bf16_ms: float) -> cpu_gemm.GemmTiming:
    return cpu_gemm.GemmTiming(fp32_ms=fp32_ms, bf16_ms=bf16_ms, num_threads=2)


@pytest.mark.parametrize(("bf16_ms", "expected"), [(2.0, torch.bfloat16), (8.5, torch.float32), (6.6, torch.float32)])
def test_the_copy_is_bf16_only_where_its_gemms_measured_clearly_faster(fresh, monkeypatch, bf16_ms, expected):
    """AMX: bf16 several times faster; a Xeon VM with AVX512-BF16 but no AMX: 1.7x slower; about even: fp32."""
    monkeypatch.setattr(cpu_gemm, "measure", lambda: timing(7.0, bf16_ms))
    assert gemm_dtype(torch.device("cpu")) == expected
    linear = Int4Linear.from_weight(torch.randn(64, 64) * 0.05)
    # the copy is bf16 either way (its memory); an fp32 product widens it per call into a per-thread scratch
    assert linear.gemm_weight.dtype == torch.bfloat16 and linear.is_widened == (expected == torch.float32)
    assert torch.equal(linear.gemm_weight.float(), linear.dequantized().bfloat16().float())  # the same values
    x = torch.randn(MAX_PACKED_ROWS + 8, 64)
    exact = torch.nn.functional.linear(x, linear.gemm_weight.float())  # the copy's (bf16-rounded) weights
    scale = float(exact.abs().max())
    if expected == torch.float32:  # fp32 activations over the copy's weights: fp32's own rounding only
        torch.testing.assert_close(linear(x), exact, atol=scale * 1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(linear(x), exact, atol=scale * 2**-7, rtol=2**-7)


def test_widened_weights_share_one_scratch_per_thread():
    small, large = torch.randn(16, 32).bfloat16(), torch.randn(64, 96).bfloat16()
    first = widened(large)
    assert first.dtype == torch.float32 and torch.equal(first, large.float())
    again = widened(small)
    assert torch.equal(again, small.float()) and again.data_ptr() == first.data_ptr()  # no new memory
    with torch.inference_mode():  # made or written in inference mode (a prefill) or out of it (HF's forward)
        assert torch.equal(widened(large), large.float())
    assert torch.equal(widened(small), small.float())
    other: list[torch.Tensor] = []
    thread = threading.Thread(target=lambda: other.append(widened(small)))
    thread.start()
    thread.join()
    assert other[0].data_ptr() != first.data_ptr()  # another thread's prefill: a scratch of its own


def test_a_cpu_without_native_bf16_never_measures(monkeypatch):
    monkeypatch.setattr(cpu_gemm, "_resolved", {})
    monkeypatch.setattr(cpu_gemm, "_forced", [])
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    monkeypatch.setattr(cpu_gemm, "measure", lambda: pytest.fail("measured on an AVX2-only CPU"))
    assert gemm_dtype(torch.device("cpu")) == torch.float32


def test_the_measurement_is_kept_per_machine_and_read_back(fresh, monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(cpu_gemm, "measure", lambda: calls.append(1) or timing(7.0, 2.0))
    first = cpu_gemm.bf16_gemm_timing(tmp_path)
    assert first.is_bf16_faster and len(calls) == 1
    records = json.loads((tmp_path / cpu_gemm.CACHE_FILE).read_text())
    assert records == {cpu_gemm.machine_key(): {"fp32_ms": 7.0, "bf16_ms": 2.0, "num_threads": 2}}
    # the process holds its first answer whatever is measured later
    assert cpu_gemm.bf16_gemm_timing(tmp_path) == first and len(calls) == 1
    # a new process on this machine reads it back: a busy machine at restart cannot flip the choice
    monkeypatch.setattr(cpu_gemm, "_resolved", {})
    monkeypatch.setattr(cpu_gemm, "measure", lambda: pytest.fail("measured again"))
    assert cpu_gemm.bf16_gemm_timing(tmp_path) == first
    # another machine's record beside it is kept
    monkeypatch.setattr(cpu_gemm, "_resolved", {})
    monkeypatch.setattr(cpu_gemm, "machine_key", lambda: "other cpu")
    monkeypatch.setattr(cpu_gemm, "measure", lambda: timing(3.0, 5.0))
    assert not cpu_gemm.bf16_gemm_timing(tmp_path).is_bf16_faster
    assert set(json.loads((tmp_path / cpu_gemm.CACHE_FILE).read_text())) == {"other cpu", *records}


def test_a_record_written_meanwhile_by_another_process_wins(fresh, monkeypatch, tmp_path):
    """Two replicas starting together both measure; the first to write decides for both."""
    def measure_while_another_writes():
        (tmp_path / cpu_gemm.CACHE_FILE).write_text(json.dumps({cpu_gemm.machine_key(): asdict(timing(7.0, 2.0))}))
        return timing(7.0, 9.0)

    monkeypatch.setattr(cpu_gemm, "measure", measure_while_another_writes)
    assert cpu_gemm.bf16_gemm_timing(tmp_path) == timing(7.0, 2.0)


def test_an_unreadable_record_is_measured_again_and_an_unwritable_directory_still_answers(fresh, monkeypatch,
                                                                                          tmp_path):
    (tmp_path / cpu_gemm.CACHE_FILE).write_text("{not json")
    monkeypatch.setattr(cpu_gemm, "measure", lambda: timing(7.0, 9.0))
    assert cpu_gemm.bf16_gemm_timing(tmp_path) == timing(7.0, 9.0)
    assert json.loads((tmp_path / cpu_gemm.CACHE_FILE).read_text())[cpu_gemm.machine_key()]["bf16_ms"] == 9.0
    monkeypatch.setattr(cpu_gemm, "_resolved", {})
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    assert cpu_gemm.bf16_gemm_timing(blocked / "cache") == timing(7.0, 9.0)  # a warning, not a failure


def test_loading_a_quantized_model_resolves_the_choice_into_its_cache_dir(fresh, monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_gemm, "measure", lambda: timing(7.0, 12.0))
    loaded = load_model(ModelConfig(name="random:tiny-llama", device="cpu", cache_dir=tmp_path))
    assert (tmp_path / cpu_gemm.CACHE_FILE).is_file()
    widened_layers = {m.is_widened for m in loaded.model.modules() if isinstance(m, Int4Linear)}
    assert widened_layers == {True}


@pytest.mark.parametrize("choice", ["float32", "bfloat16"])
def test_a_configured_gemm_dtype_is_taken_without_measuring(fresh, monkeypatch, tmp_path, choice):
    """model.gemm_dtype: bfloat16 keeps the smaller copy where fp32 would be faster (memory first), float32
    the faster one; neither measures, and auto afterwards measures again."""
    monkeypatch.setattr(cpu_gemm, "measure", lambda: pytest.fail("measured a configured choice"))
    loaded = load_model(ModelConfig(name="random:tiny-llama", device="cpu", cache_dir=tmp_path, gemm_dtype=choice))
    widened_layers = {m.is_widened for m in loaded.model.modules() if isinstance(m, Int4Linear)}
    assert widened_layers == {choice == "float32"} and not (tmp_path / cpu_gemm.CACHE_FILE).exists()
    monkeypatch.setattr(cpu_gemm, "measure", lambda: timing(7.0, 2.0))
    load_model(ModelConfig(name="random:tiny-llama", device="cpu", cache_dir=tmp_path))
    assert cpu_gemm.forced() is None and gemm_dtype(torch.device("cpu")) == torch.bfloat16
    with pytest.raises(ValueError):
        ModelConfig(gemm_dtype="float16")


def test_a_real_measurement_times_both_dtypes():
    measured = cpu_gemm.measure()
    assert measured.fp32_ms > 0 and measured.bf16_ms > 0 and measured.num_threads == torch.get_num_threads()
