"""int4 weight-only linear layers: groups of 32 inputs share a scale and a zero (asymmetric), as
GGUF's Q4_1 does, for the CPU's `_weight_int4pack_mm_for_cpu` kernel.

Decode reads every weight once per token, so int4 reads half of int8's bytes. SmolLM2 ships as a
Q4_1 GGUF: its weights are already 16 levels per group of 32, which this format holds again with
only its scale and zero rounded to bf16. The kernel's fast path takes bf16 activations only (fp32 and
fp16 inputs measured ~60x slower), and it loses to a bf16 GEMM above a few dozen rows, so prefill
multiplies by a bf16 copy of the dequantized weight as Int8Linear does. Where bf16 GEMMs are not the
faster (AVX2 only: ~19 GFLOP/s against fp32's ~145; AVX512-BF16 without AMX on a Xeon VM: 1.6-1.9x
slower, measured; blend_engine/cpu_gemm.py measures which, once per machine) the product is taken in
fp32: the bf16 copy is widened at each call into a per-thread fp32 scratch the size of the largest layer
(0.23 ms for a 3 072 x 576 layer, against 4-5 ms saved on its 430-row GEMM), so the copy keeps bf16's
memory; an fp32 copy kept per layer held ~180 MB more for about the same speed (server TTFT 0.66-0.74x
of bf16 GEMMs' against 0.74-0.78x widened, two runs on that VM; docs/decisions/0025).
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import nn

from blend_engine import cpu_gemm

GROUP_SIZE = 32  # inputs per (scale, zero): Q4_1's block
NUM_ROWS_PER_BLOCK = 64  # the CPU packing interleaves rows in blocks of 64 (row slices of other sizes are no views)
MIN_ROWS_MULTIPLE = 16  # the packing kernel's requirement on out_features
MAX_PACKED_ROWS = 32  # above: the bf16 GEMM (measured crossover on CPU, as for int8)
_COMPUTE = torch.bfloat16
_PACK_ROWS = 4 * NUM_ROWS_PER_BLOCK  # rows packed at a time at load (see Int4Linear.from_q)


def gemm_dtype(device: torch.device) -> torch.dtype:
    """What prefill multiplies quantized weights' copies in: bf16 on CUDA; on CPU ModelConfig.gemm_dtype, which
    under auto is bf16 where bf16 is native (AVX512-BF16 or AMX) and its GEMMs measured clearly faster than
    fp32's (cpu_gemm), else fp32."""
    return _COMPUTE if device.type != "cpu" else cpu_gemm.prefill_dtype()


_scratch = threading.local()  # .buffer: this thread's fp32 scratch, grown to the largest layer widened in it


def widened(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] as fp32, in this thread's scratch: valid until this thread's next call (a GEMM uses it
    at once, and prefills on different threads get scratches of their own)."""
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.numel() < weight.numel():
        with torch.inference_mode(False):  # a normal tensor: written in and out of inference mode alike
            buffer = _scratch.buffer = torch.empty(weight.numel(), dtype=torch.float32, device=weight.device)
    return buffer[: weight.numel()].view(weight.shape).copy_(weight)


def release_scratch() -> None:
    """Drop this thread's fp32 scratch, where it has one (an idle server's memory: the 1.5B's largest layer
    makes it 110 MB); the next `widened` call in the thread makes it again."""
    _scratch.buffer = None


def _pack(q: torch.Tensor) -> torch.Tensor:
    """q [out, in] int32 in 0..15 -> the kernel's packed layout [out, in / 2] uint8."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)


