"""`ragblend bench llamacpp`: each model on one GGUF file, ragblend beside llama.cpp (docs/benchmarks/models.md).

Per model, three fresh processes in turn: the engine loaded with nothing kept (first load) and again (warm
start), their seconds and peak RSS; then llama.cpp (llama-cpp-python, built here from source) and the engine,
each on the same questions' prompts (the engine's token ids, fed to both: the file's vocabulary is one):
TTFT of a full prefill (both), blend and reuse (the engine, chunks' KV precomputed untimed), greedy decode of
`--decode-tokens` after a full prefill, and the process's peak RSS. Medians over the questions; one JSON.

The decode tokens/s of those two processes are minutes apart, and this 2-core VM's speed drifts by 10-25%
between processes (one pair read 1.04x and 0.66x, docs/benchmarks/models.md). `--interleaved-decode` adds
a process holding both engines over the first prompt, decoding in turn blocks of 16 greedy tokens each for
`--decode-rounds` rounds: their ratio is taken in the same minutes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from bench.harness.args import add_data, add_out
from bench.harness.memory import read_rss
from bench.harness.servers import child_summary
from bench.harness.output import cpu_name, emit_summary, fmt, refuse, table

MODES = ("full", "blend", "reuse")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_data(parser, questions=3, first_question=0)
    parser.add_argument("--models", default="smollm2,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b",
                        help="catalogue names or .gguf paths, comma-separated")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="CPU threads of both engines")
    parser.add_argument("--no-load", action="store_true", help="skip the first-load and warm-start processes")
    parser.add_argument("--interleaved-decode", action="store_true",
                        help="also decode with both engines in one process, blocks of 16 tokens in turn")
    parser.add_argument("--decode-rounds", type=int, default=8, help="rounds of --interleaved-decode")
    parser.add_argument("--child", choices=["load", "llama", "engine", "interleaved"], help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--prompts", type=Path, help=argparse.SUPPRESS)
    add_out(parser)


def run(args: argparse.Namespace) -> int:
    if args.child:
        print(json.dumps(CHILDREN[args.child](args)))
        return 0
    try:
        import llama_cpp  # noqa: F401 - only its presence: each side runs in a process of its own
    except ImportError:
        return refuse("llamacpp", "llama-cpp-python is not installed (pip install -e '.[llamacpp]': "
                      "it builds llama.cpp from source, a few minutes)", 2)
    rows = {name: measure_model(name, args) for name in args.models.split(",")}
    print_table(rows)
    emit_summary({"bench": "llamacpp", "machine": f"{cpu_name()}, {args.threads} threads", "questions": args.questions,
                  "passages": args.passages, "decode_tokens": args.decode_tokens, "models": rows}, args.out, indent=1)
    return 0


def measure_model(name: str, args: argparse.Namespace) -> dict:
    from blend_engine.config import ModelConfig
    from blend_engine.loader import resolve_model_path

    path = resolve_model_path(name, ModelConfig().cache_dir)
    row: dict = {"file": path.name}
    if not args.no_load:
        with tempfile.TemporaryDirectory() as cache:  # nothing kept: the first load reads the file from scratch
            gemm = ModelConfig().cache_dir / "cpu-gemm.json"  # the machine's GEMM probe is not the model's load
            if gemm.is_file():
                shutil.copy(gemm, cache)
            row["first_load"] = child(args, "load", path, Path(cache))
            row["warm_start"] = child(args, "load", path, Path(cache))
    row["ragblend"] = child(args, "engine", path)
    with tempfile.NamedTemporaryFile("w", suffix=".json") as ids:  # llama.cpp reads the engine's very tokens
        json.dump(row["ragblend"]["prompt_ids"], ids)
        ids.flush()
        row["llama.cpp"] = child(args, "llama", path, prompts=Path(ids.name))
    row["prompt_tokens"] = [len(p) for p in row["ragblend"].pop("prompt_ids")]
    if args.interleaved_decode:
        row["interleaved_decode"] = child(args, "interleaved", path)
    return row


def child(args: argparse.Namespace, part: str, path: Path, cache_dir: Path | None = None,
          prompts: Path | None = None) -> dict:
    """`part` of the bench for the model at `path`, in a fresh process: its JSON line."""
    command = ["app.cli", "bench", "llamacpp", "--child", part, "--models", str(path),
               "--data", str(args.data), "--questions", str(args.questions), "--passages", str(args.passages),
               "--decode-tokens", str(args.decode_tokens), "--threads", str(args.threads),
               "--decode-rounds", str(args.decode_rounds)]
    if cache_dir is not None:
        command += ["--cache-dir", str(cache_dir)]
    if prompts is not None:
        command += ["--prompts", str(prompts)]
    return child_summary(command, f"the {part} process")


def load_child(args: argparse.Namespace) -> dict:
    start = time.perf_counter()
    from blend_engine.config import ModelConfig
    from blend_engine.loader import load_model

    imported = time.perf_counter()
    loaded = load_model(ModelConfig(name=args.models, cache_dir=args.cache_dir))
    model_bytes = sum(t.nbytes for t in [*loaded.model.parameters(), *loaded.model.buffers()])
    return {"import_s": imported - start, "load_s": time.perf_counter() - imported, "peak_rss_mb": read_rss().peak_mb,
            "model_mb": model_bytes / 2**20}


def prompts(engine, args: argparse.Namespace) -> list[list]:
    """Each question's segments (chunks' KV precomputed behind the prefix sink, as ingestion does)."""
    from bench.harness.data import load_questions
    from bench.harness.engine import prompt_for
    from configs.enums import SinkMode

    return [prompt_for(engine, q, SinkMode.PREFIX, {})
            for q in load_questions(args.data, args.questions, args.passages)]


def engine_child(args: argparse.Namespace) -> dict:
    import torch

    from bench.harness.engine import Variant, measure_decode, timed_prefill
    from blend_engine.engine import BlendEngine
    from blend_engine.config import ModelConfig
    from blend_engine.types import PrefillMode
    from configs.enums import SinkMode

    torch.set_num_threads(args.threads)
    engine = BlendEngine.from_config(ModelConfig(name=args.models))
    segments = prompts(engine, args)
    ttft = {mode: [] for mode in MODES}
    for prompt in segments:
        for mode in MODES:
            ttft[mode].append(timed_prefill(engine, prompt, Variant(mode, PrefillMode(mode), SinkMode.PREFIX), 1)[1])
    decode = measure_decode(engine, segments[0], args.decode_tokens, with_hf=False)
    return {"prompt_ids": [[t for s in prompt for t in s.token_ids] for prompt in segments],
            **{f"{m}_ttft_ms": statistics.median(v) for m, v in ttft.items()},
            "decode_tok_s": 1000 / decode.engine_ms_per_token, "peak_rss_mb": read_rss().peak_mb}


def llama_child(args: argparse.Namespace) -> dict:
    """llama.cpp on the engine's own token ids of each prompt (--prompts: the engine process's)."""
    import numpy as np
    from llama_cpp import Llama

    rss_before = read_rss().peak_mb
    llm = Llama(args.models, n_ctx=4096, n_batch=512, n_threads=args.threads, n_threads_batch=args.threads,
                verbose=False)
    vocab = llm.n_vocab()

    def next_token() -> int:  # the last evaluated token's argmax (llama.cpp keeps only its logits)
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(vocab,))))

    ttft, decode = [], None
    for i, ids in enumerate(json.loads(args.prompts.read_text())):
        llm.reset()
        start = time.perf_counter()
        llm.eval(ids)
        token = next_token()
        ttft.append((time.perf_counter() - start) * 1000)
        if i == 0:  # greedy decode after the first prompt, as the engine's
            start = time.perf_counter()
            for _ in range(args.decode_tokens):
                llm.eval([token])
                token = next_token()
            decode = args.decode_tokens / (time.perf_counter() - start)
    return {"full_ttft_ms": statistics.median(ttft), "decode_tok_s": decode, "peak_rss_mb": read_rss().peak_mb,
            "rss_before_load_mb": rss_before}


BLOCK_TOKENS = 16  # --interleaved-decode: tokens each engine decodes before the other's turn


def interleaved_child(args: argparse.Namespace) -> dict:
    """Greedy decode after the first prompt's full prefill, ragblend and llama.cpp in one process, in turns of
    BLOCK_TOKENS tokens for --decode-rounds rounds: ms per token (medians), their ratio, each round's medians."""
    import numpy as np
    import torch
    from llama_cpp import Llama

    from blend_engine.config import ModelConfig
    from blend_engine.engine import BlendEngine
    from blend_engine.types import PrefillMode

    torch.set_num_threads(args.threads)
    engine = BlendEngine.from_config(ModelConfig(name=args.models))
    num_tokens = args.decode_rounds * BLOCK_TOKENS
    result = engine.prefill(prompts(engine, args)[0], PrefillMode.FULL, max_new_tokens=num_tokens + 1)
    decoder = engine.decoder(result)
    llm = Llama(args.models, n_ctx=len(result.token_ids) + num_tokens + 8, n_batch=512, n_threads=args.threads,
                n_threads_batch=args.threads, verbose=False)
    llm.eval(list(result.token_ids))
    vocab = llm.n_vocab()

    def llama_step(token: int) -> int:
        llm.eval([token])
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(vocab,))))

    steps = {"ragblend": lambda token: int(decoder.step(token).argmax()), "llama.cpp": llama_step}
    tokens = {"ragblend": int(result.logits.argmax()),
              "llama.cpp": int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(vocab,))))}
    ms: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.decode_rounds):
        for name, step in steps.items():
            for _ in range(BLOCK_TOKENS):
                start = time.perf_counter()
                tokens[name] = step(tokens[name])
                ms[name].append((time.perf_counter() - start) * 1000)
    median = {name: statistics.median(values) for name, values in ms.items()}
    return {"ragblend_ms_per_token": median["ragblend"], "llama_ms_per_token": median["llama.cpp"],
            "decode_ratio": median["llama.cpp"] / median["ragblend"],  # ragblend's tok/s over llama.cpp's
            "round_medians_ms": {name: [statistics.median(values[i : i + BLOCK_TOKENS])
                                        for i in range(0, len(values), BLOCK_TOKENS)] for name, values in ms.items()},
            "prompt_tokens": len(result.token_ids)}


