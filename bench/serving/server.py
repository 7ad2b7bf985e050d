"""`ragblend bench server`: many streaming users at once, side by side with a one-at-a-time baseline
(docs/benchmarks/server.md). The upload scenario was retired in issue 64 (`git show 66ac7e4:bench/serving/server.py`)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import httpx

from app.commands.exit_codes import ExitCode
from bench.harness.args import add_data, add_out, add_server, headers
from bench.harness.data import Question, load_questions
from bench.harness.output import emit_summary, refuse
from bench.harness.stats import in_turn
from bench.harness.client import WARMUP_TOKENS, QueryFailed, chunk_ids, ingest_ready, stream_query
from bench.serving.report import Chat, Role, Round, level_stats, print_tables, ratio_rows, target_checks
from configs.enums import RequestMode

# The baseline: one sequence at a time (the scheduler's off switch). An environment variable, so the
# same `ragblend serve` command line starts both servers.
BASELINE_ENV = {"RAGBLEND_SCHEDULER__MAX_RUNNING": "1"}


def concurrency_levels(text: str) -> list[int]:
    try:
        levels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of client counts: {text!r}") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"client counts must be >= 1: {text!r}")
    return sorted(set(levels))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_server(parser)
    parser.add_argument("--baseline-url", help="a second server, started with scheduler.max_running=1 "
                        "(RAGBLEND_SCHEDULER__MAX_RUNNING=1), measured side by side")
    parser.add_argument("--serve", action="store_true", help="start both servers here instead (`ragblend serve` "
                        "on free loopback ports, temporary data dirs; the baseline with "
                        "RAGBLEND_SCHEDULER__MAX_RUNNING=1, the other with this environment's settings)")
    parser.add_argument("--baseline-env", action="append", metavar="NAME=VALUE",
                        help="--serve: the baseline's environment instead of RAGBLEND_SCHEDULER__MAX_RUNNING=1 "
                             "(repeat for several), e.g. RAGBLEND_SCHEDULER__MAX_DECODE_STALL_MS=0 to measure "
                             "the stall bound against none")
    parser.add_argument("--concurrency", type=concurrency_levels, default=concurrency_levels("1,2,4,8"),
                        help="comma-separated client counts, e.g. 1,2,4,8")
    add_data(parser, questions=None, questions_help="questions (default and least: the largest client count)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds per level and server")
    add_request_arguments(parser, is_ignoring_eos=False)
    add_out(parser)


def add_request_arguments(parser: argparse.ArgumentParser, is_ignoring_eos: bool) -> None:
    """What `request_body` sends, the rest before each round, the servers started here and the timeouts:
    `bench server`'s and `bench compare`'s alike."""
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per answer")
    parser.add_argument("--prefix-cache", choices=["off", "server"], default="off",
                        help="off: every request says prefix_cache false (a question asked again prefills again); "
                             "server: as the server is configured (revisions before the prefix cache, issue 42, "
                             "refuse the field: give server for them)")
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=is_ignoring_eos,
                        help="every answer --max-tokens long (the request's ignore_eos): decoding then weighs what "
                             "the answers' length says, not where the model happens to stop (--no-ignore-eos for "
                             "revisions whose API has no such field)")
    parser.add_argument("--mode", choices=[m.value for m in RequestMode], help="prefill mode (default: the server's)")
    parser.add_argument("--settle-s", type=float, default=3.0,
                        help="seconds of rest before each round: a round run right after the other server's "
                             "heavy one measured up to ~19%% slower, with that server idle (docs/benchmarks/server.md)")
    parser.add_argument("--config", type=Path, help="a YAML file the servers started here layer over their defaults")
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for a started server's /readyz")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")

@dataclass(frozen=True)
class Target:
    role: Role
    url: str

# ---- measuring -------------------------------------------------------------------------------


def request_body(question: Question, qi: int, args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {"question": question.question, "chunk_ids": chunk_ids(qi, question),
                            "max_tokens": args.max_tokens, "temperature": 0.0}
    if args.ignore_eos:  # only when asked: a revision whose API predates the field refuses it
        body["ignore_eos"] = True
    if args.prefix_cache == "off":  # every round asks the same questions again: each answer prefills
        body["prefix_cache"] = False
    if args.mode:
        body["mode"] = args.mode
    return body


async def chat(client: httpx.AsyncClient, questions: Sequence[Question], qi: int, args: argparse.Namespace) -> Chat:
    try:
        return Chat(qi, await stream_query(client, request_body(questions[qi], qi, args)))
    except (QueryFailed, httpx.HTTPError) as exc:  # counted and reported: a 503 under load is a result
        return Chat(qi, None, f"{type(exc).__name__}: {exc}")


async def run_round(client: httpx.AsyncClient, questions: Sequence[Question], indices: Sequence[int],
                    args: argparse.Namespace) -> Round:
    """The chats of `indices` started at once."""
    start = time.perf_counter()
    chats = await asyncio.gather(*(chat(client, questions, qi, args) for qi in indices))
    return Round(len(indices), time.perf_counter() - start, tuple(chats))


def round_questions(num_clients: int, repeat: int, num_questions: int) -> list[int]:
    """Distinct questions for one round's clients, moving on through the set from one repeat to the next."""
    return [(repeat * num_clients + j) % num_questions for j in range(num_clients)]


