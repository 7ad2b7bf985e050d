"""Retrieval through the API, on live servers (tiny random model, real MiniLM): the per-request
`retrieval` mode on /v1/query and /v1/chat/completions (422 for an unknown one), the relevance floor
dropping a far-below chunk, an out-of-scope question answered with the fixed not-found answer and no
sources (JSON and both streams, without the model), as is one naming what no document mentions (with a
warning naming it), a question word no document uses (answered, with a warning naming it, per collection),
`structure` chunking of an uploaded PDF (no chunk spans two pages), and the warnings bad input gets: blank and unreadable PDF pages, another language."""

from __future__ import annotations

import json

import httpx
import pytest

from app.testing import LiveServer
from configs.settings import load_settings
from tests.docgen import make_pdf

TINY = {"name": "random:tiny-llama", "device": "cpu"}
LIGHTHOUSE = "Which colour is the Zanthorpe lighthouse?"
COAST = ("The harbour beacon on the northern coast is painted red and white in broad stripes. "
         "Coastal towers that guide ships at night are often whitewashed so sailors see them by day.")
RARE = "Zanthorpe holds a cattle market every Tuesday morning."
VAULT = "What is the secret code of the blue vault?"
DOCUMENTS = [{"id": "coast", "text": COAST}, {"id": "town", "text": RARE},
             {"id": "vault", "text": "The secret code of the blue vault is 4812."},
             {"id": "bread", "text": "Bread dough rises best in a warm kitchen before it is baked."}]
NOT_FOUND = "I could not find this in the documents."


def _server(tmp_path_factory, name: str, **retrieval):
    settings = load_settings(data_dir=tmp_path_factory.mktemp(name), model=TINY, generation={"max_tokens": 2},
                             retrieval={"mode": "dense", "chunking": "structure", "chunk_tokens": 64, **retrieval})
    return LiveServer(settings)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """No relevance floor, and questions naming what no document mentions answered too."""
    with _server(tmp_path_factory, "plain", min_score=-1.0, score_margin=2.0, refuse_unmentioned_names=False) as live, httpx.Client(base_url=live.url, timeout=120) as http:
        assert http.post("/v1/documents", json={"documents": DOCUMENTS}).status_code == 201
        yield http


@pytest.fixture(scope="module")
def floored(tmp_path_factory):
    """A relevance floor: nothing under 0.3 cosine, nothing 0.3 below the best."""
    with _server(tmp_path_factory, "floor", min_score=0.3, score_margin=0.3, not_found_answer=NOT_FOUND) as live, \
            httpx.Client(base_url=live.url, timeout=120) as http:
        assert http.post("/v1/documents", json={"documents": DOCUMENTS}).status_code == 201
        yield http


def _query_docs(http: httpx.Client, **body) -> list[str]:
    response = http.post("/v1/query", json={"max_tokens": 1, **body})
    assert response.status_code == 200, response.text
    return [s["document_id"] for s in response.json()["sources"]]


def _chat_docs(http: httpx.Client, question: str, **extra) -> list[str]:
    response = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": question}],
                                                       "max_tokens": 1, **extra})
    assert response.status_code == 200, response.text
    return [s["document_id"] for s in response.json()["sources"]]


def test_the_retrieval_mode_is_chosen_per_request_on_both_endpoints(plain):
    assert _query_docs(plain, question=LIGHTHOUSE, top_k=1) == ["coast"]  # the server's mode: dense
    assert _query_docs(plain, question=LIGHTHOUSE, top_k=1, retrieval="lexical") == ["town"]
    assert _query_docs(plain, question=LIGHTHOUSE, top_k=1, retrieval="hybrid") == ["town"]
    assert _query_docs(plain, question=LIGHTHOUSE, top_k=1, retrieval="dense") == ["coast"]
    assert _chat_docs(plain, LIGHTHOUSE, top_k=1) == ["coast"]
    assert _chat_docs(plain, LIGHTHOUSE, top_k=1, retrieval="lexical") == ["town"]
    with plain.stream("POST", "/v1/query", json={"question": LIGHTHOUSE, "top_k": 1, "retrieval": "lexical",
                                                 "stream": True, "max_tokens": 1}) as streamed:
        first = next(line for line in streamed.iter_lines() if line.startswith("data:"))
    assert [s["document_id"] for s in json.loads(first[5:])["sources"]] == ["town"]


def test_an_unknown_retrieval_mode_is_a_422_on_both_endpoints(plain):
    query = plain.post("/v1/query", json={"question": LIGHTHOUSE, "retrieval": "fuzzy"})
    chat = plain.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "retrieval": 3})
    for response in (query, chat):
        assert response.status_code == 422, response.text
        assert "retrieval" in response.json()["error"]["message"]


def test_the_relevance_floor_drops_a_far_below_chunk(plain, floored):
    assert _query_docs(plain, question=VAULT, top_k=2) == ["vault", "coast"]  # without a floor: two chunks
    response = floored.post("/v1/query", json={"question": VAULT, "top_k": 2, "max_tokens": 1}).json()
    assert [s["document_id"] for s in response["sources"]] == ["vault"]  # the other is 0.7 below the best
    assert response["sources"][0]["score"] > 0.8 and response["mode"] is not None


