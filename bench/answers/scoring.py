"""`ragblend bench answers`' scoring, pairing (an exact sign test) and tables: pure functions of the records."""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any, Sequence

from scipy.stats import binomtest

from bench.answers.settings import Setting
from bench.harness.client import StreamedAnswer
from bench.harness.output import fmt, table
from bench.harness.sets import REFUSAL, SetQuestion, collapse, contains_gold
from bench.harness.stats import safe_median

PARTS = {"docs_test": "documents, test half", "docs_dev": "documents, dev half", "musique": "MuSiQue"}


def answer_record(streamed: StreamedAnswer) -> dict[str, Any]:
    """What every scored answer keeps, whatever the part."""
    return {"answer": streamed.answer, "finish_reason": streamed.finish_reason,
            "ran_to_cap": streamed.finish_reason == "length", "ttft_ms": streamed.ttft_ms,
            "server_ttft_ms": streamed.timings.get("ttft_ms"), "mode": streamed.done.get("mode"),
            "completion_tokens": streamed.num_completion_tokens, "prompt_tokens": streamed.usage.get("prompt_tokens"),
            "sources": [s["document_id"] for s in streamed.sources],
            "chunks": [s["chunk_id"] for s in streamed.sources],
            # each source's cosine similarity to the question (the relevance floor's measure): how close an
            # out-of-scope question's best chunk comes to an in-scope one's
            "scores": [s.get("score") for s in streamed.sources],
            # the answer's numbers and names no source holds (app/rag/grounding.py); None: the server
            # does not check (a build before the check)
            "unsupported": streamed.done.get("unsupported"),
            # the question's words no searched chunk holds (retrieval.flag_unmatched_words); None: not said
            "unmatched_words": None if streamed.unmatched_words is None else list(streamed.unmatched_words)}


def score_document_answer(question: SetQuestion, streamed: StreamedAnswer) -> dict[str, Any]:
    """In scope: right, inside, the right source; out of scope (no document states it): right when the
    answer refuses, and no inside or source score (None)."""
    docs = [s["document_id"] for s in streamed.sources]
    is_refusal = REFUSAL.search(collapse(streamed.answer)) is not None
    if question.is_out_of_scope:
        return {"right": question.is_right(streamed.answer), "inside": None, "source_top": None, "source_any": None,
                "refused": is_refusal, "out_of_scope": True}
    return {"right": question.is_right(streamed.answer),
            "inside": question.is_inside(s["text"] for s in streamed.sources),
            "source_top": bool(docs) and docs[0] == question.document, "source_any": question.document in docs,
            "refused": is_refusal, "out_of_scope": False}


def score_musique_answer(golds: Sequence[str], expected: set[str], streamed: StreamedAnswer) -> dict[str, Any]:
    """`expected`: the question's passages that hold a gold answer (no source is right when none does:
    None then)."""
    docs = [s["document_id"] for s in streamed.sources]
    return {"right": contains_gold(streamed.answer, golds),
            "inside": any(contains_gold(s["text"], golds) for s in streamed.sources),
            "refused": REFUSAL.search(collapse(streamed.answer)) is not None,
            "source_top": (bool(docs) and docs[0] in expected) if expected else None,
            "source_any": bool(expected & set(docs)) if expected else None}


def share(flags: Sequence[bool | None]) -> float | None:
    scored = [f for f in flags if f is not None]
    return sum(scored) / len(scored) if scored else None


