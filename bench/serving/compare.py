"""`ragblend bench compare REV`: this checkout's server against REV's, side by side, in turn, through the HTTP
API; what a change to the engine, the KV store, the runtime or the RAG path quotes (docs/benchmarks/compare.md)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections import Counter
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from statistics import mean
from typing import Any, Awaitable, Callable, Sequence

import httpx

from app.commands.exit_codes import ExitCode
from bench.serving import build as compare_build
from bench.serving.build import Build, BuildError
from bench.harness.servers import REPO_ROOT, LocalServer, started
from bench.harness.args import add_api_key, add_data, headers
from bench.harness.data import Question, load_questions
from bench.harness.output import emit_summary, refuse, table
from bench.serving.server import WARMUP_TOKENS, add_request_arguments, prepare, request_body, round_questions, \
    run_round
from bench.harness.client import QueryFailed, StreamedAnswer, stream_query
from bench.harness.stats import in_turn, percentile, ratio, spread

IDLE_SHARE_WARNING = 0.05  # of one core, over a part's wall time


class Side(str, Enum):
    REV = "rev"
    CURRENT = "current"


@dataclass(frozen=True)
class Measure:
    key: str
    label: str
    unit: str
    is_lower_better: bool


def measures(clients: int) -> tuple[Measure, ...]:
    return (Measure("ttft_again_ms", "TTFT, question asked again", "ms", True),
            Measure("ttft_first_ms", "TTFT, first ask", "ms", True),
            Measure("ttft_retrieved_ms", "TTFT, first ask, retrieved", "ms", True),
            Measure("retrieval_ms", "retrieval, first ask (server)", "ms", True),
            Measure("decode_tokens_per_s", "decode tok/s, one user", "tok/s", False),
            Measure("clients_ttft_p50_ms", f"{clients} clients: TTFT p50", "ms", True),
            Measure("clients_ttft_p95_ms", f"{clients} clients: TTFT p95", "ms", True),
            Measure("clients_wall_s", f"{clients} clients: round wall", "s", True))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("rev", help="the git revision to compare this checkout with (a sha, branch, tag, HEAD~3...)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds; each measures every part on both builds")
    parser.add_argument("--clients", type=int, default=8, help="streaming clients at once in a round's concurrent part")
    add_data(parser, questions=None, first_question=0,
             questions_help="questions the concurrent part's clients draw from (default and least: --clients)")
    add_request_arguments(parser, is_ignoring_eos=True)  # a decode rate needs answers of one length
    parser.add_argument("--python", type=Path,
                        help="run REV under this interpreter (one with REV's dependencies) instead of building a venv")
    parser.add_argument("--venv", choices=[compare_build.Interpreter.SHARED.value, compare_build.Interpreter.OWN.value],
                        default=compare_build.Interpreter.SHARED.value,
                        help="shared: REV runs under this interpreter where it has every dependency REV's "
                             "pyproject.toml declares, else in its own venv (the run says why); own: always "
                             "its own venv (two venvs leaned the figures 5-12%% toward this checkout: "
                             "docs/benchmarks/compare.md)")
    parser.add_argument("--skip-build", action="store_true",
                        help="make nothing: use the worktree and venv an earlier run built for REV (an error if none)")
    parser.add_argument("--cache-dir", type=Path, default=compare_build.default_cache_dir(),
                        help="where REV's worktree and venv are kept, under <full sha>/ (default %(default)s)")
    add_api_key(parser)
    parser.add_argument("--out", type=Path, help="the JSON's path (default: docs/results/compare_<rev sha>.json)")


def check_args(args: argparse.Namespace) -> None:
    if args.questions is None:
        args.questions = args.clients
    if args.rounds < 1 or args.clients < 1 or args.max_tokens < 2 or args.first_question < 0 or args.settle_s < 0:
        raise ValueError("--rounds and --clients must be >= 1, --max-tokens >= 2 (a decode rate needs two tokens), "
                         "--first-question and --settle-s >= 0")
    if args.questions < args.clients:
        raise ValueError(f"--questions {args.questions} < {args.clients} clients: each client asks its own")


# ---- which question each part asks ---------------------------------------------------------------
# The ingested list: [the repeated question] + [the concurrent pool] + [one first ask per round]
# + [one retrieved first ask per round].


def num_questions(args: argparse.Namespace) -> int:
    return 1 + args.questions + 2 * args.rounds


def pool_indices(args: argparse.Namespace) -> list[int]:
    return list(range(1, 1 + args.questions))


def concurrent_indices(round_index: int, args: argparse.Namespace) -> list[int]:
    return [1 + i for i in round_questions(args.clients, round_index, args.questions)]


def first_ask_index(round_index: int, args: argparse.Namespace) -> int:
    return 1 + args.questions + round_index


def retrieved_ask_index(round_index: int, args: argparse.Namespace) -> int:
    return 1 + args.questions + args.rounds + round_index


# ---- measuring ------------------------------------------------------------------------------------


def decode_rate(answers: Sequence[StreamedAnswer]) -> float | None:
    """Tokens after the first over the time after the first, summed over `answers`."""
    tokens = sum(max(a.num_completion_tokens - 1, 0) for a in answers)
    seconds = sum(a.total_ms - a.ttft_ms for a in answers) / 1000
    return tokens / seconds if tokens and seconds > 0 else None


@dataclass
class Part:
    """One part's figures on one server, its answers (for the modes and prompt sizes) and failures."""

    values: dict[str, float | None]
    answers: list[StreamedAnswer]
    errors: list[str]