def test_an_out_of_scope_question_gets_the_not_found_answer_and_no_sources(floored, plain):
    question = "Who painted the Mona Lisa?"
    answer = floored.post("/v1/query", json={"question": question}).json()
    assert answer["answer"] == NOT_FOUND and answer["sources"] == [] and answer["mode"] is None
    assert answer["finish_reason"] == "stop" and answer["usage"]["prompt_tokens"] == 0
    chat = floored.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": question}]}).json()
    assert chat["choices"][0]["message"]["content"] == NOT_FOUND and chat["sources"] == [] and chat["mode"] is None
    with floored.stream("POST", "/v1/query", json={"question": question, "stream": True}) as streamed:
        events = [json.loads(line[5:]) for line in streamed.iter_lines() if line.startswith("data:")]
    assert events[0]["sources"] == [] and events[1] == {"text": NOT_FOUND} and events[-1]["mode"] is None
    with floored.stream("POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": question}],
                                                              "stream": True}) as streamed:
        lines = [line[5:].strip() for line in streamed.iter_lines() if line.startswith("data:")]
    chunks = [json.loads(line) for line in lines[:-1]]
    assert lines[-1] == "[DONE]" and chunks[0]["sources"] == []
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == NOT_FOUND
    # without a floor the model answers whatever was retrieved (what the floor prevents)
    assert plain.post("/v1/query", json={"question": question, "max_tokens": 1}).json()["sources"] != []
    # named chunks are never refused: the caller chose them
    named = floored.post("/v1/query", json={"question": question, "chunk_ids": ["bread#0"], "max_tokens": 1}).json()
    assert [s["chunk_id"] for s in named["sources"]] == ["bread#0"] and named["mode"] is not None


def test_a_question_naming_what_no_document_mentions_is_not_found_with_a_warning(floored, plain):
    question = "What is the secret code of the blue vault in OpenVault2?"  # the vault's chunk is close; the name is not
    warning = "no document in the searched collections mentions 'OpenVault2': answered as not found"
    answer = floored.post("/v1/query", json={"question": question}).json()
    assert answer["answer"] == NOT_FOUND and answer["sources"] == [] and answer["mode"] is None
    assert answer["warnings"] == [warning] and answer["usage"]["prompt_tokens"] == 0
    chat = floored.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": question}]}).json()
    assert chat["choices"][0]["message"]["content"] == NOT_FOUND and chat["sources"] == [] and chat["warnings"] == [warning]
    with floored.stream("POST", "/v1/query", json={"question": question, "stream": True}) as streamed:
        events = [json.loads(line[5:]) for line in streamed.iter_lines() if line.startswith("data:")]
    assert events[0]["sources"] == [] and events[0]["warnings"] == [warning] and events[1] == {"text": NOT_FOUND}
    with floored.stream("POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": question}],
                                                              "stream": True}) as streamed:
        chunks = [json.loads(line[5:]) for line in streamed.iter_lines() if line.startswith("data:") and "[DONE]" not in line]
    assert chunks[0]["warnings"] == [warning]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == NOT_FOUND
    # a name the documents hold, in another case, is no reason: the vault's chunk answers
    assert _query_docs(floored, question="What is the secret code of the BLUE VAULT?", top_k=1) == ["vault"]
    # off (refuse_unmentioned_names: false), or with named chunks, the model answers over what was found
    assert _query_docs(plain, question=question, top_k=1) == ["vault"]
    named = floored.post("/v1/query", json={"question": question, "chunk_ids": ["vault#0"], "max_tokens": 1}).json()
    assert [s["chunk_id"] for s in named["sources"]] == ["vault#0"] and named["warnings"] == []


def unmatched_warning(*words: str) -> str:
    return ("no document in the searched collections uses the question's word(s) " + ", ".join(f"'{w}'" for w in words)
            + ": they may not cover what was asked; check the answer against the sources")


def test_a_question_word_no_document_uses_is_answered_with_a_warning_naming_it(plain):
    """The question's words (stop words left out) that no chunk of the searched collections holds are listed in
    `unmatched_words`, with a warning, on every response shape; the question is answered all the same."""
    question = "At what hour does the Zanthorpe cattle market open?"  # "hour" and "open": in no document
    warning = unmatched_warning("hour", "open")
    answer = plain.post("/v1/query", json={"question": question, "max_tokens": 1}).json()
    assert answer["unmatched_words"] == ["hour", "open"] and answer["warnings"] == [warning]
    assert answer["sources"] and answer["mode"] is not None  # answered by the model, over what was found
    with plain.stream("POST", "/v1/query", json={"question": question, "max_tokens": 1, "stream": True}) as streamed:
        events = [json.loads(line[5:]) for line in streamed.iter_lines() if line.startswith("data:")]
    assert events[0]["unmatched_words"] == ["hour", "open"] and events[0]["warnings"] == [warning]
    messages = [{"role": "user", "content": question}]
    chat = plain.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()
    assert chat["warnings"] == [warning]
    with plain.stream("POST", "/v1/chat/completions", json={"messages": messages, "max_tokens": 1,
                                                            "stream": True}) as streamed:
        chunks = [json.loads(line[5:]) for line in streamed.iter_lines() if line.startswith("data:") and "[DONE]" not in line]
    assert chunks[0]["warnings"] == [warning]
    text = plain.post("/v1/completions", json={"prompt": question, "max_tokens": 1}).json()
    assert text["warnings"] == [warning]
    # every word held, stemmed as the index reads it ("hold" by "holds"), in another case: nothing to say
    held = plain.post("/v1/query", json={"question": "When does ZANTHORPE hold its cattle market?", "max_tokens": 1}).json()
    assert held["unmatched_words"] == [] and held["warnings"] == []
    # named chunks are the caller's choice: not checked
    named = plain.post("/v1/query", json={"question": question, "chunk_ids": ["town#0"], "max_tokens": 1}).json()
    assert named["unmatched_words"] == [] and named["warnings"] == []


