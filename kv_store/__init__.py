"""ragblend: kv_store — tiered, persistent, content-addressed chunk KV caches, streamed layer by layer.

The names below are imported on first use (PEP 562): the settings import `kv_store.config` alone, and
should not load torch and redis-py for it."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "Admission": "kv_store.admission", "BudgetStats": "kv_store.admission",
    "Backend": "kv_store.backend", "LayerReader": "kv_store.backend", "Tier": "configs.enums",
    "StoreConfig": "kv_store.config",
    "CostModel": "kv_store.planner", "LoadPlan": "kv_store.planner", "LoadPlanner": "kv_store.planner",
    "PlanKind": "kv_store.planner", "PlanRequest": "kv_store.planner", "PrefillShape": "kv_store.planner",
    "CorruptEntryError": "kv_store.errors", "EntryLostError": "kv_store.errors", "KVStoreError": "kv_store.errors",
    "SourceStats": "kv_store.loader", "StoredChunk": "kv_store.loader", "StoreLayerSource": "kv_store.loader",
    "CachedPrompt": "kv_store.prefix_cache", "PrefixCache": "kv_store.prefix_cache",
    "PrefixCacheStats": "kv_store.prefix_cache", "PrefixMatch": "kv_store.prefix_cache",
    "StoreStats": "kv_store.stats", "TierStats": "kv_store.stats",
    "KVStore": "kv_store.store", "KVScope": "kv_store.keys",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from configs.enums import Tier
    from kv_store.admission import Admission, BudgetStats
    from kv_store.backend import Backend, LayerReader
    from kv_store.config import StoreConfig
    from kv_store.errors import CorruptEntryError, EntryLostError, KVStoreError
    from kv_store.keys import KVScope
    from kv_store.loader import SourceStats, StoredChunk, StoreLayerSource
    from kv_store.planner import CostModel, LoadPlan, LoadPlanner, PlanKind, PlanRequest, PrefillShape
    from kv_store.prefix_cache import CachedPrompt, PrefixCache, PrefixCacheStats, PrefixMatch
    from kv_store.stats import StoreStats, TierStats
    from kv_store.store import KVStore


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kv_store' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