async def prepare(url: str, questions: Sequence[Question], args: argparse.Namespace,
                  headers: dict[str, str]) -> dict[str, Any]:
    """Readiness, model id, the questions' passages ingested, one warm-up answer to question 0 (a server's
    first request waits for its loading planner's start-up measurement)."""
    model, ingest_s = await asyncio.to_thread(ingest_ready, url, headers, args.timeout, questions)
    info = {"url": url, "model": model, "ingest_s": ingest_s}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=args.timeout) as client:
        await stream_query(client, {**request_body(questions[0], 0, args), "max_tokens": WARMUP_TOKENS})
    return info


async def chat_levels(targets: Sequence[Target], clients: dict[Role, httpx.AsyncClient],
                      questions: Sequence[Question], args: argparse.Namespace,
                      schedule: list[dict[str, Any]]) -> dict[Role, dict[int, list[Round]]]:
    """Every level's rounds on every server, interleaved: role -> clients -> rounds."""
    levels: dict[Role, dict[int, list[Round]]] = {t.role: defaultdict(list) for t in targets}
    for repeat in range(args.repeats):
        for level, num_clients in enumerate(args.concurrency):
            # who goes first alternates from level to level and, for each level, from repeat to repeat
            for target in in_turn(targets, level + repeat):
                indices = round_questions(num_clients, repeat, len(questions))
                await asyncio.sleep(args.settle_s)
                levels[target.role][num_clients].append(await run_round(clients[target.role], questions,
                                                                        indices, args))
                schedule.append({"repeat": repeat, "clients": num_clients, "server": target.role.value})
    return levels


async def measure(targets: Sequence[Target], questions: Sequence[Question], args: argparse.Namespace, headers: dict[str, str],
                  prepared: dict[Role, dict[str, Any]] | None = None) -> dict[str, Any]:
    """`prepared`: the servers' `prepare` results where that ran already."""
    servers = prepared or {t.role: await prepare(t.url, questions, args, headers) for t in targets}
    clients = {t.role: httpx.AsyncClient(base_url=t.url, headers=headers, timeout=args.timeout,
                                         limits=httpx.Limits(max_connections=None)) for t in targets}
    schedule: list[dict[str, Any]] = []  # what ran, in order
    try:
        levels = await chat_levels(targets, clients, questions, args, schedule)
    finally:
        for client in clients.values():
            await client.aclose()
    results = {role.value: [level_stats(rounds) for _, rounds in sorted(by_level.items())]
               for role, by_level in levels.items()}
    return {
        "servers": {role.value: info for role, info in servers.items()},
        "results": results,
        "ratios": ratio_rows(results),
        "schedule": schedule,
    }

# ---- the command -----------------------------------------------------------------------------


