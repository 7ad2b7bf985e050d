"""`ragblend bench retrieval-quality`: retrieval alone on the answers set, no LLM, per chunking, ranking, top_k
and relevance floor: inside, source first, prompt tokens, refusals; seconds per configuration, so the grid
can be wide (docs/benchmarks/retrieval.md#quality-ragblend-bench-retrieval-quality)."""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from app.commands.exit_codes import ExitCode
from bench.harness.sets import DEFAULT_SET, QuestionSet, SetQuestion, load_set
from bench.harness.output import emit_summary, fmt, refuse, table
from bench.harness.postgres import empty_store
from configs.enums import ChunkingMode, RetrievalMode


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--set", type=Path, default=DEFAULT_SET)
    parser.add_argument("--split", choices=["dev", "test", "all"], default="dev")
    parser.add_argument("--chunking", default="tokens:384,structure:128,structure:192,structure:256,structure:384",
                        help="comma-separated MODE:TOKENS (tokens|structure|none)")
    parser.add_argument("--overlap", type=int, default=32, help="retrieval.chunk_overlap")
    parser.add_argument("--modes", default="dense,lexical,hybrid")
    parser.add_argument("--top-k", default="1,2,3,4,5,8")
    parser.add_argument("--num-candidates", type=int, default=20)
    parser.add_argument("--rrf-k", type=int, default=60)
    parser.add_argument("--floors", default="",
                        help="comma-separated MIN_SCORE:MARGIN relevance floors to score (e.g. 0.25:0.15)")
    parser.add_argument("--database-url", help="a Postgres document store instead of SQLite (an empty database)")
    parser.add_argument("--out", type=Path)


@dataclass(frozen=True)
class Chunking:
    mode: ChunkingMode
    tokens: int

    @property
    def name(self) -> str:
        return f"{self.mode.value}:{self.tokens}"


def parse_chunkings(text: str) -> list[Chunking]:
    out = []
    for item in text.split(","):
        mode, _, tokens = item.strip().partition(":")
        out.append(Chunking(ChunkingMode(mode), int(tokens or 384)))
    return out


def build_retriever(qset: QuestionSet, chunking: Chunking, overlap: int, data_dir: Path, database_url: str | None):
    """A retriever over the set's documents chunked as the server would (no KV); in Postgres at `database_url`,
    emptied first (one configuration at a time in the database)."""
    import numpy as np

    from app.documents.writes import MARKDOWN_FORMATS
    from app.extract import ExtractionLimits, extract_file
    from app.config import LimitsConfig
    from blend_engine.loader import _embedded_tokenizer
    from blend_engine.prompt import encode_text
    from blend_engine.config import ModelConfig
    from retrieval.chunker import Chunker
    from retrieval.config import RetrievalConfig
    from retrieval.retriever import Retriever
    from retrieval.store_types import NewChunk

    tokenizer = _embedded_tokenizer(ModelConfig().cache_dir)
    chunker = Chunker(lambda text: list(encode_text(tokenizer, text)), tokenizer.decode, chunking.tokens,
                      min(overlap, chunking.tokens - 1))
    retriever = Retriever.open(data_dir, RetrievalConfig(), empty_store(database_url))
    for doc in qset.documents:
        (extracted,) = extract_file(doc.path.name, doc.path.read_bytes(), ExtractionLimits.of(LimitsConfig()), doc.id)
        chunks = chunker.split(extracted.text, chunking.mode, is_markdown=extracted.file_format.value in MARKDOWN_FORMATS)
        vectors = retriever.embedder.encode([c.text for c in chunks])
        result = retriever.store.put_document(doc.id, extracted.title, extracted.metadata, len(extracted.text),
                                              [NewChunk(c.text, c.token_ids, v) for c, v in zip(chunks, vectors)])
        retriever.follow(result.replaced, result.document.chunks, list(np.asarray(vectors)))
    return retriever


