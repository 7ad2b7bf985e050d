"""The options benches share, spelled once: the prompts (`--data`, `--questions`, `--passages`), the model
of an engine in this process, a running server to measure, and where the JSON goes."""

from __future__ import annotations

import argparse
import os

from bench.harness.data import DEFAULT_DATA
from configs.enums import WeightFormat


def add_data(parser: argparse.ArgumentParser, questions: int | None, passages: int = 5,
             first_question: int | None = None, questions_help: str = "questions (default: %(default)s)") -> None:
    """`--data` (MuSiQue JSON), `--questions`, `--passages` and, where a default is given, `--first-question`."""
    parser.add_argument("--data", default=DEFAULT_DATA, help="MuSiQue JSON (list of question/answers/ctxs; "
                        "default: %(default)s)")
    parser.add_argument("--questions", type=int, default=questions, help=questions_help)
    if first_question is not None:
        parser.add_argument("--first-question", type=int, default=first_question,
                            help="skip this many questions of the data first (default: %(default)s)")
    parser.add_argument("--passages", type=int, default=passages,
                        help="passages per question, one chunk each (default: %(default)s; 5: a ~3k-token prompt)")


def add_model(parser: argparse.ArgumentParser, threads: int | None = None) -> None:
    """The model of an engine loaded here (`model.*` over the settings) and its CPU threads."""
    parser.add_argument("--model", default=None, help="model.name: smollm2, a HF dir, a .gguf, or "
                        "random:<shape>[:layers] (default: the configured one)")
    parser.add_argument("--device", default=None, choices=["auto", "cpu", "cuda"])
    parser.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--weights", default=None, choices=[w.value for w in WeightFormat],
                        help="linear layers' weight format (model.weights; auto: int4 on CPU where the shapes fit, "
                             "else int8)")
    parser.add_argument("--threads", type=int, default=threads,
                        help="torch CPU threads (default: %(default)s; None: torch's own)")


def add_server(parser: argparse.ArgumentParser) -> None:
    """A running server: `--url` and `--api-key` (env RAGBLEND_URL, RAGBLEND_API_KEY)."""
    parser.add_argument("--url", default=os.environ.get("RAGBLEND_URL", "http://127.0.0.1:8000"),
                        help="the server measured (env RAGBLEND_URL)")
    add_api_key(parser)


def add_api_key(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--api-key", default=os.environ.get("RAGBLEND_API_KEY"),
                        help="API key of the servers, if they require one (env RAGBLEND_API_KEY)")


def add_out(parser: argparse.ArgumentParser, help: str = "also write the JSON summary here") -> None:
    parser.add_argument("--out", default=None, help=help)


def headers(args: argparse.Namespace) -> dict[str, str]:
    """The requests' headers: the bearer key where one is given."""
    return {"Authorization": f"Bearer {args.api_key}"} if getattr(args, "api_key", None) else {}
