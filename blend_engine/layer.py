"""One decoder layer of a Hugging Face Llama-family model as the engine's loops call it: its modules
looked up once, q/k/v before attention and the rest of the layer after it.

A decode step makes hundreds of these calls per token, and attribute lookups through nn.Module and
its call machinery cost a few µs each, so `LayerCalls` holds them ready (measured: README, "Fewer
calls per layer"). Being an argument rather than a layer index, it would also let torch.compile make
one graph for every layer (measured there too, not used). q/k/v and the MLP's gate/up are one matmul
each where the weights are quantized (one kernel call and one bf16 cast of the input instead of
three or two).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property, partial

import torch
import torch.nn.functional as F

from blend_engine import native
from blend_engine.weights import fuse_block, is_gated, unhooked

# RMSNorms computing weight * (x * rsqrt(mean(x^2) + eps)) in fp32: torch's one fused op gives the
# same on fp32 inputs instead of seven small ones (a decode step runs 61 of them per token)
_PLAIN_RMS_NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})
Call = Callable[[torch.Tensor], torch.Tensor]


def norm_call(norm: torch.nn.Module, dtype: torch.dtype) -> Call:
    """`norm` as a callable on inputs of `dtype`: torch's fused RMSNorm where it computes the same
    (a known plain RMSNorm, fp32), through ragblend's kernel where that is built (the same bits in one call:
    csrc/rms_norm.cpp), else the module."""
    if dtype != torch.float32 or type(norm).__name__ not in _PLAIN_RMS_NORMS:
        return norm
    torch_norm = partial(F.rms_norm, normalized_shape=(norm.weight.shape[-1],), weight=norm.weight,
                         eps=norm.variance_epsilon)
    kernel = native.rms_norm()
    width = norm.weight.shape[-1]
    is_native = (kernel is not None and norm.weight.device.type == "cpu" and norm.weight.dtype == torch.float32
                 and norm.weight.is_contiguous() and native.RMS_NORM_WIDTHS[0] <= width < native.RMS_NORM_WIDTHS[1])
    if not is_native:
        return torch_norm
    weight, eps = norm.weight, norm.variance_epsilon

    def rms_norm(x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous() and not x.requires_grad:
            return kernel(x, weight, eps)
        return torch_norm(x)

    return rms_norm


def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """`apply_rope(x, cos, sin)` (blend_engine/runner.py) bit for bit, in four ops instead of seven (a
    decode step runs it per layer): rotate_half(x) * sin == x.roll(D/2) * signed_sin(sin), negation
    being exact."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


def rotate_into(out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> None:
    """`out[...] = rotate(x, cos, sin_signed)` bit for bit, `out` a view (a span of the cache): laying out
    a prompt's reused keys one layer at a time (the CPU path), a 620-token chunk's layer took 0.092 ms as
    `apply_rope` and a copy (five temporaries of its size), 0.042 ms so (2-core Xeon)."""
    torch.mul(x, cos, out=out)
    out.add_(x.roll(x.shape[-1] // 2, dims=-1) * sin_signed)


@dataclass(frozen=True)
class HeadShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @cached_property  # read per layer and token by the decode step: made once
    def qkv_split(self) -> list[int]:
        return [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim]


@dataclass(frozen=True)
class LayerCalls:
    """What a decoder layer's pass calls (batch size 1: tensors carry no batch dimension)."""

    shape: HeadShape
    input_norm: Call
    post_norm: Call
    attn: torch.nn.Module  # q_proj/k_proj/v_proj where unfused, and q_norm/k_norm
    mlp: torch.nn.Module  # whole where not gated, and its act_fn
    fused_qkv: Call | None  # [n, hidden] -> [n, (H + 2 H_kv) D]; None: q_proj, k_proj, v_proj apart
    o_proj: Call
    fused_gate_up: Call | None  # [n, hidden] -> [n, 2 I]; None: not gated, or not quantized
    down: Call | None
    is_normed: bool  # Qwen3: per-head RMSNorm on q and k before RoPE

    @classmethod
    def of(cls, block: torch.nn.Module, shape: HeadShape, dtype: torch.dtype) -> LayerCalls:
        attn, mlp, gated = block.self_attn, block.mlp, is_gated(block.mlp)
        qkv, gate_up = fuse_block(block)
        return cls(
            shape, norm_call(block.input_layernorm, dtype), norm_call(block.post_attention_layernorm, dtype),
            attn, mlp, None if qkv is None else unhooked(qkv), unhooked(attn.o_proj),
            None if gate_up is None else unhooked(gate_up), unhooked(mlp.down_proj) if gated else None,
            hasattr(attn, "q_norm"),
        )

    def qkv(
        self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [n, hidden] -> q [H, n, D], k [H_kv, n, D], v [H_kv, n, D]; q and k before RoPE, or
        rotated by `rope` (cos, signed sin [n, D]: see `rotate`), both in one pass where q/k/v are fused."""
        x = self.input_norm(hidden)
        n, head_dim, split = x.shape[0], self.shape.head_dim, self.shape.qkv_split
        if self.fused_qkv is not None and rope is not None and not self.is_normed:
            fused = self.fused_qkv(x)  # [n, (H + 2 H_kv) D]
            num_qk = split[0] + split[1]
            qk = rotate(fused[:, :num_qk].reshape(n, -1, head_dim).transpose(0, 1), *rope)  # [H + H_kv, n, D]
            q, k = qk.split([self.shape.num_heads, self.shape.num_kv_heads])
            return q, k, fused[:, num_qk:].reshape(n, -1, head_dim).transpose(0, 1)
        if self.fused_qkv is not None:
            q, k, v = self.fused_qkv(x).split(split, dim=-1)
        else:
            q, k, v = self.attn.q_proj(x), self.attn.k_proj(x), self.attn.v_proj(x)
        q, k, v = (t.reshape(n, -1, head_dim) for t in (q, k, v))
        if self.is_normed:
            q, k = self.attn.q_norm(q), self.attn.k_norm(k)
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        if rope is None:
            return q, k, v
        # q and k rotated in one pass (one copy to stack them, then `rotate`'s four ops instead of eight:
        # on a GPU each op is a launch); elementwise, so bit for bit what rotating each gives
        q, k = rotate(torch.cat([q, k]), *rope).split([self.shape.num_heads, self.shape.num_kv_heads])
        return q, k, v

    def finish(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residual + o_proj, then the MLP block: hidden [n, hidden] -> [n, hidden]."""
        hidden = hidden + self.o_proj(attn_out)
        x = self.post_norm(hidden)
        if self.fused_gate_up is None:
            return hidden + self.mlp(x)
        # a gated MLP: down(act(gate(x)) * up(x)), with gate and up in one matmul
        gate, up = self.fused_gate_up(x).chunk(2, dim=-1)
        return hidden + self.down(self.mlp.act_fn(gate) * up)