def test_unmatched_words_are_read_in_the_searched_collections_only(tmp_path_factory):
    """A word another collection holds is still unmatched in this one: the check says nothing of what
    other collections hold; and with the check off nothing is listed."""
    for is_on in (True, False):
        with _server(tmp_path_factory, f"unmatched-{is_on}", min_score=-1.0, score_margin=2.0,
                     flag_unmatched_words=is_on) as live, httpx.Client(base_url=live.url, timeout=120) as http:
            assert http.post("/v1/collections", json={"name": "other"}).status_code == 201
            assert http.post("/v1/documents", json={"documents": DOCUMENTS}).status_code == 201
            assert http.post("/v1/documents", json={"collection": "other", "documents": [
                {"id": "hours", "text": "The market opens at six in the morning, every hour on the hour."}]}).status_code == 201
            question = "At what hour does the Zanthorpe cattle market open?"
            default = http.post("/v1/query", json={"question": question, "max_tokens": 1}).json()
            other = http.post("/v1/query", json={"question": question, "max_tokens": 1, "collection": "other"}).json()
            both = http.post("/v1/query", json={"question": question, "max_tokens": 1,
                                                "collection": ["default", "other"]}).json()
            if is_on:
                assert default["unmatched_words"] == ["hour", "open"]
                assert other["unmatched_words"] == ["zanthorpe", "cattle"]
                assert both["unmatched_words"] == []
            else:
                assert default["unmatched_words"] == other["unmatched_words"] == [] and default["warnings"] == []


def _damaged_page(pdf: bytes, line: str) -> bytes:
    """`pdf` with the page drawing `line` given a content stream pypdf cannot parse (an unclosed array)."""
    good = f"BT /F1 12 Tf 72 720 Td 14 TL ({line}) Tj T* ET".encode()
    bad = f"BT /F1 12 Tf 72 720 Td 14 TL [({line}) Tj T* ET".encode()
    return pdf.replace(b"<< /Length %d >>\nstream\n" % len(good) + good, b"<< /Length %d >>\nstream\n" % len(bad) + bad)


def test_an_uploaded_pdf_chunks_by_page_and_warns_of_blank_and_unreadable_pages(plain):
    pages = [[f"Harbour line {i} tells of the boats." for i in range(8)], [],
             [f"Lighthouse line {i} tells of the lamp." for i in range(8)], ["Broken page line."]]
    pdf = _damaged_page(make_pdf(pages), "Broken page line.")
    response = plain.post("/v1/documents/files", files=[("files", ("harbour.pdf", pdf))])
    assert response.status_code == 201, response.text
    (document,) = response.json()["documents"]
    assert document["num_pages"] == 4 and len(document["warnings"]) == 2
    assert document["warnings"][0].startswith("page 4 could not be read (")
    assert document["warnings"][1].startswith("page 2 has no text (blank, or a scanned image")
    metadata = plain.get("/v1/documents/harbour.pdf").json()["metadata"]
    assert metadata["chunk_pages"] == metadata["chunk_last_pages"]  # no chunk spans two pages
    assert set(metadata["chunk_pages"]) == {1, 3}
    detail = plain.get("/v1/documents/harbour.pdf").json()["chunks"]
    assert all("\f" not in c["text"] for c in detail)


def test_a_document_in_another_language_gets_a_warning(plain):
    german = ("Die Katze sitzt auf der Matte und schaut aus dem Fenster. Der Hund schläft im Garten, weil es heute "
              "sehr warm ist. Am Abend gehen wir mit den Kindern in den Park und essen dort ein Eis. ") * 3
    response = plain.post("/v1/documents", json={"documents": [{"id": "katze", "text": german},
                                                               {"id": "cat", "text": COAST * 2}]}).json()
    warnings = {d["id"]: d["warnings"] for d in response["documents"]}
    assert warnings["cat"] == [] and len(warnings["katze"]) == 1
    assert "looks like German" in warnings["katze"][0] and "all-minilm-l6-v2" in warnings["katze"][0]
    upload = plain.post("/v1/documents/files", files=[("files", ("katze.txt", german.encode()))]).json()
    assert "looks like German" in upload["documents"][0]["warnings"][0]
