"""The loading planner: per request, predict TTFT for each way to use the stored KV and pick the fastest.

CacheBlend's promise is TTFT <= max(KV load, selective recompute). When loads are slow (a cold disk,
a slow network tier) reusing can be slower than not loading at all, so the planner compares:

- `full`: load nothing, compute the whole prompt;
- `blend`: every chunk streamed from its tier, recomputing `r` of the reused tokens, with `r` raised
  to what the loads hide (free quality) but never where full would be faster;
- `mixed`: chunks on the fast tiers reused, chunks on slower tiers computed as fresh tokens (the
  server copies them up afterwards, so the next question finds them fast);
- `split` (as Cake, ICML'25): the first k chunks in prompt order computed as fresh tokens while the
  rear chunks' layers load, the rear blended; k is where the front's compute and the rear's load meet.
  A mixed plan chosen by position rather than by tier: it helps where every chunk is on one slow tier.
- `prefix_cache`: where the prefix cache holds a prefix of the prompt (kv_store/prefix_cache.py), that
  prefix's KV reused exactly and only the rest computed, through every layer; chosen whenever it is
  predicted faster than the plan chosen otherwise (it reads no chunk, and what it reuses is a finished
  prompt's own KV: at least as good as blending for the part it covers).

Predictions come from a `CostModel` of the engine (fitted on measured prefills, refined by every
answered request) and the tiers' measured throughput. Layer-pipelined, a plan's TTFT is the larger
of its load and its compute.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import Enum
from typing import Mapping, Sequence

import torch

from kv_store.backend import Tier
from kv_store.loader import StoredChunk

# Bytes/s and seconds per layer read assumed for a tier until a load was measured on it.
# Memory-tier layers are views (CPU) or one copy each: negligible next to compute until measured.
# The GPU tier's layers are views on the engine's device: nothing is copied.
PRIOR_THROUGHPUT = {Tier.GPU: 1e13, Tier.MEMORY: 1e12, Tier.DISK: 1e9, Tier.REDIS: 0.5e9}
PRIOR_READ_LATENCY_S = {Tier.GPU: 0.0, Tier.MEMORY: 0.0, Tier.DISK: 20e-6, Tier.REDIS: 100e-6}


class PlanKind(str, Enum):
    FULL = "full"
    BLEND = "blend"
    MIXED = "mixed"
    SPLIT = "split"
    PREFIX_CACHE = "prefix_cache"


@dataclass(frozen=True)
class PrefillShape:
    """What a prefill computes, in the cost model's terms."""

    num_prompt_tokens: int  # n
    num_computed_tokens: int  # c: tokens recomputed after the first reuse layer (fresh + selected)
    num_reused_tokens: int  # M: tokens whose KV is laid out from a cache
    reuse_fraction: float  # share of the layers that reuse (after blend's first check layer), 0 for full

    def features(self) -> list[float]:
        """[1, token-layers, attended pairs, reused tokens], per layer on average."""
        n, c, f = float(self.num_prompt_tokens), float(self.num_computed_tokens), self.reuse_fraction
        return [1.0, (1 - f) * n + f * c, (1 - f) * n * n + f * c * n, float(self.num_reused_tokens)]


@dataclass(frozen=True)
class CostModel:
    """Prefill seconds = overhead + per-token + per-attended-pair + per-reused-token terms (all >= 0).

    Not linear in the computed tokens on a GPU or a CPU (attention grows with the prompt), hence the
    pair term; fitted by least squares over measured prefills.
    """

    weights: tuple[float, float, float, float]

    def seconds(self, shape: PrefillShape) -> float:
        return max(0.0, sum(w * x for w, x in zip(self.weights, shape.features())))

    @classmethod
    def fit(cls, samples: Sequence[tuple[PrefillShape, float]]) -> CostModel:
        """Non-negative least squares (by dropping negative terms and refitting; 4 terms at most)."""
        if not samples:
            raise ValueError("the cost model needs at least one measured prefill")
        x = torch.tensor([s.features() for s, _ in samples], dtype=torch.float64)  # [S, 4]
        y = torch.tensor([t for _, t in samples], dtype=torch.float64)  # [S]
        scale = x.abs().amax(dim=0).clamp_min(1e-12)  # columns differ by ~1e7: condition the solve
        active = [j for j in range(x.shape[1]) if bool((x[:, j] != 0).any())]
        while active:
            sol = torch.linalg.lstsq(x[:, active] / scale[active], y[:, None]).solution[:, 0] / scale[active]
            negative = [j for j, w in zip(active, sol.tolist()) if w < 0]
            if not negative:
                weights = [0.0] * x.shape[1]
                for j, w in zip(active, sol.tolist()):
                    weights[j] = w
                return cls(tuple(weights))
            active.remove(negative[0])
        return cls((float(y.mean()), 0.0, 0.0, 0.0))


