"""`model.attention_dtype`: a prefill's attention computed in bf16 over an fp32 model, against the same
engine's attention in the model's dtype; decode after it; the KV's identity; what `auto` resolves to."""

import engine_models
import pytest
import torch
from engine_models import build_engine, random_ids

from blend_engine.attention import (
    BF16_MIN_KEYS,
    AttentionBackend,
    attend,
    causal_meta,
    last_meta,
    resolve_attention_dtype,
    subset_meta,
)
from blend_engine.config import ModelConfig
from blend_engine.engine import BlendEngine
from blend_engine.int4 import gemm_dtype
from blend_engine.types import BlendConfig, PrefillMode, Segment
from blend_engine.weights import convert_linears
from configs.enums import AttentionDtype, DecodeCache, WeightFormat

pytestmark = pytest.mark.skipif(engine_models.test_device().type == "cuda", reason="CUDA engines already run in bf16")


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p, q = p_logits.float().log_softmax(-1), q_logits.float().log_softmax(-1)
    return float((p.exp() * (p - q)).sum())


def prompt(engine, seed=40):
    segments = [Segment(random_ids(6, seed))]
    for i in range(3):
        ids = random_ids(24, seed + 1 + i)
        segments.append(Segment(ids, engine.precompute(ids)))
    segments.append(Segment(random_ids(8, seed + 9)))
    return segments


