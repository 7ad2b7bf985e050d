"""ragblend: kv_store — tiered, persistent, content-addressed chunk KV caches, streamed layer by layer."""

from kv_store.admission import Admission, BudgetStats
from kv_store.backend import Backend, LayerReader, Tier
from kv_store.config import StoreConfig
from kv_store.planner import CostModel, LoadPlan, LoadPlanner, PlanKind, PlanRequest, PrefillShape
from kv_store.errors import CorruptEntryError, EntryLostError, KVStoreError
from kv_store.loader import SourceStats, StoredChunk, StoreLayerSource
from kv_store.stats import StoreStats, TierStats
from kv_store.store import KVStore

__all__ = [
    "Admission",
    "Backend",
    "BudgetStats",
    "CorruptEntryError",
    "CostModel",
    "EntryLostError",
    "KVStore",
    "KVStoreError",
    "LayerReader",
    "LoadPlan",
    "LoadPlanner",
    "PlanKind",
    "PlanRequest",
    "PrefillShape",
    "SourceStats",
    "StoreConfig",
    "StoreLayerSource",
    "StoreStats",
    "StoredChunk",
    "Tier",
    "TierStats",
]
