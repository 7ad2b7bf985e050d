"""`ragblend bench server`'s records, statistics, targets and tables: pure functions of the records."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from enum import Enum
from statistics import mean, median
from typing import Any, Sequence

from bench.harness.client import StreamedAnswer
from bench.harness.output import fmt, table
from bench.harness.stats import percentile, ratio

# Targets of issue 23, checked at the largest level (vs one client and vs the baseline) and at one client.
MIN_TOKENS_PER_S_VS_ONE_CLIENT = 1.6
MAX_TTFT_VS_BASELINE = 0.6
ONE_CLIENT_TOLERANCE = 0.05


class Role(str, Enum):
    SERVER = "server"  # the server measured
    BASELINE = "baseline"  # the same, one sequence at a time


@dataclass(frozen=True)
class Chat:
    question: int
    answer: StreamedAnswer | None
    error: str | None = None


@dataclass(frozen=True)
class Round:
    """`clients` chats started at once; wall_s: first request out to last chat done."""

    clients: int
    wall_s: float
    chats: tuple[Chat, ...]


# ---- statistics ------------------------------------------------------------------------------


def level_stats(rounds: Sequence[Round]) -> dict[str, Any]:
    """One level's row over its rounds: latencies pooled over every request; rates per round, median."""
    answers = [c.answer for r in rounds for c in r.chats if c.answer is not None]
    errors = [c.error for r in rounds for c in r.chats if c.error is not None]
    ttft = [a.ttft_ms for a in answers]
    itl = [gap for a in answers for gap in a.inter_token_ms]
    queue = [a.timings["queue_ms"] for a in answers if "queue_ms" in a.timings]
    decode = [rate for a in answers if (rate := a.decode_tokens_per_s) is not None]
    tokens = [sum(c.answer.num_completion_tokens for c in r.chats if c.answer is not None) for r in rounds]
    requests_per_s = [sum(c.answer is not None for c in r.chats) / r.wall_s for r in rounds]
    return {
        "clients": rounds[0].clients,
        "num_rounds": len(rounds),
        "num_requests": len(answers) + len(errors),
        "num_errors": len(errors),
        "errors": sorted(set(errors))[:5],
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p95_ms": percentile(ttft, 95),
        "itl_p50_ms": percentile(itl, 50),
        "itl_p95_ms": percentile(itl, 95),
        "itl_max_ms": max(itl) if itl else None,  # the longest a running answer went without a token
        "queue_p50_ms": percentile(queue, 50),  # None: the server reports no queue wait
        "queue_p95_ms": percentile(queue, 95),
        "tokens_per_s": median(n / r.wall_s for n, r in zip(tokens, rounds)),
        "requests_per_s": median(requests_per_s),
        "requests_per_s_rounds": requests_per_s,
        "wall_s": median(r.wall_s for r in rounds),
        "wall_s_rounds": [r.wall_s for r in rounds],
        "completion_tokens": sum(tokens),
        "decode_tokens_per_s_p50": percentile(decode, 50),
        "server_ttft_p50_ms": percentile([a.timings["ttft_ms"] for a in answers if "ttft_ms" in a.timings], 50),
        "server_prefill_p50_ms": percentile([a.timings["prefill_ms"] for a in answers if "prefill_ms" in a.timings], 50),
        "mean_prompt_tokens": mean(a.usage.get("prompt_tokens", 0) for a in answers) if answers else None,
        "modes": dict(Counter(a.done.get("mode") for a in answers)),
    }