@pytest.mark.parametrize("backend", list(AttentionBackend))
def test_attention_in_bf16_is_close_and_returns_the_inputs_dtype(backend):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(h, 40, 16, generator=g) for h in (4, 2, 2))  # [H, N, D], GQA 2
    pos = torch.tensor([3, 9, 17, 30, 39])
    bias = torch.zeros(40).index_fill_(0, torch.tensor([1, 2, 5]), -0.7)
    for meta32, meta16, rows in (
        (causal_meta(40), causal_meta(40, torch.bfloat16), slice(None)),
        (last_meta(40, bias), last_meta(40, bias, torch.bfloat16), slice(39, 40)),
        (subset_meta(pos, 40, backend, 2, pos.tolist(), torch.float32, bias),
         subset_meta(pos, 40, backend, 2, pos.tolist(), torch.bfloat16, bias), pos),
    ):
        exact, cast = attend(q[:, rows], k, v, meta32, 0.25), attend(q[:, rows], k, v, meta16, 0.25)
        assert cast.dtype == torch.float32
        assert not torch.equal(exact, cast)  # it did compute in bf16
        torch.testing.assert_close(cast, exact, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("family", ["llama-gqa", "qwen2-bias"])
def test_bf16_attention_prefills_stay_close_to_the_model_dtype(family):
    exact, bf16 = build_engine(family), build_engine(family, attention_dtype="bfloat16")
    assert exact.attention_dtype == torch.float32 and bf16.attention_dtype == torch.bfloat16
    chunk = random_ids(24, 60)
    kv32, kv16 = exact.precompute(chunk), bf16.precompute(chunk)
    assert not torch.equal(kv32.values[1:], kv16.values[1:])  # layers past the first saw bf16 attention
    torch.testing.assert_close(kv16.values, kv32.values, atol=5e-2, rtol=5e-2)
    blend = BlendConfig.cacheblend(recompute_ratio=0.3)
    for mode in (PrefillMode.FULL, PrefillMode.BLEND, PrefillMode.REUSE):
        a = exact.prefill(prompt(exact), mode, blend)
        b = bf16.prefill(prompt(bf16), mode, blend)
        assert b.cache.keys.dtype == torch.float32  # the cache keeps the model's dtype
        assert kl(a.logits, b.logits) < 1e-3, mode
    # blend over bf16 attention against the same engine's full prefill: what blend is judged by
    full, fused = bf16.prefill(prompt(bf16), PrefillMode.FULL), bf16.prefill(prompt(bf16), PrefillMode.BLEND, blend)
    assert kl(full.logits, fused.logits) < 0.5


def test_decode_after_a_scaled_bf16_prefill():
    """The reused attention's column bias is built in bf16 for the prefill; decode attends in the
    cache's dtype, over its own copy of it."""
    engine = build_engine("llama-gqa", attention_dtype="bfloat16")
    blend = BlendConfig.cacheblend(recompute_ratio=0.3, reused_attention_scale=0.5)
    result = engine.prefill(prompt(engine), PrefillMode.BLEND, blend, max_new_tokens=6)
    assert result.cache.column_bias is not None and result.cache.column_bias.values.dtype == torch.float32
    exact = build_engine("llama-gqa")
    reference = exact.prefill(prompt(exact), PrefillMode.BLEND, blend, max_new_tokens=6)
    for fmt in (DecodeCache.MODEL, DecodeCache.INT8):
        decoder, ref_decoder = engine.decoder(result, cache_format=fmt), exact.decoder(reference, cache_format=fmt)
        token = int(result.logits.argmax())
        for _ in range(4):
            logits, ref_logits = decoder.step(token), ref_decoder.step(token)
            assert logits.dtype == torch.float32 and kl(ref_logits[-1], logits[-1]) < 1e-3
            token = int(ref_logits[-1].argmax())


def test_the_attention_dtype_is_part_of_the_kv_identity_only_when_set():
    a, b = build_engine("llama-gqa"), build_engine("llama-gqa")
    assert a.fingerprint == b.fingerprint
    assert build_engine("llama-gqa", attention_dtype="bfloat16").fingerprint != a.fingerprint
    with pytest.raises(ValueError):
        ModelConfig(attention_dtype="float16")


def test_auto_takes_bf16_where_the_prefill_gemms_already_run_in_it():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    native = gemm_dtype(cpu)  # bf16 on CPUs with AVX512-BF16 or AMX
    assert ModelConfig().attention_dtype is AttentionDtype.AUTO
    assert resolve_attention_dtype(AttentionDtype.AUTO, cpu, torch.float32, is_quantized=True) == native
    assert resolve_attention_dtype(AttentionDtype.AUTO, cpu, torch.float32, is_quantized=False) == torch.float32
    assert resolve_attention_dtype(AttentionDtype.AUTO, cuda, torch.bfloat16, is_quantized=False) == torch.bfloat16
    assert resolve_attention_dtype(AttentionDtype.MODEL, cpu, torch.float32, is_quantized=True) == torch.float32
    assert resolve_attention_dtype(AttentionDtype.BFLOAT16, cpu, torch.float32, is_quantized=False) == torch.bfloat16
    # an engine of fp32 weights (the tests' tiny models) stays exact; int4 weights follow the CPU
    assert build_engine("llama-gqa").attention_dtype == torch.float32
    engine = build_engine("llama-gqa")
    convert_linears(engine.model, WeightFormat.INT4)
    auto = BlendEngine.from_model(engine.model, name="int4", attention_dtype="auto")
    assert auto.attention_dtype == native
    # auto casts long prefills only; an explicit bfloat16 casts every one
    assert auto.attention_dtype_for(BF16_MIN_KEYS - 1) == torch.float32
    assert auto.attention_dtype_for(BF16_MIN_KEYS) == native
    assert build_engine("llama-gqa", attention_dtype="bfloat16").attention_dtype_for(8) == torch.bfloat16


def test_auto_leaves_a_short_prefill_exactly_as_the_model_dtype_computes_it():
    """Under auto a prompt below BF16_MIN_KEYS attends in the model's dtype: the same logits, bit for bit,
    as an engine told `model` (a long one is past the tiny models' 512 positions: `attention_dtype_for`
    says what it gets, and the bfloat16 engines above what bf16 attention computes)."""
    engines = {}
    for choice in ("auto", "model"):
        engine = build_engine("llama-gqa")
        convert_linears(engine.model, WeightFormat.INT4)
        engines[choice] = BlendEngine.from_model(engine.model, name="int4", attention_dtype=choice)
    short = [engines[c].prefill(prompt(engines[c]), PrefillMode.BLEND, BlendConfig.cacheblend()) for c in engines]
    assert torch.equal(short[0].logits, short[1].logits)
