"""`python -m bench.attention_dtype_server`: `model.attention_dtype` through the server, by prompt length.

Two `ragblend serve` children of the same settings (`--config`), one as configured (`auto` by default) and
one with `model.attention_dtype: model`, take turns (who goes first alternates by question) on the same
MuSiQue questions: per prompt length (`--passages-list`: the question's first k passages as `chunk_ids`)
and per mode, each server's prefill_ms and server TTFT, one token an answer, the prefix cache off. It
printed the figures behind `BF16_MIN_KEYS` (docs/decisions/0023): where bf16 attention starts to pay.
Prints a line per length and mode and one JSON object (also written to `--out`).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from statistics import median

import httpx

from bench.harness.data import DEFAULT_DATA
from bench.harness.servers import LocalServer, started
from bench.harness.data import load_questions
from bench.harness.output import cpu_name, emit_summary
from bench.harness.client import chunk_ids, ingest

SIDES = ("configured", "model")
PAUSE_S = 0.3  # between turns: the other server's spinning threads go to sleep


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", default=DEFAULT_DATA, help="MuSiQue-style JSON (default: %(default)s)")
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--first-question", type=int, default=20)
    parser.add_argument("--passages-list", default="1,2,3,5", help="prompt lengths: passages per prompt")
    parser.add_argument("--modes", default="blend,full")
    parser.add_argument("--config", type=Path, default=None, help="both servers' settings YAML")
    parser.add_argument("--out", default=None)


def run(args: argparse.Namespace) -> int:
    counts = [int(x) for x in args.passages_list.split(",")]
    questions = load_questions(args.data, args.first_question + args.questions, max(counts))[args.first_question:]
    servers = {"configured": LocalServer("configured", config=args.config),
               "model": LocalServer("model", config=args.config, env={"RAGBLEND_MODEL__ATTENTION_DTYPE": "model"})}
    rows = []
    with ExitStack() as stack:
        for server in servers.values():
            stack.enter_context(started(server, 900.0))
        clients = {side: stack.enter_context(httpx.Client(base_url=servers[side].url, timeout=600)) for side in SIDES}
        for client in clients.values():
            ingest(client, questions)
        for mode in args.modes.split(","):
            for k in counts:
                turns = {side: [] for side in SIDES}
                for qi, question in enumerate(questions):
                    for side in SIDES if qi % 2 == 0 else SIDES[::-1]:
                        time.sleep(PAUSE_S)
                        body = {"question": question.question, "chunk_ids": chunk_ids(qi, question)[:k], "mode": mode,
                                "max_tokens": 1, "prefix_cache": False}
                        response = clients[side].post("/v1/query", json=body)
                        response.raise_for_status()
                        answer = response.json()
                        turns[side].append({"prefill_ms": answer["timings"]["prefill_ms"],
                                            "ttft_ms": answer["timings"]["ttft_ms"],
                                            "prompt_tokens": answer["usage"]["prompt_tokens"]})
                rows.append(_row(mode, k, turns))
                print(_line(rows[-1]), flush=True)
    summary = {"bench": "attention-dtype-server", "machine": platform.machine(), "processor": cpu_name(),
               "questions": len(questions), "first_question": args.first_question,
               "config": str(args.config) if args.config else None, "rows": rows}
    emit_summary(summary, args.out)
    return 0


def _row(mode: str, k: int, turns: dict[str, list[dict]]) -> dict:
    a, b = turns["configured"], turns["model"]
    return {"mode": mode, "passages": k, "prompt_tokens_p50": median(t["prompt_tokens"] for t in a),
            "prefill_ms_p50": {side: median(t["prefill_ms"] for t in turns[side]) for side in SIDES},
            # per question, the model-dtype server's over the configured one's: above 1, the configured is faster
            "prefill_model_over_configured": median(y["prefill_ms"] / x["prefill_ms"] for x, y in zip(a, b)),
            "ttft_model_over_configured": median(y["ttft_ms"] / x["ttft_ms"] for x, y in zip(a, b)),
            "turns": turns}


def _line(row: dict) -> str:
    ms = row["prefill_ms_p50"]
    return (f"{row['mode']:<6} {row['passages']} passages, ~{row['prompt_tokens_p50']:.0f} tokens: prefill p50 "
            f"configured {ms['configured']:.0f} ms, model dtype {ms['model']:.0f} ms; model/configured prefill "
            f"{row['prefill_model_over_configured']:.3f}x, TTFT {row['ttft_model_over_configured']:.3f}x")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
