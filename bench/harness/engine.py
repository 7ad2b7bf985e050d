"""An engine in this process as the engine benches drive it: prompts with their chunks' KV precomputed, a timed
prefill to the first token, greedy answers, decode speed against Hugging Face's eager decode.

Without a tokenizer (a random shape on a bare GPU host) the prompts are random ids of the real ones' lengths:
the data set's passages average 3.96 characters per SmolLM2 token and its questions 4.47, laid out as
PromptBuilder lays them (a 30-token prefix, 2-token separators, the question's suffix).
"""

from __future__ import annotations

import argparse
import time
import zlib
from dataclasses import dataclass, fields
from enum import Enum
from pathlib import Path

import torch

from bench.harness.data import Question
from blend_engine.engine import BlendEngine
from blend_engine.types import BlendConfig, PrefillMode, PrefillResult, Segment
from configs.enums import SinkMode
from configs.settings import Settings, load_settings

CHARS_PER_PASSAGE_TOKEN = 3.96
CHARS_PER_QUESTION_TOKEN = 4.47
NUM_PREFIX_TOKENS = 30
NUM_SEPARATOR_TOKENS = 2
NUM_SUFFIX_TOKENS = 15  # "Answer briefly." and the assistant header around the question


def synthetic_prompt(engine: BlendEngine, question: Question, sink: SinkMode, seed: int) -> list[Segment]:
    """[prefix (with its exact KV), chunk, sep, chunk, ..., question]: chunks precomputed behind `sink`."""
    vocab = engine.model.config.vocab_size
    g = torch.Generator().manual_seed(seed)

    def ids(n: int) -> tuple[int, ...]:
        return tuple(torch.randint(3, vocab, (max(1, n),), generator=g).tolist())

    prefix = ids(NUM_PREFIX_TOKENS)
    context = {SinkMode.NONE: (), SinkMode.BOS: (1,), SinkMode.PREFIX: prefix}[sink]
    segments = [Segment(prefix, engine.precompute(prefix))]
    for i, text in enumerate(question.passages):
        if i:
            segments.append(Segment(ids(NUM_SEPARATOR_TOKENS)))
        chunk = ids(round(len(text) / CHARS_PER_PASSAGE_TOKEN))
        segments.append(Segment(chunk, engine.precompute(chunk, context)))
    segments.append(Segment(ids(round(len(question.question) / CHARS_PER_QUESTION_TOKEN) + NUM_SUFFIX_TOKENS)))
    return segments


@dataclass(frozen=True)
class Variant:
    """One row of a bench: a prefill mode, the sink its chunks were computed behind, its blend config."""

    label: str
    mode: PrefillMode
    sink: SinkMode
    blend: BlendConfig | None = None


def load_engine(config: str | Path | None = None, threads: int | None = None, **overrides) -> tuple[Settings, BlendEngine]:
    """The settings (`overrides` over `config`) and their engine; torch's CPU threads set first where
    `threads` is given."""
    if threads:
        torch.set_num_threads(threads)
    settings = load_settings(config, **overrides)
    return settings, BlendEngine.from_config(settings.model, settings.blend)


def model_overrides(args: argparse.Namespace) -> dict:
    """The model settings a bench's --model (model.name), --device, --dtype and --weights ask for
    (those it has and was given)."""
    return {"name" if key == "model" else key: getattr(args, key) for key in ("model", "device", "dtype", "weights")
            if getattr(args, key, None) is not None}


def prompt_for(engine: BlendEngine, question: Question, sink: SinkMode, chunk_cache: dict) -> list[Segment]:
    """The question's prompt with every passage's KV precomputed behind `sink` (cached per sink);
    random token ids of the same lengths when the model has no tokenizer."""
    if sink not in chunk_cache and engine.tokenizer is None:
        chunk_cache[sink] = synthetic_prompt(engine, question, sink, seed=zlib.crc32(question.question.encode()))
    if sink not in chunk_cache:
        context = engine.sink_ids(sink)
        chunks = []
        for text in question.passages:
            ids = engine.tokenize(text)
            chunks.append(Segment(tuple(ids), engine.precompute(ids, context)))
        chunk_cache[sink] = engine.build_segments(question.question, chunks)
    return chunk_cache[sink]


def timed_prefill(engine: BlendEngine, segments, variant: Variant, extra: int) -> tuple[PrefillResult, float, int]:
    """Prefill in `variant.mode` under `variant.blend` and pick the first token: the time to first token
    (ms), and that token."""
    t0 = time.perf_counter()
    result = engine.prefill(segments, variant.mode, variant.blend, max_new_tokens=extra)
    first = int(result.logits.argmax())
    if result.logits.device.type == "cuda":
        torch.cuda.synchronize()
    return result, (time.perf_counter() - t0) * 1000, first


def greedy_ids(engine: BlendEngine, result: PrefillResult, max_tokens: int) -> list[int]:
    decoder = engine.decoder(result)
    ids, logits = [], result.logits
    for _ in range(max_tokens):
        token = int(logits.argmax())
        if token in engine.eos_ids:
            break
        ids.append(token)
        logits = decoder.step(token)
    return ids


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


def parse_spec(base: BlendConfig, spec: str) -> dict:
    """A `--variant` spec's BlendConfig fields over `base`: "FIELD=VALUE ..." (`none` -> None, a tuple's
    items comma-separated); ValueError naming a bad item (the engine and kv benches' `--variant`)."""
    types = {f.name: str(f.type) for f in fields(BlendConfig)}
    names = set(types)
    changes = {}
    for item in spec.split():
        name, sep, text = item.partition("=")
        if not sep or name not in names:
            raise ValueError(f"bad variant item {item!r}: expected FIELD=VALUE with FIELD one of {sorted(names)}")
        current = getattr(base, name)
        if text.lower() == "none":
            changes[name] = None
        elif isinstance(current, tuple):
            changes[name] = tuple(int(x) for x in text.split(","))
        elif isinstance(current, Enum):
            changes[name] = type(current)(text)
        elif isinstance(current, bool):
            changes[name] = text.lower() in ("1", "true", "yes")
        elif isinstance(current, int) or types[name].startswith("int"):
            changes[name] = int(text)
        else:
            changes[name] = float(text)
    return changes