async def one_user(client: httpx.AsyncClient, questions: Sequence[Question], round_index: int,
                   args: argparse.Namespace) -> Part:
    again = await stream_query(client, request_body(questions[0], 0, args))
    qi = first_ask_index(round_index, args)
    first = await stream_query(client, request_body(questions[qi], qi, args))
    ri = retrieved_ask_index(round_index, args)
    retrieved = await stream_query(client, retrieved_body(questions[ri], ri, args))
    # a fixed not-found answer (nothing relevant retrieved) has no prefill: its TTFT is left out of the
    # figures, and the table's modes count it (None)
    is_answered = retrieved.done.get("mode") is not None
    return Part({"ttft_again_ms": again.ttft_ms, "ttft_first_ms": first.ttft_ms,
                 "ttft_retrieved_ms": retrieved.ttft_ms if is_answered else None,
                 "retrieval_ms": retrieved.done["timings"]["retrieval_ms"],
                 "decode_tokens_per_s": decode_rate([again, first])}, [again, first, retrieved], [])


def retrieved_body(question: Question, qi: int, args: argparse.Namespace) -> dict[str, Any]:
    """The same request without its chunks named: the server retrieves them (its default top_k and mode)."""
    body = request_body(question, qi, args)
    del body["chunk_ids"]
    return body


async def many_users(client: httpx.AsyncClient, questions: Sequence[Question], round_index: int,
                     args: argparse.Namespace) -> Part:
    chats = await run_round(client, questions, concurrent_indices(round_index, args), args)
    answers = [c.answer for c in chats.chats if c.answer is not None]
    ttft = [a.ttft_ms for a in answers]
    return Part({"clients_ttft_p50_ms": percentile(ttft, 50), "clients_ttft_p95_ms": percentile(ttft, 95),
                 "clients_wall_s": chats.wall_s}, answers, [c.error for c in chats.chats if c.error is not None])


PARTS: tuple[tuple[str, Callable[..., Awaitable[Part]]], ...] = (("one_user", one_user), ("clients", many_users))


@dataclass(frozen=True)
class Target:
    side: Side
    server: LocalServer


async def warm_up(url: str, questions: Sequence[Question], args: argparse.Namespace,
                  headers: dict[str, str]) -> dict[str, Any]:
    """server_bench's set-up (readiness, ingest, a short answer to question 0: the repeated one), then short
    answers to the concurrent pool's questions, `--clients` at a time, so every round finds them asked."""
    info = await prepare(url, questions, args, headers)
    short = argparse.Namespace(**{**vars(args), "max_tokens": WARMUP_TOKENS})
    pool = pool_indices(args)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=args.timeout,
                                 limits=httpx.Limits(max_connections=None)) as client:
        for start in range(0, len(pool), args.clients):
            warm = await run_round(client, questions, pool[start:start + args.clients], short)
            failed = [c.error for c in warm.chats if c.error is not None]
            if failed:
                raise RuntimeError(f"warming up {url}: {failed[0]}")
    return info


