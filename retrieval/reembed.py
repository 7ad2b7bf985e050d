"""Stored chunks' embeddings made the current embedder's, at start-up.

A chunk's embedding is stored by the embedder that ingested it. Started with another embedder
(`retrieval.embedder`), a server would rank stored chunks by vectors of another space than the
question's: silently wrong when the two have one dimension, a start-up error when not. The stored
embeddings are checked against the current embedder on a sample of chunks (its vectors for their texts
against the stored ones: another embedder's are far apart, the same one's equal up to float noise);
when they differ, every chunk's text is embedded again, a transaction per page, and the vector indexes
are rebuilt from the store (retrieval/retriever.py).
"""

from __future__ import annotations

import logging
import time

import numpy as np

from retrieval.embedder import Embedder
from retrieval.store_types import DocumentStore

logger = logging.getLogger(__name__)

NUM_SAMPLES = 4  # chunks compared at each start, at each end of the row ids
MIN_COSINE = 0.999  # the same embedder, batched otherwise (padding) or on another CPU: > 0.9999


def is_embedded_otherwise(store: DocumentStore, embedder: Embedder) -> bool:
    """Whether the stored embeddings of the first and the last chunks (by row id: `reembed` goes in
    that order, so one it left half done shows at the end) are not `embedder`'s for their texts."""
    row_ids = sorted(store.row_ids())
    sample = sorted(set(row_ids[:NUM_SAMPLES] + row_ids[-NUM_SAMPLES:]))
    chunks = store.chunks_by_row_ids(sample)
    # one row at a time: a run killed half way leaves vectors of two dimensions, which one batch cannot hold
    stored = {i: store.embeddings_of([i]).vectors for i in chunks}  # [1, stored dim] each
    if any(v.shape != (1, embedder.dim) for v in stored.values()):
        return True
    if not stored:
        return False  # no chunks
    ids = sorted(stored)
    fresh = embedder.encode([chunks[i].text for i in ids])  # [n, dim] unit vectors
    return bool(np.min(np.sum(fresh * np.concatenate([stored[i] for i in ids]), axis=1)) < MIN_COSINE)


def reembed(store: DocumentStore, embedder: Embedder, batch_size: int = 256) -> int:
    """Embed every stored chunk's text again and store the vectors; returns the chunks done."""
    num_done = 0
    for page in store.iter_chunks(batch_size):
        store.set_chunk_embeddings([c.row_id for c in page], embedder.encode([c.text for c in page]))
        num_done += len(page)
    return num_done


def reembed_if_changed(store: DocumentStore, embedder: Embedder) -> int:
    """`reembed` when the stored embeddings are another embedder's; the chunks embedded again (0: none)."""
    if not is_embedded_otherwise(store, embedder):
        return 0
    start = time.perf_counter()
    logger.warning("the stored chunks were embedded by another embedder than %s: embedding them again", embedder.name)
    num_done = reembed(store, embedder)
    logger.warning("%d chunks embedded again by %s in %.1f s", num_done, embedder.name, time.perf_counter() - start)
    return num_done