CHILDREN = {"load": load_child, "llama": llama_child, "engine": engine_child, "interleaved": interleaved_child}


def print_table(rows: dict[str, dict]) -> None:
    parts = {name: [row.get(k, {}) for k in ("first_load", "warm_start", "llama.cpp", "ragblend")]
             for name, row in rows.items()}
    print(table(["model", "first s", "warm s", "load RSS", "llama full", "rb full", "rb blend", "blend/llama",
                 "llama tok/s", "rb tok/s", "llama RSS", "rb RSS"], (
        [name, fmt(first.get("load_s")), fmt(warm.get("load_s")), fmt(first.get("peak_rss_mb"), 0),
         fmt(llama["full_ttft_ms"], 0), fmt(ours["full_ttft_ms"], 0), fmt(ours["blend_ttft_ms"], 0),
         fmt(ours["blend_ttft_ms"] / llama["full_ttft_ms"], 2), fmt(llama["decode_tok_s"]), fmt(ours["decode_tok_s"]),
         fmt(llama["peak_rss_mb"], 0), fmt(ours["peak_rss_mb"], 0)]
        for name, (first, warm, llama, ours) in parts.items())))
    side = {name: row["interleaved_decode"] for name, row in rows.items() if "interleaved_decode" in row}
    if side:
        print(table(["model", "interleaved: llama ms/token", "rb ms/token", "decode rb/llama"], (
            [name, fmt(s["llama_ms_per_token"]), fmt(s["ragblend_ms_per_token"]), fmt(s["decode_ratio"], 2)]
            for name, s in side.items())))
