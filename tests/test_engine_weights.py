"""Weight formats: the int8 and bf16 linear modules, the engine on a converted model, fingerprints, settings."""

import copy

import pytest
import pydantic
import torch
import torch.nn.functional as F

from blend_engine.engine import BlendEngine
from blend_engine.int4 import Int4Linear
from blend_engine.rows import join_rows
from blend_engine.types import BlendConfig, PrefillMode, Segment
from blend_engine.weights import (
    MAX_PACKED_ROWS, Bf16Linear, Int8Linear, convert_linears, resolve_weight_format, unhooked, weight_format,
)
from configs.enums import WeightFormat
from configs.settings import load_settings
from engine_models import MODEL_BUILDERS, cpu_exact, decode_reference, random_ids
from test_engine_blend import assert_same_prefill, rag_prompt

pytestmark = cpu_exact  # int8 weight-only kernels are measured and tested on CPU


def _quantized_engine(fmt: WeightFormat, family: str = "llama-gqa", seed: int = 0) -> BlendEngine:
    torch.manual_seed(seed)
    model = MODEL_BUILDERS[family]().eval()
    convert_linears(model, fmt)
    return BlendEngine.from_model(model, name=family, blend=BlendConfig.cacheblend())


@pytest.mark.parametrize("num_rows", [1, 3, MAX_PACKED_ROWS, MAX_PACKED_ROWS + 1, 300])
@pytest.mark.parametrize("is_bf16_gemm", [True, False])
def test_int8_linear_matches_its_dequantized_weight(num_rows, is_bf16_gemm, decode_kernel):
    """Every path (a decode kernel for few rows; for many, a bf16 GEMM over the kept bf16 copy or an
    fp32 one over the weight dequantized per call) multiplies by q * scale: equal to an fp32
    product of x as the path rounds it (int8 per group of 32 in ragblend's kernel, bf16 in torch's and
    the bf16 GEMM) to bf16's resolution."""
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64) * 0.05, torch.randn(96)
    linear = Int8Linear.from_weight(weight, bias)
    assert linear.is_native == (decode_kernel == "native")
    if not is_bf16_gemm:  # a CPU without native bf16
        linear.is_bf16_gemm, linear.gemm_weight = False, None
    x = torch.randn(num_rows, 64)
    if num_rows <= MAX_PACKED_ROWS:
        ref = decode_reference(x, linear.dequantized(), decode_kernel) + bias
    else:
        ref = F.linear(x.bfloat16().float() if is_bf16_gemm else x, linear.dequantized(), bias)
    out = linear(x)
    assert out.dtype == torch.float32 and out.shape == (num_rows, 96)
    # the kernels round their output to bf16: within half a bf16 step (2^-8 relative) of the largest value
    torch.testing.assert_close(out, ref, atol=float(ref.abs().max()) * 2**-8, rtol=2**-8)
    assert linear(x[None]).shape == (1, num_rows, 96)  # leading dims kept


def test_int8_quantization_is_per_channel_absmax():
    torch.manual_seed(1)
    weight = torch.randn(32, 48) * torch.logspace(-3, 1, 32)[:, None]  # channels of very different scales
    linear = Int8Linear.from_weight(weight)
    assert linear.qweight.dtype == torch.int8 and linear.qweight.abs().amax(1).min() >= 126
    error = (linear.dequantized() - weight).abs().amax(1)
    assert torch.all(error <= linear.scales.float() * 0.5 * 1.02)  # half a step (bf16-rounded scale)


def test_bf16_linear():
    torch.manual_seed(2)
    weight, x = torch.randn(40, 24), torch.randn(5, 24)
    out = Bf16Linear(weight, None)(x)
    ref = F.linear(x.bfloat16().float(), weight.bfloat16().float())
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=1e-2)


