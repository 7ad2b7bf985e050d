"""Stored chunks made fit for the model being served, at start-up.

A chunk is stored with its token ids and the key of its KV, both made by the model that ingested it.
A server started over the same data with another model (another tokenizer), or another KV format or
precompute context, would otherwise feed the new model token ids of the old tokenizer (wrong text,
silently), and never find or repair those chunks' KV (the key is not the one the current config makes
for them, so every question would recompute them). Each such chunk is tokenized again from its stored
text and given the key of those tokens; its KV is then computed as questions use it (app/rag/repair.py),
and the old entries, which no chunk points at any more, are collected by the start-up garbage
collection. The chunk boundaries stay those the first tokenizer drew: only a re-sent document is
chunked again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from retrieval.chunker import Chunker
from retrieval.store_types import ChunkTokens, DocumentStore

if TYPE_CHECKING:
    from kv_store import KVStore

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RebuildStats:
    num_chunks: int = 0  # chunks checked
    num_rekeyed: int = 0  # the same token ids, another key (another KV format or precompute context)
    num_retokenized: int = 0  # other token ids (another tokenizer) and their key

    @property
    def num_rebuilt(self) -> int:
        return self.num_rekeyed + self.num_retokenized


def rebuild_for_model(store: DocumentStore, chunker: Chunker, kv_store: KVStore, context_ids: Sequence[int],
                      batch_size: int = 1024) -> RebuildStats:
    """Give every chunk whose KV key is not the one this config makes for its token ids the token ids
    of its text under this tokenizer and their key; one store transaction per page of chunks."""
    salts = {row.name: row.kv_salt for row in store.list_collections()}
    context = tuple(context_ids)
    num_chunks = num_rekeyed = num_retokenized = 0
    for page in store.iter_chunks(batch_size):
        updates = []
        for chunk in page:
            num_chunks += 1
            salt = salts.get(chunk.collection)
            if chunk.kv_key is None or salt is None or chunk.kv_key == kv_store.key_for(chunk.token_ids, context, salt):
                continue
            token_ids = chunker.token_ids(chunk.text)
            if token_ids == chunk.token_ids:
                num_rekeyed += 1
            else:
                num_retokenized += 1
            updates.append(ChunkTokens(chunk.id, token_ids, kv_store.key_for(token_ids, context, salt)))
        if updates:
            store.set_chunk_tokens(updates)
    stats = RebuildStats(num_chunks, num_rekeyed, num_retokenized)
    if stats.num_rebuilt:
        logger.warning("%d of %d chunks were stored for another model or KV format: %d tokenized again with this "
                       "model's tokenizer, %d given this format's KV keys; their KV is computed as questions use "
                       "them", stats.num_rebuilt, num_chunks, num_retokenized, num_rekeyed)
    return stats