@dataclass(frozen=True)
class LoadPlan:
    kind: PlanKind
    ratio: float | None  # blend's recompute ratio; None for full
    reused_tiers: frozenset[Tier]  # chunks on these tiers are reused, the others computed fresh
    predicted_load_ms: float
    predicted_compute_ms: float
    is_pipelined: bool = True  # loads overlap compute (else they add up)
    num_front_computed: int = 0  # split: the first chunks (prompt order) computed fresh whatever their tier

    @property
    def predicted_ttft_ms(self) -> float:
        if not self.is_pipelined:
            return self.predicted_load_ms + self.predicted_compute_ms
        return max(self.predicted_load_ms, self.predicted_compute_ms)

    def is_reused(self, chunk: StoredChunk) -> bool:
        """For plans chosen by tier; a split plan is positional (see `reused_mask`)."""
        if self.num_front_computed:
            raise ValueError("a split plan reuses chunks by position: use reused_mask(chunks)")
        return chunk.tier in self.reused_tiers

    def reused_mask(self, chunks: Sequence[StoredChunk]) -> list[bool]:
        """Per chunk (prompt order): reused from its tier, or computed as fresh tokens."""
        return [i >= self.num_front_computed and c.tier in self.reused_tiers for i, c in enumerate(chunks)]


@dataclass(frozen=True)
class PlanRequest:
    """What the planner knows of one request before its prefill."""

    chunks: Sequence[StoredChunk]  # the stored chunks, prompt order
    num_prompt_tokens: int
    num_fresh_tokens: int  # tokens without a stored cache (prefix, separators, question, unstored chunks)
    first_reused_layer: int  # blend's first check layer: loads start there
    num_layers: int
    is_pipelined: bool = True  # the store streams layers while the engine computes
    num_prefix_cached_tokens: int = 0  # the prompt's first tokens the prefix cache holds (0: none)