def test_convert_replaces_every_projection_and_a_copy_of_the_tied_lm_head():
    torch.manual_seed(0)
    model = MODEL_BUILDERS["llama-gqa"]().eval()
    model.config.tie_word_embeddings = True
    model.tie_weights()
    embedding = model.get_input_embeddings().weight.detach().clone()
    assert convert_linears(model, WeightFormat.INT8) == 4 * 7 + 1  # q k v o gate up down per layer + lm_head
    assert weight_format(model) == WeightFormat.INT8
    assert isinstance(model.lm_head, Int8Linear)
    assert torch.equal(model.get_input_embeddings().weight, embedding)  # the lookup stays exact
    torch.testing.assert_close(model.lm_head.dequantized(), embedding, atol=float(model.lm_head.scales.max()), rtol=0)
    assert convert_linears(MODEL_BUILDERS["llama-gqa"](), WeightFormat.FP32) == 0


def test_fused_int8_projections_equal_the_separate_ones_and_share_their_memory():
    torch.manual_seed(4)
    parts = [Int8Linear.from_weight(torch.randn(n, 32), torch.randn(n)) for n in (48, 16, 16)]
    x = torch.randn(5, 32)
    separate = torch.cat([p(x) for p in parts], dim=-1)
    fused = Int8Linear.fuse(parts)
    torch.testing.assert_close(fused(x), separate, atol=0, rtol=0)
    assert parts[1].qweight.data_ptr() == fused.qweight.data_ptr() + 48 * 32  # views, no copy
    torch.testing.assert_close(torch.cat([p(x) for p in parts], dim=-1), separate, atol=0, rtol=0)
    assert Int8Linear.fuse([parts[0], torch.nn.Linear(32, 8)]) is None


def test_joined_rows_are_a_view_where_the_parts_lie_back_to_back_and_a_copy_elsewhere():
    whole = torch.arange(40.0).reshape(10, 4)
    parts = [whole[0:3], whole[3:4], whole[4:10]]
    joined = join_rows(parts)
    assert torch.equal(joined, whole) and joined.data_ptr() == whole.data_ptr()  # a view: no copy
    tail = join_rows([whole[4:6], whole[6:9]])  # a view that starts inside the storage
    assert torch.equal(tail, whole[4:9]) and tail.data_ptr() == whole[4].data_ptr()
    for apart in ([whole[0:3], whole[4:6]],  # a gap
                  [whole[3:6], whole[0:3]],  # out of order
                  [whole[0:3], whole[3:6].clone()],  # another storage
                  [whole[0:3, :2], whole[3:6, :2]]):  # not contiguous
        copied = join_rows(apart)
        assert torch.equal(copied, torch.cat(apart)) and copied.data_ptr() != whole.data_ptr()


def test_fusing_parts_fused_before_copies_nothing():
    """A second fuse (a warm start's engine over the kept, joined parts) views the first one's buffers."""
    torch.manual_seed(5)
    x = torch.randn(5, 64)
    for cls in (Int8Linear, Int4Linear):
        parts = [cls.from_weight(torch.randn(n, 64), torch.randn(n)) for n in (64, 32, 32)]
        first, again = cls.fuse(parts), cls.fuse(parts)
        expected = first(x)
        for name, buffer in first.named_buffers():
            assert getattr(again, name).data_ptr() == buffer.data_ptr(), name
        torch.testing.assert_close(again(x), expected, atol=0, rtol=0)


def test_unhooked_skips_the_call_machinery_of_our_modules_only():
    ours = Int8Linear.from_weight(torch.randn(16, 32))
    assert unhooked(ours) == ours.forward
    hf = torch.nn.Linear(32, 16)
    assert unhooked(hf) is hf  # an HF layer may carry accelerate's hooks: called as a module
    seen = []
    ours.register_forward_hook(lambda *args: seen.append(1))
    unhooked(ours)(torch.randn(1, 32))
    assert seen == [1]  # a hooked module of ours is called as a module too


@pytest.mark.parametrize("family", ["llama-gqa", "qwen2-bias"])
@pytest.mark.parametrize("fmt", [WeightFormat.INT8, WeightFormat.INT4, WeightFormat.BF16])
def test_engine_forward_equals_hf_forward_of_the_converted_model(family, fmt):
    engine = _quantized_engine(fmt, family)
    ids = random_ids(48, seed=1)
    with torch.no_grad():
        ref = engine.model(torch.tensor([ids])).logits[0]  # [n, vocab], HF's forward over our modules
    result = engine.prefill([Segment(ids[:40])], PrefillMode.FULL)
    torch.testing.assert_close(result.logits, ref[39], atol=3e-2, rtol=2e-2)
    decoder = engine.decoder(result)
    for i, token in enumerate(ids[40:]):  # the decode path: the int8 kernel (one row)
        torch.testing.assert_close(decoder.step(token), ref[40 + i], atol=3e-2, rtol=2e-2)


