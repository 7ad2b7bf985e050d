"""`ragblend bench context-bound`: the model's right answers by which chunks its prompt holds (as retrieved,
the best alone, the chunk stating the answer alone, retrieved or not): what a better context could still
gain with this model (docs/benchmarks/answers.md#the-model-alone-ragblend-bench-context-bound)."""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

from app.commands.exit_codes import ExitCode
from app.query.protocol import GenerationOptions
from app.query.serving import build_rag_request
from app.rag.pipeline import relevant_chunks
from app.rag.types import RagRequest
from bench.harness.sets import DEFAULT_SET, SetQuestion, load_set
from bench.harness.output import emit_summary, refuse
from bench.answers.retrieval_quality import Chunking, build_retriever
from configs.enums import PrefillMode
from configs.settings import Settings
from retrieval.store_types import StoredChunk

ARRANGEMENTS = ("retrieved", "first", "answer", "stored")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--set", type=Path, default=DEFAULT_SET)
    parser.add_argument("--split", choices=["dev", "test", "all"], default="dev")
    parser.add_argument("--arrangements", default=",".join(ARRANGEMENTS), help=f"comma-separated: {ARRANGEMENTS}")
    parser.add_argument("--mode", choices=[PrefillMode.FULL.value, PrefillMode.BLEND.value], default="full",
                        help="full: the model reads every chunk (nothing reused); blend: each chunk's KV reused")
    parser.add_argument("--model", help="model.name (default: the server's, the embedded SmolLM2)")
    parser.add_argument("--limit", type=int, default=0, help="the first N in-scope questions only (0: all)")
    parser.add_argument("--out", type=Path)


@dataclass(frozen=True)
class Prompted:
    """One arrangement's chunks for a question; None: nothing to ask (retrieval refused the question, or no
    chunk of its document states the answer)."""

    arrangement: str
    chunks: tuple[StoredChunk, ...] | None


def stating(question: SetQuestion, chunks: Sequence[StoredChunk]) -> StoredChunk | None:
    """The first chunk whose text states the question's answer (SetQuestion.is_inside, chunk by chunk)."""
    return next((c for c in chunks if question.is_inside([c.text])), None)


def arranged(question: SetQuestion, retrieved: Sequence[StoredChunk] | None, stored: Sequence[StoredChunk],
             arrangements: Sequence[str]) -> list[Prompted]:
    """Each arrangement's chunks; `retrieved` None: retrieval refused the question."""
    out = []
    for name in arrangements:
        if name == "stored":
            holder = stating(question, stored)
            out.append(Prompted(name, (holder,) if holder else None))
        elif not retrieved:
            out.append(Prompted(name, None))
        elif name == "retrieved":
            out.append(Prompted(name, tuple(retrieved)))
        elif name == "first":
            out.append(Prompted(name, (retrieved[0],)))
        elif name == "answer":
            holder = stating(question, retrieved)
            out.append(Prompted(name, (holder,) if holder else tuple(retrieved)))
        else:
            raise ValueError(f"unknown arrangement {name!r} (one of {', '.join(ARRANGEMENTS)})")
    return out


class Answerer:
    """The engine in this process, prompting and decoding as the server does (its settings, resolved once)."""

    def __init__(self, settings: Settings, mode: PrefillMode):
        from blend_engine.engine import BlendEngine

        self.engine = BlendEngine.from_config(settings.model, settings.blend)
        self.blend = settings.blend
        self.mode = mode
        self._context = self.engine.sink_ids(settings.blend.sink)  # what ingestion precomputes a chunk behind

    def answer(self, request: RagRequest, chunks: Sequence[StoredChunk]) -> tuple[str, int]:
        """The answer's text and the prompt's length in tokens."""
        from blend_engine.types import Segment

        engine = self.engine
        segments = [Segment(c.token_ids, engine.precompute(c.token_ids, self._context)
                            if self.mode is PrefillMode.BLEND else None) for c in chunks]
        prompt = engine.build_segments(request.question, segments)
        result = engine.prefill(prompt, self.mode, self.blend, max_new_tokens=request.sampling.max_tokens)
        text = "".join(delta.text for delta in engine.generate(result, request.sampling))
        return text, sum(len(s.token_ids) for s in prompt)


