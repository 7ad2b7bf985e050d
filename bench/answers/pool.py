"""`ragblend bench answers-pool RUN.json ...`: several `ragblend bench answers` runs (one per question set)
read as one: each part pooled, every setting paired against the first; nothing is asked again
(docs/benchmarks/answers.md#several-sets-as-one-ragblend-bench-answers-pool)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from app.commands.exit_codes import ExitCode
from bench.answers.scoring import paired, print_tables, results
from bench.answers.settings import Setting
from bench.harness.output import emit_summary, refuse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", type=Path, nargs="+", help="JSON files `ragblend bench answers --out` wrote")
    parser.add_argument("--settings", default=None,
                        help="a,b,...: the settings to pool, the first paired against (default: those every run "
                             "asked, in the first run's order)")
    parser.add_argument("--out", type=Path, default=None, help="write the pooled figures here as JSON")


def load_run(path: Path) -> dict[str, Any]:
    """A run's JSON; ValueError naming what is wrong with it."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: {exc}") from exc
    if not isinstance(data, dict) or data.get("bench") != "answers" or not isinstance(data.get("answers"), list):
        raise ValueError(f"{path}: not a `ragblend bench answers` result (no answers recorded)")
    return data


def pooled_settings(runs: list[dict[str, Any]], asked: str | None) -> list[str]:
    """The settings every run asked, in the first run's order, or those named (each asked by every run)."""
    per_run = [[s["name"] for s in run["settings"]] for run in runs]
    common = [name for name in per_run[0] if all(name in names for names in per_run[1:])]
    if asked is None:
        if not common:
            raise ValueError("the runs have no setting in common")
        return common
    named = [name.strip() for name in asked.split(",") if name.strip()]
    missing = [name for name in named if name not in common]
    if missing or not named:
        raise ValueError(f"--settings: not asked by every run: {', '.join(missing) or '(none named)'}")
    return named


def pooled_records(runs: list[dict[str, Any]], sets: list[str], names: list[str]) -> list[dict[str, Any]]:
    """Every run's answers in the settings `names`, each question keyed `set:id` (sets[i]: run i's set)."""
    return [{**r, "set": name, "question": f"{name}:{r['question']}"}
            for run, name in zip(runs, sets) for r in run["answers"] if r["setting"] in names]


def mismatched(runs: list[dict[str, Any]], sets: list[str]) -> str | None:
    """Why these runs cannot be pooled (None: they can): a set given twice would count its questions
    twice; answers of another model, or capped at another length, are not the same measurement."""
    if len(set(sets)) < len(sets):
        return f"a set appears twice ({', '.join(sets)}): its questions would count twice"
    for key, what in (("model", "models"), ("max_tokens", "max_tokens")):
        values = {str(r[key]) for r in runs}
        if len(values) > 1:
            return f"the runs' {what} differ ({', '.join(sorted(values))}): not one measurement"
    return None


def run(args: argparse.Namespace) -> int:
    try:
        runs = [load_run(path) for path in args.runs]
        names = pooled_settings(runs, args.settings)
    except ValueError as exc:
        return refuse("answers-pool", exc, ExitCode.USAGE)
    sets = [Path(r["set"]).parent.name for r in runs]  # each run's question set, by its folder
    mismatch = mismatched(runs, sets)
    if mismatch:
        return refuse("answers-pool", mismatch, ExitCode.USAGE)
    records = pooled_records(runs, sets, names)
    settings = [Setting(name) for name in names]
    summary = {
        "bench": "answers-pool", "runs": [str(p) for p in args.runs], "sets": sets,
        "model": runs[0]["model"], "settings": names, "repeats": max(r["repeats"] for r in runs),
        "max_tokens": runs[0]["max_tokens"],
        "documents": {f"{s}:{d}": doc for s, r in zip(sets, runs) for d, doc in r["documents"].items()},
        "results": results(records, settings),
        "paired": paired(records, settings),
    }
    print_tables(summary)
    emit_summary(summary, args.out, indent=2)
    return ExitCode.OK