class LoadPlanner:
    """Chooses a `LoadPlan`; learns the engine's cost from every prefill it is told about."""

    def __init__(self, min_ratio: float, max_ratio: float = 1.0, margin: float = 0.05, max_samples: int = 64):
        if not 0.0 <= min_ratio <= max_ratio <= 1.0:
            raise ValueError(f"need 0 <= min_ratio ({min_ratio}) <= max_ratio ({max_ratio}) <= 1")
        if not 0.0 <= margin < 1.0:
            raise ValueError(f"the planner's margin must be in [0, 1), got {margin}")
        self.min_ratio, self.max_ratio, self.margin = min_ratio, max_ratio, margin
        self._samples: deque[tuple[PrefillShape, float]] = deque(maxlen=max_samples)
        self._model: CostModel | None = None

    @property
    def is_ready(self) -> bool:
        return self._model is not None

    @property
    def cost_model(self) -> CostModel:
        if self._model is None:
            raise RuntimeError("the planner has no measured prefill yet (see measure_engine)")
        return self._model

    def observe(self, shape: PrefillShape, seconds: float) -> None:
        """Add a measured prefill's compute time and refit (cheap: a 4-column least squares)."""
        self._samples.append((shape, seconds))
        self._model = CostModel.fit(list(self._samples))

    def plan(self, request: PlanRequest, throughput: Mapping[Tier, float | None], is_blend_only: bool = False) -> LoadPlan:
        """The fastest plan; `is_blend_only` for an explicit blend. Reusing every chunk is the default:
        another plan must be predicted faster by more than `margin` (the cost model's own error) to
        replace it, so noise in the measurements does not flip plans."""
        chosen = self._chunk_plan(request, throughput, is_blend_only)
        return self.with_prefix_cache(request, chosen)

    def with_prefix_cache(self, request: PlanRequest, chosen: LoadPlan) -> LoadPlan:
        """The prefix cache's plan where the request has a cached prefix and it is predicted faster than
        `chosen`, else `chosen`."""
        if not request.num_prefix_cached_tokens:
            return chosen
        cached = self.prefix_cached(request)
        return cached if cached.predicted_ttft_ms < chosen.predicted_ttft_ms else chosen

    def _chunk_plan(self, request: PlanRequest, throughput: Mapping[Tier, float | None], is_blend_only: bool) -> LoadPlan:
        """The fastest way to use the stored chunks (the prefix cache aside)."""
        tiers_fast_first = [t for t in Tier if any(c.tier == t for c in request.chunks)]
        default = self._reusing(request, frozenset(tiers_fast_first), throughput)
        if is_blend_only:
            return default
        others = [self.full(request)]
        others += [self._reusing(request, frozenset(tiers_fast_first[:k]), throughput)
                   for k in range(1, len(tiers_fast_first))]
        if len(request.chunks) > 1:
            others.append(self._best_split(request, throughput))
        best = min(others, key=lambda p: (round(p.predicted_ttft_ms, 3), -_quality_rank(p)))
        return best if best.predicted_ttft_ms < (1 - self.margin) * default.predicted_ttft_ms else default

    def full(self, request: PlanRequest) -> LoadPlan:
        """Compute the whole prompt, loading nothing."""
        n = request.num_prompt_tokens
        compute = self.cost_model.seconds(PrefillShape(n, n, 0, 0.0))
        return LoadPlan(PlanKind.FULL, None, frozenset(), 0.0, compute * 1000)

    def prefix_cached(self, request: PlanRequest) -> LoadPlan:
        """Reuse the prefix cache's `num_prefix_cached_tokens` as they are, compute the rest through every
        layer (what a reuse from layer 0 computes: the rest's tokens against the whole prompt). The kept
        tokens are not the reused-token term's: that is a stored chunk's cost (loaded, re-positioned, laid
        out), where a kept prompt's KV is copied as it is. Counted there, a follow-up whose few new tokens
        are what any plan computes was predicted slower than blending it again whenever blends had
        fitted that term high (a 33-token follow-up took 8 ms, the blend chosen instead 17 ms)."""
        n, m = request.num_prompt_tokens, request.num_prefix_cached_tokens
        if not 0 < m < n:
            raise ValueError(f"a cached prefix of {m} tokens leaves nothing or everything of {n} to compute")
        compute = self.cost_model.seconds(PrefillShape(n, n - m, 0, 1.0))
        return LoadPlan(PlanKind.PREFIX_CACHE, None, frozenset(), 0.0, compute * 1000)

    def _best_split(self, request: PlanRequest, throughput: Mapping[Tier, float | None]) -> LoadPlan:
        """The split whose front compute and rear load meet: the lowest predicted TTFT over k (ties:
        the larger front, closer to full). Compute grows and load shrinks with k, so that is where
        they cross; a prompt holds tens of chunks at most, so every k is tried."""
        splits = [self._split(request, k, throughput) for k in range(1, len(request.chunks))]
        return min(splits, key=lambda p: (round(p.predicted_ttft_ms, 3), -p.num_front_computed))

    def _split(self, request: PlanRequest, num_front: int, throughput: Mapping[Tier, float | None]) -> LoadPlan:
        """The first `num_front` chunks computed as fresh tokens, the rear ones reused whatever their tier."""
        all_tiers = frozenset(c.tier for c in request.chunks)
        return self._reusing(request, all_tiers, throughput, num_front)

    def _reusing(self, request: PlanRequest, tiers: frozenset[Tier], throughput: Mapping[Tier, float | None],
                 num_front: int = 0) -> LoadPlan:
        mask = [i >= num_front and c.tier in tiers for i, c in enumerate(request.chunks)]
        reused = [c for c, is_reused in zip(request.chunks, mask) if is_reused]
        num_reused = sum(c.num_tokens for c in reused)
        num_fresh = request.num_fresh_tokens + sum(c.num_tokens for c, r in zip(request.chunks, mask) if not r)
        num_layers_loaded = max(request.num_layers - request.first_reused_layer, 0)
        load_s = sum(_read_seconds(c, num_layers_loaded, throughput) for c in reused)
        fraction = num_layers_loaded / max(request.num_layers, 1)

        def compute_s(ratio: float) -> float:
            computed = round(ratio * num_reused) + num_fresh
            return self.cost_model.seconds(PrefillShape(request.num_prompt_tokens, computed, num_reused, fraction))

        # only a load that overlaps compute hides extra recompute for free
        ratio = self._hiding_ratio(compute_s, load_s) if request.is_pipelined else self.min_ratio
        kind = PlanKind.SPLIT if num_front else PlanKind.MIXED
        kind = PlanKind.BLEND if len(reused) == len(request.chunks) else kind
        return LoadPlan(kind, ratio, tiers, load_s * 1000, compute_s(ratio) * 1000, request.is_pipelined, num_front)

    def _hiding_ratio(self, compute_s, load_s: float) -> float:
        """The largest ratio in [min, max] whose compute still fits under the load, with `margin`
        headroom for the cost model's error (bisection: the cost is monotonic in the ratio); the
        floor when even that exceeds the load."""
        load_s *= 1 - self.margin
        lo, hi = self.min_ratio, self.max_ratio
        if compute_s(lo) >= load_s:
            return lo
        if compute_s(hi) <= load_s:
            return hi
        for _ in range(20):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if compute_s(mid) <= load_s else (lo, mid)
        return round(lo, 4)


def _read_seconds(chunk: StoredChunk, num_layers: int, throughput: Mapping[Tier, float | None]) -> float:
    rate = throughput.get(chunk.tier) or PRIOR_THROUGHPUT[chunk.tier]
    return num_layers * (chunk.layer_nbytes / rate + PRIOR_READ_LATENCY_S[chunk.tier])


def _quality_rank(plan: LoadPlan) -> float:
    """Higher is closer to full: full, then more recomputed."""
    if plan.kind is PlanKind.FULL:
        return 2.0
    return (plan.ratio or 0.0) + (0.5 if plan.kind in (PlanKind.MIXED, PlanKind.SPLIT) else 0.0)
