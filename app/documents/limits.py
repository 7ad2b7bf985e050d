"""Document limits against the KV store's bounds, and the nominal KV bytes per token.

With the collection's KV budget (`store.budgeted`, the default) no document is refused for its KV:
ingestion precomputes into free room only and the rest is computed when used (kv_store/admission.py).
Without it (`budgeted: false`), a document's chunk caches must fit the disk tier (or, without one,
memory): one whose KV is larger than that bound would evict itself while it is being stored, so
start-up refuses a limits.max_document_chars whose KV cannot fit (counting one token per character,
what hostile or unusual text reaches), and ingestion rejects, with the numbers, a document or batch
that cannot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence, TYPE_CHECKING

import anyio

from app.documents.protocol import IngestRequest
from app.errors import PayloadTooLargeError
from configs.enums import ChunkingMode, KVQuantization
from configs.settings import Settings
from kv_store.codec import storage_bytes_per_layer
from kv_store.keys import StorageFormat

if TYPE_CHECKING:
    from blend_engine.engine import BlendEngine


def _gb(num_bytes: float) -> str:
    return f"{num_bytes / 1e9:.1f} GB"


@dataclass(frozen=True)
class KVBudget:
    bytes_per_token: int  # K and V of every layer, in the bounding tier's storage format
    capacity_bytes: int
    setting: str  # the bound: store.max_disk_bytes or store.max_memory_bytes
    tokenize: Callable[[str], Sequence[int]]
    settings: Settings

    @classmethod
    def of(cls, settings: Settings, engine: BlendEngine) -> KVBudget | None:
        """The bound a document's KV must fit in; None when none is known (e.g. Redis holds it) or
        the collection's KV budget takes documents of any size."""
        store, tiers = settings.store, set(settings.store.write_tiers)
        if store.budgeted:
            return None
        if store.disk_enabled and "disk" in tiers and store.max_disk_bytes > 0:
            capacity, setting, is_remote = store.max_disk_bytes, "store.max_disk_bytes", True
        elif store.redis_url and "redis" in tiers:
            return None  # Redis's own maxmemory bounds it, unknown here
        elif store.max_memory_bytes > 0 and "memory" in tiers:
            capacity, setting, is_remote = store.max_memory_bytes, "store.max_memory_bytes", False
        else:
            return None
        bytes_per_token = int(nominal_bytes_per_token(settings, engine, is_remote) + 0.999)
        return cls(bytes_per_token, capacity, setting, engine.tokenize, settings)

    def needed_bytes(self, num_tokens: int, chunking: ChunkingMode) -> int:
        """KV bytes of a document of `num_tokens`; chunking repeats the overlap tokens in each chunk (an upper
        bound for `structure`, which repeats them only where it cuts a block longer than a chunk)."""
        retrieval = self.settings.retrieval
        factor = 1.0
        if chunking is not ChunkingMode.NONE:
            factor = retrieval.chunk_tokens / max(retrieval.chunk_tokens - retrieval.chunk_overlap, 1)
        return int(num_tokens * factor) * self.bytes_per_token

    def check_settings(self) -> None:
        """Refuse a max document size whose KV cannot fit (at one token per character)."""
        max_chars = self.settings.limits.max_document_chars
        needed = self.needed_bytes(max_chars, self.settings.retrieval.chunking)
        if needed > self.capacity_bytes:
            fitting = self.capacity_bytes * max_chars // needed
            raise ValueError(
                f"limits.max_document_chars={max_chars} allows documents needing up to {_gb(needed)} of KV "
                f"({self.bytes_per_token} bytes per token, one token per character), over {self.setting}="
                f"{self.capacity_bytes} ({_gb(self.capacity_bytes)}): lower limits.max_document_chars to "
                f"{fitting} or less, or raise {self.setting}"
            )

    async def check_request(self, request: IngestRequest) -> None:
        """413 for a document (or batch) whose KV would not fit the store's bound."""
        if not request.precompute:
            return  # nothing is stored now; caches are made chunk by chunk as they are retrieved
        chunking = request.chunking or self.settings.retrieval.chunking
        # byte-level tokenizers make at most one token per UTF-8 byte: a cheap bound first
        upper = [len(doc.text.encode("utf-8", "surrogatepass")) for doc in request.documents]
        if self.needed_bytes(sum(upper), chunking) <= self.capacity_bytes:
            return
        counts = await anyio.to_thread.run_sync(lambda: [len(self.tokenize(d.text)) for d in request.documents])
        for doc, num_tokens in zip(request.documents, counts):
            self._check(f"document {doc.id or '(new)'} has {num_tokens} tokens", num_tokens, chunking)
        self._check(f"the {len(counts)} documents have {sum(counts)} tokens", sum(counts), chunking)

    def _check(self, what: str, num_tokens: int, chunking: ChunkingMode) -> None:
        needed = self.needed_bytes(num_tokens, chunking)
        if needed > self.capacity_bytes:
            raise PayloadTooLargeError(
                f"{what}: their KV needs {_gb(needed)} ({self.bytes_per_token} bytes per token), over the "
                f"store's bound {self.setting}={self.capacity_bytes} ({_gb(self.capacity_bytes)}); split the "
                f"document, ingest with precompute=false, or raise the bound"
            )


def nominal_bytes_per_token(settings: Settings, engine: BlendEngine, is_remote: bool = True) -> float:
    """KV bytes per token in the disk/Redis format (`is_remote`) or the memory tier's, before any
    entry is measured: a low-bit format's bound before zstd (its entries are smaller)."""
    store = settings.store
    quantization = store.quantization if is_remote else KVQuantization.NONE
    fmt = StorageFormat(store.dtype, quantization)
    num_tokens = 1024  # per-group scales spread over a typical chunk
    per_layer = storage_bytes_per_layer(engine.num_kv_heads, num_tokens, engine.head_dim, fmt)
    return engine.num_layers * per_layer / num_tokens


def check_document_limit(settings: Settings, engine: BlendEngine) -> None:
    """Start-up: ValueError when limits.max_document_chars cannot fit the store's bound."""
    budget = KVBudget.of(settings, engine)
    if budget is not None:
        budget.check_settings()
