"""Weight formats of the model's linear layers: fp32 (as loaded), bf16, int8 or int4 weight-only.

Decode reads every weight once per token, so its speed on CPU is the bytes of the weights: int8
reads a quarter of fp32. The HF model is kept and its `nn.Linear` modules (attention and MLP
projections of every decoder layer, and the lm_head) are swapped for the small modules below; the
rest (embedding lookup, norms, residual stream, RoPE, attention, the KV cache) stays in the model's
dtype. The tied embedding stays as loaded (a lookup reads one row per token), while the lm_head
gets its own quantized copy: its 49152x576 matrix is SmolLM2's largest.

int8: symmetric absmax per output channel, scales rounded to bf16 first so that `q * scale` is the
exact dequantized weight. A few rows (decode) run ragblend's int8 kernel (blend_engine/native.py:
int8 activations per group of 32, integer dot products; x86-64 with AVX2), else
`torch._weight_int8pack_mm` with bf16 activations (measured ~3x faster than fp32 at batch 1;
torchao's int8 weight-only linear dequantizes per call in eager mode, ~4x slower than this kernel
there). Many rows (prefill) run a
bf16 GEMM over a bf16 copy of the dequantized weight where the CPU has native bf16 (oneDNN; faster
than fp32 there), else an fp32 GEMM over the weight dequantized per call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from blend_engine import native
from blend_engine.int4 import GROUP_SIZE, Int4Linear, gemm_dtype
from blend_engine.rows import join_rows
from configs.enums import WeightFormat

MAX_PACKED_ROWS = 32  # above: the GEMM path (measured crossover of the int8 kernel on CPU)
_COMPUTE = torch.bfloat16


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (q [out, in] int8, scales [out] bf16): Int8Linear's levels, row by row (so a
    large matrix can be quantized a slice of rows at a time)."""
    scales = (weight.detach().float().abs().amax(dim=1).clamp_min(1e-8) / 127).to(_COMPUTE)
    q = torch.round(weight.detach().float() / scales.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


class Int8Linear(nn.Module):
    """y = x @ (q * scale).T + bias with q int8 [out, in] and scale [out] (bf16)."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 is_copy_kept: bool = True, gemm_weight: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("qweight", qweight)  # [out, in] int8
        self.register_buffer("scales", scales)  # [out] bf16
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.in_features, self.out_features = qweight.shape[1], qweight.shape[0]
        self.is_bf16_gemm = gemm_dtype(qweight.device) == _COMPUTE
        self.is_copy_kept = is_copy_kept
        # decode's kernel: ragblend's where it builds and the rows are whole groups of its int8 activations
        is_native = qweight.device.type == "cpu" and self.in_features % GROUP_SIZE == 0
        self._native = native.int8_mm() if is_native else None
        # prefill's weight: the dequantized weight kept in bf16 (2 more bytes a weight, still less than
        # fp32's 4) where bf16 GEMMs are native; else dequantized to fp32 at each call. Not
        # `is_copy_kept`: made at the first call with many rows (the lm_head's: it sees one row a
        # sequence but in teacher forcing and batches of over 32 answers, and is SmolLM2's largest).
        # `gemm_weight` given: a fuse's, its parts' copies joined (a view where they lie back to back)
        if gemm_weight is None and self.is_bf16_gemm and is_copy_kept:
            gemm_weight = self.dequantized(_COMPUTE)
        self.register_buffer("gemm_weight", gemm_weight, persistent=False)  # [out, in] bf16 or None

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, is_copy_kept: bool = True,
                    ) -> Int8Linear:
        return cls(*quantize_int8(weight), None if bias is None else bias.detach().clone(), is_copy_kept)

    @property
    def is_native(self) -> bool:
        """Whether decode's rows go through ragblend's kernel (else torch's)."""
        return self._native is not None

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight this module multiplies by, [out, in]."""
        return (self.qweight.to(dtype) * self.scales.to(dtype)[:, None]).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # [n, in]
        if rows.shape[0] <= MAX_PACKED_ROWS and self._native is not None:
            out = self._native(rows.float().contiguous(), self.qweight, self.scales)
        elif rows.shape[0] <= MAX_PACKED_ROWS:
            out = torch._weight_int8pack_mm(rows.to(_COMPUTE).contiguous(), self.qweight, self.scales)
        elif self.is_bf16_gemm:
            if self.gemm_weight is None:  # the first call with many rows of a copy not kept from the start
                self.gemm_weight = self.dequantized(_COMPUTE)
            out = F.linear(rows.to(_COMPUTE), self.gemm_weight)
        else:
            out = F.linear(rows.float(), self.dequantized(torch.float32))
        out = out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    @classmethod
    def fuse(cls, linears: list[nn.Module]) -> Int8Linear | None:
        """One module over the rows of `linears` (same input), or None unless all are Int8Linear
        (with biases all or none). Their int8 buffers become views of the fused ones: no weight
        memory is added, and each still works alone (HF's own forward calls them)."""
        num_biased = sum(isinstance(m, Int8Linear) and m.bias is not None for m in linears)
        if not all(isinstance(m, Int8Linear) for m in linears) or num_biased not in (0, len(linears)):
            return None
        bias = torch.cat([m.bias.detach() for m in linears]) if num_biased else None
        # views where the parts were joined before (a kept file's: blend_engine/rows.py, or a fuse's), else
        # copies; the parts' bf16 copies too, rather than a new one (row by row the same dequantization)
        kept = [m.gemm_weight for m in linears]
        gemm = join_rows(kept) if all(w is not None for w in kept) else None
        fused = cls(join_rows([m.qweight for m in linears]), join_rows([m.scales for m in linears]), bias,
                    gemm_weight=gemm)
        start = 0
        for m in linears:
            rows = slice(start, start + m.out_features)
            m.qweight, m.scales, start = fused.qweight[rows], fused.scales[rows], rows.stop
            if fused.gemm_weight is not None:
                m.gemm_weight = fused.gemm_weight[rows]
        return fused

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


class Bf16Linear(nn.Module):
    """nn.Linear with bf16 weights and bf16 activations at the matmul only; output in x's dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().to(_COMPUTE), requires_grad=False)  # [out, in]
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x.to(_COMPUTE), self.weight).to(x.dtype)
        return out if self.bias is None else out + self.bias


_MODULES = {WeightFormat.INT8: Int8Linear, WeightFormat.INT4: Int4Linear, WeightFormat.BF16: Bf16Linear}


# int4 layers keep an int8 lm_head: SmolLM2 ships its (tied) embedding in Q8_0, and 4 bits there
# cost most of int4's KL against fp32 (measured: README); it is ~1/5 of the decode's weight bytes
_LM_HEAD_FORMAT = {WeightFormat.INT4: WeightFormat.INT8, WeightFormat.GGUF: WeightFormat.INT8}


def is_gated(mlp: nn.Module) -> bool:
    return all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn"))


def fuse_block(block: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    """A decoder block's fused q/k/v and, for a gated MLP, gate/up (`fuse_linears`: None where not fused).
    The parts become views of the fused buffers, so a second call joins them without a copy."""
    attn, mlp = block.self_attn, block.mlp
    qkv = fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj])
    return qkv, fuse_linears([mlp.gate_proj, mlp.up_proj]) if is_gated(mlp) else None


def fuse_linears(linears: list[nn.Module]) -> nn.Module | None:
    """One quantized module over the rows of `linears` (same input), or None where they are not
    all of one quantized format (fp32 and bf16 layers are not fused)."""
    for cls in (Int8Linear, Int4Linear):
        if all(isinstance(m, cls) for m in linears):
            return cls.fuse(linears)
    return None


def unhooked(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """`module` as a callable: the bound `forward` of this file's modules, which nothing hooks (they
    are made after loading), else the module itself (an HF layer may carry accelerate's hooks)."""
    is_ours = isinstance(module, (Int8Linear, Int4Linear, Bf16Linear))
    return module.forward if is_ours and not (module._forward_hooks or module._forward_pre_hooks) else module


def resolve_weight_format(fmt: WeightFormat, device: torch.device, model: nn.Module | None = None) -> WeightFormat:
    """auto: int4 on CPU where every decoder linear layer's shape fits the int4 kernel (`model`
    given), else int8 (measured: README); the weights as loaded elsewhere."""
    if fmt == WeightFormat.AUTO:
        if device.type != "cpu":
            return WeightFormat.FP32
        return WeightFormat.INT4 if model is not None and fits_int4(model) else WeightFormat.INT8
    if fmt == WeightFormat.INT4 and device.type != "cpu":
        raise ValueError("model.weights int4 runs on CPU only (its kernel is torch's CPU int4 matmul)")
    if fmt == WeightFormat.GGUF:
        raise ValueError("model.weights gguf keeps a GGUF file's layers as stored: for a .gguf model only")
    return fmt


def fits_int4(model: nn.Module) -> bool:
    """Whether every linear layer of the decoder has a shape the int4 packing takes."""
    return all(Int4Linear.fits(m.out_features, m.in_features)
               for m in model.get_decoder().layers.modules() if isinstance(m, nn.Linear))


def convert_linears(model: nn.Module, fmt: WeightFormat) -> int:
    """Swap the decoder layers' and the lm_head's nn.Linear modules for `fmt`'s; returns how many."""
    if fmt == WeightFormat.FP32:
        return 0
    if fmt not in _MODULES:
        raise ValueError(f"resolve weight format {fmt.value!r} to a concrete one first")
    targets = [(name, module) for name, module in model.get_decoder().layers.named_modules()
               if isinstance(module, nn.Linear)]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_decoder().layers.get_submodule(parent_name)
        setattr(parent, child, _convert(linear, fmt))
    lm_head = model.get_output_embeddings()
    if isinstance(lm_head, nn.Linear):  # tied or not: a converted copy (the embedding lookup stays)
        model.set_output_embeddings(_convert(lm_head, _LM_HEAD_FORMAT.get(fmt, fmt), is_lm_head=True))
        targets.append(("lm_head", lm_head))
    return len(targets)


def _convert(linear: nn.Linear, fmt: WeightFormat, is_lm_head: bool = False) -> nn.Module:
    if fmt == WeightFormat.INT8:  # the lm_head's prefill copy only once it sees many rows (see Int8Linear)
        return Int8Linear.from_weight(linear.weight, linear.bias, is_copy_kept=not is_lm_head)
    if fmt == WeightFormat.INT4:
        return Int4Linear.from_weight(linear.weight, linear.bias)
    return Bf16Linear(linear.weight, linear.bias)


def weight_format(model: nn.Module) -> WeightFormat:
    """The format of the model's linear layers (what the KV fingerprint records): int4 and int8 layers
    together are a GGUF file's as stored (blend_engine/gguf_loader.py)."""
    found = {type(m) for m in model.get_decoder().layers.modules()}
    formats = {fmt for fmt, cls in _MODULES.items() if cls in found}
    if formats == {WeightFormat.INT4, WeightFormat.INT8}:
        formats = {WeightFormat.GGUF}
    if len(formats) > 1 or (formats and nn.Linear in found):
        raise ValueError(f"the model mixes weight formats: {sorted(f.value for f in formats)} and nn.Linear")
    fmt = formats.pop() if formats else WeightFormat.FP32
    lm_head = model.get_output_embeddings()
    expected = _MODULES.get(_LM_HEAD_FORMAT.get(fmt, fmt), nn.Linear)
    if lm_head is not None and type(lm_head) is not expected:
        raise ValueError(f"the model mixes weight formats: {fmt.value} layers and a {type(lm_head).__name__} lm_head")
    return fmt
