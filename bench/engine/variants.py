"""The engine bench's rows: modes and ratios, `--variant` specs. (The `--sweep` and `--selections` rows, and the
`--adaptive`, `--check-layers` and `--deviation` options, were retired in issue 64; `--variant` and `--sink` ask
the same: docs/benchmarks/README.md#retired.)"""

from __future__ import annotations

from dataclasses import replace

from bench.harness.engine import Variant, parse_spec
from blend_engine.types import BlendConfig, PrefillMode
from configs.enums import SinkMode


def main_variants(blend: BlendConfig, sink: SinkMode, ratios: list[float]) -> list[Variant]:
    """full, prefix, reuse and blend at each ratio in the engine's config; with a key or attention scale
    configured, CacheBlend's own reuse and blend (no scale) too: the reference of the KL ratios."""
    out = [Variant("full", PrefillMode.FULL, sink), Variant("prefix", PrefillMode.PREFIX, sink),
           Variant("reuse", PrefillMode.REUSE, sink, blend)]
    out += [Variant(f"blend@{r:.2f}", PrefillMode.BLEND, sink, replace(blend, recompute_ratio=r)) for r in ratios]
    if blend.is_reuse_scaled:
        plain = replace(blend, reused_key_scale=1.0, reused_attention_scale=1.0)
        out.append(Variant("reuse unscaled", PrefillMode.REUSE, sink, plain))
        out += [Variant(f"blend@{r:.2f} unscaled", PrefillMode.BLEND, sink, replace(plain, recompute_ratio=r))
                for r in ratios]
    return out


def spec_variants(blend: BlendConfig, sink: SinkMode, specs: list[str]) -> list[Variant]:
    """Rows from `--variant` specs: space-separated BlendConfig fields over the engine's config at
    r=0.15, e.g. "selection=query_deviation check_layers=1,2,3", and optionally `mode=reuse` (default
    blend); the label is the spec itself, prefixed by the mode."""
    base = replace(blend, recompute_ratio=0.15)
    out = []
    for spec in specs:
        modes = [item.partition("=")[2] for item in spec.split() if item.startswith("mode=")]
        mode = PrefillMode(modes[-1]) if modes else PrefillMode.BLEND
        rest = " ".join(item for item in spec.split() if not item.startswith("mode="))
        out.append(Variant(f"{mode.value} {rest}".strip(), mode, sink, replace(base, **parse_spec(base, rest))))
    return out
