"""Prometheus metrics on a per-app registry (no module-level globals): requests, latencies,
TTFT per mode, tokens reused / recomputed, and the KV store's per-tier hits and misses."""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


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
        self.plan_error = Histogram(
            "ragblend_load_plan_error_ratio", "Actual prefill ms / predicted TTFT ms of planned answers",
            buckets=(0.25, 0.5, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0), registry=self.registry,
        )

    def watch_store(self, get_stats: Callable[[], object], get_repairs: Callable[[], object] | None = None) -> None:
        self.registry.register(_StoreCollector(get_stats, get_repairs))

    def watch_worker(self, worker: object) -> None:
        self.registry.register(_WorkerCollector(worker))

    def observe_generation(self, mode: str, ttft_s: float, reused: int, recomputed: int, completion: int) -> None:
        self.ttft.labels(mode=mode).observe(ttft_s)
        self.tokens.labels(kind="reused").inc(reused)
        self.tokens.labels(kind="recomputed").inc(recomputed)
        self.completion_tokens.inc(completion)

    def observe_plan(self, plan: str, predicted_ms: float, actual_ms: float) -> None:
        self.load_plans.labels(plan=plan).inc()
        if predicted_ms > 0:
            self.plan_error.observe(actual_ms / predicted_ms)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _WorkerCollector(Collector):
    def __init__(self, worker: object):
        self._worker = worker

    def collect(self) -> Iterator:
        stats = self._worker.stats
        jobs = CounterMetricFamily("ragblend_engine_jobs", "Engine jobs by outcome", labels=["outcome"])
        for outcome in ("completed", "failed", "cancelled", "rejected"):
            jobs.add_metric([outcome], float(getattr(stats, f"num_{outcome}")))
        yield jobs
        yield GaugeMetricFamily("ragblend_engine_queue_depth", "Engine jobs waiting", value=self._worker.num_waiting)
        yield GaugeMetricFamily("ragblend_engine_busy", "1 while the engine runs a job", value=int(self._worker.is_busy))