async def measure(targets: Sequence[Target], questions: Sequence[Question], args: argparse.Namespace,
                  headers: dict[str, str]) -> dict[str, Any]:
    """Every round's parts on both servers, in turn; the figures per side as lists over rounds."""
    clients = {t.side: httpx.AsyncClient(base_url=t.server.url, headers=headers, timeout=args.timeout,
                                         limits=httpx.Limits(max_connections=None)) for t in targets}
    values: dict[Side, dict[str, list[float | None]]] = {t.side: {} for t in targets}
    answers: dict[Side, list[StreamedAnswer]] = {t.side: [] for t in targets}
    errors: dict[Side, list[str]] = {t.side: [] for t in targets}
    schedule: list[dict[str, Any]] = []
    try:
        for round_index in range(args.rounds):
            for part_index, (name, part) in enumerate(PARTS):
                for target in in_turn(targets, round_index + part_index):
                    idle = next(t for t in targets if t is not target)
                    await asyncio.sleep(args.settle_s)
                    idle_before, start = idle.server.cpu_s(), time.perf_counter()
                    result = await part(clients[target.side], questions, round_index, args)
                    wall_s, idle_after = time.perf_counter() - start, idle.server.cpu_s()
                    idle_cpu_s = idle_after - idle_before if idle_before is not None and idle_after is not None \
                        else None
                    for key, value in result.values.items():
                        values[target.side].setdefault(key, []).append(value)
                    answers[target.side] += result.answers
                    errors[target.side] += result.errors
                    schedule.append({"round": round_index, "part": name, "build": target.side.value,
                                     "wall_s": wall_s, "idle_build": idle.side.value, "idle_cpu_s": idle_cpu_s})
    finally:
        for client in clients.values():
            await client.aclose()
    return {"values": values, "answers": answers, "errors": errors, "schedule": schedule}


# ---- statistics -----------------------------------------------------------------------------------


def compare_measures(values: dict[Side, dict[str, list[float | None]]], clients: int) -> dict[str, Any]:
    """Each measure per build, and current/REV per round (both builds' figures of one round)."""
    out = {}
    for m in measures(clients):
        rev, current = values[Side.REV][m.key], values[Side.CURRENT][m.key]
        out[m.key] = {"label": m.label, "unit": m.unit, "better": "lower" if m.is_lower_better else "higher",
                      Side.REV.value: spread(rev), Side.CURRENT.value: spread(current),
                      "ratio": spread([ratio(c, r) for c, r in zip(current, rev)])}
    return out


