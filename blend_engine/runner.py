"""Our own layer loop over a Hugging Face Llama-family model, by composition.

The HF modules (embeddings, norms, projections, rotary embedding, MLP, lm_head) are called as they
are; only the attention is ours, so any subset of tokens can be computed against a cache at
arbitrary absolute positions (blend_engine/attention.py). Batch size is 1 throughout, so tensors carry no batch dimension.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from blend_engine.weights import fuse_linears, unhooked

_REQUIRED = ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")
# RMSNorms computing weight * (x * rsqrt(mean(x^2) + eps)) in fp32: torch's one fused op gives the
# same on fp32 inputs instead of seven small ones (a decode step runs 61 of them per token)
_PLAIN_RMS_NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})
Call = Callable[[torch.Tensor], torch.Tensor]


def norm_call(norm: torch.nn.Module, dtype: torch.dtype) -> Call:
    """`norm` as a callable on inputs of `dtype`: torch's fused RMSNorm where it computes the same
    (a known plain RMSNorm, fp32), else the module."""
    if dtype == torch.float32 and type(norm).__name__ in _PLAIN_RMS_NORMS:
        return partial(F.rms_norm, normalized_shape=(norm.weight.shape[-1],), weight=norm.weight,
                       eps=norm.variance_epsilon)
    return norm


def _is_gated(mlp: torch.nn.Module) -> bool:
    return all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn"))


@dataclass(frozen=True)
class LayerCalls:
    """What a decoder layer's pass calls, looked up once: a decode step makes hundreds of these
    calls per token, and attribute lookups through nn.Module and its call machinery cost a few µs
    each. q/k/v and the MLP's gate/up are one matmul each where the weights are quantized (one
    kernel call and one bf16 cast of the input instead of three or two)."""

    input_norm: Call
    post_norm: Call
    qkv: Call | None  # [n, hidden] -> [n, (H + 2 H_kv) D]; None: q_proj, k_proj, v_proj apart
    o_proj: Call
    gate_up: Call | None  # [n, hidden] -> [n, 2 I]; None: the MLP is not gated (called whole)
    down: Call | None
    is_normed: bool  # Qwen3: per-head RMSNorm on q and k before RoPE

    @classmethod
    def of(cls, block: torch.nn.Module, dtype: torch.dtype) -> LayerCalls:
        attn, mlp = block.self_attn, block.mlp
        qkv = fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj])
        gate_up = fuse_linears([mlp.gate_proj, mlp.up_proj]) if _is_gated(mlp) else None
        return cls(
            norm_call(block.input_layernorm, dtype), norm_call(block.post_attention_layernorm, dtype),
            None if qkv is None else unhooked(qkv), unhooked(attn.o_proj),
            None if gate_up is None else unhooked(gate_up), unhooked(mlp.down_proj) if _is_gated(mlp) else None,
            hasattr(attn, "q_norm"),
        )


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [H, n, D] rotated by cos, sin [n, D] (from the model's own rotary embedding)."""
    return x * cos + rotate_half(x) * sin


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin [n, D] with its first half negated: the table `rotate` takes."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """`apply_rope(x, cos, sin)` bit for bit, in four ops instead of seven (a decode step runs it per
    layer): rotate_half(x) * sin == x.roll(D/2) * signed_sin(sin), negation being exact."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


class ModelRunner:
    """Layer-by-layer access to a causal LM's modules (Llama, Mistral, Qwen2, Qwen3 families)."""

    def __init__(self, model: PreTrainedModel):
        self.model = model
        self.decoder = model.get_decoder()
        self.layers = self.decoder.layers
        for name in _REQUIRED:
            if not hasattr(self.layers[0], name):
                raise ValueError(f"unsupported architecture {type(model).__name__}: decoder layer lacks {name!r}")
        attn = self.layers[0].self_attn
        config = model.config
        self.num_layers = len(self.layers)
        self.head_dim = attn.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scaling = attn.scaling
        self.qkv_split = [attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features]
        self.calls = [LayerCalls.of(block, self.dtype) for block in self.layers]
        self._final_norm = norm_call(self.decoder.norm, self.dtype)

    @property
    def device(self) -> torch.device:
        return self.decoder.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.embed_tokens.weight.dtype

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [n] -> hidden [n, hidden]."""
        return self.decoder.embed_tokens(token_ids)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [n, D] for absolute `positions` [n], honouring the model's rope_scaling."""
        probe = torch.empty(0, device=self.device, dtype=self.dtype)
        cos, sin = self.decoder.rotary_emb(probe, positions[None, :])
        return cos[0], sin[0]

    def qkv(
        self, layer: int, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [n, hidden] -> q [H, n, D], k [H_kv, n, D], v [H_kv, n, D]; q and k before RoPE, or
        rotated by `rope` (cos, signed sin [n, D]: see `rotate`), both in one pass where q/k/v are fused."""
        calls, attn = self.calls[layer], self.layers[layer].self_attn
        x = calls.input_norm(hidden)
        n = x.shape[0]
        if calls.qkv is not None and rope is not None and not calls.is_normed:
            fused = calls.qkv(x)  # [n, (H + 2 H_kv) D]
            num_qk = self.qkv_split[0] + self.qkv_split[1]
            qk = rotate(fused[:, :num_qk].reshape(n, -1, self.head_dim).transpose(0, 1), *rope)  # [H + H_kv, n, D]
            q, k = qk.split([self.num_heads, self.num_kv_heads])
            return q, k, fused[:, num_qk:].reshape(n, -1, self.head_dim).transpose(0, 1)
        if calls.qkv is not None:
            q, k, v = calls.qkv(x).split(self.qkv_split, dim=-1)
        else:
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        q, k, v = (t.reshape(n, -1, self.head_dim) for t in (q, k, v))
        if calls.is_normed:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        return (q, k, v) if rope is None else (rotate(q, *rope), rotate(k, *rope), v)

    def finish(self, layer: int, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residual + o_proj, then the MLP block: hidden [n, hidden] -> [n, hidden]."""
        calls = self.calls[layer]
        hidden = hidden + calls.o_proj(attn_out)
        x = calls.post_norm(hidden)
        if calls.gate_up is None:
            return hidden + self.layers[layer].mlp(x)
        # a gated MLP: down(act(gate(x)) * up(x)), with gate and up in one matmul
        gate, up = calls.gate_up(x).chunk(2, dim=-1)
        return hidden + calls.down(self.layers[layer].mlp.act_fn(gate) * up)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] -> logits [n, vocab] in float32."""
        return self.model.lm_head(self._final_norm(hidden)).float()