def run_set(args: argparse.Namespace, arrangements: Sequence[str]) -> dict:
    qset = load_set(args.set)
    questions = [q for q in qset.split(args.split) if not q.is_out_of_scope]
    if args.limit:
        questions = questions[:args.limit]
    settings = Settings()
    if args.model:
        settings = settings.model_copy(update={"model": replace(settings.model, name=args.model)})
    config = settings.retrieval
    answerer = Answerer(settings, PrefillMode(args.mode))
    rows = []
    with tempfile.TemporaryDirectory(prefix="ragblend-context-bound-") as tmp:
        retriever = build_retriever(qset, Chunking(config.chunking, config.chunk_tokens), config.chunk_overlap,
                                    Path(tmp), None)
        try:
            for q in questions:
                document = retriever.store.get_document(q.document)
                stored = document.chunks if document is not None else []
                request = build_rag_request(settings, q.question, GenerationOptions())
                found = relevant_chunks(retriever, config, request)
                retrieved = [s.chunk for s in found.chunks] or None  # None: refused (nothing relevant, a name)
                row = {"question": q.id, "retrieved_chunks": [c.id for c in retrieved or []],
                       "inside": bool(retrieved) and bool(q.is_inside(c.text for c in retrieved)), "arrangements": {}}
                for prompted in arranged(q, retrieved, stored, arrangements):
                    if prompted.chunks is None:
                        row["arrangements"][prompted.arrangement] = {"answer": None, "right": False}
                        continue
                    t0 = time.perf_counter()
                    text, num_tokens = answerer.answer(request, prompted.chunks)
                    row["arrangements"][prompted.arrangement] = {
                        "answer": text, "right": q.is_right(text), "prompt_tokens": num_tokens,
                        "chunks": [c.id for c in prompted.chunks], "seconds": round(time.perf_counter() - t0, 3)}
                rows.append(row)
                print(f"{q.id}: " + ", ".join(f"{name} {'right' if a['right'] else '-'}"
                                              for name, a in row["arrangements"].items()), flush=True)
        finally:
            retriever.close()
    return {"set": str(args.set), "split": args.split, "num_questions": len(questions),
            "summary": summarize(rows, arrangements), "questions": rows}


def summarize(rows: Sequence[dict], arrangements: Sequence[str]) -> dict:
    """Per arrangement its right answers, its prompts' mean length and how many it asked; and the questions
    some arrangement answered right."""
    out = {}
    for name in arrangements:
        asked = [r["arrangements"][name] for r in rows if r["arrangements"][name]["answer"] is not None]
        out[name] = {"right": sum(r["arrangements"][name]["right"] for r in rows), "asked": len(asked),
                     "prompt_tokens_mean": (sum(a["prompt_tokens"] for a in asked) / len(asked)) if asked else None}
    out["right_in_any"] = sum(any(a["right"] for a in r["arrangements"].values()) for r in rows)
    out["inside"] = sum(r["inside"] for r in rows)
    return out


def run(args: argparse.Namespace) -> int:
    arrangements = [a.strip() for a in args.arrangements.split(",") if a.strip()]
    unknown = [a for a in arrangements if a not in ARRANGEMENTS]
    if unknown or not arrangements:
        return refuse("context-bound", f"unknown arrangement(s) {unknown} (one of {', '.join(ARRANGEMENTS)})",
                      ExitCode.USAGE)
    result = run_set(args, arrangements)
    summary, n = result["summary"], result["num_questions"]
    print(f"\n{result['set']} ({result['split']}): {n} questions in scope, the answer inside the retrieved text "
          f"{summary['inside']}; mode {args.mode}")
    print(f"{'arrangement':<12}{'right':>10}{'asked':>8}{'prompt tokens':>15}")
    for name in arrangements:
        s = summary[name]
        tokens = "-" if s["prompt_tokens_mean"] is None else f"{s['prompt_tokens_mean']:.0f}"
        print(f"{name:<12}{s['right']:>6}/{n:<3}{s['asked']:>8}{tokens:>15}")
    print(f"{'any of them':<12}{summary['right_in_any']:>6}/{n:<3}")
    emit_summary({"bench": "context-bound", "mode": args.mode, "arrangements": arrangements, **result}, args.out,
                 indent=2)
    return ExitCode.OK
