"""The collection's KV budget on a live server (tiny random model, real embedder): a collection
whose KV is far over the disk tier's bound is ingested whole, the tier stays within its bound, every
question is still answered from its passages (chunks without KV are computed fresh), a chunk that
keeps being asked for earns its KV back, and the documents API and /metrics show it all."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from app.testing import LiveServer
from blend_engine.engine import BlendEngine
from configs.settings import load_settings
from kv_store import codec
from kv_store.keys import StorageFormat

TOPICS = [
    ("ferry", "The orange ferry to Tromso leaves the harbour at dawn and carries timber."),
    ("violin", "A violin maker in Cremona carves spruce tops for cellos and violas."),
    ("glacier", "The glacier above Chamonix retreats forty metres every summer."),
    ("beekeeper", "Our beekeeper moves the hives to the heather moors in August."),
    ("observatory", "The observatory on La Palma photographs distant galaxies on clear nights."),
    ("bakery", "The corner bakery sells rye loaves and cardamom buns before seven."),
    ("lighthouse", "The lighthouse keeper on Skerryvore logs every passing trawler."),
    ("orchid", "Rare ghost orchids bloom in the Florida swamps during July."),
    ("tram", "The yellow tram climbs the steep hills of Lisbon past the castle."),
    ("volcano", "Sensors on the Etna volcano measure sulphur gas from the crater."),
    ("chess", "The chess club meets in the library basement on Thursday evenings."),
    ("salmon", "Wild salmon leap the weir on the river Tay each autumn."),
]


def _metric(http: httpx.Client, name: str, **labels: str) -> float:
    selector = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = rf"^{name}\{{{selector}\}} (\S+)$" if labels else rf"^{name} (\S+)$"
    match = re.search(pattern, http.get("/metrics").text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    base = dict(data_dir=tmp_path_factory.mktemp("budget"), model={"name": "random:tiny-llama", "device": "cpu"},
                retrieval={"chunking": "none"})
    settings = load_settings(**base)
    engine = BlendEngine.from_config(settings.model, settings.blend)
    # one document's entry, in the store's own format: the budget holds about three of the twelve
    kv = engine.precompute(engine.tokenize(TOPICS[0][1]), engine.sink_ids(settings.blend.sink))
    fmt = StorageFormat(settings.store.dtype, settings.store.quantization)
    entry_bytes = len(codec.encode(kv, "0" * 64, engine.fingerprint, fmt))
    budget = 3 * entry_bytes + entry_bytes // 2
    # the prefix cache off: a question asked again must use (and count) its chunks' KV
    settings = load_settings(**base, store={"max_disk_bytes": budget, "max_memory_bytes": 64 << 20,
                                            "prefix_cache_bytes": 0})
    with LiveServer(settings, engine=engine) as live:
        live.budget = budget
        yield live


def _ask(http: httpx.Client, topic: str) -> dict:
    response = http.post("/v1/query", json={"question": f"What about the {topic}?", "top_k": 1, "max_tokens": 2})
    assert response.status_code == 200, response.text
    return response.json()


def test_a_collection_over_the_budget_is_ingested_whole_and_answered(server):
    kv_store = server.components.kv_store
    with httpx.Client(base_url=server.url, timeout=120) as http:
        docs = [{"id": topic, "title": topic, "text": text} for topic, text in TOPICS]
        response = http.post("/v1/documents", json={"documents": docs})
        assert response.status_code == 201, response.text
        assert [d["status"] for d in response.json()["documents"]] == ["created"] * len(TOPICS)
        disk, memory = kv_store.backend("disk"), kv_store.backend("memory")
        assert 0 < disk.bytes_used() <= server.budget
        # the memory tier holds copies of the admitted entries only (room for them: copied at ingestion)
        assert memory.bytes_used() > 0 and all(disk.contains(key) for key in memory.keys_lru_order())
        listed = http.get("/v1/documents", params={"limit": 100}).json()
        shares = {d["id"]: d["kv_cached_share"] for d in listed["documents"]}
        assert 1 <= sum(share == 1.0 for share in shares.values()) < len(TOPICS)
        assert sum(d["kv_bytes"] for d in listed["documents"]) == disk.bytes_used()
        collection = listed["kv"]
        assert collection["budget_bytes"] == server.budget and collection["cached_bytes"] == disk.bytes_used()
        assert collection["estimated_full_bytes"] > server.budget and collection["num_tokens"] > 0
        detail = http.get(f"/v1/documents/{listed['documents'][0]['id']}").json()
        assert detail["kv_cached_share"] == shares[detail["id"]] and detail["kv_bytes"] >= 0

        for topic, _ in TOPICS:  # every question answered from its own passage, KV or not
            answer = _ask(http, topic)
            assert answer["sources"][0]["document_id"] == topic and answer["usage"]["completion_tokens"] >= 1
        assert disk.bytes_used() <= server.budget
        assert _metric(http, "ragblend_kv_budget_uses_total", result="miss") >= 1
        assert _metric(http, "ragblend_kv_budget_uses_total", result="hit") >= 1
        assert _metric(http, "ragblend_kv_budget_bytes") == server.budget


def test_a_chunk_asked_for_again_and_again_earns_its_kv(server):
    kv_store = server.components.kv_store
    with httpx.Client(base_url=server.url, timeout=120) as http:
        listed = http.get("/v1/documents", params={"limit": 100}).json()["documents"]
        cold = next(d["id"] for d in listed if d["kv_cached_share"] == 0.0)
        deadline = time.monotonic() + 60
        while http.get(f"/v1/documents/{cold}").json()["kv_cached_share"] < 1.0:
            assert time.monotonic() < deadline, "a chunk used again and again never got its KV"
            _ask(http, cold)
            time.sleep(0.2)
        assert kv_store.backend("disk").bytes_used() <= server.budget
        assert _metric(http, "ragblend_kv_budget_admissions_total", decision="admitted") >= 1
        reused = _ask(http, cold)["usage"]["reused_tokens"]
        assert reused > 0


def test_a_delete_frees_its_bytes(server):
    kv_store = server.components.kv_store
    with httpx.Client(base_url=server.url, timeout=120) as http:
        listed = http.get("/v1/documents", params={"limit": 100}).json()["documents"]
        cached = next(d for d in listed if d["kv_bytes"] > 0)
        before = kv_store.backend("disk").bytes_used()
        assert http.delete(f"/v1/documents/{cached['id']}").status_code == 200
        assert kv_store.backend("disk").bytes_used() == before - cached["kv_bytes"]


def test_uploaded_files_over_the_budget_are_accepted(server):
    with httpx.Client(base_url=server.url, timeout=120) as http:
        files = [("files", (f"note{i}.txt", f"Note {i}: the canal barges carry coal to Leeds. ".encode() * 8))
                 for i in range(4)]
        response = http.post("/v1/documents/files", files=files)
        assert response.status_code == 201, response.text
        assert server.components.kv_store.backend("disk").bytes_used() <= server.budget