def check_args(args: argparse.Namespace) -> None:
    if args.questions is None:
        args.questions = max(args.concurrency)
    if args.questions < max(args.concurrency):
        raise ValueError(f"--questions {args.questions} < {max(args.concurrency)} clients: each client asks its own")
    if args.repeats < 1 or args.max_tokens < 1 or args.settle_s < 0:
        raise ValueError("--repeats and --max-tokens must be >= 1, --settle-s >= 0")
    if args.baseline_env and not args.serve:
        raise ValueError("--baseline-env sets the environment of the baseline --serve starts: give --serve")
    baseline_environment(args.baseline_env)  # a malformed pair is refused before any server starts
    if args.serve and args.baseline_url:
        raise ValueError("--serve starts both servers: give no --baseline-url")
    if args.config is not None and not args.serve:
        raise ValueError("--config is for the servers --serve starts")


async def bench(args: argparse.Namespace, targets: Sequence[Target], questions: Sequence[Question],
                headers: dict[str, str], prepared: dict[Role, dict[str, Any]] | None = None) -> dict[str, Any]:
    measured = await measure(targets, questions, args, headers, prepared)
    summary = {"bench": "server", "concurrency": args.concurrency, "questions": args.questions,
               "passages": args.passages, "max_tokens": args.max_tokens, "ignore_eos": args.ignore_eos, "mode": args.mode,
               "repeats": args.repeats, "settle_s": args.settle_s, **measured}
    summary["targets"] = target_checks(summary)
    return summary


def run(args: argparse.Namespace) -> int:
    try:
        check_args(args)
    except ValueError as exc:
        return refuse("server", exc, ExitCode.USAGE)
    questions = load_questions(args.data, args.questions, args.passages)
    if len(questions) < args.questions:
        return refuse("server", f"{args.data} has {len(questions)} questions, {args.questions} needed", ExitCode.USAGE)
    auth = headers(args)
    if args.serve:
        summary = serve_and_bench(args, questions, auth)
    else:
        targets = [Target(Role.SERVER, args.url)]
        if args.baseline_url:
            targets.append(Target(Role.BASELINE, args.baseline_url))
        summary = asyncio.run(bench(args, targets, questions, auth))
    print_tables(summary)
    emit_summary(summary, args.out, indent=2)
    num_errors = sum(row["num_errors"] for rows in summary["results"].values() for row in rows)
    return ExitCode.FAILED if num_errors else ExitCode.OK


def serve_and_bench(args: argparse.Namespace, questions: Sequence[Question], headers: dict[str, str]) -> dict[str, Any]:
    from bench.harness.servers import LocalServer, started

    config = args.config.resolve() if args.config else None
    baseline_env = baseline_environment(args.baseline_env)
    # the server under test gets this environment as it is; the baseline, that and its own (max_running=1)
    local = {Role.SERVER: LocalServer(Role.SERVER.value, config=config),
             Role.BASELINE: LocalServer(Role.BASELINE.value, baseline_env, config)}
    with contextlib.ExitStack() as stack:
        # One after the other: a server's loading planner times prefills right after start-up, and a
        # second server starting meanwhile would slow those down and skew its plans (auto mode).
        prepared = {}
        for role, server in local.items():
            stack.enter_context(started(server, args.ready_timeout))
            prepared[role] = asyncio.run(prepare(server.url, questions, args, headers))
        targets = [Target(role, server.url) for role, server in local.items()]
        summary = asyncio.run(bench(args, targets, questions, headers, prepared))
    summary["servers"][Role.BASELINE.value].update(env=baseline_env)
    summary["servers"][Role.SERVER.value]["env"] = {name: os.environ[name] for name in baseline_env
                                                    if name in os.environ}
    return summary


def baseline_environment(pairs: Sequence[str] | None) -> dict[str, str]:
    """`--baseline-env NAME=VALUE ...` as a mapping; none given: one request at a time (BASELINE_ENV).
    ValueError for a pair without a name or an `=`."""
    env = {}
    for name, sep, value in (pair.partition("=") for pair in pairs or ()):
        if not sep or not name:
            raise ValueError(f"--baseline-env takes NAME=VALUE, got {name + sep + value!r}")
        env[name] = value
    return env or dict(BASELINE_ENV)