class Int4Linear(nn.Module):
    """y = x @ W.T + bias, W[o, g*32 + j] = (q[o, g*32 + j] - 8) * scale[g, o] + zero[g, o], q in 0..15."""

    def __init__(self, packed: torch.Tensor, scales_zeros: torch.Tensor, gemm_weight: torch.Tensor,
                 bias: torch.Tensor | None):
        """The buffers as they are (`from_q` makes them from levels)."""
        super().__init__()
        self.out_features, self.in_features = gemm_weight.shape
        self.register_buffer("packed", packed)  # [out, in / 2] uint8, the kernel's layout
        # [in / 32, out, 2] bf16: (scale, zero); a fused part's a strided view of the fused module's
        self.register_buffer("scales_zeros", scales_zeros)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        # prefill's GEMMs in fp32 where bf16 ones are not the faster: the bf16 copy widened at each call
        self.is_widened = gemm_dtype(gemm_weight.device) == torch.float32
        self.register_buffer("gemm_weight", gemm_weight, persistent=False)  # [out, in] bf16

    @classmethod
    def from_q(cls, q: torch.Tensor, scales_zeros: torch.Tensor, bias: torch.Tensor | None) -> Int4Linear:
        """q [out, in] in 0..15 (any integer dtype, or float), scales_zeros [in / 32, out, 2] bf16."""
        num_out, num_in = q.shape
        scale, zero = (scales_zeros[..., i].t().float()[..., None] for i in (0, 1))  # [out, in / 32, 1]
        gemm_weight = torch.empty(num_out, num_in, dtype=_COMPUTE, device=q.device)
        packed = torch.empty(num_out, num_in // 2, dtype=torch.uint8, device=q.device)
        # a slice of rows at a time: each step's fp32 temporaries stay in cache and are reused, where whole-matrix
        # ones are fresh pages every time (2.5x slower for a 1.5B model's layers); slices start at multiples of
        # the packing's 64-row blocks, so each packs as the same rows of the whole
        for start in range(0, num_out, _PACK_ROWS):
            rows = slice(start, start + _PACK_ROWS)
            # [r, in / 32, 32]; not in place: q may be float already, and .float() then no copy
            levels = q[rows].reshape(-1, num_in // GROUP_SIZE, GROUP_SIZE).float() - 8
            # the exact fp32 weight, rounded once to bf16 (one fused multiply-add)
            gemm_weight[rows] = torch.addcmul(zero[rows], levels, scale[rows]).reshape(-1, num_in)
            packed[rows] = _pack(q[rows].to(torch.int32))
        return cls(packed, scales_zeros, gemm_weight, bias)

    def _per_row(self, index: int) -> torch.Tensor:
        return self.scales_zeros[..., index].t().float()[..., None]  # [out, in / 32, 1]

    @staticmethod
    def fits(num_out: int, num_in: int) -> bool:
        return num_in % GROUP_SIZE == 0 and num_out % MIN_ROWS_MULTIPLE == 0

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int4Linear:
        num_out, num_in = weight.shape
        if not cls.fits(num_out, num_in):
            raise ValueError(f"int4 weights need in_features divisible by {GROUP_SIZE} and out_features by "
                             f"{MIN_ROWS_MULTIPLE}; this layer is {num_out}x{num_in} (use int8)")
        w = weight.detach().float().reshape(num_out, -1, GROUP_SIZE)  # [out, groups, 32]
        low, high = w.amin(-1), w.amax(-1)  # [out, groups]
        # scale and zero rounded to bf16 first, then q chosen against the rounded pair: the
        # dequantized weight is exactly what the kernel multiplies by
        scale = ((high - low) / 15).clamp_min(1e-8).to(_COMPUTE)
        zero = (low + 8 * scale.float()).to(_COMPUTE)
        q = torch.round((w - zero.float()[..., None]) / scale.float()[..., None] + 8).clamp_(0, 15)
        return cls.from_levels(q.reshape(num_out, num_in), scale, zero, bias)

    @classmethod
    def from_levels(cls, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                    bias: torch.Tensor | None = None) -> Int4Linear:
        """W[o, g*32 + j] = (q[o, g*32 + j] - 8) * scale[o, g] + zero[o, g]: q [out, in] in 0..15, scale and
        zero [out, in / 32] (rounded to bf16 here, as the kernel takes them). A GGUF's 4-bit tensor comes in
        so, level for level (blend_engine/gguf_loader.py)."""
        num_out, num_in = q.shape
        if not cls.fits(num_out, num_in):
            raise ValueError(f"int4 weights need in_features divisible by {GROUP_SIZE} and out_features by "
                             f"{MIN_ROWS_MULTIPLE}; this layer is {num_out}x{num_in} (use int8)")
        # [groups, out, 2]: (scale, zero) per group of 32 inputs and output row
        scales_zeros = torch.stack([scale.to(_COMPUTE), zero.to(_COMPUTE)], dim=-1).transpose(0, 1).contiguous()
        return cls.from_q(q, scales_zeros, None if bias is None else bias.detach().clone())

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the decode kernel multiplies by, [out, in]."""
        return self.levels().reshape(self.out_features, -1, GROUP_SIZE).sub(8).mul(self._per_row(0)).add(
            self._per_row(1)).reshape(self.out_features, self.in_features).to(dtype)

    def levels(self) -> torch.Tensor:
        """q [out, in] in 0..15, recovered from the bf16 copy: exact unless a group's zero is hundreds
        of times its scale, where the copy rounds adjacent levels together (the recovered ones then
        differ below bf16's resolution of the weight; `fuse` refuses any that change the copy)."""
        w = self.gemm_weight.float().reshape(self.out_features, -1, GROUP_SIZE)
        scale = self._per_row(0)
        # a group of scale 0 (a GGUF's Q4_K sub-block whose 6-bit scale is 0) holds its zero whatever the level
        levels = torch.round((w - self._per_row(1)) / torch.where(scale == 0, 1.0, scale) + 8)
        return torch.where(scale == 0, 8.0, levels).clamp_(0, 15).reshape(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= MAX_PACKED_ROWS:  # decode's rows: as few small ops as can be
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.to(_COMPUTE).contiguous(), self.packed, GROUP_SIZE, self.scales_zeros.contiguous()).to(x.dtype)
            return out if self.bias is None else out + self.bias
        rows = x.reshape(-1, x.shape[-1])  # [n, in]
        if rows.shape[0] <= MAX_PACKED_ROWS:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows.to(_COMPUTE).contiguous(), self.packed, GROUP_SIZE,
                                                              self.scales_zeros.contiguous())
        elif self.is_widened:
            out = F.linear(rows.float(), widened(self.gemm_weight))
        else:
            out = F.linear(rows.to(_COMPUTE), self.gemm_weight)
        out = out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    @classmethod
    def fuse(cls, linears: list[nn.Module]) -> Int4Linear | None:
        """One module over the rows of `linears` (same input), or None unless all are Int4Linear with biases
        all or none. Where every part is a whole number of 64-row blocks (the packing's unit), the fused buffers
        are the parts' joined and the parts' become views of them (no weight memory added; each still works
        alone). Else the levels are recovered from the parts' bf16 copies and packed again, and None where one
        is not recovered exactly."""
        num_biased = sum(isinstance(m, Int4Linear) and m.bias is not None for m in linears)
        if not all(isinstance(m, Int4Linear) for m in linears) or num_biased not in (0, len(linears)):
            return None
        bias = torch.cat([m.bias.detach() for m in linears]) if num_biased else None
        scales_zeros = torch.cat([m.scales_zeros for m in linears], dim=1)
        gemm_weight = torch.cat([m.gemm_weight for m in linears])
        if not all(m.out_features % NUM_ROWS_PER_BLOCK == 0 for m in linears):
            fused = cls.from_q(torch.cat([m.levels() for m in linears]), scales_zeros, bias)
            # a level not recovered (a group whose zero dwarfs its scale): stay unfused
            return fused if torch.equal(fused.gemm_weight, gemm_weight) else None
        fused = cls(torch.cat([m.packed for m in linears]), scales_zeros, gemm_weight, bias)
        start = 0
        for m in linears:
            rows = slice(start, start + m.out_features)
            # views, the scales too (a part's are strided: made contiguous at its own kernel calls, HF's forward
            # only; kept as copies they were 100 MB of an idle 1.5B server's memory)
            m.packed, m.scales_zeros = fused.packed[rows], fused.scales_zeros[:, rows]
            m.gemm_weight, start = fused.gemm_weight[rows], rows.stop
        return fused

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 groups of {GROUP_SIZE}"
