"""Our own layer loop over a Hugging Face Llama-family model, by composition.

The HF modules (embeddings, norms, projections, rotary embedding, MLP, lm_head) are called as they
are; only the attention is ours, so any subset of tokens can be computed against a cache at
arbitrary absolute positions (blend_engine/attention.py). Batch size is 1 throughout, so tensors carry no batch dimension.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from blend_engine.layer import HeadShape, LayerCalls, norm_call

# The families whose layers this runner computes as transformers does (tested against it: tests/engine_models.py).
# Others of the same module layout (Gemma: a scaled embedding and (1 + w) norms, ...) would run and be wrong.
SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
_REQUIRED = ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")


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


class ModelRunner:
    """Layer-by-layer access to a causal LM's modules (Llama, Mistral, Qwen2, Qwen3 families)."""

    def __init__(self, model: PreTrainedModel):
        self.model = model
        self.decoder = model.get_decoder()
        self.layers = self.decoder.layers
        model_type = getattr(model.config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:  # a family of the same layout can differ in what it scales
            raise ValueError(f"unsupported architecture {type(model).__name__} (model_type {model_type!r}): "
                             f"ragblend runs {', '.join(sorted(SUPPORTED_MODEL_TYPES))}")
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
        self.shape = HeadShape(self.num_heads, self.num_kv_heads, self.head_dim)
        self.calls = [LayerCalls.of(block, self.shape, self.dtype) for block in self.layers]
        self._final_norm = norm_call(self.decoder.norm, self.dtype)

    # read off the final norm: the embedding may be held in int8 blocks (blend_engine/embedding.py)
    @property
    def device(self) -> torch.device:
        return self.decoder.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.norm.weight.dtype

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
        """hidden [n, hidden] -> q [H, n, D], k [H_kv, n, D], v [H_kv, n, D] (`LayerCalls.qkv`)."""
        return self.calls[layer].qkv(hidden, rope)

    def finish(self, layer: int, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residual + o_proj, then the MLP block: hidden [n, hidden] -> [n, hidden]."""
        return self.calls[layer].finish(hidden, attn_out)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] -> logits [n, vocab] in float32."""
        return self.model.lm_head(self._final_norm(hidden)).float()
