"""Typed configuration: `configs/default.yaml` < an optional user YAML < `RAGBLEND_*` env vars < CLI flags.

Nested fields are reached from the environment with a double underscore, e.g.
`RAGBLEND_BLEND__RECOMPUTE_RATIO=0.3` or `RAGBLEND_SERVER__PORT=9000`.
"""

from __future__ import annotations

from enum import Enum
from importlib.resources import files
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

DEFAULT_CONFIG = Path(str(files("configs").joinpath("default.yaml")))


class RequestMode(str, Enum):
    """A request's mode: `auto` (the loading planner picks full, blend, mixed or split per request), or a
    prefill mode the request insists on."""

    AUTO = "auto"
    FULL = "full"
    PREFIX = "prefix"
    REUSE = "reuse"
    BLEND = "blend"


class PrefillMode(str, Enum):
    """How a prompt's chunk caches are used (see blend_engine.engine)."""

    FULL = "full"  # no reuse: the baseline
    PREFIX = "prefix"  # reuse only caches that are an exact prefix of the prompt
    REUSE = "reuse"  # reuse every chunk cache, recompute nothing of them
    BLEND = "blend"  # CacheBlend: reuse, then recompute the most deviating tokens


class DeviationKind(str, Enum):
    """Which fresh-vs-reused difference selects the tokens to recompute."""

    KEY = "key"
    VALUE = "value"


class SelectionKind(str, Enum):
    """How blend mode ranks the cached tokens it recomputes (same budget: a ratio of reused tokens)."""

    DEVIATION = "deviation"  # CacheBlend: fresh-vs-reused K or V distance at the check layer
    CHUNK_START = "chunk_start"  # each chunk's first tokens always (EPIC's sink fix), the rest by deviation
    QUERY = "query"  # attention mass the question's tokens give each cached token at the check layer
    QUERY_DEVIATION = "query_deviation"  # that mass times the deviation
    QUERY_CHUNK_START = "query_chunk_start"  # each chunk's first tokens always, the rest by query mass

    @property
    def is_forcing_chunk_starts(self) -> bool:
        return self in (SelectionKind.CHUNK_START, SelectionKind.QUERY_CHUNK_START)

    @property
    def is_query(self) -> bool:
        return self in (SelectionKind.QUERY, SelectionKind.QUERY_DEVIATION, SelectionKind.QUERY_CHUNK_START)

    @property
    def is_deviation(self) -> bool:
        return self in (SelectionKind.DEVIATION, SelectionKind.CHUNK_START, SelectionKind.QUERY_DEVIATION)


class HeadReduce(str, Enum):
    """How query-aware selection combines the attention mass each head gives a cached token."""

    SUM = "sum"
    MAX = "max"  # a token one head relies on counts fully, however the others ignore it


class ScoreCombine(str, Enum):
    """How query_deviation combines the question's attention mass with the deviation."""

    PRODUCT = "product"
    RANK_SUM = "rank_sum"  # the sum of the two ranks: neither scale dominates


class SinkMode(str, Enum):
    """What a chunk is computed behind at precompute (its KV is dropped afterwards)."""

    NONE = "none"  # the chunk alone, from position 0
    BOS = "bos"  # behind the tokenizer's BOS token: an attention sink
    PREFIX = "prefix"  # behind the prompt prefix (chat header + system prompt)


class WeightFormat(str, Enum):
    """Format of the model's linear layers (blend_engine/weights.py); the rest keeps model.dtype."""

    AUTO = "auto"  # int4 on CPU where the shapes fit, else int8 (measured: README); as loaded on CUDA
    FP32 = "fp32"  # as loaded, in model.dtype
    BF16 = "bf16"  # bf16 weights, bf16 activations at the matmul
    INT8 = "int8"  # int8 weight-only, per-output-channel scales
    INT4 = "int4"  # int4 weight-only, a scale and a zero per 32 inputs (CPU only)


