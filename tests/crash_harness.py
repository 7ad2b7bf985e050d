"""Crash harness: the real server (`ragblend serve`) in a child process, SIGKILLed at random moments
of a random workload of ingest / replace / delete batches in two collections, and of deletions of a
whole collection (its documents and their KV), restarted, and checked.

Children are forked from a fork server that has imported the heavy modules once (torch,
transformers, sentence-transformers: ~8 s a start on a busy 2-core machine), so a restart costs
the server's own start-up only. The child runs `app.cli.main(["serve", ...])`, the console script.
"""

from __future__ import annotations

import json
import multiprocessing
import random
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import faiss
import httpx

from app import cli
from app.readiness import free_port, wait_ready
from blend_engine.kv import KVShape
from kv_store import codec
from kv_store.disk import SUFFIX
from kv_store.keys import StorageFormat

PRELOAD = ["app.cli", "app.main", "app.commands.serve", "blend_engine.engine", "kv_store", "retrieval.retriever",
           "sentence_transformers", "transformers", "uvicorn", "faiss", "torch"]
CONFIG = """\
model: {name: "random:tiny-llama", device: cpu}
retrieval: {chunk_tokens: 32, chunk_overlap: 0}
store: {max_memory_bytes: 0}
"""
NUM_DOC_IDS = 8
COLLECTIONS = ("default", "kb1")  # kb1 is deleted whole now and then, and made again
DROPPED = "kb1"
_SYLLABLES = ["ka", "lo", "mi", "ren", "to", "vu", "zel", "qa", "dor", "pim", "sa", "tek", "bo", "ny", "fa", "gri"]


def fork_context() -> multiprocessing.context.BaseContext:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


class ServerProcess:
    """One run of `ragblend serve` on a free loopback port over `data_dir`."""

    def __init__(self, ctx, data_dir: Path, config_path: Path):
        self.port = free_port()
        argv = ["serve", "--port", str(self.port), "--data-dir", str(data_dir), "--config", str(config_path),
                "--log-level", "warning"]
        self.process = ctx.Process(target=cli.main, args=(argv,), daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 180.0) -> None:
        self.process.start()
        wait_ready(self.url, self._check_alive, timeout_s, poll_s=0.05)

    def _check_alive(self) -> None:
        if not self.process.is_alive():
            raise RuntimeError(f"server exited during start-up (code {self.process.exitcode})")

    def kill(self) -> None:
        self.process.kill()  # SIGKILL: no finally, no atexit, no flush
        self.process.join(30)

    def stop(self) -> None:
        self.process.terminate()
        self.process.join(60)
        if self.process.is_alive():
            self.kill()


@dataclass(frozen=True)
class Version:
    number: int
    text: str


@dataclass
class Model:
    """What the server must hold: acknowledged states, plus the targets of the op in flight."""

    # "<collection>/<document id>" -> its acknowledged state
    acked: dict[str, Version | None] = field(default_factory=lambda: {
        f"{c}/doc{i}": None for c in COLLECTIONS for i in range(NUM_DOC_IDS // 2)})
    pending: dict[str, Version | None] = field(default_factory=dict)
    next_version: int = 1
    num_ops_acked: int = 0
    num_drops_acked: int = 0  # whole-collection deletions acknowledged
    op_seconds: list[float] = field(default_factory=list)  # of acknowledged ops

    def allowed(self, doc_id: str) -> list[Version | None]:
        return [self.acked[doc_id]] + ([self.pending[doc_id]] if doc_id in self.pending else [])

    def settle(self, observed: dict[str, Version | None]) -> None:
        """After a crash: the op in flight happened or not, per document, as the restarted server says."""
        for doc_id in self.pending:
            self.acked[doc_id] = observed.get(doc_id)
        self.pending = {}


def _sentence(rng: random.Random) -> str:
    words = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3))) for _ in range(rng.randint(4, 6))]
    return " ".join(words).capitalize() + "."


