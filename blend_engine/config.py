"""The engine's frozen configs: the model, how blend fuses reused KV, the answer defaults.

Each is the one place its defaults, bounds and meaning live: the server's settings (`configs.settings`)
compose these classes as their `model`, `blend` and `generation` sections, and the engine, the executor,
the benchmarks and the tests construct the same classes. They are pydantic dataclasses, so a value is
validated however it arrives (YAML, env, a constructor, `dataclasses.replace`). No torch here: the
settings import this module without loading the model's libraries.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Annotated, Literal

from pydantic import ConfigDict, Field, field_validator
from pydantic.dataclasses import dataclass

from configs.enums import (
    AttentionDtype,
    ChunkOrder,
    DecodeCache,
    DeviationKind,
    HeadReduce,
    RepetitionScope,
    RequestMode,
    ScoreCombine,
    SelectionKind,
    SinkMode,
    WeightFormat,
)

# frozen, unknown keys refused (a YAML typo is an error at start-up), defaults validated like values
CONFIG = ConfigDict(extra="forbid", validate_default=True)


@dataclass(frozen=True, config=CONFIG)
class ModelConfig:
    """Which model runs, where and how (the `model` section)."""

    name: Annotated[str, Field(
        description="A catalogue model (`ragblend models list`: smollm2, the embedded SmolLM2-135M-Instruct; "
        "qwen2.5-coder-0.5b; qwen2.5-coder-1.5b; installed by `ragblend models install NAME`), a .gguf file (llama, "
        "qwen2, qwen3; read natively: docs/choosing-a-model.md), a local HF model directory, or 'random:<shape>' "
        "(random weights of a real architecture, e.g. random:llama-7b). The default answers the most right within "
        "a 1.5 s TTFT on 2 cores (docs/decisions/0030).")] = "qwen2.5-coder-1.5b"
    device: Annotated[Literal["auto", "cpu", "cuda"], Field(description="auto: CUDA when present, else CPU.")] = "auto"
    dtype: Annotated[Literal["auto", "float32", "bfloat16", "float16"], Field(
        description="auto: float32 on CPU, bfloat16 on CUDA.")] = "auto"
    weights: Annotated[WeightFormat, Field(
        description="Linear layers' weights: auto (CPU: a GGUF's each as stored, i.e. gguf; a model directory's "
        "int4, int8 where a shape does not fit int4) | fp32 (as loaded; a GGUF's dequantized) | bf16 | int8 | int4 (CPU) "
        "| gguf (a GGUF's 4-bit types level for level in int4, the others in int8; CPU).")] = WeightFormat.AUTO
    gemm_dtype: Annotated[Literal["auto", "float32", "bfloat16"], Field(
        description="CPU, quantized weights: what prefill multiplies their dequantized copy in. auto: bfloat16 where "
        "bf16 GEMMs measured clearly faster than fp32 ones on this CPU (once per machine, kept in cache_dir: "
        "blend_engine/cpu_gemm.py), else float32 (the bf16 copy widened per call into a per-thread scratch: fp32's "
        "speed at bf16's memory; 1.3-1.4x faster prefills where bf16 GEMMs are slow, docs/decisions/0025). auto "
        "attention follows it.")] = "auto"
    decode_kernel: Annotated[Literal["auto", "torch"], Field(
        description="CPU, int4 and int8 weights: what multiplies decode's few rows, what attends over the int8 "
        "decode cache, and what computes fp32 RMSNorms. auto: ragblend's kernels (int8 activations, integer dot "
        "products; the attention, its K/V write and RMSNorm rounding as torch's do, bit for bit on AVX2; built once "
        "per machine by the C++ compiler, ~45 s, x86-64 with AVX2: blend_engine/native.py), torch's where they "
        "cannot be built; torch: torch's always (docs/decisions/0033-0036).")] = "auto"
    cpu_threads: Annotated[int, Field(
        ge=0, le=1024,
        description="CPU threads of each engine job and decode step. 0: as many as the cores other processes "
        "left idle since the last look (at most torch's thread count), so the CLI's briefly spinning OpenMP "
        "threads never share a core (docs/decisions/0006); n: always n.")] = 0
    decode_cache: Annotated[DecodeCache, Field(
        description="What decode attends over: auto (int8 with quantized weights on CPU, else model) | "
        "model (the prefill's cache, exact) | bf16 (a bf16 copy) | int8 (keys and values int8 with a scale "
        "per token and head; CPU).")] = DecodeCache.AUTO
    attention_dtype: Annotated[AttentionDtype, Field(
        description="What a prefill's attention computes in (chunks' KV at ingestion, full, blend and reuse "
        "prefills; decode is unchanged): auto (bfloat16 for a prompt of 1 024 tokens or more where the prefill's "
        "GEMMs already run in bf16 (gemm_dtype): quantized weights on a CPU where bf16 GEMMs are the faster; else "
        "model) | "
        "model (the model's dtype: float32 on CPU) | bfloat16 (q, k and v cast per call, whatever the length). "
        "Measured through the server on a 2-core Xeon with AMX: blend's prefill 1.46-1.50x and full's 1.41-1.48x "
        "faster at ~3 060 tokens, no faster under ~700; blend's KL unchanged (docs/decisions/0023). Part of the KV's "
        "identity: stored chunks are re-keyed at start-up when it changes.")] = AttentionDtype.AUTO
    prefill_graphs: Annotated[bool, Field(
        description="CUDA: a prefill's layers past blend's last check layer (every layer in reuse, prefix and full "
        "modes) run their linear parts as CUDA graphs captured per token-count bucket, the K/V writes and the "
        "attention eagerly (docs/benchmarks/gpu.md); false: every layer eagerly. No effect on CPU.")] = True
    cache_dir: Annotated[Path, Field(
        description="Where catalogue models are installed; where a GGUF model's config, tokenizer and packed weights "
        "are kept for warm starts (read from the file once); and this machine's measured bf16 and fp32 GEMM speeds "
        "(cpu-gemm.json: gemm_dtype auto).")] = (
        Path("~/.cache/ragblend/models"))
    system_prompt: Annotated[str, Field(description="System message of every RAG prompt.")] = (
        "You are a helpful assistant. Answer the question using the documents.")
    tokenizer: Annotated[Path | None, Field(
        description="random:<shape> models only: a local tokenizer directory (tokenizer.json, tokenizer_config.json, "
        "a chat template) the model reads its prompts with, its vocabulary grown to cover it (e.g. on a GPU host "
        "without the embedded model's package: docs/benchmarks/gpu.md). Null: the embedded SmolLM2's where its "
        "package is installed, else none (callers feed token ids).")] = None
    answer_instruction: Annotated[str, Field(
        max_length=1000,
        description="The line after the question in every RAG prompt (the documents before it are numbered [1], "
        "[2], ...: an answer citing them so is mapped to its sources). Measured on SmolLM2-135M: "
        "docs/decisions/0021.")] = "Answer briefly and cite your source."
    chunk_order: Annotated[ChunkOrder, Field(
        description="Where a RAG prompt puts its chunks: best_last (the best ranked next to the question) or "
        "best_first; each keeps its number, [1] being the best ranked (docs/decisions/0021).")] = ChunkOrder.BEST_LAST

    @field_validator("cache_dir", "tokenizer")
    @classmethod
    def _expand(cls, value: Path | None) -> Path | None:
        return None if value is None else value.expanduser()

    def __post_init__(self) -> None:
        if self.tokenizer is not None and not self.name.startswith("random:"):
            raise ValueError("model.tokenizer is for random:<shape> models: a model directory or GGUF file carries its "
                             "own tokenizer")


@dataclass(frozen=True, config=CONFIG)
class BlendConfig:
    """How reused chunk KV is fused and which tokens blend recomputes (the `blend` section). Frozen:
    per request, `dataclasses.replace` it. The defaults are the server's, each measured (README,
    docs/decisions); `cacheblend()` is the paper's own configuration, which the engine's tests use."""

    mode: Annotated[RequestMode, Field(
        description="Default mode of a request: auto (the loading planner) or a prefill mode.")] = RequestMode.AUTO
    recompute_ratio: Annotated[float, Field(
        ge=0.0, le=1.0, description="Share of reused tokens recomputed in blend mode (from the last check layer "
        "on).")] = 0.15
    is_ratio_adaptive: Annotated[bool, Field(
        description="Recompute the fewest top-ranked tokens holding adaptive_mass of the ranking score, within "
        "[adaptive_min_ratio, adaptive_max_ratio], instead of recompute_ratio (a request's recompute_ratio "
        "'adaptive' sets it; docs/decisions/0010).")] = False
    check_layers: Annotated[tuple[int, ...], Field(
        min_length=1,
        description="Layers where tokens are selected (after them reused KV is read); several = gradual "
        "filtering. A deviation ranking checks at layer 1 at least (its K/V deviation is zero at layer 0).")] = (0,)
    filter_growth: Annotated[float, Field(
        ge=1.0, description="With several check layers, each earlier check keeps this many times more "
        "tokens.")] = 2.0
    deviation: Annotated[DeviationKind, Field(description="Select tokens by K or V deviation.")] = DeviationKind.VALUE
    selection: Annotated[SelectionKind, Field(
        description="How cached tokens are ranked for recompute (measured: docs/decisions/0002).")] = SelectionKind.QUERY
    chunk_start_tokens: Annotated[int, Field(
        ge=0, le=256, description="chunk_start selections: each chunk's first tokens always recomputed.")] = 8
    probe_layer: Annotated[int | None, Field(
        ge=1,
        description="Query selections: measure the question's attention at this deeper layer with a probe of the "
        "fresh tokens over the reused cache (null: at the check layer). 18 with probe_budget 0.3: a better ranking on "
        "long prompts, at a cost to their server TTFT (docs/decisions/0039).")] = 8
    probe_budget: Annotated[float | None, Field(
        gt=0.0, le=1.0,
        description="Query selections: the probe's layer passes of the prompt's fresh tokens may cost at most this "
        "share of the blend's own (every layer over the fresh and the recomputed tokens; a pass over few rows costs "
        "as much as over 128, the weights' read); where probe_layer would cost more (short prompts: few recomputed "
        "tokens) it probes at the deepest layer that fits. With probe_layer 18, 0.3 keeps a short prompt's probe at 8 "
        "and takes a 3k-token prompt's to 18 (docs/decisions/0039). Null: always at probe_layer.")] = None
    probe_span: Annotated[int, Field(
        ge=1, description="The probe sums the attention over this many layers up to probe_layer.")] = 4
    query_heads: Annotated[HeadReduce, Field(description="Query selections: sum or max over heads.")] = HeadReduce.SUM
    query_tokens: Annotated[int, Field(
        ge=0, description="Query selections: only the question's last tokens' attention counts (0: all).")] = 0
    combine: Annotated[ScoreCombine, Field(
        description="query_deviation: attention mass x deviation, or the sum of their ranks.")] = ScoreCombine.PRODUCT
    adaptive_mass: Annotated[float, Field(
        gt=0.0, le=1.0, description="An adaptive ratio recomputes the fewest top-ranked tokens holding this share "
        "of the score.")] = 0.9
    adaptive_min_ratio: Annotated[float, Field(ge=0.0, le=1.0, description="Lower bound of an adaptive ratio.")] = 0.05
    adaptive_max_ratio: Annotated[float, Field(ge=0.0, le=1.0, description="Upper bound of an adaptive ratio.")] = 0.5
    guard_unselected_mass: Annotated[float | None, Field(
        ge=0.0, le=1.0,
        description="Quality guard (off when null): a request leaving more of the score unselected is risky, "
        "and is recomputed at guard_ratio.")] = None
    guard_ratio: Annotated[float, Field(
        ge=0.0, le=1.0, description="The ratio a risky request is recomputed at.")] = 0.5
    reused_key_scale: Annotated[float, Field(
        gt=0.0, le=2.0,
        description="Keys of reused chunks not computed at their place are multiplied by this after the last check "
        "layer (an attention temperature; 1 = CacheBlend; calibrated: docs/benchmarks/key-scale.md).")] = 1.0
    reused_attention_scale: Annotated[float, Field(
        gt=0.0, le=4.0,
        description="The attention weight of every query on a reused token of such a chunk (not recomputed) is "
        "multiplied by this after the last check layer, in prefill and decode (APE's scaling factor; "
        "1 = none; calibrated: docs/decisions/0003).")] = 0.5
    sink: Annotated[SinkMode, Field(
        description="What a chunk is computed behind at precompute (measured: docs/decisions/0001).")] = SinkMode.PREFIX
    is_shift_measured: Annotated[bool, Field(
        description="Benchmarks: report each blend prefill's last-token attention shift at the first check "
        "(two one-query attentions more).")] = False
    selected_positions: Annotated[tuple[int, ...] | None, Field(
        description="Benchmarks: the cached positions to recompute, given instead of ranked (to compare two "
        "caches of the same chunks under one selection); null: ranked.")] = None

    def __post_init__(self) -> None:
        # the bounds of single fields are their Field()s'; these relate several
        if self.selected_positions is not None and any(p < 0 for p in self.selected_positions):
            raise ValueError("selected_positions must be >= 0")
        if self.adaptive_min_ratio > self.adaptive_max_ratio:
            raise ValueError("adaptive_min_ratio must be <= adaptive_max_ratio")
        if self.is_ratio_decided_at_check and len(self.check_layers) > 1:
            raise ValueError("an adaptive ratio or a quality guard needs exactly one check layer")
        if list(self.check_layers) != sorted(set(self.check_layers)) or self.check_layers[0] < 0:
            raise ValueError(f"check_layers must be >= 0 and strictly increasing, got {self.check_layers}")
        if self.probe_layer is not None and self.probe_layer <= self.check_layers[0]:
            raise ValueError(f"probe_layer must be after the first check layer {self.check_layers[0]}")

    @classmethod
    def cacheblend(cls, **changes: object) -> BlendConfig:
        """CacheBlend's own configuration (arXiv 2405.16444), with `changes`: tokens ranked by their value
        deviation at layer 1, no probe (one given probes where asked: no budget), no scaling of the reused KV.
        The engine's tests compare against it."""
        preset = cls(check_layers=(1,), selection=SelectionKind.DEVIATION, probe_layer=None, probe_span=1,
                     probe_budget=None, reused_attention_scale=1.0)
        return replace(preset, **changes) if changes else preset

    def fitted(self, num_layers: int) -> BlendConfig:
        """This config on a model of `num_layers` layers: a probe past the last layer probes at the last one
        (none where that is not after the first check); a deviation-ranked selection checks at layer 1 at
        least (at layer 0 a chunk's K/V do not depend on its context, so their deviation is zero)."""
        config = self
        if config.selection.is_deviation and config.first_check_layer == 0 and num_layers > 1:
            checks = tuple(sorted({max(1, layer) for layer in config.check_layers}))
            probe = config.probe_layer if config.probe_layer is None or config.probe_layer > 1 else None
            config = replace(config, check_layers=checks, probe_layer=probe)
        return config.probe_fitted(num_layers)

    def probe_fitted(self, num_layers: int) -> BlendConfig:
        """This config with a probe past the last of `num_layers` layers probing at the last one (none where
        that is not after the first check); what the engine's prefill does to any config it is given."""
        if self.probe_layer is None or self.probe_layer < num_layers:
            return self
        last = num_layers - 1
        return replace(self, probe_layer=last if last > self.first_check_layer else None)

    @property
    def first_check_layer(self) -> int:
        """Layers before it compute every token and read no reused KV (check_layers is never empty)."""
        return self.check_layers[0]

    @property
    def is_reuse_scaled(self) -> bool:
        """Whether the reused tokens' keys or attention are scaled (else CacheBlend's own reuse / blend)."""
        return self.reused_key_scale != 1.0 or self.reused_attention_scale != 1.0

    @property
    def is_ratio_decided_at_check(self) -> bool:
        """The kept count is read back at the check layer (one host read per request)."""
        return self.is_ratio_adaptive or self.guard_unselected_mass is not None

    def ratio_at_check(self, check_idx: int) -> float:
        """Share of reused tokens kept at the `check_idx`-th check layer."""
        num_after = len(self.check_layers) - 1 - check_idx
        return min(1.0, self.recompute_ratio * self.filter_growth**num_after)