class ModelSettings(BaseModel):
    name: str = Field(
        "smollm2",
        description="'smollm2' (the embedded SmolLM2-135M-Instruct GGUF), a local HF model directory, "
        "a .gguf file, or 'random:<shape>' (random weights of a real architecture, e.g. random:llama-7b).",
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: CUDA when present, else CPU.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto: float32 on CPU, bfloat16 on CUDA."
    )
    weights: WeightFormat = Field(
        WeightFormat.AUTO, description="Linear layers' weights: auto (int4 on CPU, int8 where a shape does not fit int4) | fp32 (as loaded) | bf16 | int8 | int4 (CPU)."
    )
    cache_dir: Path = Field(
        Path("~/.cache/ragblend/models"),
        validate_default=True,  # so the default's "~" is expanded too
        description="Where a GGUF model's converted copy (safetensors + tokenizer) is kept for warm starts.",
    )
    system_prompt: str = Field(
        "You are a helpful assistant. Answer the question using the documents.",
        description="System message of every RAG prompt.",
    )

    @field_validator("cache_dir")
    @classmethod
    def _expand(cls, value: Path) -> Path:
        return value.expanduser()


class BlendSettings(BaseModel):
    mode: RequestMode = Field(
        RequestMode.AUTO, description="Default mode of a request: auto (the loading planner) or a prefill mode."
    )
    recompute_ratio: float = Field(
        0.15, ge=0.0, le=1.0, description="Share of reused tokens recomputed in blend mode."
    )
    check_layers: list[int] = Field(
        [1], min_length=1, description="Layers where deviating tokens are selected; several = gradual filtering."
    )
    filter_growth: float = Field(
        2.0, ge=1.0, description="With several check layers, each earlier check keeps this many times more tokens."
    )
    deviation: DeviationKind = Field(DeviationKind.VALUE, description="Select tokens by K or V deviation.")
    selection: SelectionKind = Field(
        SelectionKind.DEVIATION, description="How cached tokens are ranked for recompute (README: measured)."
    )
    chunk_start_tokens: int = Field(
        8, ge=0, le=256, description="chunk_start selections: each chunk's first tokens always recomputed."
    )
    probe_layer: int | None = Field(
        None, ge=1,
        description="Query selections: measure the question's attention at this deeper layer with a probe of the "
                    "fresh tokens over the reused cache (null: at the check layer).",
    )
    probe_span: int = Field(1, ge=1, description="The probe sums the attention over this many layers up to probe_layer.")
    query_heads: HeadReduce = Field(HeadReduce.SUM, description="Query selections: sum or max over heads.")
    query_tokens: int = Field(
        0, ge=0, description="Query selections: only the question's last tokens' attention counts (0: all)."
    )
    combine: ScoreCombine = Field(
        ScoreCombine.PRODUCT, description="query_deviation: attention mass x deviation, or the sum of their ranks."
    )
    adaptive_mass: float = Field(
        0.5, gt=0.0, le=1.0,
        description="recompute_ratio='adaptive': recompute the fewest top-ranked tokens holding this share of the score.",
    )
    adaptive_min_ratio: float = Field(0.05, ge=0.0, le=1.0, description="Lower bound of an adaptive ratio.")
    adaptive_max_ratio: float = Field(0.5, ge=0.0, le=1.0, description="Upper bound of an adaptive ratio.")
    guard_unselected_mass: float | None = Field(
        None, ge=0.0, le=1.0,
        description="Quality guard (off when null): a request leaving more of the score unselected is risky",
    )
    guard_ratio: float = Field(0.5, ge=0.0, le=1.0, description="The ratio a risky request is recomputed at.")
    sink: SinkMode = Field(
        SinkMode.PREFIX, description="What a chunk is computed behind at precompute (measured: README)."
    )

    @field_validator("check_layers")
    @classmethod
    def _sorted_unique(cls, value: list[int]) -> list[int]:
        if any(layer < 0 for layer in value):
            raise ValueError("check layers must be >= 0")
        if sorted(set(value)) != value:
            raise ValueError("check layers must be strictly increasing")
        return value


class GenerationSettings(BaseModel):
    max_tokens: int = Field(128, ge=1, le=4096, description="Default answer length cap in tokens.")
    temperature: float = Field(0.0, ge=0.0, le=2.0, description="0 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")


class IndexKind(str, Enum):
    """FAISS index over normalised embeddings (inner product = cosine)."""

    FLAT = "flat"
    HNSW = "hnsw"


class ChunkingMode(str, Enum):
    TOKENS = "tokens"  # split by the LLM's tokens at sentence/paragraph boundaries
    NONE = "none"  # one passage = one chunk


