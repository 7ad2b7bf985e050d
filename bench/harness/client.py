"""The server benches' HTTP client: a server's readiness, model and /metrics, questions' passages ingested (one
passage, one chunk, KV precomputed), a question set's documents uploaded, documents deleted, background KV
waited for, and one streamed /v1/query timing each event's arrival here (time.perf_counter)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Sequence

import httpx

from app.commands.ask import iter_events
from app.commands.client import error_message
from bench.harness.data import Question
from bench.harness.sets import SetDocument


WARMUP_TOKENS = 4  # a warm-up answer's length: a server's first requests pay one-off costs, not counted


class QueryFailed(Exception):
    """A query answered with an HTTP error or an in-stream `error` event; the message is the server's."""


def chunk_ids(qi: int, question: Question) -> list[str]:
    """The chunk ids `ingest` gives question `qi`'s passages (one passage, one chunk)."""
    return [f"q{qi}p{pi}#0" for pi in range(len(question.passages))]


def ingest(client: httpx.Client, questions: Sequence[Question]) -> float:
    """Ingest every question's passages (one passage, one chunk, KV precomputed); seconds taken."""
    start = time.perf_counter()
    for qi, question in enumerate(questions):
        docs = [{"id": f"q{qi}p{pi}", "title": text.split("\n", 1)[0][:200], "text": text}
                for pi, text in enumerate(question.passages)]
        response = client.post("/v1/documents", json={"documents": docs, "chunking": "none", "precompute": True})
        if response.status_code != 201:
            raise QueryFailed(f"ingesting question {qi}'s passages: {error_message(response)}")
    return time.perf_counter() - start


def ready_model(client: httpx.Client) -> str:
    """The model a ready server serves; QueryFailed where it is not ready."""
    ready = client.get("/readyz")
    if ready.status_code != 200:
        raise QueryFailed(f"{client.base_url} is not ready: {ready.text[:300]}")
    return client.get("/v1/models").json()["data"][0]["id"]


def ingest_ready(url: str, headers: dict[str, str], timeout_s: float, questions: Sequence[Question]) -> tuple[str, float]:
    """A ready server's model, and the seconds ingesting `questions`' passages took (see `ingest`)."""
    with httpx.Client(base_url=url, headers=headers, timeout=timeout_s) as client:
        model = ready_model(client)
        return model, ingest(client, questions)


def metrics(client: httpx.Client, prefix: str = "ragblend_") -> dict[str, dict[str, float]]:
    """The server's /metrics families named `prefix`...: family (less the prefix) -> its samples by their
    `tier` label ("" for none)."""
    from prometheus_client.parser import text_string_to_metric_families

    response = client.get("/metrics")
    response.raise_for_status()
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if family.name.startswith(prefix) and not sample.name.endswith("_created"):
                out.setdefault(family.name.removeprefix(prefix), {})[sample.labels.get("tier", "")] = sample.value
    return out


async def upload_documents(client: httpx.AsyncClient, documents: Sequence[SetDocument], kv_timeout_s: float
                           ) -> dict[str, dict]:
    """A question set's documents through POST /v1/documents/files, one file a request, under their set
    ids; then waits for any background KV. Per document: format, pages, chunks, seconds."""
    out: dict[str, dict] = {}
    for doc in documents:
        start = time.perf_counter()
        response = await client.post("/v1/documents/files", files=[("files", (doc.path.name, doc.path.read_bytes()))],
                                     data={"ids": doc.id})
        if response.status_code != 201:
            raise QueryFailed(f"uploading {doc.path.name}: {error_message(response)}")
        (document,) = response.json()["documents"]
        out[doc.id] = {"format": document["format"], "num_pages": document.get("num_pages"),
                       "num_chunks": len(document["chunks"]), "num_tokens": sum(c["num_tokens"] for c in document["chunks"]),
                       "upload_s": time.perf_counter() - start, "kv_pending": document.get("kv_pending", False)}
    await wait_for_kv(client, [d for d, info in out.items() if info["kv_pending"]], kv_timeout_s)
    return out


