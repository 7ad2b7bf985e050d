"""The settings' enums (re-exported by `configs.settings` and `configs`)."""

from __future__ import annotations

from enum import Enum


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


class RepetitionScope(str, Enum):
    """The tokens a repetition penalty (CTRL / Hugging Face's) covers."""

    ANSWER = "answer"  # the tokens generated so far only: the documents' words stay free to be quoted
    PROMPT_AND_ANSWER = "prompt_and_answer"  # the prompt's tokens too (Hugging Face's and vLLM's behaviour)


class ChunkOrder(str, Enum):
    """Where a RAG prompt puts its chunks, which keep their numbers [1] (the best ranked), [2], ... either way."""

    BEST_FIRST = "best_first"  # [1] right after the prompt's prefix, the lowest ranked next to the question
    BEST_LAST = "best_last"  # the lowest ranked first, [1] next to the question


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

    AUTO = "auto"  # CPU: a GGUF file's as stored (gguf); a model directory's int4 where the shapes fit, else int8
    # (measured: docs/decisions/0004). CUDA: as loaded
    FP32 = "fp32"  # as loaded, in model.dtype
    BF16 = "bf16"  # bf16 weights, bf16 activations at the matmul
    INT8 = "int8"  # int8 weight-only, per-output-channel scales
    INT4 = "int4"  # int4 weight-only, a scale and a zero per 32 inputs (CPU only)
    GGUF = "gguf"  # a GGUF file's layers each as stored: int4 for its 4-bit types, int8 for the rest (CPU only)


class DecodeCache(str, Enum):
    """What a decode step attends over once the prompt is in (blend_engine/decode.py)."""

    AUTO = "auto"  # int8 with quantized weights on CPU (bf16 where the head size does not fit), else model
    MODEL = "model"  # the prefill's own cache, in model.dtype (exact)
    BF16 = "bf16"  # a bf16 copy: half of fp32's bytes per step
    INT8 = "int8"  # keys and values int8 with a scale per token and KV head (CPU)


class AttentionDtype(str, Enum):
    """What a prefill's attention computes in (blend_engine/attention.py `resolve_attention_dtype`)."""

    AUTO = "auto"  # bf16 from 1 024 keys where the prefill's GEMMs already are (quantized weights, native bf16)
    MODEL = "model"  # the model's dtype (float32 on CPU)
    BFLOAT16 = "bfloat16"  # q, k and v cast to bf16 per call, the output cast back


class IndexKind(str, Enum):
    """FAISS index over normalised embeddings (inner product = cosine)."""

    FLAT = "flat"
    HNSW = "hnsw"


class RetrievalMode(str, Enum):
    """How chunks are ranked for a question (retrieval/retriever.py)."""

    DENSE = "dense"  # the embedder's cosine similarity (FAISS)
    LEXICAL = "lexical"  # the store's full-text index (SQLite FTS5 BM25, Postgres ts_rank_cd)
    HYBRID = "hybrid"  # both, fused by reciprocal rank


class EmbedderRuntime(str, Enum):
    """What runs the embedder's modules (retrieval/embedder.py)."""

    TORCH = "torch"  # sentence-transformers' modules in torch
    ONNX = "onnx"  # the same modules exported once to ONNX (torch.onnx), run by ONNX Runtime on the CPU


class ChunkingMode(str, Enum):
    TOKENS = "tokens"  # split by the LLM's tokens at sentence/paragraph boundaries
    STRUCTURE = "structure"  # the document's blocks kept whole, headings start chunks, never across pages
    NONE = "none"  # one passage = one chunk


class StorageDtype(str, Enum):
    """dtype KV caches are stored in (kv_store); fp32 keeps them bit-exact."""

    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    FLOAT32 = "float32"


class LoaderPriority(str, Enum):
    """CPU priority of the threads that read and decode stored KV beside the engine: a pipelined prefill's
    reader (kv_store/loader.py) and the prefetch at retrieval (kv_store/prefetch.py)."""

    AUTO = "auto"  # idle where the engine computes on the CPU (its threads take every core), else normal
    NORMAL = "normal"  # competes with the engine's threads for the cores
    IDLE = "idle"  # SCHED_IDLE: runs on cores the engine leaves free, and whenever the engine waits on it

    def is_idle_beside(self, engine_device_type: str) -> bool:
        """Whether the loader runs at idle priority beside an engine on a device of this type ("cpu", "cuda")."""
        if self is LoaderPriority.AUTO:
            return engine_device_type == "cpu"
        return self is LoaderPriority.IDLE


class KVQuantization(str, Enum):
    """Optional compression of the disk and Redis tiers' entries."""

    NONE = "none"
    INT8 = "int8"  # per-channel absmax int8 (scales kept in fp32)
    INT4 = "int4"  # keys 4 bits per channel over 32-token groups, values 3 bits per token, 8-bit scales, zstd (kv_store/lowbit.py)


class Tier(str, Enum):
    """The KV store's tiers, fastest first: the order reads go through (kv_store/)."""

    GPU = "gpu"  # chunk KV held on the engine's device (kv_store/device.py)
    MEMORY = "memory"
    DISK = "disk"
    REDIS = "redis"
