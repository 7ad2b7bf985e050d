"""The server's shared objects, built once in the lifespan (never at import) and closed in order."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from app.chat.serving import ChatService
from app.documents.limits import check_document_limit
from app.documents.storage import DiskReserve, check_free_space
from app.documents.serving import DocumentService
from app.metrics import Metrics
from app.query.serving import QueryService
from app.rag.pipeline import RagPipeline
from app.documents.backfill import KVBackfill
from app.rag.repair import KVRepairer
from app.worker import EngineWorker
from configs.settings import Settings
from retrieval.chunker import Chunker
from retrieval.retriever import Retriever

logger = logging.getLogger(__name__)


@dataclass
class Components:
    settings: Settings
    engine: Any  # blend_engine.engine.BlendEngine
    retriever: Retriever
    kv_store: Any  # kv_store.KVStore
    worker: EngineWorker
    documents: DocumentService
    query: QueryService
    chat: ChatService
    pipeline: RagPipeline
    model_id: str
    started_at: float

    @classmethod
    def build(cls, settings: Settings, metrics: Metrics, engine: Any | None = None) -> Components:
        """Load the model (unless given), open the index, the document store and the KV store."""
        from blend_engine.engine import BlendEngine
        from blend_engine.threads import single_threaded_default
        from kv_store import KVStore

        settings.data_dir.mkdir(parents=True, exist_ok=True)
        if engine is None:
            engine = BlendEngine.from_settings(settings, max_cpu_threads=single_threaded_default())
        check_document_limit(settings, engine)  # before any store opens: the limit must fit its bound
        retriever = kv_store = worker = None
        try:
            retriever = Retriever.open(settings.data_dir, settings.retrieval)
            kv_store = KVStore.from_settings(settings, engine.fingerprint)
            _collect_kv_garbage(settings, kv_store, retriever)
            reserve = _take_reserve(settings, kv_store)
            worker = EngineWorker(settings.server.max_queue, settings.server.retry_after_s)
            repairer = KVRepairer(engine, kv_store, worker, retriever.store.is_kv_key_used)
            backfill = KVBackfill(engine, kv_store, worker, retriever.store.is_kv_key_used,
                                  engine.sink_ids(settings.blend.sink))
            metrics.watch_store(kv_store.stats, repairer.stats)
            metrics.watch_worker(worker)
            chunker = Chunker(engine.tokenize, engine.tokenizer.decode, settings.retrieval.chunk_tokens,
                              settings.retrieval.chunk_overlap)
            pipeline = RagPipeline(settings, engine, retriever, kv_store, worker, metrics, repairer)
            model_id = settings.server.model_id or _model_id(engine.model_name)
            return cls(
                settings=settings, engine=engine, retriever=retriever, kv_store=kv_store, worker=worker,
                documents=DocumentService(settings, engine, retriever, kv_store, chunker, worker, backfill, reserve),
                query=QueryService(settings, pipeline), chat=ChatService(settings, pipeline, model_id),
                pipeline=pipeline, model_id=model_id, started_at=time.time(),
            )
        except BaseException:
            _close_all(worker, kv_store, retriever)
            raise

    def close(self) -> None:
        """Stop the worker first (its job, e.g. an ingest, stops after the document it is writing);
        the stores it writes are closed only once it has stopped."""
        if self.worker.close():
            _close_all(self.kv_store, self.retriever)
        else:  # never close SQLite or the store under a running job: both survive a hard exit
            logger.error("engine worker did not stop: the stores are left open to the process exit")


def _collect_kv_garbage(settings: Settings, kv_store: Any, retriever: Retriever) -> None:
    """Delete the KV entries no chunk points at (e.g. of an ingest killed before its commit). Only
    when this server owns the disk tier: a `store.disk_dir` set by hand may be shared."""
    if settings.store.disk_enabled and settings.store.disk_dir is not None:
        logger.info("store.disk_dir is set: it may be shared, so orphan KV entries are not collected")
        return
    num_orphans = kv_store.collect_garbage(retriever.store.kv_keys())
    if num_orphans:
        logger.warning("deleted %d KV entries no chunk points at", num_orphans)


def _take_reserve(settings: Settings, kv_store: Any) -> DiskReserve:
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


def _model_id(model_name: str) -> str:
    """'SmolLM2-135M-Instruct.Q4_1.gguf:93595b75' -> 'SmolLM2-135M-Instruct'."""
    name = model_name.split(":")[0]
    for suffix in (".gguf",):
        name = name.removesuffix(suffix)
    return name.split(".Q")[0] or model_name


def _close_all(*objects: Any) -> None:
    for obj in objects:
        if obj is None:
            continue
        try:
            obj.close()
        except Exception:  # keep closing the rest
            logger.exception("closing %s failed", type(obj).__name__)
