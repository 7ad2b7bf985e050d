"""An answer's numbers and names that none of its sources holds (app/rag/grounding.py): the rule on
answers chosen here, then every response shape carrying them (`unsupported`, and a warning) for a canned
answer over a real RagContext, and none when the check is off or no model answered."""

from __future__ import annotations

import asyncio
import json

import pytest

from app.chat.serving import ChatCall, ChatService
from app.completions.serving import CompletionService
from app.query.serving import QueryService
from app.rag.grounding import unsupported_in, unsupported_terms, unsupported_warnings
from app.rag.types import RagContext, Source
from configs.settings import load_settings
from tests.test_citations import canned_stream

CHUNK = ("Wget reads /etc/wgetrc, then $HOME/.wgetrc. read_timeout = 900 sets the read timeout; "
         "the default tries is 20. Version v1.21.3 of GNU Wget. See RFC 2616 and **HTTP/1.1**.")


@pytest.mark.parametrize(("answer", "unsupported"), [
    ("The read timeout is 900 seconds [1].", []),  # held; [1] is a citation, not a number
    ("The read timeout is 10 seconds [1].", ["10"]),  # made up
    ("Wget tries 2 times.", ["2"]),  # "20" does not hold "2"
    ("Wget tries 20 times; it is version 1.21.3.", []),  # "v1.21.3" holds the number
    ("It is version 21 or 3.", ["21", "3"]),  # not held by "1.21.3": a digit and a point before them
    ("It reads /etc/wgetrc and READ_TIMEOUT.", []),  # paths and names without case
    ("It reads /etc/wgetrc.d/main and `connect_timeout`.", ["etc/wgetrc.d/main", "connect_timeout"]),
    ("It speaks **HTTP/1.1** per RFC 2616.", []),  # Markdown emphasis is not part of the name
    ("It speaks HTTP/2 and uses OpenSSL.", ["HTTP/2", "OpenSSL"]),
    ("The file is small and the timeout is long.", []),  # ordinary words are not checked
    ("Set wget's tries to 20 (twenty) for 20 hosts.", []),  # each term once
])
def test_the_answers_numbers_and_names_are_checked_against_the_sources(answer, unsupported):
    assert unsupported_terms(answer, [CHUNK]) == unsupported


def test_what_the_question_or_history_says_is_held():
    assert unsupported_terms("Port 8080 of CUPS.", [CHUNK]) == ["8080", "CUPS"]
    assert unsupported_terms("Port 8080 of CUPS.", [CHUNK, "Which port, CUPS?", "I said 8080."]) == []


def source(text: str) -> Source:
    return Source("wgetrc#0", "wgetrc", "wgetrc", 0.5, text, (1, 2), None)


def context(is_support_checked: bool = True, is_nothing_relevant: bool = False) -> RagContext:
    return RagContext([source(CHUNK)], [], 1.0, asked=("What is the read timeout?",),
                      is_support_checked=is_support_checked, is_nothing_relevant=is_nothing_relevant)


def test_the_check_runs_only_on_a_models_answer_with_the_check_on():
    answer = "The read timeout is 10 seconds."
    assert unsupported_in(context(), answer) == ["10"]
    assert unsupported_in(context(is_support_checked=False), answer) == []
    assert unsupported_in(context(is_nothing_relevant=True), answer) == []  # the fixed not-found answer
    assert unsupported_warnings([]) == []
    assert "'10'" in unsupported_warnings(["10"])[0]


PIECES = ["The read time", "out is 1", "0 seconds [1], not 900, with Open", "SSL."]  # terms split across tokens
UNSUPPORTED = ["10", "OpenSSL"]


def data(line: str) -> dict:
    return json.loads(line.split("data: ", 1)[1])


@pytest.mark.parametrize("is_support_checked", [True, False])
def test_every_response_shape_carries_the_unsupported_terms_and_their_warning(is_support_checked):
    """/v1/query's JSON and SSE `done`, the chat and completion responses and their finish chunks: the
    whole answer's terms (pieces joined), a warning naming them after retrieval's own; nothing when off."""
    ctx = RagContext([source(CHUNK)], ["wgetrc#9"], 1.0, asked=("What is the read timeout?",),
                     is_support_checked=is_support_checked)
    expected = UNSUPPORTED if is_support_checked else []
    query = QueryService(load_settings(), None, None)  # no pipeline, no scopes: the stream is canned
    chat = ChatService(load_settings(), None, "m", None)
    legacy = CompletionService(load_settings(), None, "m", None)
    never = lambda: asyncio.sleep(0, result=False)  # noqa: E731 (the client never goes away)

    async def run() -> tuple:
        answer = await query.answer(ctx, canned_stream(PIECES), never)
        events = [line async for line in query.events(ctx, canned_stream(PIECES))]
        completion = await chat.complete(ChatCall("id", 0, "m", None, ctx, canned_stream(PIECES)), never)
        chunks = [line async for line in chat.chunks(ChatCall("id", 0, "m", None, ctx, canned_stream(PIECES)))]
        text = await legacy.complete(ChatCall("id", 0, "m", None, ctx, canned_stream(PIECES)), never)
        text_chunks = [line async for line in legacy.chunks(ChatCall("id", 0, "m", None, ctx, canned_stream(PIECES)))]
        return answer, events, completion, chunks, text, text_chunks

    answer, events, completion, chunks, text, text_chunks = asyncio.run(run())
    dropped = ctx.warnings  # retrieval's warning (a dropped chunk) comes first, before the answer's
    assert len(dropped) == 1
    extra = unsupported_warnings(expected)
    assert answer.unsupported == expected and answer.warnings == dropped + extra
    assert data(events[0])["warnings"] == dropped
    done = data(events[-1])
    assert events[-1].startswith("event: done") and done["unsupported"] == expected and done["warnings"] == extra
    for response in (completion, text):
        assert response.unsupported == expected and response.warnings == dropped + extra
    for lines in (chunks, text_chunks):
        first, last = data(lines[0]), data(lines[-2])  # the last before [DONE]
        assert first["warnings"] == dropped and last["unsupported"] == expected
        assert last.get("warnings") == (extra or None)  # a chunk leaves out null fields
        assert all("unsupported" not in data(line) for line in lines[1:-2])
    if is_support_checked:
        assert "'10', 'OpenSSL'" in extra[0]


def test_ragblend_ask_prints_both_warnings_and_the_answer(capsys):
    """`ragblend ask` prints retrieval's warnings (the `sources` event) and the answer's own (`done`) on
    stderr, the answer on stdout: the stream as /v1/query sends it (tests/test_citations.py runs the
    command against a live server)."""
    from app.commands.ask import show_events

    done = {"mode": "blend", "usage": {"reused_tokens": 9, "recomputed_tokens": 2},
            "timings": {"ttft_ms": 5, "total_ms": 9},
            "citations": [{"number": 1}], "unsupported": ["10"], "warnings": unsupported_warnings(["10"])}
    events = [("sources", {"sources": [{"chunk_id": "wgetrc#0"}], "warnings": ["dropped 1 chunk"]}),
              ("token", {"text": "It is 10 "}), ("token", {"text": "seconds [1]."}), ("done", done)]
    sources, cited = show_events(events)
    out, err = capsys.readouterr()
    assert sources == [{"chunk_id": "wgetrc#0"}] and cited == {1}
    assert out.startswith("It is 10 seconds [1].") and "[blend] ttft 5 ms" in out
    assert err.splitlines() == ["[warning] dropped 1 chunk", f"[warning] {unsupported_warnings(['10'])[0]}"]
    assert show_events([("error", {"error": {"message": "boom"}})]) is None
