"""The `ragblend` console script. Each subcommand lives in its own module, imported only when run,
so `ragblend --help` stays fast and no model is loaded at import time."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# OpenMP threads spin 10 000 turns before they sleep: decode and the reused
# prefill modes are thousands of small parallel regions, each far shorter than a sleeping thread's
# wake-up, and libgomp's default (300 000 turns) keeps cores busy long after the work. Read when torch
# loads, so set before any subcommand imports it; an environment that sets either variable wins.
# Measured on 2 cores (docs/decisions/0006): int8 decode 20.9 ms/token vs 34.4 with passive waits (one thread; two
# were slower still), reuse TTFT 194 vs 379 ms. Spinning threads must not share a core with another
# busy process, which is what the engine's thread governor (blend_engine/threads.py) sees to, nor
# outnumber the CPUs across threads' OpenMP pools (then libgomp cuts spins to 100 turns): the server
# runs torch wide on its engine worker only (`single_threaded_default`).
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")

# oneDNN (a prefill's bf16 GEMMs) keeps each GEMM shape's compiled primitive, and torch's ideep layer a
# cache of its own beside it: 1024 entries each by default, about 0.55 MB a shape for the two. Prompt
# lengths differ from question to question, so a long-running server filled both (~560 MB) with shapes
# it never met again, while a prefill reuses only its own (four projections per distinct row count,
# up to a dozen) across its layers. 16 keeps a prefill's and an interleaved precompute's
# (docs/benchmarks/memory.md). 0 crashes ideep.
for _name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
    os.environ.setdefault(_name, "16")

# subcommand path -> (module, help). The module defines add_arguments(parser) and run(args) -> int. The
# benches are bench/<group>/<module>: `ragblend bench --help` lists them by group (bench.GROUPS).
COMMANDS: dict[tuple[str, ...], tuple[str, str]] = {
    ("serve",): ("app.commands.serve", "run the RAG server"),
    ("ingest",): ("app.commands.ingest", "ingest files into a running server (--collection: into a knowledge base)"),
    ("ask",): ("app.commands.ask", "ask a running server a question, streaming the answer"),
    ("store", "copy"): ("app.commands.store_copy", "copy a data directory's SQLite documents into Postgres"),
    ("collections",): ("app.commands.collections", "create, list or delete knowledge bases on a running server"),
    ("keys",): ("app.commands.keys", "create, list or revoke scoped API keys on a running server"),
    ("models",): ("app.commands.models", "list the models ragblend knows, or install one (downloaded, hash-checked)"),
    ("bench", "engine"): ("bench.engine.prefill", "engine benchmark: TTFT and fidelity per prefill mode"),
    ("bench", "batch-decode"): ("bench.engine.batch_decode", "one decode step for B sequences at once against B "
                                "single steps (eager, and CUDA-graphed buckets on a GPU)"),
    ("bench", "llamacpp"): ("bench.engine.llamacpp", "each model on one GGUF file beside llama.cpp: first load and "
                            "warm start, TTFT (llama.cpp full; ragblend full, blend, reuse), decode tok/s, RSS"),
    ("bench", "kv"): ("bench.store.kv", "KV store benchmark: blend TTFT per tier, pipelined, and as the loading planner plans it"),
    ("bench", "server"): ("bench.serving.server", "concurrent streaming clients against servers, side by side with a "
                          "one-sequence-at-a-time baseline: TTFT, inter-token latency, aggregate tok/s"),
    ("bench", "compare"): ("bench.serving.compare", "this checkout's server against a git revision's, side by side: "
                           "TTFT asked again and first ask, decode tok/s, concurrent clients; ratios"),
    ("bench", "server-modes"): ("bench.serving.modes", "end-to-end TTFT and fidelity per prefill mode against a "
                                "running server"),
    ("bench", "retrieval"): ("bench.serving.retrieval", "retrieval latency per ranking mode (dense, lexical, hybrid) "
                             "and store (SQLite, Postgres) at a given number of chunks: p50/p99"),
    ("bench", "memory"): ("bench.serving.memory", "where a server's memory goes: RSS stage by stage through start-up, "
                          "and a live server's, idle after start-up and after a run of questions"),
    ("bench", "answers"): ("bench.answers.ask", "answer quality of the whole pipeline on real documents and MuSiQue, "
                           "settings side by side: right, inside the retrieved text, source, ran to the cap, TTFT"),
    ("bench", "answers-pool"): ("bench.answers.pool", "several answers runs (other question sets) read as one: "
                                "each part pooled over them, settings paired against the first"),
    ("bench", "retrieval-quality"): ("bench.answers.retrieval_quality", "retrieval alone on the answers set (no LLM): inside, "
                                     "source, prompt tokens per chunking, mode, top_k and relevance floor"),
}


def _group_help(group: tuple[str, ...]) -> dict:
    """`ragblend bench --help`: the benches under the question each group answers."""
    if group != ("bench",):
        return {}
    from bench import GROUPS

    lines = ["benches by the question they answer (bench/<group>/; docs/benchmarks/README.md):"]
    for name, question in GROUPS.items():
        commands = [path[-1] for path, (module, _) in COMMANDS.items() if module.startswith(f"bench.{name}.")]
        lines.append(f"  {name}: {question}\n    {', '.join(commands) or 'no ragblend command'}")
    return {"epilog": "\n".join(lines), "formatter_class": argparse.RawDescriptionHelpFormatter}


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ragblend", description=__doc__)
    groups: dict[tuple[str, ...], argparse._SubParsersAction] = {(): parser.add_subparsers(dest="command")}
    for path, (module, help_text) in COMMANDS.items():
        for depth in range(1, len(path)):
            group = path[:depth]
            if group not in groups:
                sub = groups[group[:-1]].add_parser(group[-1], help=f"{group[-1]} commands", **_group_help(group))
                groups[group] = sub.add_subparsers(dest=f"{group[-1]}_command")
        sub = groups[path[:-1]].add_parser(path[-1], help=help_text)
        sub.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv = sys.argv[1:] if argv is None else argv
    # The longest command path that argv starts with; else the top-level parser answers (help, errors).
    path = max((p for p in COMMANDS if tuple(argv[: len(p)]) == p), key=len, default=None)
    if path is None:
        parser = _build_parser()
        parser.parse_args(argv)
        parser.print_help()
        return 2
    module_name, help_text = COMMANDS[path]
    module = importlib.import_module(module_name)
    sub = argparse.ArgumentParser(prog="ragblend " + " ".join(path), description=help_text)
    module.add_arguments(sub)
    try:
        return int(module.run(sub.parse_args(argv[len(path) :])) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a server that cannot be reached is one line, not a traceback
        from app.commands.client import describe_transport_error
        from app.commands.exit_codes import ExitCode

        message = describe_transport_error(exc)
        if message is None:
            raise
        print(f"ragblend {' '.join(path)}: {message}", file=sys.stderr)
        return ExitCode.UNREACHABLE


if __name__ == "__main__":
    sys.exit(main())
