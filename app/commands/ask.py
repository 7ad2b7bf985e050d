"""`ragblend ask "question"`: stream an answer from a running server, then print its sources (those the
answer cites as [n] marked)."""

from __future__ import annotations

import argparse
import json
import sys

from typing import Iterable, Iterator

from app.commands.client import add_client_arguments, error_message, make_client
from app.commands.exit_codes import ExitCode


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("question")
    parser.add_argument("--mode", choices=["blend", "full", "prefix", "reuse"])
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--retrieval", choices=["dense", "lexical", "hybrid"], help="default from the server's config")
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--recompute-ratio", help="a number in [0, 1] or 'auto'")
    parser.add_argument("--chunk-id", action="append", dest="chunk_ids", help="use this chunk (repeatable)")
    parser.add_argument("--collection", action="append", dest="collections",
                        help="the knowledge base to ask (repeatable; default: `default`, a scoped key: its own)")
    add_client_arguments(parser)


def request_body(args: argparse.Namespace) -> dict:
    body: dict = {"question": args.question, "stream": True}
    for name in ("mode", "top_k", "retrieval", "max_tokens", "chunk_ids"):
        if getattr(args, name) is not None:
            body[name] = getattr(args, name)
    if args.collections:
        body["collection"] = args.collections
    if args.recompute_ratio is not None:
        body["recompute_ratio"] = args.recompute_ratio if args.recompute_ratio == "auto" else float(args.recompute_ratio)
    return body


def iter_events(lines: Iterable[str]) -> Iterator[tuple[str, dict]]:
    event = "message"
    for line in lines:
        if line.startswith("event:"):
            event = line.partition(":")[2].strip()
        elif line.startswith("data:"):
            yield event, json.loads(line.partition(":")[2].strip())
            event = "message"


def page_label(pages: list[int] | None) -> str:
    """', p. 3' or ', pp. 1-2' for a PDF's chunk; '' otherwise."""
    if not pages:
        return ""
    first, last = pages[0], pages[-1]
    return f", p. {first}" if first == last else f", pp. {first}-{last}"


def run(args: argparse.Namespace) -> int:
    with make_client(args) as client, client.stream("POST", "/v1/query", json=request_body(args)) as response:
        if response.status_code != 200:
            response.read()
            print(error_message(response), file=sys.stderr)
            return ExitCode.FAILED
        shown = show_events(iter_events(response.iter_lines()))
    if shown is None:
        return ExitCode.FAILED
    sources, cited = shown
    print("\nSources:" if sources else "\nSources: none")
    for number, source in enumerate(sources, 1):
        score = "" if source["score"] is None else f" (score {source['score']:.3f})"
        title = f" {source['title']}" if source.get("title") else ""
        mark = " (cited)" if number in cited else ""
        print(f"  [{number}]{mark} {source['chunk_id']}{title}{page_label(source.get('pages'))}{score}: "
              f"{source['text'][:120]!r}")
    return ExitCode.OK


def show_events(events: Iterable[tuple[str, dict]]) -> tuple[list[dict], set[int]] | None:
    """Print a /v1/query stream as it comes: retrieval's warnings (stderr), the answer's tokens, the usage
    line, then the answer's own warnings (stderr: a number or name no source holds); the sources and the
    numbers the answer cites, or None after an `error` event (printed)."""
    sources: list[dict] = []
    cited: set[int] = set()
    for event, data in events:
        if event == "sources":
            sources = data["sources"]
            for warning in data.get("warnings", []):
                print(f"[warning] {warning}", file=sys.stderr)
        elif event == "token":
            print(data["text"], end="", flush=True)
        elif event == "done":
            usage, timings = data["usage"], data["timings"]
            cached = usage.get("prefix_cached_tokens", 0)
            cited = {citation["number"] for citation in data.get("citations", [])}
            print(f"\n\n[{data['mode'] or 'no prefill'}] ttft {timings['ttft_ms']:.0f} ms, total {timings['total_ms']:.0f} ms, "
                  f"{usage['reused_tokens']} reused / {usage['recomputed_tokens']} recomputed prompt tokens"
                  + (f", {cached} from the prefix cache" if cached else ""))
            for warning in data.get("warnings", []):
                print(f"[warning] {warning}", file=sys.stderr)
        elif event == "error":
            print(f"\nerror: {data['error']['message']}", file=sys.stderr)
            return None
    return sources, cited
