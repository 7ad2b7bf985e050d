"""int4 weight-only linear layers: groups of 32 inputs share a scale and a zero (asymmetric), as
GGUF's Q4_1 does. Decode's few rows go through ragblend's own kernel where it builds on this machine
(blend_engine/native.py: int8 activations, integer dot products; AVX2), else torch's
`_weight_int4pack_mm_for_cpu`.

Decode reads every weight once per token, so int4 reads half of int8's bytes. SmolLM2 ships as a
Q4_1 GGUF: its weights are already 16 levels per group of 32, which this format holds again with
only its scale and zero rounded to bf16. The kernel's fast path takes bf16 activations only (fp32 and
fp16 inputs measured ~60x slower), and both lose to a bf16 GEMM above a few dozen rows, so prefill
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

from blend_engine import cpu_gemm, native
from blend_engine.rows import join_rows

GROUP_SIZE = 32  # inputs per (scale, zero): Q4_1's block
MIN_ROWS_MULTIPLE = 16  # torch's packing kernel's requirement on out_features (ragblend's needs 8)
MAX_PACKED_ROWS = 32  # above: the bf16 GEMM (measured crossover on CPU, as for int8)
_COMPUTE = torch.bfloat16
_PACK_ROWS = 256  # rows packed at a time at load (see Int4Linear.from_q)


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


_BLOCK_ROWS = 8  # rows a block of the nibbles' layout holds (ragblend's kernel's output vector)


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """q [rows, in] in 0..15 (any integer or float dtype; rows a multiple of 8) -> [rows / 8, in * 4] uint8, the
    layout csrc/int4_gemv.cpp reads: a row's group of 32 levels is 16 bytes, byte j holding level j in its low
    nibble and j + 16 in its high one; a block of 8 rows holds its groups by pairs, each pair as the 8 rows'
    32 bytes (group g's, then g + 1's), and a lone last group (odd in / 32) as the 8 rows' 16 bytes."""
    num_rows, num_in = q.shape
    num_blocks, num_groups = num_rows // _BLOCK_ROWS, num_in // GROUP_SIZE
    levels = q.reshape(num_rows, num_groups, 2, GROUP_SIZE // 2).to(torch.uint8)
    groups = levels[:, :, 0].bitwise_or(levels[:, :, 1] << 4)  # [rows, groups, 16]
    paired = num_groups // 2 * 2
    pairs = groups[:, :paired].reshape(num_blocks, _BLOCK_ROWS, paired // 2, GROUP_SIZE).transpose(1, 2)
    lone = groups[:, paired:].reshape(num_blocks, -1)  # [blocks, 8 * 16] or [blocks, 0]
    return torch.cat([pairs.reshape(num_blocks, -1), lone], dim=1)


def _levels(nibbles: torch.Tensor) -> torch.Tensor:
    """`_nibbles` undone: [rows / 8, in * 4] uint8 -> q [rows, in] uint8."""
    num_blocks, width = nibbles.shape
    num_rows, num_in = num_blocks * _BLOCK_ROWS, width // 4
    num_groups = num_in // GROUP_SIZE
    paired = num_groups // 2 * 2
    pair_bytes = paired * _BLOCK_ROWS * GROUP_SIZE // 2
    pairs = nibbles[:, :pair_bytes].reshape(num_blocks, paired // 2, _BLOCK_ROWS, GROUP_SIZE).transpose(1, 2)
    lone = nibbles[:, pair_bytes:].reshape(num_rows, -1)
    groups = torch.cat([pairs.reshape(num_rows, -1), lone], dim=1).reshape(num_rows, num_groups, 1, GROUP_SIZE // 2)
    return torch.cat([groups & 15, groups >> 4], dim=2).reshape(num_rows, num_in)


def _blocked(scales_zeros: torch.Tensor) -> torch.Tensor:
    """[in / 32, out, 2] (scale, zero) pairs -> [out / 8, in / 32, 8, 2], the layout csrc/int4_gemv.cpp reads: a
    block's pairs one after another, as its nibbles are. Held by group ([in / 32, out, 2]), a block's pairs were
    in / 32 lines apart, as many streams as groups for the prefetcher: the 1.5B's gate/up read at 19 GB/s
    from DRAM where blocked it read at 27 (a 2-core AVX2 VM)."""
    num_groups, num_out, _ = scales_zeros.shape
    return scales_zeros.reshape(num_groups, num_out // _BLOCK_ROWS, _BLOCK_ROWS, 2).permute(1, 0, 2, 3).contiguous()


class Int4Linear(nn.Module):
    """y = x @ W.T + bias, W[o, g*32 + j] = (q[o, g*32 + j] - 8) * scale[g, o] + zero[g, o], q in 0..15."""

    def __init__(self, nibbles: torch.Tensor, block_scales: torch.Tensor, gemm_weight: torch.Tensor,
                 bias: torch.Tensor | None):
        """The buffers as they are (`from_q` makes them from levels)."""
        super().__init__()
        self.out_features, self.in_features = gemm_weight.shape
        self.register_buffer("nibbles", nibbles)  # [out / 8, in * 4] uint8, two levels a byte (`_nibbles`)
        # [out / 8, in / 32, 8, 2] bf16: (scale, zero) by blocks of 8 rows, as the nibbles (`_blocked`); a fused
        # part's are a slice of the fused module's blocks
        self.register_buffer("block_scales", block_scales)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        # prefill's GEMMs in fp32 where bf16 ones are not the faster: the bf16 copy widened at each call
        self.is_widened = gemm_dtype(gemm_weight.device) == torch.float32
        self.register_buffer("gemm_weight", gemm_weight, persistent=False)  # [out, in] bf16
        self._native = native.int4_mm()  # decode's kernel: ragblend's where it builds, else None (torch's)
        # torch's layouts of the levels and of the scales (levels, scales_zeros()), made at the first call that
        # needs them
        self._torch_layout: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def is_native(self) -> bool:
        """Whether decode's rows go through ragblend's kernel (else torch's)."""
        return self._native is not None

    @classmethod
    def from_q(cls, q: torch.Tensor, scales_zeros: torch.Tensor, bias: torch.Tensor | None) -> Int4Linear:
        """q [out, in] in 0..15 (any integer dtype, or float), scales_zeros [in / 32, out, 2] bf16."""
        num_out, num_in = q.shape
        scale, zero = (scales_zeros[..., i].t().float()[..., None] for i in (0, 1))  # [out, in / 32, 1]
        gemm_weight = torch.empty(num_out, num_in, dtype=_COMPUTE, device=q.device)
        nibbles = torch.empty(num_out // _BLOCK_ROWS, num_in * 4, dtype=torch.uint8, device=q.device)
        # a slice of rows at a time: each step's fp32 temporaries stay in cache and are reused, where whole-matrix
        # ones are fresh pages every time (2.5x slower for a 1.5B model's layers)
        for start in range(0, num_out, _PACK_ROWS):
            rows = slice(start, start + _PACK_ROWS)
            # [r, in / 32, 32]; not in place: q may be float already, and .float() then no copy
            levels = q[rows].reshape(-1, num_in // GROUP_SIZE, GROUP_SIZE).float() - 8
            # the exact fp32 weight, rounded once to bf16 (one fused multiply-add)
            gemm_weight[rows] = torch.addcmul(zero[rows], levels, scale[rows]).reshape(-1, num_in)
            nibbles[start // _BLOCK_ROWS : rows.stop // _BLOCK_ROWS] = _nibbles(q[rows])
        return cls(nibbles, _blocked(scales_zeros), gemm_weight, bias)

    def scales_zeros(self) -> torch.Tensor:
        """The (scale, zero) pairs as [in / 32, out, 2] bf16 (a copy: the layer holds them by blocks)."""
        num_blocks, num_groups = self.block_scales.shape[:2]
        return self.block_scales.permute(1, 0, 2, 3).reshape(num_groups, num_blocks * _BLOCK_ROWS, 2)

    def _per_row(self, index: int) -> torch.Tensor:
        # [out / 8, in / 32, 8] -> [out, in / 32, 1]
        return self.block_scales[..., index].transpose(1, 2).reshape(self.out_features, -1).float()[..., None]

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
        """q [out, in] in 0..15, as float."""
        return _levels(self.nibbles).float()

    def _torch_kernel_operands(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The levels and the scales in torch's kernel layouts (only where ragblend's kernel is not used: made
        once, kept)."""
        if self._torch_layout is None:
            levels = _levels(self.nibbles).to(torch.int32)
            self._torch_layout = (torch.ops.aten._convert_weight_to_int4pack_for_cpu(levels, 1), self.scales_zeros())
        return self._torch_layout

    def _few_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [n, in] (n <= MAX_PACKED_ROWS) -> [n, out] fp32 by a decode kernel, without the bias."""
        if self._native is not None:
            return self._native(rows.float().contiguous(), self.nibbles, self.block_scales)
        packed, scales_zeros = self._torch_kernel_operands()
        return torch.ops.aten._weight_int4pack_mm_for_cpu(rows.to(_COMPUTE).contiguous(), packed, GROUP_SIZE,
                                                          scales_zeros).float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= MAX_PACKED_ROWS:  # decode's rows: as few small ops as can be
            out = self._few_rows(x).to(x.dtype)
            return out if self.bias is None else out + self.bias
        rows = x.reshape(-1, x.shape[-1])  # [n, in]
        if rows.shape[0] <= MAX_PACKED_ROWS:
            out = self._few_rows(rows)
        elif self.is_widened:
            out = F.linear(rows.float(), widened(self.gemm_weight))
        else:
            out = F.linear(rows.to(_COMPUTE), self.gemm_weight)
        out = out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    @classmethod
    def fuse(cls, linears: list[nn.Module]) -> Int4Linear | None:
        """One module over the rows of `linears` (same input), or None unless all are Int4Linear with biases
        all or none. The fused buffers are the parts' joined, and the parts' become views of them (no weight
        memory added; each still works alone)."""
        num_biased = sum(isinstance(m, Int4Linear) and m.bias is not None for m in linears)
        if not all(isinstance(m, Int4Linear) for m in linears) or num_biased not in (0, len(linears)):
            return None
        bias = torch.cat([m.bias.detach() for m in linears]) if num_biased else None
        # views where the parts were joined before (a kept file's: blend_engine/rows.py), else copies
        fused = cls(join_rows([m.nibbles for m in linears]), join_rows([m.block_scales for m in linears]),
                    join_rows([m.gemm_weight for m in linears]), bias)
        start = 0
        for m in linears:
            rows = slice(start, start + m.out_features)
            # views, the scales too (kept as copies they were 100 MB of an idle 1.5B server's memory)
            blocks = slice(rows.start // _BLOCK_ROWS, rows.stop // _BLOCK_ROWS)  # parts are whole blocks: 16 rows at least
            m.nibbles, m.block_scales = fused.nibbles[blocks], fused.block_scales[blocks]
            m.gemm_weight, m._torch_layout, start = fused.gemm_weight[rows], None, rows.stop
        return fused

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 groups of {GROUP_SIZE}"
