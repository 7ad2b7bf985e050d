"""Shared options of the commands that talk to a running server (ingest, ask)."""

from __future__ import annotations

import argparse
import os

import httpx


def add_client_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=os.environ.get("RAGBLEND_URL", "http://127.0.0.1:8000"),
                        help="server URL (env RAGBLEND_URL)")
    parser.add_argument("--api-key", default=os.environ.get("RAGBLEND_API_KEY"),
                        help="API key, if the server requires one (env RAGBLEND_API_KEY)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")


def make_client(args: argparse.Namespace) -> httpx.Client:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    return httpx.Client(base_url=args.url, headers=headers, timeout=args.timeout)


def error_message(response: httpx.Response) -> str:
    try:
        error = response.json()["error"]
        return f"HTTP {response.status_code} {error['type']}: {error['message']}"
    except (ValueError, KeyError, TypeError):
        return f"HTTP {response.status_code}: {response.text[:300]}"


def describe_transport_error(exc: BaseException) -> str | None:
    """One line for a server that cannot be reached (down, wrong URL, too slow); None for other errors."""
    if not isinstance(exc, httpx.TransportError):
        return None
    url = exc.request.url if getattr(exc, "_request", None) is not None else "the server"
    if isinstance(exc, httpx.TimeoutException):
        return f"no answer from {url} in time ({type(exc).__name__}); a larger --timeout may help"
    if isinstance(exc, httpx.ConnectError):
        return f"cannot reach the server at {url}: {exc} (is `ragblend serve` running? see --url)"
    return f"connection to {url} failed: {type(exc).__name__}: {exc}"