class RetrievalSettings(BaseModel):
    embedder: str = Field("all-minilm-l6-v2", description="'all-minilm-l6-v2' (packaged) or a local model dir.")
    chunking: ChunkingMode = Field(ChunkingMode.TOKENS, description="Default chunking of ingested documents.")
    chunk_tokens: int = Field(384, ge=16, le=4096, description="Target chunk size in LLM tokens.")
    chunk_overlap: int = Field(32, ge=0, le=1024, description="Tokens shared by consecutive chunks.")
    index: IndexKind = Field(IndexKind.FLAT, description="flat (exact) or hnsw (approximate).")
    hnsw_m: int = Field(32, ge=4, le=128, description="HNSW graph degree.")
    top_k: int = Field(5, ge=1, le=100, description="Default number of retrieved chunks.")
    embed_batch_size: int = Field(32, ge=1, le=1024, description="Sentences per embedding batch.")
    max_inline_kv_chars: int = Field(
        20_000, ge=0, description="Documents up to this size get their chunks' KV precomputed before the ingest "
        "answers; larger ones are committed at once and their KV computed in the background, one chunk at a "
        "time between questions (kv_cached fills in).",
    )


class ServerSettings(BaseModel):
    host: str = Field("127.0.0.1", description="Bind address of `ragblend serve`.")
    port: int = Field(8000, ge=0, le=65535, description="Port of `ragblend serve`.")
    api_key: str | None = Field(None, description="When set, every route but /healthz and /readyz needs Bearer KEY.")
    max_queue: int = Field(16, ge=1, le=4096, description="Engine jobs waiting beyond this answer 503.")
    retry_after_s: int = Field(2, ge=1, le=3600, description="Retry-After of a 503 when the queue is full.")
    model_id: str | None = Field(None, description="Model id shown by /v1/models (default: the engine's name).")
    allow_public_without_key: bool = Field(
        False, description="Let `ragblend serve` listen on a non-loopback host with no api_key (refused otherwise)."
    )
    header_timeout_s: float = Field(
        10.0, gt=0.0, le=3600.0, description="A connection whose request headers are not all in by then is closed."
    )
    body_timeout_s: float = Field(
        30.0, gt=0.0, le=3600.0, description="A request body not all in by then (from its first byte read) is a 408."
    )


class LimitsSettings(BaseModel):
    max_body_bytes: int = Field(8_000_000, ge=1024, description="Largest request body (413 above).")
    max_document_chars: int = Field(
        500_000, ge=1, description="Largest document text; its KV (one token per char) must fit the store bound."
    )
    max_documents_per_request: int = Field(64, ge=1, description="Documents in one POST /v1/documents.")
    max_top_k: int = Field(20, ge=1, le=1000, description="Largest top_k a request may ask.")
    max_tokens: int = Field(1024, ge=1, description="Largest max_tokens a request may ask.")
    max_question_chars: int = Field(4000, ge=1, description="Longest question / user message.")
    max_chunk_ids: int = Field(32, ge=1, description="Longest chunk_ids list.")
    max_upload_bytes: int = Field(
        100_000_000, ge=1024, description="Largest request body of POST /v1/documents/files (413 above)."
    )
    max_unzipped_bytes: int = Field(
        200_000_000, ge=1024, description="A DOCX expanding past this is refused (zip bombs; 413)."
    )


class StorageDtype(str, Enum):
    """dtype KV caches are stored in (kv_store); fp32 keeps them bit-exact."""

    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    FLOAT32 = "float32"


class KVQuantization(str, Enum):
    """Optional compression of the disk and Redis tiers' entries."""

    NONE = "none"
    INT8 = "int8"  # per-channel absmax int8 (scales kept in fp32)


