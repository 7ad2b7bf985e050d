"""Prometheus metrics on a per-app registry (no module-level globals): requests, latencies,
TTFT per mode, tokens reused / recomputed / served from the prefix cache, the KV store's per-tier hits
and misses, and the prefix cache's."""

from __future__ import annotations

from enum import Enum
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

# Every request label comes from a fixed set: a client picks the method and path of its request line
# (h11 takes any token as a method), and each new label value would be a new series for ever: /metrics
# would grow without bound, and so would the time to render it.
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "CONNECT", "TRACE"})
OTHER_LABEL = "other"  # a method outside HTTP_METHODS, a path that matched none of the app's routes


def method_label(method: str) -> str:
    return method if method in HTTP_METHODS else OTHER_LABEL


class _StoreCollector(Collector):
    """Reads the KV store's counters at scrape time."""

    def __init__(self, get_stats: Callable[[], object], get_repairs: Callable[[], object] | None = None):
        self._get_stats, self._get_repairs = get_stats, get_repairs

    def collect(self) -> Iterator:
        stats = self._get_stats()  # kv_store.StoreStats
        families = {
            "hits": CounterMetricFamily("ragblend_kv_hits", "KV store hits per tier", labels=["tier"]),
            "misses": CounterMetricFamily("ragblend_kv_misses", "KV store misses per tier", labels=["tier"]),
            "evictions": CounterMetricFamily("ragblend_kv_evictions", "KV store evictions per tier", labels=["tier"]),
            "bytes_used": GaugeMetricFamily("ragblend_kv_bytes", "Bytes held per tier", labels=["tier"]),
            "load_seconds": CounterMetricFamily("ragblend_kv_load_seconds", "Time loading KV per tier", labels=["tier"]),
            "corrupt": CounterMetricFamily(
                "ragblend_kv_corrupt", "KV entries found damaged per tier (deleted, then recomputed)", labels=["tier"]
            ),
        }
        for tier, tier_stats in stats.tiers.items():
            for name, family in families.items():
                family.add_metric([tier], float(getattr(tier_stats, name)))
        yield from families.values()
        repairs = CounterMetricFamily(
            "ragblend_kv_repairs", "Damaged or missing KV entries recomputed, by how", labels=["how"]
        )
        repairs.add_metric(["inline"], float(stats.num_recovered))  # mid-request, by the request itself
        if self._get_repairs is not None:
            repair_stats = self._get_repairs()  # app.rag.repair.RepairStats
            repairs.add_metric(["background"], float(repair_stats.num_repaired))
            repairs.add_metric(["background_failed"], float(repair_stats.num_failed))
            repairs.add_metric(["background_dropped"], float(repair_stats.num_dropped))
        yield repairs
        yield from _budget_families(getattr(stats, "budget", None))
        yield from _prefix_families(getattr(stats, "prefix", None))


def _prefix_families(prefix) -> Iterator:
    """The prefix cache (kv_store.PrefixCacheStats): lookups by what they reused, evictions, entries
    dropped with their documents, and bytes held against the bound."""
    if prefix is None:
        return
    lookups = CounterMetricFamily("ragblend_prefix_cache_lookups", "Prefix cache lookups by what they reused: hit "
                                  "(the whole prompt), partial (a prefix, the rest computed), miss (nothing)",
                                  labels=["result"])
    for result, value in (("hit", prefix.hits), ("partial", prefix.partial_hits), ("miss", prefix.misses)):
        lookups.add_metric([result], float(value))
    yield lookups
    yield CounterMetricFamily("ragblend_prefix_cache_tokens", "Prompt tokens served from the prefix cache",
                              value=float(prefix.tokens_served))
    yield CounterMetricFamily("ragblend_prefix_cache_evictions", "Kept prompts evicted for room (LRU)",
                              value=float(prefix.evictions))
    yield CounterMetricFamily("ragblend_prefix_cache_invalidations",
                              "Kept prompts dropped because a document they hold changed or was deleted",
                              value=float(prefix.invalidations))
    yield GaugeMetricFamily("ragblend_prefix_cache_entries", "Prompts the prefix cache holds",
                            value=float(prefix.num_entries))
    yield GaugeMetricFamily("ragblend_prefix_cache_bytes", "Bytes the prefix cache holds", value=float(prefix.bytes_used))
    yield GaugeMetricFamily("ragblend_prefix_cache_max_bytes", "The prefix cache's bound (store.prefix_cache_bytes)",
                            value=float(prefix.max_bytes))