# random weights are not Q4_1 ones: int4's is a looser sanity bound (SmolLM2's own figures: README)
@pytest.mark.parametrize("fmt,max_kl", [(WeightFormat.INT8, 1e-2), (WeightFormat.INT4, 5e-2)])
def test_converted_model_stays_close_to_fp32(fmt, max_kl):
    """Teacher-forced next-token distributions of a format vs fp32 (a sanity bound; measured on SmolLM2: README)."""
    fp32, quantized = _quantized_engine(WeightFormat.FP32), _quantized_engine(fmt)
    ids = random_ids(64, seed=3)
    a = fp32.prefill([Segment(ids)], PrefillMode.FULL).logits
    b = quantized.prefill([Segment(ids)], PrefillMode.FULL).logits
    kl = (torch.softmax(a, -1) * (torch.log_softmax(a, -1) - torch.log_softmax(b, -1))).sum()
    assert float(kl) < max_kl


@pytest.mark.parametrize("fmt", [WeightFormat.INT8, WeightFormat.INT4])
@pytest.mark.parametrize("check_layers", [(1,), (1, 2, 3)])
def test_blend_at_ratio_one_equals_full_under_quantized_weights(check_layers, fmt):
    engine = _quantized_engine(fmt)
    segments = rag_prompt(engine)
    full = engine.prefill(segments, PrefillMode.FULL)
    blend = engine.prefill(segments, PrefillMode.BLEND, BlendConfig.cacheblend(recompute_ratio=1.0, check_layers=check_layers))
    assert_same_prefill(blend, full, atol=1e-5)
    assert blend.stats.num_recomputed_tokens == len(full.token_ids)


def test_fingerprint_differs_per_weight_format():
    formats = (WeightFormat.FP32, WeightFormat.BF16, WeightFormat.INT8, WeightFormat.INT4)
    engines = {fmt: _quantized_engine(fmt) for fmt in formats}
    assert {fmt: e.weights for fmt, e in engines.items()} == {fmt: fmt for fmt in engines}
    assert len({e.fingerprint for e in engines.values()}) == len(formats)
    assert _quantized_engine(WeightFormat.INT8).fingerprint == engines[WeightFormat.INT8].fingerprint


def test_mixed_formats_are_refused():
    torch.manual_seed(0)
    model = MODEL_BUILDERS["llama-gqa"]().eval()
    layer = model.model.layers[0].self_attn
    layer.q_proj = Int8Linear.from_weight(layer.q_proj.weight)
    with pytest.raises(ValueError, match="mixes weight formats"):
        weight_format(model)


def test_weights_setting():
    assert load_settings().model.weights == WeightFormat.AUTO
    assert load_settings(model={"weights": "int8"}).model.weights == WeightFormat.INT8
    with pytest.raises(pydantic.ValidationError):
        load_settings(model={"weights": "int2"})
    assert load_settings(model={"weights": "int4"}).model.weights == WeightFormat.INT4
    assert resolve_weight_format(WeightFormat.AUTO, torch.device("cpu")) == WeightFormat.INT8  # no model: int8
    model = MODEL_BUILDERS["llama-gqa"]()
    assert resolve_weight_format(WeightFormat.AUTO, torch.device("cpu"), model) == WeightFormat.INT4
    model.model.layers[0].mlp.down_proj = torch.nn.Linear(128, 72)  # 72 rows: not a multiple of 16
    assert resolve_weight_format(WeightFormat.AUTO, torch.device("cpu"), model) == WeightFormat.INT8
    assert resolve_weight_format(WeightFormat.AUTO, torch.device("cuda")) == WeightFormat.FP32
    assert resolve_weight_format(WeightFormat.BF16, torch.device("cpu")) == WeightFormat.BF16
    with pytest.raises(ValueError, match="resolve"):
        convert_linears(copy.deepcopy(MODEL_BUILDERS["llama-gqa"]()), WeightFormat.AUTO)
