"""Decode speed after a full prefill: the engine's decoder (CUDA-graphed on CUDA) against Hugging
Face's own eager decode with its DynamicCache, greedy, a fixed number of tokens (EOS ignored)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from blend_engine.engine import BlendEngine
from blend_engine.types import PrefillMode, Segment


@dataclass(frozen=True)
class DecodeFigures:
    context_tokens: int
    num_tokens: int
    engine_ms_per_token: float
    hf_ms_per_token: float | None  # None when HF was not measured


def measure_decode(engine: BlendEngine, segments: list[Segment], num_tokens: int, with_hf: bool = True) -> DecodeFigures:
    result = engine.prefill(segments, PrefillMode.FULL, max_new_tokens=num_tokens + 1)
    decoder = engine.decoder(result)
    logits = decoder.step(int(result.logits.argmax()))  # untimed: captures the CUDA graph

    def engine_step(token: int) -> torch.Tensor:
        return decoder.step(token)

    engine_ms = _time_steps(engine_step, logits, num_tokens, engine.device)
    hf_ms = _hf_ms_per_token(engine, result.token_ids, num_tokens) if with_hf else None
    return DecodeFigures(len(result.token_ids), num_tokens, engine_ms, hf_ms)


@torch.inference_mode()
def _hf_ms_per_token(engine: BlendEngine, token_ids: list[int], num_tokens: int) -> float:
    model, device = engine.model, engine.device
    out = model(torch.tensor([token_ids], device=device), use_cache=True)
    cache = out.past_key_values
    out = model(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)  # untimed warm step

    def hf_step(token: int) -> torch.Tensor:
        nonlocal out
        out = model(torch.tensor([[token]], device=device), past_key_values=cache, use_cache=True)
        return out.logits[0, -1]

    return _time_steps(hf_step, out.logits[0, -1], num_tokens, device)


def _time_steps(step, logits: torch.Tensor, num_tokens: int, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(num_tokens):
        logits = step(int(logits.argmax()))  # the host needs each token: one sync per step, as in serving
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) * 1000 / num_tokens