def idle_summary(schedule: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The most CPU the idle server used during one of the other's parts, in seconds and as a share of
    that part's wall time (None where /proc could not be read)."""
    known = [s for s in schedule if s["idle_cpu_s"] is not None]
    return {"cpu_s_max": max((s["idle_cpu_s"] for s in known), default=None),
            "cpu_share_max": max((s["idle_cpu_s"] / s["wall_s"] for s in known if s["wall_s"] > 0), default=None),
            "cpu_s_total": sum(s["idle_cpu_s"] for s in known) if known else None}


def summarize(args: argparse.Namespace, builds: dict[Side, Build], servers: dict[Side, dict[str, Any]],
              measured: dict[str, Any]) -> dict[str, Any]:
    build_info = {}
    for side, build in builds.items():
        answers = measured["answers"][side]
        build_info[side.value] = {
            **build.describe(), **servers[side],
            "modes": dict(Counter(a.done.get("mode") for a in answers)),
            "mean_prompt_tokens": mean(a.usage.get("prompt_tokens", 0) for a in answers) if answers else None,
            "num_errors": len(measured["errors"][side]), "errors": sorted(set(measured["errors"][side]))[:5],
        }
    return {"bench": "compare", "rev": args.rev, "rounds": args.rounds, "clients": args.clients,
            "questions": args.questions, "first_question": args.first_question, "passages": args.passages,
            "max_tokens": args.max_tokens, "ignore_eos": args.ignore_eos, "prefix_cache": args.prefix_cache,
            "mode": args.mode, "settle_s": args.settle_s,
            "builds": build_info, "measures": compare_measures(measured["values"], args.clients),
            "idle": idle_summary(measured["schedule"]), "schedule": measured["schedule"],
            "num_errors": sum(len(e) for e in measured["errors"].values())}


# ---- the table ------------------------------------------------------------------------------------


def _cell(stats: dict[str, Any], unit: str) -> str:
    """The median [min-max] over rounds: ratios ("x") to 2 places, rates and seconds to 1, milliseconds to 0."""
    if stats["median"] is None:
        return "-"
    digits, suffix = {"x": (2, "x"), "tok/s": (1, ""), "s": (1, "")}.get(unit, (0, ""))
    return f"{stats['median']:.{digits}f}{suffix} [{stats['min']:.{digits}f}-{stats['max']:.{digits}f}]"


def print_table(summary: dict[str, Any]) -> None:
    builds = summary["builds"]
    rev, current = builds[Side.REV.value], builds[Side.CURRENT.value]
    prompts = [b["mean_prompt_tokens"] for b in builds.values() if b["mean_prompt_tokens"] is not None]
    mode = summary["mode"] or "each server's default"
    print(f"\ncompare: REV {summary['rev']} ({rev['sha'][:10]}) against the current checkout ({current['sha'][:10]}"
          f"{', with uncommitted changes' if current['is_dirty'] else ''}); model {current['model']}; "
          f"{summary['rounds']} round(s), prompt ~{mean(prompts) if prompts else 0:.0f} tokens, "
          f"{summary['max_tokens']} tokens an answer, mode {mode}")
    print("median over rounds [min-max]; ratio: current/REV per round")
    print(table(["measure", "REV", "current", "current/REV", "better"], (
        [f"{m['label']} ({m['unit']})", _cell(m["rev"], m["unit"]), _cell(m["current"], m["unit"]),
         _cell(m["ratio"], "x"), m["better"]] for m in summary["measures"].values())))
    for side, info in builds.items():
        print(f"{side}: modes {info['modes']}, errors {info['num_errors']}")
    idle = summary["idle"]
    if idle["cpu_share_max"] is not None:
        print(f"the idle server during the other's parts: at most {idle['cpu_s_max']:.2f} s of CPU, "
              f"{idle['cpu_share_max']:.1%} of a part's wall time")


# ---- the command ----------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    try:
        check_args(args)
        questions = load_questions(args.data, num_questions(args), args.passages, args.first_question)
    except (ValueError, FileNotFoundError) as exc:
        return refuse("compare", exc, ExitCode.USAGE)
    if len(questions) < num_questions(args):
        return refuse("compare", f"{args.data} has {len(questions)} questions after the first {args.first_question}; "
                      f"{num_questions(args)} needed (1 asked again, --questions {args.questions}, two first asks "
                      f"per round)", ExitCode.USAGE)
    try:
        builds = {Side.REV: compare_build.build(args.rev, args.cache_dir, args.python, args.skip_build,
                                                   compare_build.Interpreter(args.venv)),
                  Side.CURRENT: compare_build.current_build()}
    except BuildError as exc:
        return refuse("compare", exc, ExitCode.FAILED)
    auth = headers(args)
    config = args.config.resolve() if args.config else None
    local = {side: LocalServer(side.value, config=config, python=build.python, root=build.root)
             for side, build in builds.items()}
    try:
        with contextlib.ExitStack() as stack:
            servers = {}
            # one after the other: a server's loading planner times prefills right after start-up
            for side, server in local.items():
                stack.enter_context(started(server, args.ready_timeout))
                servers[side] = asyncio.run(warm_up(server.url, questions, args, auth))
            targets = [Target(side, server) for side, server in local.items()]
            measured = asyncio.run(measure(targets, questions, args, auth))
    except (QueryFailed, RuntimeError) as exc:  # a server that did not start, or refused a one-user question
        return refuse("compare", exc, ExitCode.FAILED)
    summary = summarize(args, builds, servers, measured)
    print_table(summary)
    share = summary["idle"]["cpu_share_max"]
    if share is not None and share > IDLE_SHARE_WARNING:
        refuse("compare", f"the idle server used up to {share:.0%} of a core while the other was measured: the "
               f"builds' figures disturbed each other (see the JSON's schedule)", 0)
    out = args.out or REPO_ROOT / "docs" / "results" / f"compare_{builds[Side.REV].sha[:10]}.json"
    emit_summary(summary, out, indent=2)
    return ExitCode.FAILED if summary["num_errors"] else ExitCode.OK
