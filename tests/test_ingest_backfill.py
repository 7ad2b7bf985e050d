"""Large documents do not hold the engine: their KV is computed one chunk per background task, so a
question queued meanwhile waits for at most one chunk; on a live server kv_cached fills in."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import httpx

from app.documents.backfill import KVBackfill
from app.testing import LiveServer
from runtime.config import SchedulerConfig
from runtime.loop import EngineLoop
from configs.settings import load_settings

PRECOMPUTE_S = 0.05


class SlowEngine:
    def __init__(self) -> None:
        self.num_calls = 0

    def precompute(self, token_ids, context_ids):
        time.sleep(PRECOMPUTE_S)
        self.num_calls += 1
        return ("kv", tuple(token_ids))


class DictStore:
    def __init__(self) -> None:
        self.entries: dict[str, object] = {}
        self.lock = threading.Lock()

    def readable_many(self, keys):
        with self.lock:
            return [k in self.entries for k in keys]

    def put(self, key, kv, salt=""):
        with self.lock:
            self.entries[key] = kv

    def should_compute(self, key, num_tokens, why, scope=None):  # an unbounded store: the budget always has room
        return True

    def offer(self, key, kv, why, scope=None):
        self.put(key, kv)
        return True


def test_a_question_waits_for_one_chunk_not_the_whole_document():
    async def main():
        worker, engine, store = EngineLoop(None, None, SchedulerConfig(max_queue=8)), SlowEngine(), DictStore()
        live = {f"k{i}" for i in range(40)} - {"k7"}  # k7's chunk was replaced meanwhile: skipped
        backfill = KVBackfill(engine, store, worker, lambda key: key in live, context_ids=(1,))
        chunks = [SimpleNamespace(kv_key=f"k{i}", token_ids=(i, i + 1)) for i in range(40)]
        try:
            backfill.schedule(chunks)
            await asyncio.sleep(5 * PRECOMPUTE_S)
            num_before = engine.num_calls
            num_at_answer = await worker.run(lambda job: engine.num_calls)  # a question arriving mid-backfill
            assert num_at_answer - num_before <= 1  # it waited for the chunk in progress at most
            assert backfill.stats().num_pending > 20  # the document was far from done
            deadline = time.monotonic() + 10
            while backfill.stats().num_pending and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            await asyncio.sleep(3 * PRECOMPUTE_S)
            assert set(store.entries) == live and engine.num_calls == 39
            assert backfill.stats().num_done == 40 and backfill.stats().num_failed == 0
        finally:
            worker.close()

    asyncio.run(main())


def test_large_documents_answer_at_once_and_their_kv_fills_in(tmp_path):
    settings = load_settings(data_dir=tmp_path, model={"name": "random:tiny-llama", "device": "cpu"},
                             retrieval={"max_inline_kv_chars": 200, "chunk_tokens": 16, "chunk_overlap": 0})
    small = {"id": "small", "text": "A short note about owls."}
    large = {"id": "large", "text": " ".join(f"Sentence {i} is about the river town number {i}." for i in range(30))}
    with LiveServer(settings) as server, httpx.Client(base_url=server.url, timeout=120) as http:
        body = http.post("/v1/documents", json={"documents": [small, large]}).json()
        by_id = {d["id"]: d for d in body["documents"]}
        assert not by_id["small"]["kv_pending"] and all(c["kv_cached"] for c in by_id["small"]["chunks"])
        assert by_id["large"]["kv_pending"] and len(by_id["large"]["chunks"]) > 4
        answer = http.post("/v1/query", json={"question": "river town", "max_tokens": 4, "mode": "blend"})
        assert answer.status_code == 200  # answerable at once (uncached chunks are computed)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            chunks = http.get("/v1/documents/large").json()["chunks"]
            if all(c["kv_cached"] for c in chunks):
                break
            time.sleep(0.1)
        assert all(c["kv_cached"] for c in chunks)