def _next_op(rng: random.Random, model: Model) -> tuple[str, dict, dict[str, Version | None]]:
    """(method, request, targets): an ingest of 1-3 documents of one collection (new, replaced, or
    re-sent as they are), a delete, or the deletion of collection kb1 whole."""
    present = [d for d, v in model.acked.items() if v is not None]
    in_dropped = [d for d in present if d.startswith(f"{DROPPED}/")]
    if in_dropped and rng.random() < 0.08:
        return "drop", {"name": DROPPED}, {d: None for d in model.acked if d.startswith(f"{DROPPED}/")}
    if present and rng.random() < 0.25:
        key = rng.choice(present)
        collection, doc_id = key.split("/")
        return "delete", {"id": doc_id, "collection": collection}, {key: None}
    collection = rng.choice(COLLECTIONS)
    targets: dict[str, Version | None] = {}
    documents = []
    for key in rng.sample(sorted(k for k in model.acked if k.startswith(f"{collection}/")), rng.randint(1, 3)):
        doc_id = key.split("/")[1]
        old = model.acked[key]
        if old is not None and rng.random() < 0.2:
            version = old  # a re-send of what is stored: must be a no-op
        else:  # most replaces keep the sentence count: same chunk count, the case counts cannot see
            num_sentences = old.text.count(".") if old is not None and rng.random() < 0.7 else rng.randint(1, 4)
            version = Version(model.next_version, " ".join(_sentence(rng) for _ in range(num_sentences)))
            model.next_version += 1
        targets[key] = version
        documents.append({"id": doc_id, "text": version.text, "metadata": {"version": version.number}})
    return "ingest", {"collection": collection, "documents": documents}, targets


def run_workload(url: str, rng: random.Random, model: Model, errors: list[str]) -> None:
    """Send ops back to back until the server dies; `model` tracks what was acknowledged."""
    with httpx.Client(base_url=url, timeout=60) as http:
        while True:
            method, request, targets = _next_op(rng, model)
            model.pending = targets
            start = time.perf_counter()
            try:
                if method == "delete":
                    response = http.delete(f"/v1/documents/{request['id']}", params={"collection": request["collection"]})
                elif method == "drop":
                    response = http.delete(f"/v1/collections/{request['name']}")
                    if response.status_code == 200:  # made again at once (or at the next start, if killed first)
                        ensure_collections(http)
                else:
                    response = http.post("/v1/documents", json=request)
            except httpx.TransportError:
                return  # killed mid-op: `pending` says what may or may not have happened
            if response.status_code not in (200, 201):
                errors.append(f"{method} answered {response.status_code}: {response.text[:200]}")
                return
            model.acked.update(targets)
            model.pending = {}
            model.num_ops_acked += 1
            model.num_drops_acked += method == "drop"
            model.op_seconds.append(time.perf_counter() - start)


def start_workload(url: str, rng: random.Random, model: Model, errors: list[str]) -> threading.Thread:
    thread = threading.Thread(target=run_workload, args=(url, rng, model, errors), daemon=True)
    thread.start()
    return thread


def _squash(text: str) -> str:
    return "".join(text.split())  # chunk texts are decoded tokens: compare without whitespace


def ensure_collections(http: httpx.Client) -> None:
    """Make the collections the workload writes to (409: there already)."""
    for name in COLLECTIONS[1:]:
        response = http.post("/v1/collections", json={"name": name})
        if response.status_code not in (201, 409):
            raise RuntimeError(f"creating collection {name}: {response.status_code} {response.text[:200]}")


def check_invariants(url: str, data_dir: Path, model: Model) -> list[str]:
    """Every violation found on a freshly started (idle) server, as readable lines."""
    violations: list[str] = []
    with httpx.Client(base_url=url, timeout=60) as http:
        existing = {c["name"] for c in http.get("/v1/collections").json()["collections"]}
        docs: dict[str, dict] = {}
        for collection in sorted(existing & set(COLLECTIONS)):
            listed = http.get("/v1/documents", params={"limit": 1000, "collection": collection}).json()["documents"]
            docs.update((f"{collection}/{d['id']}", http.get(f"/v1/documents/{d['id']}",
                                                              params={"collection": collection}).json())
                        for d in listed)
        found, observed = _check_documents(model, docs)
        violations += found
        violations += _check_files(data_dir, docs)
        for key, doc in docs.items():
            collection, doc_id = key.split("/")
            question = doc["chunks"][0]["text"]
            body = {"question": question, "top_k": 3, "mode": "full", "max_tokens": 1, "collection": collection}
            sources = http.post("/v1/query", json=body).json().get("sources", [])
            if doc_id not in {s["document_id"] for s in sources}:
                violations.append(f"{key}: a query with its own first chunk does not retrieve it")
        ensure_collections(http)  # a kill between a collection's deletion and its making again
    model.settle(observed)
    return violations


