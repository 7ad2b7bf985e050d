"""The engine bench's variants: modes and ratios, the ablation sweep, selection strategies, adaptive rows."""

from __future__ import annotations

from dataclasses import fields, replace
from enum import Enum

from bench.harness.engine import Variant
from blend_engine.types import BlendConfig, PrefillMode
from configs.enums import DeviationKind, SelectionKind, SinkMode


def main_variants(blend: BlendConfig, sink: SinkMode, ratios: list[float]) -> list[Variant]:
    """full, prefix, reuse and blend at each ratio in the engine's config; with a key or attention scale
    configured, CacheBlend's own reuse and blend (no scale) too: the reference of the KL ratios."""
    out = [Variant("full", PrefillMode.FULL, sink), Variant("prefix", PrefillMode.PREFIX, sink),
           Variant("reuse", PrefillMode.REUSE, sink, blend)]
    out += [Variant(f"blend@{r:.2f}", PrefillMode.BLEND, sink, _with(blend, recompute_ratio=r, is_shift_measured=True))
            for r in ratios]  # the guard report's candidate signals are measured on these rows
    if blend.is_reuse_scaled:
        plain = _with(blend, reused_key_scale=1.0, reused_attention_scale=1.0)
        out.append(Variant("reuse unscaled", PrefillMode.REUSE, sink, plain))
        out += [Variant(f"blend@{r:.2f} unscaled", PrefillMode.BLEND, sink, _with(plain, recompute_ratio=r))
                for r in ratios]
    return out


def sweep_variants(blend: BlendConfig, sink: SinkMode) -> list[Variant]:
    """Ablations at r=0.15: K vs V deviation (the deviation ranking, whatever the default's) at each
    check-layer choice (one layer, or gradual filtering over several), then each attention-sink choice
    with its own `reuse` reference."""
    base = _with(blend, recompute_ratio=0.15)
    out = []
    for layers in [(0,), (1,), (2,), (1, 2), (1, 2, 3)]:
        for dev in DeviationKind:
            label = f"blend@0.15 {dev.value[0].upper()} check=" + ",".join(map(str, layers))
            config = _with(base, selection=SelectionKind.DEVIATION, deviation=dev, check_layers=layers)
            out.append(Variant(label, PrefillMode.BLEND, sink, config))
    for other in SinkMode:
        if other != sink:
            out.append(Variant(f"reuse sink={other.value}", PrefillMode.REUSE, other))
            out.append(Variant(f"blend@0.15 sink={other.value}", PrefillMode.BLEND, other, base))
    return out


def selection_variants(blend: BlendConfig, sink: SinkMode, num_layers: int) -> list[Variant]:
    """Every selection strategy at r=0.15 (chunk starts: 8 and 32 tokens per chunk), each fitted to
    the model as the server would run it (a deviation ranking checks at layer 1 at least)."""
    base = _with(blend, recompute_ratio=0.15)
    out = []
    for kind in SelectionKind:
        for num_start in ((8, 32) if kind.is_forcing_chunk_starts else (0,)):
            label = f"blend@0.15 sel={kind.value}" + (f" k={num_start}" if num_start else "")
            config = _with(base, selection=kind, chunk_start_tokens=num_start or base.chunk_start_tokens).fitted(num_layers)
            out.append(Variant(label, PrefillMode.BLEND, sink, config))
    return out


def _with(config: BlendConfig, **changes) -> BlendConfig:
    return replace(config, **changes)


def adaptive_variants(blend: BlendConfig, sink: SinkMode, shares: list[float]) -> list[Variant]:
    """Adaptive-ratio rows: recompute until each share of the ranking score is covered."""
    return [Variant(f"blend@adaptive m={m:.2f}", PrefillMode.BLEND, sink, _with(blend, is_ratio_adaptive=True, adaptive_mass=m)) for m in shares]


def spec_variants(blend: BlendConfig, sink: SinkMode, specs: list[str]) -> list[Variant]:
    """Rows from `--variant` specs: space-separated BlendConfig fields over the engine's config at
    r=0.15, e.g. "selection=query_deviation check_layers=1,2,3", and optionally `mode=reuse` (default
    blend); the label is the spec itself, prefixed by the mode."""
    base = _with(blend, recompute_ratio=0.15)
    out = []
    for spec in specs:
        modes = [item.partition("=")[2] for item in spec.split() if item.startswith("mode=")]
        mode = PrefillMode(modes[-1]) if modes else PrefillMode.BLEND
        rest = " ".join(item for item in spec.split() if not item.startswith("mode="))
        out.append(Variant(f"{mode.value} {rest}".strip(), mode, sink, _with(base, **parse_spec(base, rest))))
    return out


def parse_spec(base: BlendConfig, spec: str) -> dict:
    types = {f.name: str(f.type) for f in fields(BlendConfig)}
    names = set(types)
    changes = {}
    for item in spec.split():
        name, sep, text = item.partition("=")
        if not sep or name not in names:
            raise ValueError(f"bad variant item {item!r}: expected FIELD=VALUE with FIELD one of {sorted(names)}")
        current = getattr(base, name)
        if text.lower() == "none":
            changes[name] = None
        elif isinstance(current, tuple):
            changes[name] = tuple(int(x) for x in text.split(","))
        elif isinstance(current, Enum):
            changes[name] = type(current)(text)
        elif isinstance(current, bool):
            changes[name] = text.lower() in ("1", "true", "yes")
        elif isinstance(current, int) or types[name].startswith("int"):
            changes[name] = int(text)
        else:
            changes[name] = float(text)
    return changes
