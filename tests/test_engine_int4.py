"""int4 weights (groups of 32, scale + zero), the decode attention over a bf16 cache."""

import pytest
import torch
import torch.nn.functional as F

from blend_engine import cpu_gemm
from blend_engine.int4 import _PACK_ROWS, GROUP_SIZE, MAX_PACKED_ROWS, Int4Linear, _levels, _nibbles
from blend_engine.weights import resolve_weight_format
from configs.enums import WeightFormat
from engine_models import cpu_exact, decode_reference
from test_engine_weights import _quantized_engine

pytestmark = cpu_exact  # the int4 kernels are CPU ones


def _q4_1_weight(num_out: int, num_in: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight as a Q4_1 GGUF holds it: levels 0..15 (each group spanning all 16) times a scale
    plus an offset, both bf16 values, so the format can hold it exactly. Returns (weight, levels)."""
    g = torch.Generator().manual_seed(seed)
    levels = torch.randint(0, 16, (num_out, num_in // GROUP_SIZE, GROUP_SIZE), generator=g)
    levels[..., 0], levels[..., 1] = 0, 15
    scale = (torch.rand(num_out, num_in // GROUP_SIZE, 1, generator=g) * 0.01 + 1e-3).bfloat16().float()
    zero = (torch.randn(num_out, num_in // GROUP_SIZE, 1, generator=g) * 0.01).bfloat16().float()
    weight = ((levels.float() - 8) * scale + zero).reshape(num_out, num_in)
    return weight, levels.reshape(num_out, num_in)


def test_a_q4_1_weight_round_trips_exactly():
    weight, levels = _q4_1_weight(64, 96, seed=0)
    linear = Int4Linear.from_weight(weight)
    assert torch.equal(linear.dequantized(), weight)
    assert torch.equal(linear.levels(), levels.float())
    assert linear.nibbles.dtype == torch.uint8 and linear.nibbles.shape == (8, 384)  # blocks of 8 rows, 2 levels a byte
    assert torch.equal(_levels(linear.nibbles), levels.to(torch.uint8))


def test_int4_error_is_at_most_half_a_step_per_group():
    torch.manual_seed(1)
    weight = torch.randn(32, 64) * torch.logspace(-3, 1, 32)[:, None]
    linear = Int4Linear.from_weight(weight)
    error = (linear.dequantized() - weight).abs().reshape(32, -1, GROUP_SIZE).amax(-1)  # [out, groups]
    steps = linear.scales_zeros()[..., 0].t().float()  # [out, groups]
    assert torch.all(error <= steps * 0.5 * 1.05 + 1e-6)


@pytest.mark.parametrize("num_out", [16, 272, 2 * _PACK_ROWS + 80])
def test_a_layer_packed_a_slice_of_rows_at_a_time_equals_it_packed_whole(num_out, decode_kernel):
    """from_q makes its buffers a slice of rows at a time (load speed): byte for byte what the whole matrix
    gives, a tail of rows short of a slice included, and each decode kernel multiplies by them."""
    weight, levels = _q4_1_weight(num_out, 128, seed=3)
    linear = Int4Linear.from_weight(weight)
    assert torch.equal(linear.nibbles, _nibbles(levels))
    assert torch.equal(linear.gemm_weight, weight.bfloat16())  # exact in bf16 by construction
    assert linear.is_native == (decode_kernel == "native")
    x = torch.randn(1, 128)
    ref = decode_reference(x, weight, decode_kernel)
    torch.testing.assert_close(linear(x), ref, atol=float(ref.abs().max()) * 2**-7, rtol=2**-7)


@pytest.mark.parametrize("num_rows", [1, 3, MAX_PACKED_ROWS, MAX_PACKED_ROWS + 1, 300])
def test_int4_linear_matches_its_dequantized_weight(num_rows, decode_kernel):
    """The decode kernel (few rows) and the bf16 GEMM (many) both multiply by the dequantized weight."""
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64) * 0.05, torch.randn(96)
    linear = Int4Linear.from_weight(weight, bias)
    x = torch.randn(num_rows, 64)
    kind = decode_kernel if num_rows <= MAX_PACKED_ROWS else "torch"  # many rows: the bf16 copy's GEMM
    ref = decode_reference(x, linear.dequantized(), kind) + bias
    out = linear(x)
    assert out.dtype == torch.float32 and out.shape == (num_rows, 96)
    torch.testing.assert_close(out, ref, atol=float(ref.abs().max()) * 2**-7, rtol=2**-7)


@pytest.mark.parametrize("is_bf16_native", [True, False])
def test_int4_gemm_copy_is_fp32_where_bf16_gemms_are_not_native(monkeypatch, is_bf16_native):
    """An AVX2-only CPU multiplies bf16 at ~1/8 of fp32's speed: the prefill copy (bf16) is then widened to
    fp32 at each call, and the results agree with the bf16 path's. (Where bf16 is
    native, whether it is also faster is measured: tests/test_cpu_gemm.py; here it is.)"""
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: is_bf16_native)
    monkeypatch.setattr(cpu_gemm, "_resolved", {})
    monkeypatch.setattr(cpu_gemm, "measure", lambda: cpu_gemm.GemmTiming(fp32_ms=7.0, bf16_ms=2.0, num_threads=2))
    torch.manual_seed(0)
    weight = torch.randn(96, 64) * 0.05
    linear = Int4Linear.from_weight(weight)
    assert linear.gemm_weight.dtype == torch.bfloat16 and linear.is_widened == (not is_bf16_native)
    assert torch.equal(linear.gemm_weight.float(), linear.dequantized().bfloat16().float())
    x = torch.randn(MAX_PACKED_ROWS + 8, 64)
    ref = F.linear(x, linear.dequantized())
    torch.testing.assert_close(linear(x), ref, atol=float(ref.abs().max()) * 2**-7, rtol=2**-7)


def test_int4_layers_keep_an_int8_lm_head():
    from blend_engine.weights import Int8Linear, weight_format

    engine = _quantized_engine(WeightFormat.INT4)
    assert isinstance(engine.model.lm_head, Int8Linear) and engine.weights == WeightFormat.INT4
    engine.model.lm_head = Int4Linear.from_weight(engine.model.get_input_embeddings().weight)
    with pytest.raises(ValueError, match="mixes weight formats"):
        weight_format(engine.model)


def test_int4_refuses_shapes_its_kernel_cannot_pack():
    with pytest.raises(ValueError, match="divisible by 32"):
        Int4Linear.from_weight(torch.randn(64, 40))
    with pytest.raises(ValueError, match="out_features by 16"):
        Int4Linear.from_weight(torch.randn(40, 64))
    with pytest.raises(ValueError, match="CPU only"):
        resolve_weight_format(WeightFormat.INT4, torch.device("cuda"))


@pytest.mark.parametrize("sizes", [(128, 64, 64), (64, 32, 32), (48, 16, 16)])
def test_fused_int4_projections_equal_the_separate_ones(sizes, decode_kernel):
    """Fused q/k/v (or gate/up) give the separate modules' outputs, and the parts become views of the fused
    buffers (rows of nibbles: any row count), the scales too: fusing adds no memory."""
    torch.manual_seed(4)
    parts = [Int4Linear.from_weight(torch.randn(n, 64), torch.randn(n)) for n in sizes]
    x = torch.randn(5, 64)
    separate = torch.cat([p(x) for p in parts], dim=-1)
    fused = Int4Linear.fuse(parts)
    torch.testing.assert_close(fused(x), separate, atol=0, rtol=0)
    torch.testing.assert_close(fused(x[:1]), separate[:1], atol=1e-5, rtol=0)  # the kernel path
    assert parts[1].nibbles.data_ptr() == fused.nibbles.data_ptr() + sizes[0] * 32
    assert all(p.block_scales.untyped_storage().data_ptr() == fused.block_scales.untyped_storage().data_ptr()
               for p in parts)
    # each part alone, through its view of the fused blocks of scales
    torch.testing.assert_close(torch.cat([p(x[:1]) for p in parts], dim=-1), separate[:1], atol=1e-5, rtol=0)


def test_fusing_a_group_whose_zero_dwarfs_its_scale_is_exact():
    """The levels are held as they are (not recovered from the bf16 copy), so even a group whose zero is
    hundreds of times its scale fuses to the same weights."""
    weight = torch.full((64, 32), 1000.0) + torch.arange(32.0) * 0.01  # spread 0.31 on an offset of 1000
    parts = [Int4Linear.from_weight(weight), Int4Linear.from_weight(weight.clone())]
    fused = Int4Linear.fuse(parts)
    assert torch.equal(fused.dequantized(), torch.cat([p.dequantized() for p in parts]))
    assert torch.equal(fused.levels(), torch.cat([p.levels() for p in parts]))
