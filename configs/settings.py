"""Typed configuration: `configs/default.yaml` < an optional user YAML < `RAGBLEND_*` env vars < CLI flags.

Nested fields are reached from the environment with a double underscore, e.g.
`RAGBLEND_BLEND__RECOMPUTE_RATIO=0.3` or `RAGBLEND_SERVER__PORT=9000`.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

# the enums and the store section live in their own modules; imported here so that
# `from configs.settings import X` keeps working for every X
from configs.enums import (  # noqa: F401
    ChunkingMode,
    DecodeCache,
    DeviationKind,
    HeadReduce,
    IndexKind,
    KVQuantization,
    LoaderPriority,
    PrefillMode,
    RequestMode,
    ScoreCombine,
    SelectionKind,
    SinkMode,
    StorageDtype,
    WeightFormat,
)
from configs.store_settings import StoreSettings

DEFAULT_CONFIG = Path(str(files("configs").joinpath("default.yaml")))


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
    cpu_threads: int = Field(
        0, ge=0, le=1024,
        description="CPU threads of each engine job and decode step. 0: as many as the cores other processes "
        "left idle since the last look (at most torch's thread count), so the CLI's briefly spinning OpenMP "
        "threads never share a core (docs/decisions/0006); n: always n.",
    )
    decode_cache: DecodeCache = Field(
        DecodeCache.AUTO,
        description="What decode attends over: auto (int8 with quantized weights on CPU, else model) | "
        "model (the prefill's cache, exact) | bf16 (a bf16 copy) | int8 (keys and values int8 with a scale "
        "per token and head; CPU).",
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
        [0], min_length=1,
        description="Layers where tokens are selected (after them reused KV is read); several = gradual filtering. "
                    "A deviation ranking checks at layer 1 at least (its K/V deviation is zero at layer 0).",
    )
    filter_growth: float = Field(
        2.0, ge=1.0, description="With several check layers, each earlier check keeps this many times more tokens."
    )
    deviation: DeviationKind = Field(DeviationKind.VALUE, description="Select tokens by K or V deviation.")
    selection: SelectionKind = Field(
        SelectionKind.QUERY, description="How cached tokens are ranked for recompute (measured: docs/decisions/0002)."
    )
    chunk_start_tokens: int = Field(
        8, ge=0, le=256, description="chunk_start selections: each chunk's first tokens always recomputed."
    )
    probe_layer: int | None = Field(
        8, ge=1,
        description="Query selections: measure the question's attention at this deeper layer with a probe of the "
                    "fresh tokens over the reused cache (null: at the check layer).",
    )
    probe_span: int = Field(4, ge=1, description="The probe sums the attention over this many layers up to probe_layer.")
    query_heads: HeadReduce = Field(HeadReduce.SUM, description="Query selections: sum or max over heads.")
    query_tokens: int = Field(
        0, ge=0, description="Query selections: only the question's last tokens' attention counts (0: all)."
    )
    combine: ScoreCombine = Field(
        ScoreCombine.PRODUCT, description="query_deviation: attention mass x deviation, or the sum of their ranks."
    )
    adaptive_mass: float = Field(
        0.9, gt=0.0, le=1.0,
        description="recompute_ratio='adaptive': recompute the fewest top-ranked tokens holding this share of the score.",
    )
    adaptive_min_ratio: float = Field(0.05, ge=0.0, le=1.0, description="Lower bound of an adaptive ratio.")
    adaptive_max_ratio: float = Field(0.5, ge=0.0, le=1.0, description="Upper bound of an adaptive ratio.")
    guard_unselected_mass: float | None = Field(
        None, ge=0.0, le=1.0,
        description="Quality guard (off when null): a request leaving more of the score unselected is risky",
    )
    guard_ratio: float = Field(0.5, ge=0.0, le=1.0, description="The ratio a risky request is recomputed at.")
    reused_key_scale: float = Field(
        1.0, gt=0.0, le=2.0,
        description="Keys of reused chunks not computed at their place are multiplied by this after the last check "
                    "layer (an attention temperature; 1 = CacheBlend; calibrated: docs/benchmarks/key-scale.md).",
    )
    reused_attention_scale: float = Field(
        0.5, gt=0.0, le=4.0,
        description="The attention weight of every query on a reused token of such a chunk (not recomputed) is "
                    "multiplied by this after the last check layer, in prefill and decode (APE's scaling factor; "
                    "1 = none; calibrated: docs/decisions/0003).",
    )
    sink: SinkMode = Field(
        SinkMode.PREFIX, description="What a chunk is computed behind at precompute (measured: docs/decisions/0001)."
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
    max_queue: int = Field(16, ge=1, le=4096, description="Requests waiting for the engine (and, apart, writes waiting for the one in progress) beyond this answer 503.")
    retry_after_s: int = Field(2, ge=1, le=3600, description="Retry-After of a 503 when the queue is full.")
    max_running: int = Field(
        8, ge=1, le=256, description="Answers decoding together in one batch (1: one request at a time); beyond, "
        "requests wait in the queue (docs/design/server.md).",
    )
    max_running_kv_bytes: int = Field(
        4 << 30, ge=1 << 20, description="Bytes the running answers' KV caches may hold together; beyond, a request "
        "waits (one always runs, whatever its size).",
    )
    max_prefill_tokens: int = Field(
        4096, ge=1, description="Prompt tokens admitted per scheduler step (one prefill always is, whatever its size).",
    )
    prefill_chunk_tokens: int = Field(
        512, ge=16, description="A long prefill runs in parts, one per scheduler step, so running answers keep "
        "streaming between them: a full prefill longer than this in chunks of this many tokens; any other "
        "(blend, reuse, prefix) in groups of layers whose active tokens add up to this x the model's layers, "
        "the work of one such chunk (docs/design/server.md).",
    )
    max_decode_stall_ms: int = Field(
        0, ge=0, le=600_000, description="While prefills run, the running answers' decode step is put off "
        "until one of them would go longer than this without a token, so queued prefills (at most max_running) "
        "run back to back: fuller decode batches, for a running answer's pause of about this long. 0 (the "
        "default): the running answers decode after every step. Measured in docs/decisions/0016.",
    )
    background_every_steps: int = Field(
        8, ge=1, description="Background work (KV repair, backfill, an ingest's precompute) runs when nothing "
        "waits; while busy, once in this many busy steps, and never a second unit before a waiting request's "
        "first token (a question's TTFT grows by one chunk's precompute at most).",
    )
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
    shutdown_timeout_s: float = Field(
        10.0, gt=0.0, le=3600.0, description="On SIGTERM/SIGINT, requests in flight get this long to finish; then "
        "they are cancelled, the engine worker stops (a running ingest after its current document) and the stores "
        "close.",
    )
    allowed_hosts: list[str] | None = Field(
        None, description="Host header names the server answers (port ignored; '*': any); others get a 403 "
        "(DNS rebinding). Default (null): localhost, 127.0.0.1, ::1 and server.host; any name when server.host "
        "is a wildcard address (0.0.0.0, ::), where the API key guards.",
    )
    allowed_origins: list[str] = Field(
        [], description="Browser origins (scheme://host:port; '*': any) besides the server's own whose pages may "
        "send POST/PUT/PATCH/DELETE; a request with another Origin gets a 403 (drive-by writes).",
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
    max_history_messages: int = Field(
        200, ge=0, description="Most earlier messages in one chat request (422 above, before anything is tokenized)."
    )
    max_history_chars: int = Field(
        100_000, ge=0, description="Most characters in a chat request's earlier messages together (422 above, before "
        "anything is tokenized; SmolLM2's 8192-token context holds ~30 000; raise it for a longer-context model).",
    )
    max_chunk_ids: int = Field(32, ge=1, description="Longest chunk_ids list.")
    max_upload_bytes: int = Field(
        100_000_000, ge=1024, description="Largest request body of POST /v1/documents/files (413 above)."
    )
    max_unzipped_bytes: int = Field(
        200_000_000, ge=1024, description="A DOCX expanding past this is refused (zip bombs; 413)."
    )


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