async def delete_documents(client: httpx.AsyncClient, ids: Sequence[str]) -> None:
    for doc_id in ids:
        response = await client.delete(f"/v1/documents/{doc_id}")
        if response.status_code != 200:
            raise QueryFailed(f"deleting document {doc_id}: {error_message(response)}")


async def wait_for_kv(client: httpx.AsyncClient, doc_ids: Sequence[str], timeout_s: float, poll_s: float = 0.2) -> None:
    """Until every chunk of `doc_ids` has its KV (a large document's is computed in the background, and
    a question asked meanwhile would wait for it)."""
    deadline = time.monotonic() + timeout_s
    for doc_id in doc_ids:
        while True:
            response = await client.get(f"/v1/documents/{doc_id}")
            if response.status_code != 200:
                raise QueryFailed(f"reading document {doc_id}: {error_message(response)}")
            if all(chunk["kv_cached"] for chunk in response.json()["chunks"]):
                break
            if time.monotonic() > deadline:
                raise QueryFailed(f"document {doc_id}'s KV not computed within {timeout_s:.0f} s (--kv-timeout)")
            await asyncio.sleep(poll_s)


@dataclass(frozen=True)
class StreamedAnswer:
    """One streamed answer, times in perf_counter seconds as the client saw them."""

    sent_s: float  # the request went out
    token_s: tuple[float, ...]  # each `token` event arrived
    end_s: float  # the stream ended
    answer: str
    done: dict[str, Any]  # the `done` event: mode, finish_reason, usage, timings, plan
    sources: tuple[dict[str, Any], ...] = ()  # the `sources` event: the chunks the prompt held, with their text
    # the `sources` event's question words no searched chunk holds; None: the server does not say (an older build)
    unmatched_words: tuple[str, ...] | None = None

    @property
    def ttft_ms(self) -> float:
        """Request sent to the first token received (the whole stream when no token came)."""
        return ((self.token_s[0] if self.token_s else self.end_s) - self.sent_s) * 1000

    @property
    def total_ms(self) -> float:
        return (self.end_s - self.sent_s) * 1000

    @property
    def inter_token_ms(self) -> list[float]:
        """Gaps between consecutive token events."""
        return [(b - a) * 1000 for a, b in zip(self.token_s, self.token_s[1:])]

    @property
    def num_completion_tokens(self) -> int:
        return int(self.done.get("usage", {}).get("completion_tokens", len(self.token_s)))

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first over the time after the first (None for answers of one token)."""
        decode_s = (self.total_ms - self.ttft_ms) / 1000
        n = self.num_completion_tokens
        return (n - 1) / decode_s if n > 1 and decode_s > 0 else None

    @property
    def finish_reason(self) -> str | None:
        """'stop', 'length' (ran to max_tokens), ..., as the `done` event says."""
        return self.done.get("finish_reason")

    @property
    def timings(self) -> dict[str, float]:
        return self.done.get("timings", {})

    @property
    def usage(self) -> dict[str, int]:
        return self.done.get("usage", {})


async def stream_query(client: httpx.AsyncClient, body: dict[str, Any]) -> StreamedAnswer:
    """POST /v1/query with stream=true; raises QueryFailed with the server's message on an error."""
    pieces: list[str] = []
    token_s: list[float] = []
    done: dict[str, Any] = {}
    sources: list[dict[str, Any]] = []
    unmatched: list[str] | None = None
    sent = time.perf_counter()
    async with client.stream("POST", "/v1/query", json={**body, "stream": True}) as response:
        if response.status_code != 200:
            await response.aread()
            raise QueryFailed(error_message(response))
        lines = []
        async for line in response.aiter_lines():
            if line.startswith("event: token"):
                token_s.append(time.perf_counter())
            lines.append(line)
    end = time.perf_counter()
    for kind, data in iter_events(lines):
        if kind == "token":
            pieces.append(data["text"])
        elif kind == "sources":
            sources, unmatched = data["sources"], data.get("unmatched_words")
        elif kind == "done":
            done = data
        elif kind == "error":
            raise QueryFailed(data["error"]["message"])
    if not done:
        raise QueryFailed("the stream ended without a done event")
    return StreamedAnswer(sent, tuple(token_s), end, "".join(pieces), done, tuple(sources),
                          None if unmatched is None else tuple(unmatched))

