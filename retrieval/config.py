"""Retrieval's frozen configs (the settings' `retrieval` and `database` sections): the one place their
defaults live."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import ConfigDict, Field, field_validator
from pydantic.dataclasses import dataclass

from configs.enums import ChunkingMode, EmbedderRuntime, IndexKind, RetrievalMode

_CONFIG = ConfigDict(extra="forbid", validate_default=True)


@dataclass(frozen=True, config=_CONFIG)
class RetrievalConfig:
    embedder: Annotated[str, Field(
        description="'all-minilm-l6-v2' (packaged) or a local model dir.")] = "all-minilm-l6-v2"
    embedder_runtime: Annotated[EmbedderRuntime, Field(
        description="What runs the embedder on the CPU: onnx (sentence-transformers' modules exported once to ONNX "
        "by a child process, under embedder_cache_dir, and run by ONNX Runtime: a question's embedding ~9.8 -> "
        "~6.0 ms p50 and ~15-17 -> ~8 ms p99 on 2 cores, and ~8 MB less resident than torch, sentence-transformers "
        "never imported) or torch (sentence-transformers' modules; docs/decisions/0024). The same vectors either "
        "way (within 1e-5); onnx falls back to torch, with a warning, where it cannot export or load.")] = (
        EmbedderRuntime.ONNX)
    embedder_cache_dir: Annotated[Path, Field(
        description="Where the onnx runtime's exports are kept (keyed by the embedder's files and the torch / "
        "transformers versions that exported it; shared by the servers of a machine, as model.cache_dir).")] = (
        Path("~/.cache/ragblend/embedder"))
    chunking: Annotated[ChunkingMode, Field(description="Default chunking of ingested documents: structure (the document's blocks, "
        "headings and pages), tokens (sentences) or none (one passage, one chunk).")] = ChunkingMode.STRUCTURE
    chunk_tokens: Annotated[int, Field(ge=16, le=4096, description="Target chunk size in LLM tokens (docs/decisions/0022).")] = 192
    chunk_overlap: Annotated[int, Field(ge=0, le=1024, description="Tokens shared by consecutive chunks.")] = 32
    index: Annotated[IndexKind, Field(description="flat (exact) or hnsw (approximate).")] = IndexKind.FLAT
    hnsw_m: Annotated[int, Field(ge=4, le=128, description="HNSW graph degree.")] = 32
    search_threads: Annotated[int, Field(
        ge=1, le=1024, description="FAISS's threads in one question's vector search (1: on 2 cores more woke "
        "beside torch's and cost ~10 ms at p99; docs/benchmarks/retrieval.md). More pays off only for a flat "
        "index far over 100 000 chunks on many cores.")] = 1
    top_k: Annotated[int, Field(ge=1, le=100, description="Default number of retrieved chunks.")] = 3
    mode: Annotated[RetrievalMode, Field(
        description="How chunks are ranked: dense (the embedder's cosine similarity) | lexical (the store's "
        "full-text index: SQLite FTS5, Postgres tsvector) | hybrid (both, fused by reciprocal rank); a request's "
        "`retrieval` field overrides it. Design: docs/design/retrieval.md.")] = RetrievalMode.HYBRID
    num_candidates: Annotated[int, Field(
        ge=1, le=1000, description="Hybrid: chunks each ranking (dense, lexical) offers the fusion (at least "
        "top_k).")] = 20
    rrf_k: Annotated[int, Field(
        ge=1, le=1000, description="Hybrid: the reciprocal rank fusion's constant k (a chunk scores the sum of "
        "1 / (k + its rank) over the rankings).")] = 60
    min_score: Annotated[float, Field(
        ge=-1.0, le=1.0, description="Relevance floor: when no retrieved chunk's cosine similarity to the question "
        "reaches this, nothing stored is relevant and the answer is not_found_answer, with no sources (the "
        "model is not asked). -1: off.")] = 0.35
    score_margin: Annotated[float, Field(
        ge=0.0, le=2.0, description="Relevance floor: retrieved chunks whose cosine similarity is more than this "
        "below the best one's are left out of the prompt. 2: off.")] = 0.15
    refuse_unmentioned_names: Annotated[bool, Field(
        description="When the question names something (a word with a digit among its letters, two capitals or "
        "more, or joined by . _ - / or =: 'bzip2', 'CUPS', 'core.autocrlf') that no chunk of the searched "
        "collections mentions, the answer is not_found_answer with a "
        "warning naming it, and the model is not asked (a small model answers a question next to the documents "
        "with a fact it makes up: docs/benchmarks/answers.md). Named chunks (chunk_ids) are never refused.")] = True
    flag_unmatched_words: Annotated[bool, Field(
        description="When a word of the question (stop words left out, stemmed as the lexical index reads it) is in "
        "no chunk of the searched collections, the response lists it in `unmatched_words` with a warning naming "
        "it: the documents may not cover what was asked ('Brotli' over documents that never use the word). The "
        "question is answered as usual, not refused: a question's wording need not be the documents' "
        "(docs/decisions/0028). Named chunks (chunk_ids) are not checked.")] = True
    flag_unsupported_terms: Annotated[bool, Field(
        description="An answer stating a number or a name (as refuse_unmentioned_names reads names) that none of "
        "its sources, the question or the chat's earlier messages contains gets a warning naming it, and lists it "
        "in `unsupported` (a small model answers a detail the documents are silent on with a value it makes up: "
        "docs/benchmarks/answers.md). The answer itself is kept.")] = True
    not_found_answer: Annotated[str, Field(
        min_length=1, description="The answer when nothing stored is relevant to the question (min_score, "
        "refuse_unmentioned_names).")] = (
        "I could not find this in the documents.")
    context_tokens: Annotated[int, Field(
        ge=0, description="Most tokens of retrieved chunks one prompt holds: the lowest-ranked chunks past it are "
        "left out (the best one is always kept). 0: as many as the model's context allows.")] = 0
    embed_batch_size: Annotated[int, Field(ge=1, le=1024, description="Sentences per embedding batch.")] = 32
    max_inline_kv_chars: Annotated[int, Field(
        ge=0, description="Documents up to this size get their chunks' KV precomputed before the ingest answers; "
        "larger ones are committed at once and their KV computed in the background, one chunk at a time between "
        "questions (kv_cached fills in).")] = 20_000

    @field_validator("embedder_cache_dir")
    @classmethod
    def _expand(cls, value: Path) -> Path:
        return value.expanduser()


@dataclass(frozen=True, config=_CONFIG)
class DatabaseConfig:
    """The Postgres document store that server replicas share (documents, chunks, embeddings)."""

    url: Annotated[str | None, Field(
        description="postgresql://user@host:5432/db of a document store shared by server replicas (documents, "
        "chunks, embeddings; each replica's vector index follows it); unset = SQLite under the data directory. "
        "Design: docs/design/server.md#replicas.")] = None
    max_connections: Annotated[int, Field(ge=1, description="Size bound of the Postgres connection pool.")] = 8
    timeout_s: Annotated[float, Field(
        gt=0, description="Seconds a call waits for a Postgres connection before answering 503 (server "
        "down).")] = 5.0
    poll_s: Annotated[float, Field(
        gt=0, description="How often a replica polls the shared store's change log when no NOTIFY arrives (the "
        "fallback; a NOTIFY wakes it at once).")] = 1.0