def evaluate(retriever, questions: Sequence[SetQuestion], modes: Sequence[RetrievalMode], top_ks: Sequence[int],
             floors: Sequence[tuple[float, float]], num_candidates: int, rrf_k: int) -> list[dict[str, Any]]:
    from retrieval.retriever import RelevanceFloor
    from retrieval.store_types import DEFAULT_COLLECTION

    rows = []
    for mode in modes:
        for top_k in top_ks:
            for floor in [None, *floors]:
                inside = top = tokens = refused = oos_refused = 0
                missed: list[str] = []  # in-scope questions whose answer is in no retrieved chunk
                best_scores: list[tuple[bool, float]] = []
                in_scope = [q for q in questions if not q.is_out_of_scope]
                oos = [q for q in questions if q.is_out_of_scope]
                for q in questions:
                    scored = retriever.search(q.question, top_k, (DEFAULT_COLLECTION,), mode, num_candidates, rrf_k)
                    best_scores.append((q.is_out_of_scope, max((s.score for s in scored), default=-1.0)))
                    if floor is not None:
                        scored = RelevanceFloor(*floor).apply(scored)
                    if q.is_out_of_scope:
                        oos_refused += not scored
                        continue
                    refused += not scored
                    is_inside = bool(q.is_inside(s.chunk.text for s in scored))
                    inside += is_inside
                    if not is_inside:
                        missed.append(q.id)
                    top += bool(scored) and scored[0].chunk.document_id == q.document
                    tokens += sum(s.chunk.num_tokens for s in scored)
                rows.append({"mode": mode.value, "top_k": top_k, "floor": list(floor) if floor else None,
                             "inside": inside, "source_top": top, "num_questions": len(in_scope),
                             "prompt_chunk_tokens_mean": tokens / max(len(in_scope), 1), "refused": refused,
                             "oos_refused": oos_refused, "num_out_of_scope": len(oos), "missed": missed,
                             "best_scores_in_scope": sorted(round(s, 3) for o, s in best_scores if not o),
                             "best_scores_out_of_scope": sorted(round(s, 3) for o, s in best_scores if o)})
    return rows


def unmentioned_names(retriever, questions: Sequence[SetQuestion]) -> dict[str, dict[str, list[str]]]:
    """The questions retrieval.refuse_unmentioned_names refuses (whatever the ranking, top k or floor), in
    scope (wrongly) and out of scope (rightly): question id -> the names no chunk mentions."""
    from retrieval.store_types import DEFAULT_COLLECTION

    out: dict[str, dict[str, list[str]]] = {"in_scope": {}, "out_of_scope": {}}
    for q in questions:
        names = retriever.question_words(q.question, (DEFAULT_COLLECTION,), words=False).unmentioned_names
        if names:
            out["out_of_scope" if q.is_out_of_scope else "in_scope"][q.id] = list(names)
    return out


def run(args: argparse.Namespace) -> int:
    try:
        qset = load_set(args.set)
        chunkings = parse_chunkings(args.chunking)
        modes = [RetrievalMode(m.strip()) for m in args.modes.split(",")]
        top_ks = [int(k) for k in args.top_k.split(",")]
        floors = [tuple(float(x) for x in f.split(":")) for f in args.floors.split(",") if f.strip()]
    except ValueError as exc:
        return refuse("retrieval-quality", exc, ExitCode.USAGE)
    questions = qset.split(args.split)
    results = {}
    for chunking in chunkings:
        with tempfile.TemporaryDirectory(prefix="ragblend-retrieval-quality-") as tmp:
            retriever = build_retriever(qset, chunking, args.overlap, Path(tmp), args.database_url)
            try:
                num_chunks = retriever.store.num_chunks()
                rows = evaluate(retriever, questions, modes, top_ks, floors, args.num_candidates, args.rrf_k)
                unmentioned = unmentioned_names(retriever, questions)
            finally:
                retriever.close()
        results[chunking.name] = {"num_chunks": num_chunks, "rows": rows, "unmentioned_names": unmentioned}
        print(f"\n{chunking.name}: {num_chunks} chunks; {len(questions)} questions ({args.split})")
        for kind, found in unmentioned.items():
            print(f"  names no chunk mentions, {kind}: {len(found)} refused"
                  + "".join(f"; {qid}: {', '.join(names)}" for qid, names in found.items()))
        print(table(["mode", "top_k", "floor", "inside", "top src", "tokens", "refused", "oos ok"], (
            [row["mode"], row["top_k"], "-" if row["floor"] is None else f"{row['floor'][0]:g}:{row['floor'][1]:g}",
             f"{row['inside']}/{row['num_questions']}", f"{row['source_top']}/{row['num_questions']}",
             fmt(row["prompt_chunk_tokens_mean"], 0), row["refused"], f"{row['oos_refused']}/{row['num_out_of_scope']}"]
            for row in rows)))
    emit_summary({"bench": "retrieval-quality", "split": args.split, "set": str(args.set),
                  "num_candidates": args.num_candidates, "rrf_k": args.rrf_k, "overlap": args.overlap,
                  "store": "postgres" if args.database_url else "sqlite", "results": results}, args.out, indent=2)
    return ExitCode.OK
