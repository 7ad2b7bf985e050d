"""Truth in answers, on a live server with a tiny random model: a PDF chunk spanning two pages (`tokens`
chunking; `structure` never spans pages: tests/test_retrieval_api.py) cites both (metadata, /v1/query and
/v1/chat/completions sources, `ragblend ask`), and /readyz says ready only once the loading planner's
start-up measurement has run (so the first question waits for nothing). An answer's [n] map to the
prompt's n-th source, a number naming none is dropped, in every response shape."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest

from app.cli import main
from app.commands.ask import iter_events
from app.query.serving import citations_out
from app.rag.citations import citations
from app.rag.grounding import unsupported_terms
from app.chat.serving import ChatCall, ChatService
from app.completions.serving import CompletionService
from app.query.serving import QueryService
from app.rag.types import RagContext, Source
from blend_engine.types import FinishReason, PrefillMode
from runtime.jobs import END, JobStream, new_job
from runtime.types import DoneEvent, Timings, TokenEvent, Usage
from app.testing import LiveServer
from configs.settings import load_settings
from tests.docgen import make_pdf

PAGE_ONE = [f"Page one line {i} tells of the harbour." for i in range(6)]
PAGE_TWO = [f"Page two line {i} tells of the lighthouse." for i in range(6)]
PAGE_THREE = ["Page three stands alone."]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    settings = load_settings(data_dir=tmp_path_factory.mktemp("citations"),
                             model={"name": "random:tiny-llama", "device": "cpu"},
                             retrieval={"chunking": "tokens", "chunk_tokens": 400, "chunk_overlap": 0},
                             generation={"max_tokens": 2})  # tokens: one chunk packs every page
    with LiveServer(settings) as live:
        # ready means the engine is free: the start-up measurement ran before, not after, /readyz said so
        assert live.components.kv_store.planner.is_ready
        assert not live.components.loop.is_busy and live.components.loop.num_waiting == 0
        yield live


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        pdf = make_pdf([PAGE_ONE, PAGE_TWO, PAGE_THREE])
        assert client.post("/v1/documents/files", files=[("files", ("harbour.pdf", pdf))]).status_code == 201
        yield client


def test_a_chunk_spanning_pages_records_its_page_range(http):
    detail = http.get("/v1/documents/harbour.pdf").json()
    assert detail["metadata"]["chunk_pages"][0] == 1
    assert detail["metadata"]["chunk_last_pages"][0] == 3  # one chunk over all three pages


def test_query_and_chat_sources_carry_the_pages(http):
    query = http.post("/v1/query", json={"question": "harbour?", "chunk_ids": ["harbour.pdf#0"]}).json()
    assert query["sources"][0]["pages"] == [1, 3]
    chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "harbour?"}],
                                                   "chunk_ids": ["harbour.pdf#0"]}).json()
    assert chat["sources"][0]["pages"] == [1, 3]
    with http.stream("POST", "/v1/query", json={"question": "harbour?", "chunk_ids": ["harbour.pdf#0"],
                                                "stream": True}) as streamed:
        first = next(line for line in streamed.iter_lines() if line.startswith("data:"))
    assert '"pages":[1,3]' in first.replace(" ", "")
    assert http.post("/v1/documents", json={"documents": [{"id": "plain", "text": "No pages here."}]}).status_code == 201
    plain = http.post("/v1/query", json={"question": "x", "chunk_ids": ["plain#0"]}).json()
    assert plain["sources"][0]["pages"] is None


def test_ragblend_ask_prints_the_pages(server, http, capsys):
    assert main(["ask", "harbour?", "--url", server.url, "--chunk-id", "harbour.pdf#0"]) == 0
    out = capsys.readouterr().out
    assert "harbour.pdf#0" in out and "pp. 1-3" in out, out


def source(number: int, pages: tuple[int, int] | None = None) -> Source:
    return Source(f"doc{number}#0", f"doc{number}", f"Doc {number}", 0.5, f"text {number}", (1, 2), None, pages)


SOURCES = [source(1, (2, 3)), source(2), source(3)]


@pytest.mark.parametrize(("answer", "numbers"), [
    ("The code is 4812 [1].", [1]),
    ("It is 5 [2][1], as [2] says.", [2, 1]),  # each once, in the order first cited
    ("Both say so [1, 3]; see also [ 2 ].", [1, 3, 2]),
    ("Either [3; 1].", [3, 1]),
    ("No source [4], none [0], and [12] either.", []),  # no such source: dropped
    ("Run argv[1] or x[2], then read [3].", [3]),  # an index in code is not a citation
    ("Nothing cited here, [a] nor [].", []),
])
def test_each_cited_number_maps_to_its_source_and_no_other(answer, numbers):
    assert [c.number for c in citations(answer, SOURCES)] == numbers
    assert all(c.source is SOURCES[c.number - 1] for c in citations(answer, SOURCES))


def test_the_api_citations_carry_the_chunk_document_title_and_pages():
    assert [c.model_dump() for c in citations_out("See [1] and [2], not [7].", SOURCES)] == [
        {"number": 1, "chunk_id": "doc1#0", "document_id": "doc1", "title": "Doc 1", "pages": [2, 3]},
        {"number": 2, "chunk_id": "doc2#0", "document_id": "doc2", "title": "Doc 2", "pages": None},
    ]


def expected_citations(answer: str, sources: list[dict]) -> list[dict]:
    """What the response should map, read here from the answer and its sources independently."""
    numbers = dict.fromkeys(int(n) for group in re.findall(r"(?<![A-Za-z_])\[([\d,; ]+)\]", answer)
                            for n in re.split(r"[,;]", group) if n.strip())
    return [{"number": n, "chunk_id": sources[n - 1]["chunk_id"], "document_id": sources[n - 1]["document_id"],
             "title": sources[n - 1]["title"], "pages": sources[n - 1].get("pages")}
            for n in numbers if 1 <= n <= len(sources)]


def without_nulls(items: list[dict]) -> list[dict]:
    """As a streamed chat chunk writes them (null fields left out)."""
    return [{k: v for k, v in item.items() if v is not None} for item in items]


def test_every_response_shape_carries_the_answers_citations(http):
    """/v1/query (JSON and SSE `done`), /v1/chat/completions and /v1/completions (the response and the
    last stream chunk) carry `citations`: the sources the answer itself cites (a random model's answer may cite none)."""
    body = {"chunk_ids": ["harbour.pdf#0"], "max_tokens": 24, "temperature": 1.5, "seed": 1}
    query = http.post("/v1/query", json={"question": "harbour?", **body}).json()
    assert query["citations"] == expected_citations(query["answer"], query["sources"])
    # the pipeline hands the question and the sources to the answer's check (tests/test_grounding.py)
    assert query["unsupported"] == unsupported_terms(query["answer"],
                                                     [s["text"] for s in query["sources"]] + ["harbour?"])
    with http.stream("POST", "/v1/query", json={"question": "harbour?", "stream": True, **body}) as streamed:
        events = list(iter_events(streamed.iter_lines()))
    answer = "".join(data["text"] for kind, data in events if kind == "token")
    assert events[-1][0] == "done" and events[-1][1]["citations"] == expected_citations(answer, events[0][1]["sources"])
    messages = [{"role": "user", "content": "harbour?"}]
    chat = http.post("/v1/chat/completions", json={"messages": messages, **body}).json()
    assert chat["citations"] == expected_citations(chat["choices"][0]["message"]["content"], chat["sources"])
    assert chat["unsupported"] == unsupported_terms(chat["choices"][0]["message"]["content"],
                                                    [s["text"] for s in chat["sources"]] + ["harbour?"])
    with http.stream("POST", "/v1/chat/completions", json={"messages": messages, "stream": True, **body}) as streamed:
        chunks = [json.loads(line[5:]) for line in streamed.iter_lines() if line.startswith("data:") and "[DONE]" not in line]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert chunks[-1]["citations"] == without_nulls(expected_citations(text, chunks[0]["sources"]))
    assert all("citations" not in c for c in chunks[:-1])
    completion = http.post("/v1/completions", json={"prompt": "harbour?", **body}).json()
    assert completion["citations"] == expected_citations(completion["choices"][0]["text"], completion["sources"])
    with http.stream("POST", "/v1/completions", json={"prompt": "harbour?", "stream": True, **body}) as streamed:
        chunks = [json.loads(line[5:]) for line in streamed.iter_lines()
                  if line.startswith("data:") and "[DONE]" not in line]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert chunks[-1]["citations"] == without_nulls(expected_citations(text, chunks[0]["sources"]))
    assert all("citations" not in c for c in chunks[:-1])


def canned_stream(pieces: list[str]) -> JobStream:
    """The events a generation emits (its text in `pieces`, then its DoneEvent), as the engine loop's
    JobStream carries them: what the serving layer reads, with an answer chosen here (no model writes
    [n] on demand). Call inside a running event loop."""
    job = new_job(lambda job: None)
    items: asyncio.Queue = asyncio.Queue()
    for piece in pieces:
        items.put_nowait(TokenEvent(piece))
    items.put_nowait(DoneEvent(Usage(completion_tokens=len(pieces)), Timings(), FinishReason.STOP, PrefillMode.BLEND))
    items.put_nowait(END)
    job.future.set_result(None)
    return JobStream(job, items)


PIECES = ["The code is 4812 [", "1]. See [2", "] and [7], not argv[3]."]  # [n] split across tokens
CITED = [{"number": 1, "chunk_id": "doc1#0", "document_id": "doc1", "title": "Doc 1", "pages": [2, 3]},
         {"number": 2, "chunk_id": "doc2#0", "document_id": "doc2", "title": "Doc 2", "pages": None}]


def test_each_response_shape_maps_the_whole_answers_citations():
    """/v1/query's JSON and SSE `done`, the chat and the completion responses and their last chunks: the
    [n] of the whole answer (pieces joined: a number split across tokens counts), [7] of three sources and
    argv[3] left out."""
    context = RagContext(SOURCES, [], 1.0)
    query = QueryService(load_settings(), None, None)  # no pipeline, no scopes: the stream is canned
    chat = ChatService(load_settings(), None, "m", None)
    legacy = CompletionService(load_settings(), None, "m", None)

    async def run() -> tuple:
        answer = await query.answer(context, canned_stream(PIECES), lambda: asyncio.sleep(0, result=False))
        events = [line async for line in query.events(context, canned_stream(PIECES))]
        call = ChatCall("id", 0, "m", None, context, canned_stream(PIECES))
        completion = await chat.complete(call, lambda: asyncio.sleep(0, result=False))
        chunks = [line async for line in chat.chunks(ChatCall("id", 0, "m", None, context, canned_stream(PIECES)))]
        text = await legacy.complete(ChatCall("id", 0, "m", None, context, canned_stream(PIECES)),
                                     lambda: asyncio.sleep(0, result=False))
        text_call = ChatCall("id", 0, "m", None, context, canned_stream(PIECES))
        text_chunks = [line async for line in legacy.chunks(text_call)]
        return answer, events, completion, chunks, text, text_chunks

    answer, events, completion, chunks, text, text_chunks = asyncio.run(run())
    assert answer.answer == "".join(PIECES) and [c.model_dump() for c in answer.citations] == CITED
    done = json.loads(events[-1].split("data: ", 1)[1])
    assert events[-1].startswith("event: done") and done["citations"] == CITED
    assert [c.model_dump() for c in completion.citations] == CITED
    last = json.loads(chunks[-2].split("data: ", 1)[1])  # before [DONE]; chunks leave out null fields
    assert last["citations"] == without_nulls(CITED) and all("citations" not in c for c in chunks[:-2])
    assert text.choices[0].text == "".join(PIECES) and [c.model_dump() for c in text.citations] == CITED
    last = json.loads(text_chunks[-2].split("data: ", 1)[1])
    assert last["citations"] == without_nulls(CITED) and all("citations" not in c for c in text_chunks[:-2])


def test_the_pipeline_hands_the_question_and_the_history_to_the_answers_check(server, http):
    """What an answer may repeat without a source: the question and every earlier message, as the live
    pipeline builds the context (the check itself: tests/test_grounding.py)."""
    from app.query.protocol import QueryRequest
    from app.query.serving import build_rag_request
    from app.rag.grounding import unsupported_in

    history = [{"role": "user", "content": "Is the code 4812?"}, {"role": "assistant", "content": "It is, per RFC-9."}]
    request = build_rag_request(server.components.settings, "harbour?",
                                QueryRequest(question="harbour?", chunk_ids=["harbour.pdf#0"]), history=history)
    context = asyncio.run(server.components.pipeline.retrieve(request))
    assert context.asked == ("harbour?", "Is the code 4812?", "It is, per RFC-9.") and context.is_support_checked
    assert unsupported_in(context, "The code 4812 per RFC-9 and X11, at line 3 of the harbour.") == ["X11"]