class StoreSettings(BaseModel):
    max_gpu_bytes: int | None = Field(
        None, ge=0, description="GPU tier bound (LRU of chunk KV on the device, above the memory tier); null: "
        "gpu_memory_share of the free GPU memory at start-up where the model runs on CUDA, else off; 0 disables it.",
    )
    gpu_memory_share: float = Field(
        0.2, gt=0.0, lt=1.0, description="Share of the free GPU memory (after the model loaded) the GPU tier takes by default."
    )
    gpu_device: str = Field(
        "cuda", pattern=r"^(cuda(:[0-9]+)?|cpu)$",
        description="Device of the GPU tier: cuda or cuda:N; cpu for tests only, with an explicit max_gpu_bytes.",
    )
    max_memory_bytes: int = Field(2 << 30, ge=0, description="Memory tier bound (LRU); 0 disables it.")
    disk_enabled: bool = Field(True, description="Keep chunk caches on disk (survives restarts).")
    disk_dir: Path | None = Field(None, description="Disk tier directory; default <data_dir>/kv.")
    max_disk_bytes: int = Field(20 << 30, ge=0, description="Disk tier bound (LRU by last use).")
    redis_url: str | None = Field(None, description="redis://host:port/db of a shared tier; unset = no Redis.")
    redis_ttl_s: int = Field(7 * 86400, ge=1, description="Expiry of Redis entries.")
    dtype: StorageDtype = Field(StorageDtype.FLOAT16, description="dtype of stored KV.")
    quantization: KVQuantization = Field(KVQuantization.NONE, description="int8 for the disk/Redis tiers.")
    write_tiers: list[Literal["gpu", "memory", "disk", "redis"]] = Field(
        ["memory", "disk", "redis"], description="Tiers a new chunk cache is written to (when enabled); the GPU "
        "tier fills on reads by default (a chunk read from a slower tier is copied up).",
    )
    fsync: bool = Field(True, description="fsync disk entries before the atomic rename.")
    pipelined: bool = Field(True, description="Read layer i+1 while the engine computes layer i.")
    prefetch_depth: int = Field(2, ge=1, le=16, description="Layers read ahead of the engine when pipelined.")
    min_recompute_ratio: float = Field(
        0.15, ge=0.0, le=1.0, description="Quality floor of the loading planner's blend ratio (mode or ratio 'auto')."
    )
    max_recompute_ratio: float = Field(1.0, ge=0.0, le=1.0, description="Ceiling of the loading planner's blend ratio.")
    max_prefetch_bytes: int = Field(
        1 << 30, ge=0, description="Bytes of chunk KV copied up into the memory tier at once, started at "
        "retrieval so queue wait hides the load; 0 disables prefetching.",
    )
    planner_profile_tokens: list[int] = Field(
        [64, 256, 1024], min_length=1, description="Prompt lengths of the timed prefills the loading planner's "
        "cost model is fitted on at start-up (then refined by every answer).",
    )
    throttle_mbps: dict[Literal["memory", "disk", "redis"], float] = Field(
        {}, description="Tests and benchmarks: slow a tier down to this many MB/s (simulates a cold disk, a remote tier).",
    )

    @field_validator("throttle_mbps")
    @classmethod
    def _positive_throttles(cls, v: dict[str, float]) -> dict[str, float]:
        if any(mbps <= 0 for mbps in v.values()):
            raise ValueError(f"throttle_mbps values must be > 0, got {v}")
        return v

    @model_validator(mode="after")
    def _gpu_tier_on_cpu_is_explicit(self) -> StoreSettings:
        if self.gpu_device == "cpu" and self.max_gpu_bytes is None:
            raise ValueError("a GPU tier on gpu_device 'cpu' is for tests: give max_gpu_bytes explicitly")
        return self

    @field_validator("planner_profile_tokens")
    @classmethod
    def _positive_sizes(cls, v: list[int]) -> list[int]:
        if any(n < 1 for n in v):
            raise ValueError(f"planner_profile_tokens must be >= 1, got {v}")
        return v


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="RAGBLEND_",
        env_nested_delimiter="__",
        yaml_file=[DEFAULT_CONFIG],
        yaml_file_encoding="utf-8",
        extra="forbid",
    )

    data_dir: Path = Field(Path("./data"), description="Root of the server's persistent state.")
    model: ModelSettings = ModelSettings()
    blend: BlendSettings = BlendSettings()
    generation: GenerationSettings = GenerationSettings()
    store: StoreSettings = StoreSettings()
    retrieval: RetrievalSettings = RetrievalSettings()
    server: ServerSettings = ServerSettings()
    limits: LimitsSettings = LimitsSettings()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Earlier sources win: CLI flags (init) > environment > YAML files.
        return (init_settings, env_settings, YamlConfigSettingsSource(settings_cls, deep_merge=True))


def load_settings(config_file: Path | str | None = None, **overrides: Any) -> Settings:
    """Settings from the default YAML, then `config_file`, env vars and `overrides` (nested dicts)."""
    yaml_files = [DEFAULT_CONFIG]
    if config_file is not None:
        path = Path(config_file)
        if not path.is_file():
            raise FileNotFoundError(f"config file not found: {path}")
        yaml_files.append(path)

    class _FileSettings(Settings):
        model_config = SettingsConfigDict(**{**Settings.model_config, "yaml_file": yaml_files})

    return Settings.model_validate(_FileSettings(**overrides).model_dump())