def _budget_families(budget) -> Iterator:
    """The collection's KV budget (kv_store.BudgetStats): chunk uses that found KV or not, entries
    admitted or turned away, evictions, and the bound."""
    if budget is None:
        return
    uses = CounterMetricFamily("ragblend_kv_budget_uses", "Chunk uses by whether some tier held their KV",
                               labels=["result"])
    uses.add_metric(["hit"], float(budget.hits))
    uses.add_metric(["miss"], float(budget.misses))
    yield uses
    offers = CounterMetricFamily("ragblend_kv_budget_admissions", "Entries offered to the budget, by decision",
                                 labels=["decision"])
    offers.add_metric(["admitted"], float(budget.admitted))
    offers.add_metric(["rejected"], float(budget.rejected))
    yield offers
    yield CounterMetricFamily("ragblend_kv_budget_evictions", "Entries the budgeted tier evicted",
                              value=float(budget.evictions))
    yield GaugeMetricFamily("ragblend_kv_budget_bytes", "The collection's KV budget (the bounded tier's bound)",
                            value=float(budget.budget_bytes))
    yield GaugeMetricFamily("ragblend_kv_budget_used_bytes", "Bytes of KV held under the budget",
                            value=float(budget.bytes_used))


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "ragblend_requests", "HTTP requests", ["method", "route", "status"], registry=self.registry
        )
        self.latency = Histogram(
            "ragblend_request_latency_seconds", "HTTP request latency", ["route"],
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.ttft = Histogram(
            "ragblend_ttft_seconds", "Time to first token per prefill mode", ["mode"],
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.tokens = Counter(
            "ragblend_prompt_tokens", "Prompt tokens by how their KV was obtained", ["kind"], registry=self.registry
        )
        self.completion_tokens = Counter("ragblend_completion_tokens", "Generated tokens", registry=self.registry)
        self.load_plans = Counter(
            "ragblend_load_plans", "Loading planner choices (mode or ratio 'auto')", ["plan"], registry=self.registry
        )
        self.batch_size = Histogram(
            "ragblend_engine_batch_size", "Sequences in each batched decode step",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128, 256), registry=self.registry,
        )
        self.inter_token = Histogram(
            "ragblend_inter_token_seconds", "Time between a sequence's successive tokens",
            buckets=(0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5, 5), registry=self.registry,
        )
        self.queue_wait = Histogram(
            "ragblend_queue_wait_seconds", "From a request's submission to its prefill's start",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.precomputes = Counter(
            "ragblend_kv_precomputes", "Chunk KV precomputes by why (ingest, backfill, repair) and outcome (computed "
            "here; found: another replica computed it; skipped: another replica is computing it)",
            ["reason", "outcome"], registry=self.registry,
        )
        self.plan_error = Histogram(
            "ragblend_load_plan_error_ratio", "Actual prefill ms / predicted TTFT ms of planned answers",
            buckets=(0.25, 0.5, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0), registry=self.registry,
        )

    def watch_store(self, get_stats: Callable[[], object], get_repairs: Callable[[], object] | None = None) -> None:
        self.registry.register(_StoreCollector(get_stats, get_repairs))

    def watch_engine(self, loop: object, writes: object) -> None:
        self.registry.register(_EngineCollector(loop, writes))

    # --- runtime.loop.LoopObserver ------------------------------------------------------------------
    def observe_step(self, batch_size: int) -> None:
        self.batch_size.observe(batch_size)

    def observe_inter_token(self, seconds: float) -> None:
        self.inter_token.observe(seconds)

    def observe_done(self, event: object) -> None:
        """A finished answer (runtime.types.DoneEvent): its TTFT, tokens and loading plan."""
        if event.plan is not None:
            self.observe_plan(event.plan.plan, event.plan.predicted_ttft_ms, event.plan.actual_prefill_ms)
        self.observe_generation(event.mode.value, event.timings.ttft_ms / 1000, event.usage.reused_tokens,
                                event.usage.recomputed_tokens, event.usage.completion_tokens,
                                event.usage.prefix_cached_tokens)
        self.queue_wait.observe(event.timings.queue_ms / 1000)

    def observe_generation(self, mode: str, ttft_s: float, reused: int, recomputed: int, completion: int,
                           prefix_cached: int = 0) -> None:
        self.ttft.labels(mode=mode).observe(ttft_s)
        self.tokens.labels(kind="reused").inc(reused)
        self.tokens.labels(kind="recomputed").inc(recomputed)
        self.tokens.labels(kind="prefix_cached").inc(prefix_cached)
        self.completion_tokens.inc(completion)

    def observe_precompute(self, reason: Enum, outcome: Enum) -> None:
        self.precomputes.labels(reason=reason.value, outcome=outcome.value).inc()

    def observe_plan(self, plan: str, predicted_ms: float, actual_ms: float) -> None:
        self.load_plans.labels(plan=plan).inc()
        if predicted_ms > 0:
            self.plan_error.observe(actual_ms / predicted_ms)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    """Reads the engine loop's (runtime.loop.EngineLoop) and the write queue's state at scrape time."""

    def __init__(self, loop: object, writes: object):
        self._loop, self._writes = loop, writes

    def collect(self) -> Iterator:
        stats = self._loop.stats
        jobs = CounterMetricFamily("ragblend_engine_jobs", "Engine requests and jobs by outcome", labels=["outcome"])
        for outcome in ("completed", "failed", "cancelled", "rejected"):
            jobs.add_metric([outcome], float(getattr(stats, f"num_{outcome}")))
        yield jobs
        yield CounterMetricFamily("ragblend_engine_prefill_parts",
                                  "Prefill parts that handed the step back before their prompt was in",
                                  value=float(stats.num_prefill_parts))
        yield CounterMetricFamily("ragblend_engine_decode_steps_mid_prefill",
                                  "Batched decode steps run between the parts of another request's prefill",
                                  value=float(stats.num_decode_steps_mid_prefill))
        yield CounterMetricFamily("ragblend_engine_decode_steps_deferred",
                                  "Steps whose prefill ran without the running answers' decode step "
                                  "(scheduler.max_decode_stall_ms)",
                                  value=float(stats.num_decode_steps_deferred))
        yield GaugeMetricFamily("ragblend_engine_waiting", "Requests and jobs waiting for the engine",
                                value=self._loop.num_waiting)
        yield GaugeMetricFamily("ragblend_engine_running", "Answers prefilling or decoding in the batch",
                                value=self._loop.num_running)
        yield GaugeMetricFamily("ragblend_engine_busy", "1 while the engine runs anything",
                                value=int(self._loop.is_busy))
        yield GaugeMetricFamily("ragblend_writes_waiting", "Ingests and deletes waiting for the write in progress",
                                value=self._writes.num_waiting)
        yield GaugeMetricFamily("ragblend_writes_running", "1 while an ingest or a delete runs",
                                value=int(self._writes.is_writing))
