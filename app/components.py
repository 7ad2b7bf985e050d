"""The server's shared objects, built once in the lifespan (never at import) and closed in order."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol

from app.chat.serving import ChatService
from app.collections.scope import Scopes
from app.collections.serving import CollectionService
from app.completions.serving import CompletionService
from app.keys.serving import KeyService
from app.documents.limits import check_document_limit
from app.documents.storage import DiskReserve, check_free_space
from app.documents.serving import DocumentService
from app.metrics import Metrics
from app.query.serving import QueryService
from app.documents.backfill import KVBackfill
from app.documents.rebuild import rebuild_for_model
from app.documents.write_queue import WriteQueue
from app.documents.writes import kv_scope
from app.rag.pipeline import RagPipeline
from app.rag.repair import KVRepairer
from configs.settings import Settings
from kv_store.keys import KVScope
from kv_store.single_flight import PrecomputeLocks, SingleFlight
from retrieval.chunker import Chunker
from retrieval.retriever import CatchUp, Retriever
from retrieval.store_types import DocumentStore
from runtime.executor import PrefillExecutor
from runtime.loop import EngineLoop

if TYPE_CHECKING:
    from blend_engine.engine import BlendEngine
    from kv_store import KVStore
    from retrieval.follower import IndexFollower

logger = logging.getLogger(__name__)


class Closeable(Protocol):
    def close(self) -> None: ...


@dataclass
class Components:
    settings: Settings
    engine: BlendEngine
    retriever: Retriever
    kv_store: KVStore
    loop: EngineLoop
    executor: PrefillExecutor
    documents: DocumentService
    query: QueryService
    chat: ChatService
    completions: CompletionService
    scopes: Scopes
    collections: CollectionService
    keys: KeyService
    pipeline: RagPipeline
    model_id: str
    started_at: float
    follower: IndexFollower | None = None  # the index following a shared store
    locks: PrecomputeLocks | None = None  # the single-flight KV precompute lock's Redis connection

    @classmethod
    def build(cls, settings: Settings, metrics: Metrics, engine: BlendEngine | None = None) -> Components:
        """Load the model (unless given), open the index, the document store and the KV store."""
        from blend_engine.engine import BlendEngine
        from blend_engine.threads import single_threaded_default
        from kv_store import KVStore

        settings.data_dir.mkdir(parents=True, exist_ok=True)
        if engine is None:
            engine = BlendEngine.from_config(settings.model, settings.blend, max_cpu_threads=single_threaded_default())
        check_document_limit(settings, engine)  # before any store opens: the limit must fit its bound
        retriever = kv_store = loop = locks = None
        try:
            retriever = Retriever.open(settings.data_dir, settings.retrieval, _shared_store(settings))
            kv_store = KVStore(engine.fingerprint, settings.store.resolved(settings.data_dir), engine.device.type,
                               shape=engine.kv_shape)
            chunker = Chunker(engine.tokenize, engine.tokenizer.decode, settings.retrieval.chunk_tokens,
                              settings.retrieval.chunk_overlap)
            # before the garbage collection: the entries of chunks stored for another model become orphans
            rebuild_for_model(retriever.store, chunker, kv_store, engine.sink_ids(settings.blend.sink))
            _collect_kv_garbage(settings, kv_store, retriever)
            reserve = _take_reserve(settings, kv_store)
            executor = PrefillExecutor(engine, kv_store, settings.blend, settings.store.planner_profile_tokens,
                                       settings.scheduler.prefill_chunk_tokens, prefix_cache=kv_store.prompts)
            loop = EngineLoop(engine, executor, settings.scheduler, metrics,
                              kv_bytes_per_token=kv_bytes_per_token(engine))
            locks = PrecomputeLocks(settings.store.redis_url, settings.store.lock_ttl_s)
            single_flight = SingleFlight(kv_store, locks, metrics.observe_precompute)
            scope_of = _kv_scope_of(retriever.store)
            executor.repairer = KVRepairer(engine, kv_store, loop, scope_of, single_flight)
            backfill = KVBackfill(engine, kv_store, loop, retriever.store.is_kv_key_used,
                                  engine.sink_ids(settings.blend.sink), single_flight)
            metrics.watch_store(kv_store.stats, executor.repairer.stats)
            writes = WriteQueue(settings.scheduler.max_queue, settings.scheduler.retry_after_s)
            metrics.watch_engine(loop, writes)
            pipeline = RagPipeline(settings, engine, retriever, kv_store, loop)
            model_id = settings.server.model_id or served_model_id(engine.model_name)
            follower = _start_follower(settings, retriever, kv_store)
            scopes = Scopes(retriever.store)
            documents = DocumentService(settings, engine, retriever, kv_store, chunker, loop, writes, backfill,
                                        single_flight, reserve)
            return cls(
                settings=settings, engine=engine, retriever=retriever, kv_store=kv_store, loop=loop,
                executor=executor, documents=documents,
                query=QueryService(settings, pipeline, scopes), chat=ChatService(settings, pipeline, model_id, scopes),
                completions=CompletionService(settings, pipeline, model_id, scopes), scopes=scopes,
                collections=CollectionService(documents, scopes), keys=KeyService(retriever.store),
                pipeline=pipeline, model_id=model_id, started_at=time.time(), follower=follower,
                locks=locks,
            )
        except BaseException:
            _close_all(loop, locks, kv_store, retriever)
            raise

    def close(self) -> None:
        """Stop the engine loop and the writes first (an ingest stops after the document it is
        writing); the stores they write are closed only once both have stopped."""
        is_loop_stopped = self.loop.close()
        is_writes_stopped = self.documents.writes.close(timeout_s=60.0)
        if is_loop_stopped and is_writes_stopped:
            _close_all(self.follower, self.locks, self.kv_store, self.retriever)
        else:  # never close SQLite or the store under a running job: both survive a hard exit
            logger.error("engine loop or a write did not stop: the stores are left open to the process exit")


def kv_bytes_per_token(engine: BlendEngine) -> int:
    """What a running answer's cache holds per token: keys and values of every layer in the model's
    dtype (the prefill's cache; a CPU decode copy in int8 or bf16 is smaller, so this bounds both)."""
    return 2 * engine.num_layers * engine.num_kv_heads * engine.head_dim * engine.dtype.itemsize


def _shared_store(settings: Settings) -> DocumentStore | None:
    """The Postgres store replicas share (`database.url`), or None: SQLite under the data dir."""
    database = settings.database
    if database.url is None:
        return None
    from retrieval.pg_store import PostgresDocumentStore  # psycopg only where it is used

    return PostgresDocumentStore(database.url, database.max_connections, database.timeout_s)


def _start_follower(settings: Settings, retriever: Retriever, kv_store: KVStore) -> IndexFollower | None:
    """With a shared store, a thread that makes the index follow the other replicas' commits, and the
    prefix cache drop the prompts holding a chunk they replaced or deleted (each replica keeps its own)."""
    if not retriever.store.is_shared or settings.database.url is None:
        return None
    from retrieval.follower import IndexFollower

    def forget_prompts(result: CatchUp) -> None:
        if result.num_removed or result.is_reconciled:
            kv_store.prompts.retain_live(retriever.store.is_kv_key_used)

    return IndexFollower(retriever, settings.database.url, settings.database.poll_s, forget_prompts).start()


def _collect_kv_garbage(settings: Settings, kv_store: KVStore, retriever: Retriever) -> None:
    """Delete the KV entries no chunk points at (e.g. of an ingest killed before its commit, or of a
    collection deleted by a server killed before it deleted their KV). Only when this server owns the
    disk tier: a `store.disk_dir` set by hand may be shared. Then account the entries left to their
    collections (each collection's share of the KV budget)."""
    if settings.store.disk_enabled and settings.store.disk_dir is not None:
        logger.info("store.disk_dir is set: it may be shared, so orphan KV entries are not collected")
    else:
        num_orphans = kv_store.collect_garbage(retriever.store.kv_keys())
        if num_orphans:
            logger.warning("deleted %d KV entries no chunk points at", num_orphans)
    if kv_store.admission is not None:
        store = retriever.store
        kv_store.admission.note_owners({key: row.name for row in store.list_collections()
                                        for key in store.kv_keys([row.name])})


def _kv_scope_of(store: DocumentStore) -> Callable[[str], KVScope | None]:
    """`scope_of(key)` for the KV repairs: the KV scope of a collection whose chunk points at `key`
    (None: no chunk does any more)."""

    def scope_of(key: str) -> KVScope | None:
        name = store.collection_of_kv_key(key)
        row = store.get_collection(name) if name is not None else None
        return kv_scope(row) if row is not None else None

    return scope_of


def _take_reserve(settings: Settings, kv_store: KVStore) -> DiskReserve:
    """The DELETE reserve, and the warning when the disk cannot hold what the bounds allow."""
    reserve = DiskReserve(settings.data_dir, settings.store.disk_reserve_bytes)
    if not reserve.take():
        logger.warning("the disk holding %s has no room for the %d-byte reserve that lets a DELETE run on a "
                       "full disk; it is taken once there is", settings.data_dir, reserve.num_bytes)
    disk = kv_store.stats().tiers.get("disk")
    warning = check_free_space(settings, disk.bytes_used if disk is not None else 0)
    if warning:
        logger.warning(warning)
    return reserve


def served_model_id(model_name: str) -> str:
    """What /v1/models shows for the engine's `model_name`: a model directory's name as it is
    ('Qwen2.5-0.5B-Instruct:<digest>' -> 'Qwen2.5-0.5B-Instruct'), a GGUF file's without `.gguf` and its
    quantization suffix ('SmolLM2-135M-Instruct.Q4_1.gguf:93595b75' -> 'SmolLM2-135M-Instruct')."""
    name = model_name.split(":")[0]
    if name.endswith(".gguf"):
        name = name.removesuffix(".gguf").split(".Q")[0]
    return name or model_name


def _close_all(*objects: Closeable | None) -> None:
    for obj in objects:
        if obj is None:
            continue
        try:
            obj.close()
        except Exception:  # keep closing the rest
            logger.exception("closing %s failed", type(obj).__name__)
