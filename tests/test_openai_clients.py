"""The OpenAI clients people use, against a live server (tiny random model, real MiniLM), each picking a
knowledge base by its model name `<model>:<collection>`: LangChain's ChatOpenAI (invoke, and stream
with usage), LlamaIndex's OpenAILike with its default settings (/v1/completions, complete and stream);
and the OpenAI surface they rely on over raw HTTP: the `developer` role, stream_options.include_usage
(a last chunk with empty choices), the fields refused (400), ignored (documented) and unknown (422)."""

from __future__ import annotations

import json

import httpx
import pytest

from app.testing import LiveServer
from configs.settings import load_settings

KEY = "clients-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    settings = load_settings(data_dir=tmp_path_factory.mktemp("clients"), model={"name": "random:tiny-llama", "device": "cpu"},
                             server={"api_key": KEY}, retrieval={"chunking": "none"}, generation={"max_tokens": 3})
    with LiveServer(settings) as live, httpx.Client(base_url=live.url, headers=AUTH, timeout=120) as http:
        for name, text in (("hr", "Every employee gets thirty-one days of paid annual leave."),
                           ("eng", "Canary releases run on Tuesdays at two in the afternoon.")):
            assert http.post("/v1/collections", json={"name": name}).status_code == 201
            assert http.post("/v1/documents", json={"collection": name, "documents": [{"id": name, "text": text}]}
                             ).status_code == 201
        live.model = http.get("/v1/models").json()["data"][0]["id"]
        yield live


def sse_chunks(response: httpx.Response) -> list[dict]:
    return [json.loads(line[5:]) for line in response.iter_lines() if line.startswith("data:") and "[DONE]" not in line]


def test_langchain_chat_openai_invokes_and_streams_in_a_knowledge_base(server):
    langchain_openai = pytest.importorskip("langchain_openai", reason="pip install '.[dev]' (langchain-openai)")
    llm = langchain_openai.ChatOpenAI(base_url=f"{server.url}/v1", api_key=KEY, model=f"{server.model}:hr",
                                      max_retries=0, stream_usage=True)
    answer = llm.invoke("How many days of annual leave?")
    assert answer.content and answer.usage_metadata["output_tokens"] == 3
    assert answer.response_metadata["model_name"] == f"{server.model}:hr"
    chunks = list(llm.stream("How many days of annual leave?"))
    assert "".join(c.content for c in chunks) and sum(1 for c in chunks if c.usage_metadata) == 1
    assert [c.usage_metadata for c in chunks if c.usage_metadata][0]["output_tokens"] == 3
    with pytest.raises(Exception, match="404"):  # a knowledge base that is not there
        langchain_openai.ChatOpenAI(base_url=f"{server.url}/v1", api_key=KEY, model=f"{server.model}:nope",
                                    max_retries=0).invoke("Anything?")


def test_llamaindex_openai_like_completes_with_default_settings(server):
    openai_like = pytest.importorskip("llama_index.llms.openai_like", reason="pip install '.[dev]' (llama-index-llms-openai-like)")
    llm = openai_like.OpenAILike(api_base=f"{server.url}/v1", api_key=KEY, model=f"{server.model}:eng", max_retries=0)
    completed = llm.complete("When do canary releases run?")  # /v1/completions: is_chat_model is False by default
    assert completed.text and completed.raw.object == "text_completion"
    assert [s["collection"] for s in completed.raw.model_extra["sources"]] == ["eng"]
    assert "".join(part.delta or "" for part in llm.stream_complete("When do canary releases run?"))


def test_completions_answer_over_the_prompt_and_stream_usage_last(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as http:
        body = {"model": f"{server.model}:hr", "prompt": ["How many days of annual leave?"]}
        done = http.post("/v1/completions", json=body).json()
        assert done["object"] == "text_completion" and done["choices"][0]["text"] and done["usage"]["completion_tokens"] == 3
        assert [s["document_id"] for s in done["sources"]] == ["hr"]
        with http.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                           "stream_options": {"include_usage": True}}) as response:
            chunks = sse_chunks(response)
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
        assert all("usage" not in c for c in chunks[:-1]) and chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert http.post("/v1/completions", json={**body, "prompt": ["one?", "two?"]}).status_code == 422


def test_chat_developer_role_usage_chunk_and_the_fields_refused_ignored_or_unknown(server):
    messages = [{"role": "developer", "content": "Answer briefly."}, {"role": "user", "content": "Leave days?"}]
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as http:
        chat = http.post("/v1/chat/completions", json={"model": f"{server.model}:hr", "messages": messages})
        assert chat.status_code == 200 and [s["collection"] for s in chat.json()["sources"]] == ["hr"]
        assert chat.json()["model"] == f"{server.model}:hr"
        stream = {"model": server.model, "collection": "hr", "messages": messages, "stream": True}
        with http.stream("POST", "/v1/chat/completions", json={**stream, "stream_options": {"include_usage": True}}) as r:
            chunks = sse_chunks(r)
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] > 3
        assert chunks[-2]["choices"][0]["finish_reason"] == "length" and "usage" not in chunks[-2]
        with http.stream("POST", "/v1/chat/completions", json=stream) as r:  # without it: on the finish chunk, as before
            assert "usage" in sse_chunks(r)[-1]
        ignored = {"user": "u-1", "store": False, "service_tier": "auto", "parallel_tool_calls": True}
        assert http.post("/v1/chat/completions", json={"messages": messages, **ignored}).status_code == 200
        for field, value in (("tools", [{"type": "function", "function": {"name": "f"}}]), ("logprobs", True),
                             ("response_format", {"type": "json_object"}), ("metadata", {"collection": "hr"})):
            refused = http.post("/v1/chat/completions", json={"messages": messages, field: value})
            assert refused.status_code == 400 and field in refused.json()["error"]["message"], refused.text
        for field in ("filter", "document_ids"):  # today's silent ignoring is gone: 422, as /v1/query answers
            unknown = http.post("/v1/chat/completions", json={"messages": messages, field: ["hr"]})
            assert unknown.status_code == 422 and f"unknown field(s): {field}" in unknown.json()["error"]["message"]
            assert http.post("/v1/query", json={"question": "x?", field: ["hr"]}).status_code == 422
        clash = http.post("/v1/chat/completions", json={"model": f"{server.model}:hr", "collection": "eng",
                                                        "messages": messages})
        assert clash.status_code == 422 and "picks collection 'hr'" in clash.json()["error"]["message"]
        names = [m["id"] for m in http.get("/v1/models").json()["data"]]
        assert names == [server.model, f"{server.model}:default", f"{server.model}:eng", f"{server.model}:hr"]