def _check_documents(model: Model, docs: dict[str, dict]) -> tuple[list[str], dict[str, Version | None]]:
    """Each document is whole and in an allowed state: its acknowledged one, or the target of the op
    in flight at the kill (atomic per document). Returns the violations and the states observed."""
    violations, observed = [], {}
    for doc_id in model.acked:
        allowed = model.allowed(doc_id)
        doc = docs.get(doc_id)
        if doc is None:
            if None not in allowed:
                violations.append(f"{doc_id}: missing, expected version {[v.number for v in allowed if v]}")
            continue
        version = next((v for v in allowed if v is not None and v.number == doc["metadata"].get("version")), None)
        observed[doc_id] = version
        if version is None:
            violations.append(f"{doc_id}: holds version {doc['metadata'].get('version')}, allowed {allowed}")
        elif _squash("".join(c["text"] for c in doc["chunks"])) != _squash(version.text):
            violations.append(f"{doc_id}: chunks are not exactly version {version.number} (a torn document)")
    for doc_id in set(docs) - set(model.acked):
        violations.append(f"{doc_id}: unexpected document")
    return violations, observed


def check_lexical_index(data_dir: Path) -> list[str]:
    """The full-text index holds exactly the store's chunks (row ids and texts), as the file is after a
    kill, read before a restart (a store opened again reads the same)."""
    path = data_dir / "documents.sqlite3"
    if not path.exists():
        return []
    conn = sqlite3.connect(path)  # read-write only to replay the WAL's committed transactions
    try:
        if conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'chunks_fts'").fetchone() is None:
            return []  # killed before the first start made it
        chunks = dict(conn.execute("SELECT row_id, text FROM chunks").fetchall())
        indexed = dict(conn.execute("SELECT rowid, text FROM chunks_fts").fetchall())
    finally:
        conn.close()
    if indexed == chunks:
        return []
    missing, dead = set(chunks) - set(indexed), set(indexed) - set(chunks)
    stale = {i for i in set(chunks) & set(indexed) if chunks[i] != indexed[i]}
    return [f"lexical index/store differ: {len(missing)} chunks unindexed, {len(dead)} dead rows, {len(stale)} stale texts"]


def _check_files(data_dir: Path, docs: dict[str, dict]) -> list[str]:
    """The index holds exactly the store's chunks; every KV file is live; every cached chunk's
    entry reads back whole (every layer's checksum)."""
    violations = []
    conn = sqlite3.connect(f"file:{data_dir / 'documents.sqlite3'}?mode=ro", uri=True)
    try:
        rows = conn.execute("SELECT id, row_id, kv_key FROM chunks").fetchall()
    finally:
        conn.close()
    row_ids = {r[1] for r in rows}
    indexed: set[int] = set()
    for index_path in sorted((data_dir / "index").glob("*.faiss")):  # one index per collection
        index = faiss.read_index(str(index_path))  # kept alive: id_map is a view into it
        indexed |= set(faiss.vector_to_array(index.id_map).tolist())
    if indexed != row_ids:
        violations.append(
            f"index/store differ: {len(row_ids - indexed)} chunks unindexed, {len(indexed - row_ids)} dead ids"
        )
    live_keys = {r[2] for r in rows if r[2]}
    kv_dir = data_dir / "kv"
    files = {p.name[: -len(SUFFIX)]: p for p in kv_dir.glob("??/*" + SUFFIX)}
    orphans = set(files) - live_keys
    if orphans:
        violations.append(f"{len(orphans)} orphan KV files after start-up")
    temps = list((kv_dir / "tmp").iterdir()) if (kv_dir / "tmp").exists() else []
    if temps:
        violations.append(f"{len(temps)} temp KV files left after start-up")
    key_of = {r[0]: r[2] for r in rows}
    for doc in docs.values():
        for chunk in doc["chunks"]:
            if chunk["kv_cached"] and not _is_readable(files.get(key_of.get(chunk["id"]) or "")):
                violations.append(f"{chunk['id']}: kv_cached but its entry is missing or unreadable")
    return violations


def _is_readable(path: Path | None) -> bool:
    if path is None:
        return False
    data = bytearray(path.read_bytes())  # writable: the decoded tensors view it
    try:
        table = json.loads(bytes(data[8 : codec.header_size(bytes(data[:8]), len(data))]))
        meta = json.loads(table["__metadata__"][codec.META_KEY])
        version, dtype, quantization = meta["format"]
        fmt = StorageFormat(codec.StorageDtype(dtype), codec.KVQuantization(quantization), int(version))
        header = codec.read_header(data, path.name[: -len(SUFFIX)], meta["fingerprint"], fmt, KVShape(*meta["shape"]))
        codec.decode(header, lambda begin, end: memoryview(data)[begin:end])
    except (codec.CorruptEntryError, ValueError, KeyError, TypeError):
        return False
    return True