def ratio_rows(results: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per level: the server's TTFT and rates over the baseline's at that level, and each server's
    aggregate tok/s over its own at one client."""
    server = {row["clients"]: row for row in results[Role.SERVER.value]}
    baseline = {row["clients"]: row for row in results.get(Role.BASELINE.value, [])}
    rows = []
    for clients, row in server.items():
        base, one, base_one = baseline.get(clients, {}), server.get(1, {}), baseline.get(1, {})
        rows.append({
            "clients": clients,
            "ttft_p50_vs_baseline": ratio(row["ttft_p50_ms"], base.get("ttft_p50_ms")),
            "ttft_p95_vs_baseline": ratio(row["ttft_p95_ms"], base.get("ttft_p95_ms")),
            "tokens_per_s_vs_baseline": ratio(row["tokens_per_s"], base.get("tokens_per_s")),
            "decode_tokens_per_s_vs_baseline": ratio(row["decode_tokens_per_s_p50"],
                                                     base.get("decode_tokens_per_s_p50")),
            "tokens_per_s_vs_one_client": ratio(row["tokens_per_s"], one.get("tokens_per_s")),
            "baseline_tokens_per_s_vs_one_client": ratio(base.get("tokens_per_s"), base_one.get("tokens_per_s")),
        })
    return rows


def target_checks(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 23's targets, where this run measured what they need (a baseline, 1 client, a larger level)."""
    ratios = {row["clients"]: row for row in summary["ratios"]}
    top = max(ratios)
    checks = []

    def check(name: str, clients: int, value: float | None, bound: str, is_met: bool) -> None:
        if value is not None:
            checks.append({"name": name, "clients": clients, "value": value, "bound": bound, "is_met": is_met})

    if top > 1:
        value = ratios[top]["tokens_per_s_vs_one_client"]
        check("aggregate tok/s vs one client's", top, value, f">= {MIN_TOKENS_PER_S_VS_ONE_CLIENT}",
              value is not None and value >= MIN_TOKENS_PER_S_VS_ONE_CLIENT)
        for key in ("ttft_p50_vs_baseline", "ttft_p95_vs_baseline"):
            value = ratios[top][key]
            check(key.replace("_vs_", " vs ").replace("_", " "), top, value, f"<= {MAX_TTFT_VS_BASELINE}",
                  value is not None and value <= MAX_TTFT_VS_BASELINE)
    if 1 in ratios:
        value = ratios[1]["ttft_p50_vs_baseline"]
        check("ttft p50 vs baseline", 1, value, f"<= {1 + ONE_CLIENT_TOLERANCE}",
              value is not None and value <= 1 + ONE_CLIENT_TOLERANCE)
        value = ratios[1]["decode_tokens_per_s_vs_baseline"]
        check("decode tok/s vs baseline", 1, value, f">= {1 - ONE_CLIENT_TOLERANCE}",
              value is not None and value >= 1 - ONE_CLIENT_TOLERANCE)
    return checks


# ---- tables ----------------------------------------------------------------------------------


def print_tables(summary: dict[str, Any]) -> None:
    prompt = [row["mean_prompt_tokens"] for rows in summary["results"].values() for row in rows
              if row["mean_prompt_tokens"] is not None]
    model = summary["servers"][Role.SERVER.value]["model"]
    print(f"\nserver bench: {model}, {summary['questions']} questions x {summary['passages']} passages "
          f"(prompt ~{mean(prompt) if prompt else 0:.0f} tokens), {summary['max_tokens']} tokens, "
          f"{summary['repeats']} repeat(s), mode {summary['mode'] or 'server default'}")
    rows = sorted(((row["clients"], role, row) for role, rows in summary["results"].items() for row in rows),
                  key=lambda item: (item[0], item[1] != Role.SERVER.value))
    print(table(["server", "clients", "TTFT p50", "TTFT p95", "ITL p50", "ITL p95", "ITL max", "queue p50", "tok/s",
                 "req/s", "decode tok/s", "errors"], (
        [role, clients, fmt(row["ttft_p50_ms"], 0), fmt(row["ttft_p95_ms"], 0), fmt(row["itl_p50_ms"]),
         fmt(row["itl_p95_ms"]), fmt(row.get("itl_max_ms"), 0), fmt(row["queue_p50_ms"], 0), fmt(row["tokens_per_s"]),
         fmt(row["requests_per_s"], 2), fmt(row["decode_tokens_per_s_p50"]), row["num_errors"]]
        for clients, role, row in rows)))
    ratios = ("ttft_p50_vs_baseline", "ttft_p95_vs_baseline", "tokens_per_s_vs_baseline", "tokens_per_s_vs_one_client",
              "baseline_tokens_per_s_vs_one_client")
    print("\n" + table(["clients", "TTFT p50 vs base", "TTFT p95 vs base", "tok/s vs base", "tok/s vs 1 client",
                        "(baseline)"], ([row["clients"], *(fmt(row[key], 2, "x") for key in ratios)]
                                        for row in summary["ratios"])))
    for check in summary["targets"]:
        print(f"target: {check['name']} at {check['clients']} client(s) {check['bound']}: {check['value']:.2f} "
              f"{'met' if check['is_met'] else 'NOT met'}")
