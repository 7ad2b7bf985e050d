"""Tiny random models built from a config: fast, exact (fp32), one per supported family trait."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from blend_engine.config import BlendConfig
from blend_engine.engine import BlendEngine

VOCAB = 256
_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=512)


def _llama_gqa():
    return LlamaForCausalLM(LlamaConfig(**_COMMON))


def _qwen2_bias():
    return Qwen2ForCausalLM(Qwen2Config(**_COMMON))  # q/k/v projections carry biases


def _llama_rope_scaling():
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64)
    return LlamaForCausalLM(LlamaConfig(**_COMMON, rope_scaling=scaling))


def _qwen3_qk_norm():
    return Qwen3ForCausalLM(Qwen3Config(**_COMMON, head_dim=16))


MODEL_BUILDERS = {
    "llama-gqa": _llama_gqa,
    "qwen2-bias": _qwen2_bias,
    "llama-rope-scaling": _llama_rope_scaling,
    "qwen3-qk-norm": _qwen3_qk_norm,
}


def test_device() -> torch.device:
    """`pytest --device cuda` runs the engine tests on CUDA in bf16 (default: CPU, fp32)."""
    return torch.device(os.environ.get("RAGBLEND_TEST_DEVICE", "cpu"))


def tol(atol: float) -> dict:
    """assert_close tolerances: the fp32 ones on CPU; on CUDA (bf16, 8 mantissa bits, other kernels'
    summation order) an absolute 5e-2 plus 2% relative, which values of order 1 need in bf16."""
    if test_device().type == "cuda":
        return dict(atol=max(atol, 5e-2), rtol=2e-2)
    return dict(atol=atol, rtol=0)


cpu_exact = pytest.mark.skipif(os.environ.get("RAGBLEND_TEST_DEVICE", "cpu") != "cpu",
                               reason="exact fp32 comparison (token choices, bit equality): CPU only")


def build_engine(name: str, seed: int = 0, **engine_options) -> BlendEngine:
    torch.manual_seed(seed)
    model = MODEL_BUILDERS[name]().eval()
    if hasattr(model, "model") and name == "qwen2-bias":
        # random init leaves biases at zero: give them values so they matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    device = test_device()
    if device.type == "cuda":
        model = model.to(device, dtype=torch.bfloat16)
    return BlendEngine.from_model(model, tokenizer=None, name=name, blend=BlendConfig.cacheblend(), **engine_options)


def random_ids(n: int, seed: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(3, VOCAB, (n,), generator=g).tolist())


def decode_reference(x: torch.Tensor, weight: torch.Tensor, kernel: str) -> torch.Tensor:
    """What a decode kernel multiplies (the `decode_kernel` fixture's `kernel`): ragblend's rounds x to int8
    per group of 32 (scale max|x| / 127), torch's to bf16. x [n, in], weight [out, in] -> [n, out]."""
    if kernel == "torch":
        return torch.nn.functional.linear(x.bfloat16().float(), weight)
    groups = x.reshape(x.shape[0], -1, 32)  # [n, in / 32, 32]
    step = groups.abs().amax(-1, keepdim=True) / 127
    return torch.nn.functional.linear((torch.round(groups / torch.where(step > 0, step, 1)) * step).reshape(x.shape),
                                      weight)