@dataclass(frozen=True, config=CONFIG)
class GenerationConfig:
    """An answer's defaults where a request leaves them out (the `generation` section)."""

    max_tokens: Annotated[int, Field(ge=1, le=4096, description="Default answer length cap in tokens.")] = 128
    temperature: Annotated[float, Field(ge=0.0, le=2.0, description="0 = greedy.")] = 0.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0, description="Nucleus sampling mass.")] = 1.0
    stop: Annotated[tuple[str, ...], Field(
        max_length=8,
        description="Stop strings: the answer ends before the first of them (a request's own `stop` replaces "
        "these; [] for none). A blank line by default: the answer asked for is brief, and SmolLM2-135M's ran on "
        "past it in loops (docs/decisions/0021).")] = ("\n\n",)
    # repetition control, applied to each sequence's own logits before sampling (greedy included):
    # blend_engine/generate.py RepetitionControl; the defaults are measured (docs/decisions/0021)
    repetition_penalty: Annotated[float, Field(
        gt=0.0, le=2.0,
        description="CTRL's repetition penalty (Hugging Face's repetition_penalty): a token already seen in "
        "repetition_scope has a positive logit divided by it, a negative one multiplied (1: off; above 1 "
        "discourages repeats). End-of-sequence tokens are never penalized.")] = 1.0
    repetition_scope: Annotated[RepetitionScope, Field(
        description="The tokens repetition_penalty covers: answer (the tokens generated so far) or "
        "prompt_and_answer (the documents and question too, as Hugging Face and vLLM do).")] = (
        RepetitionScope.ANSWER)
    frequency_penalty: Annotated[float, Field(
        ge=-2.0, le=2.0,
        description="OpenAI's frequency_penalty: each token's logit is lowered by this times the number of times "
        "it was generated so far (0: off).")] = 0.0
    presence_penalty: Annotated[float, Field(
        ge=-2.0, le=2.0,
        description="OpenAI's presence_penalty: each token generated so far has its logit lowered by this, once "
        "(0: off).")] = 0.0
    no_repeat_ngram_size: Annotated[int, Field(
        ge=0, le=32,
        description="An n-gram of this many tokens is generated at most once in an answer (the answer's own "
        "n-grams only: the documents' may be quoted; 0: off). 6 ends loops within a line (docs/decisions/0021) "
        "and leaves numbers alone (a digit is a token: 4 would forbid 100000).")] = 6