def part_row(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One setting's figures over one part's answers: failed requests counted apart, in no rate; the in-scope
    and out-of-scope questions apart (the columns: docs/benchmarks/answers.md#scoring)."""
    done = [r for r in records if r["error"] is None]
    ok = [r for r in done if not r.get("out_of_scope")]
    oos = [r for r in done if r.get("out_of_scope")]
    ttfts = sorted(r["ttft_ms"] for r in ok)
    inside = [r for r in ok if r["inside"]]
    return {
        "num_questions": len({r["question"] for r in records}), "num_answers": len(ok),
        "num_errors": len(records) - len(done), "errors": [r["error"] for r in records if r["error"] is not None][:5],
        "right": share([r["right"] for r in ok]), "num_right": sum(r["right"] for r in ok),
        "inside": share([r["inside"] for r in ok]), "num_inside": len(inside),
        "right_when_inside": share([r["right"] for r in inside]),
        "source_top": share([r["source_top"] for r in ok]), "source_any": share([r["source_any"] for r in ok]),
        "num_source_scored": sum(r["source_top"] is not None for r in ok),
        "ran_to_cap": share([r["ran_to_cap"] for r in ok]), "num_ran_to_cap": sum(r["ran_to_cap"] for r in ok),
        "refused": share([r.get("refused", False) for r in ok]), "num_refused": sum(r.get("refused", False) for r in ok),
        "num_out_of_scope": len(oos), "oos_refused": share([r["right"] for r in oos]),
        "num_oos_refused": sum(r["right"] for r in oos),
        "num_flagged": _num_flagged(ok), "num_right_flagged": _num_flagged([r for r in ok if r["right"]]),
        "num_oos_flagged": _num_flagged(oos),
        "num_unmatched": _num_unmatched(ok), "num_right_unmatched": _num_unmatched([r for r in ok if r["right"]]),
        "num_oos_unmatched": _num_unmatched([r for r in oos if not r["right"]]),
        "num_oos_unwarned": sum(not r["right"] and not r.get("unsupported") and not r.get("unmatched_words")
                                for r in oos),
        "ttft_p50_ms": safe_median(ttfts),
        "ttft_p90_ms": statistics.quantiles(ttfts, n=10, method="inclusive")[-1] if len(ttfts) > 1 else safe_median(ttfts),
        "server_ttft_p50_ms": safe_median(r["server_ttft_ms"] for r in ok if r["server_ttft_ms"] is not None),
        "completion_tokens_mean": share([r["completion_tokens"] for r in ok]),
        "prompt_tokens_mean": share([r["prompt_tokens"] for r in ok if r.get("prompt_tokens") is not None]),
        "modes": dict(Counter(r["mode"] for r in ok)),
    }


def _num_flagged(records: Sequence[dict[str, Any]]) -> int:
    return sum(bool(r.get("unsupported")) for r in records)


def _num_unmatched(records: Sequence[dict[str, Any]]) -> int:
    return sum(bool(r.get("unmatched_words")) for r in records)


def results(records: Sequence[dict[str, Any]], settings: Sequence[Setting]) -> dict[str, dict[str, dict[str, Any]]]:
    """part -> setting -> row, for the parts that ran."""
    out = {}
    for part in PARTS:
        rows = {s.name: part_row([r for r in records if r["part"] == part and r["setting"] == s.name]) for s in settings}
        if any(row["num_answers"] or row["num_errors"] for row in rows.values()):
            out[part] = rows
    return out


def paired_row(records: Sequence[dict[str, Any]], against: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One setting's right answers against another's on the same in-scope questions and repeats; `p_value`:
    the exact two-sided sign test over those only one got right (McNemar's exact test)."""
    def keyed(rows: Sequence[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
        return {(r["question"], r["repeat"]): r for r in rows if r["error"] is None and not r.get("out_of_scope")}

    mine, theirs = keyed(records), keyed(against)
    pairs = [(mine[k], theirs[k]) for k in mine.keys() & theirs.keys()]
    only_this = sum(a["right"] and not b["right"] for a, b in pairs)
    only_against = sum(b["right"] and not a["right"] for a, b in pairs)
    discordant = only_this + only_against
    return {
        "num_pairs": len(pairs), "both_right": sum(a["right"] and b["right"] for a, b in pairs),
        "only_this": only_this, "only_against": only_against,
        "neither": sum(not a["right"] and not b["right"] for a, b in pairs),
        "same_answer": sum(a["answer"] == b["answer"] for a, b in pairs),
        "p_value": float(binomtest(only_this, discordant, 0.5).pvalue) if discordant else 1.0,
    }


def paired(records: Sequence[dict[str, Any]], settings: Sequence[Setting]) -> dict[str, dict[str, Any]]:
    """part -> {"against": the first setting, "settings": every other setting -> its paired_row}."""
    if len(settings) < 2:
        return {}
    first, out = settings[0].name, {}
    for part in PARTS:
        in_part = [r for r in records if r["part"] == part]
        if not in_part:
            continue
        against = [r for r in in_part if r["setting"] == first]
        out[part] = {"against": first, "settings": {
            s.name: paired_row([r for r in in_part if r["setting"] == s.name], against) for s in settings[1:]}}
    return out


def _count(num: int, row: dict[str, Any], denominator: str = "num_answers") -> str:
    return f"{num}/{row[denominator]}" if row[denominator] else "-"


def _cells(row: dict[str, Any]) -> list[str]:
    """One setting's row of the table, its shares as counts of what they are shares of."""
    def of(share: str, denominator: str) -> str:
        return _count(round((row[share] or 0) * row[denominator]), row, denominator)

    oos = "num_out_of_scope"
    return [_count(row["num_right"], row), _count(row["num_inside"], row), of("right_when_inside", "num_inside"),
            of("source_top", "num_source_scored"), of("source_any", "num_source_scored"),
            _count(row["num_ran_to_cap"], row), _count(row["num_refused"], row), _count(row["num_oos_refused"], row, oos),
            _count(row["num_flagged"], row), str(row["num_right_flagged"]), _count(row["num_oos_flagged"], row, oos),
            _count(row["num_unmatched"], row), str(row["num_right_unmatched"]), _count(row["num_oos_unmatched"], row, oos),
            _count(row["num_oos_unwarned"], row, oos), fmt(row["prompt_tokens_mean"], 0),
            fmt(row["ttft_p50_ms"], 0, " ms"), str(row["num_errors"])]


def print_tables(summary: dict[str, Any]) -> None:
    print(f"\nanswers bench: {summary['model']}, {len(summary['documents'])} documents, "
          f"max_tokens {summary['max_tokens'] or 'the server default'}, {summary['repeats']} repeat(s)")
    for part, rows in summary["results"].items():
        first = next(iter(rows.values()))
        print(f"\n{PARTS[part]} ({first['num_questions']} questions)")
        print(table(["setting", "right", "inside", "right|in", "top src", "any src", "to cap", "refused", "oos ok",
                     "flagged", "right fl", "oos fl", "unmatch", "right um", "oos um", "unwarned", "prompt", "TTFT p50",
                     "errors"], ([name, *_cells(row)] for name, row in rows.items())))
        pairs = summary.get("paired", {}).get(part)
        if pairs:
            print(f"paired against {pairs['against']} (right only here / only there, sign test p; answers alike):")
            width = max(map(len, pairs["settings"]))
            for name, pair in pairs["settings"].items():
                print(f"  {name:<{width}} +{pair['only_this']} / -{pair['only_against']}, p {pair['p_value']:.2f}; "
                      f"alike {pair['same_answer']}/{pair['num_pairs']}")
