"""Selection strategies behind `BlendConfig.selection`: exact at ratio 1, the same budget as
deviation, chunk starts always kept, and query-aware ranking against a brute-force reference
(Hugging Face's own attention probabilities at the check layer)."""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from blend_engine.engine import BlendEngine
from blend_engine.plan import MIN_PASS_ROWS, plan_prefill
from blend_engine.selector import combine_scores
from blend_engine.types import BlendConfig, HeadReduce, PrefillMode, ScoreCombine, SelectionKind, Segment
from engine_models import MODEL_BUILDERS, build_engine, cpu_exact
from test_engine_blend import assert_same_prefill, rag_prompt


def cached_positions(segments) -> list[int]:
    out, pos = [], 0
    for seg in segments:
        if seg.kv is not None:
            out += range(pos, pos + len(seg.token_ids))
        pos += len(seg.token_ids)
    return out


@pytest.mark.parametrize("selection", list(SelectionKind))
@pytest.mark.parametrize("family", list(MODEL_BUILDERS))
def test_every_selection_at_ratio_one_equals_full(family, selection):
    engine = build_engine(family)
    segments = rag_prompt(engine)
    full = engine.prefill(segments, PrefillMode.FULL)
    blend = engine.prefill(segments, PrefillMode.BLEND, BlendConfig.cacheblend(recompute_ratio=1.0, selection=selection))
    assert_same_prefill(blend, full)


@pytest.mark.parametrize("selection", list(SelectionKind))
@pytest.mark.parametrize("check_layers", [(1,), (1, 2, 3)])
def test_every_selection_spends_the_same_budget(selection, check_layers):
    engine = build_engine("llama-gqa")
    segments = rag_prompt(engine, chunk_len=40)
    config = BlendConfig.cacheblend(recompute_ratio=0.2, selection=selection, check_layers=check_layers, chunk_start_tokens=3)
    result = engine.prefill(segments, PrefillMode.BLEND, config)
    cached = cached_positions(segments)
    assert len(result.stats.selected_positions) == round(0.2 * len(cached))
    assert set(result.stats.selected_positions) <= set(cached)
    if selection.is_forcing_chunk_starts:  # each chunk's first 3 tokens, whatever their score
        starts = {p for seg_start in _chunk_starts(segments) for p in range(seg_start, seg_start + 3)}
        assert starts <= set(result.stats.selected_positions)


def _chunk_starts(segments) -> list[int]:
    out, pos = [], 0
    for seg in segments:
        if seg.kv is not None:
            out.append(pos)
        pos += len(seg.token_ids)
    return out


@cpu_exact
@pytest.mark.parametrize("check", [1, 2])
def test_query_selection_ranks_by_the_questions_attention_mass(check):
    engine = build_engine("llama-gqa")
    segments = rag_prompt(engine, chunk_len=25)
    ratio = 0.2
    result = engine.prefill(segments, PrefillMode.BLEND,
                            BlendConfig.cacheblend(recompute_ratio=ratio, check_layers=(check,), selection=SelectionKind.QUERY))
    # Brute force: before the check layer every token is recomputed, so HF's own attention
    # probabilities at the check layer are the engine's; the question = the tokens after the last chunk.
    ids = [t for seg in segments for t in seg.token_ids]
    engine.model.set_attn_implementation("eager")
    with torch.no_grad():
        probs = engine.model(torch.tensor([ids]), output_attentions=True).attentions[check][0]  # [H, N, N]
    num_question = len(segments[-1].token_ids)
    mass = probs[:, -num_question:].sum(dim=(0, 1))  # [N]
    cached = cached_positions(segments)
    top = torch.topk(mass[cached], round(ratio * len(cached))).indices
    assert result.stats.selected_positions == sorted(cached[i] for i in top.tolist())


def test_adaptive_ratio_covers_its_share_of_the_score():
    engine = build_engine("llama-gqa")
    segments = rag_prompt(engine, chunk_len=40)
    num_cached = len(cached_positions(segments))
    low = engine.prefill(segments, PrefillMode.BLEND, BlendConfig.cacheblend(is_ratio_adaptive=True, adaptive_mass=0.3, adaptive_min_ratio=0.0, adaptive_max_ratio=1.0))
    high = engine.prefill(segments, PrefillMode.BLEND, BlendConfig.cacheblend(is_ratio_adaptive=True, adaptive_mass=0.9, adaptive_min_ratio=0.0, adaptive_max_ratio=1.0))
    assert 0 < len(low.stats.selected_positions) < len(high.stats.selected_positions) <= num_cached
    assert low.stats.unselected_mass <= 0.7 + 1e-6 and high.stats.unselected_mass <= 0.1 + 1e-6
    assert low.stats.recompute_ratio == len(low.stats.selected_positions) / num_cached
    # the bounds win over the mass
    capped = engine.prefill(segments, PrefillMode.BLEND, BlendConfig.cacheblend(is_ratio_adaptive=True, adaptive_mass=0.99, adaptive_max_ratio=0.2))
    assert len(capped.stats.selected_positions) == round(0.2 * num_cached)
    # and at full coverage it is a full prefill
    whole = engine.prefill(segments, PrefillMode.BLEND, BlendConfig.cacheblend(is_ratio_adaptive=True, adaptive_mass=1.0, adaptive_max_ratio=1.0))
    assert_same_prefill(whole, engine.prefill(segments, PrefillMode.FULL))


def test_quality_guard_raises_the_ratio_of_risky_requests_only():
    engine = build_engine("llama-gqa")
    segments = rag_prompt(engine, chunk_len=40)
    num_cached = len(cached_positions(segments))
    plain = engine.prefill(segments, PrefillMode.BLEND, BlendConfig.cacheblend(recompute_ratio=0.1))
    left = plain.stats.unselected_mass
    assert 0 < left < 1 and not plain.stats.is_guarded
    risky = engine.prefill(segments, PrefillMode.BLEND, BlendConfig.cacheblend(
        recompute_ratio=0.1, guard_unselected_mass=left - 0.01, guard_ratio=0.4))
    assert risky.stats.is_guarded and len(risky.stats.selected_positions) == round(0.4 * num_cached)
    calm = engine.prefill(segments, PrefillMode.BLEND, BlendConfig.cacheblend(
        recompute_ratio=0.1, guard_unselected_mass=left + 0.01, guard_ratio=0.4))
    assert not calm.stats.is_guarded and calm.stats.selected_positions == plain.stats.selected_positions


def test_ratio_decided_at_check_needs_one_check_layer():
    with pytest.raises(ValueError, match="one check layer"):
        BlendConfig.cacheblend(is_ratio_adaptive=True, adaptive_mass=0.5, check_layers=(1, 2))


PROBE = dict(probe_layer=3, query_heads=HeadReduce.MAX, query_tokens=3)


@pytest.mark.parametrize("selection", [SelectionKind.QUERY, SelectionKind.QUERY_DEVIATION])
@pytest.mark.parametrize("family", list(MODEL_BUILDERS))
def test_probe_selection_at_ratio_one_equals_full(family, selection):
    engine = build_engine(family)
    segments = rag_prompt(engine)
    full = engine.prefill(segments, PrefillMode.FULL)
    for checks, combine in [((1,), ScoreCombine.PRODUCT), ((1, 2, 3), ScoreCombine.RANK_SUM)]:
        config = BlendConfig.cacheblend(recompute_ratio=1.0, selection=selection, check_layers=checks, combine=combine, **PROBE)
        assert_same_prefill(engine.prefill(segments, PrefillMode.BLEND, config), full)


@pytest.mark.parametrize("combine", list(ScoreCombine))
@pytest.mark.parametrize("check_layers", [(1,), (1, 2)])
def test_probe_selection_spends_the_same_budget(check_layers, combine):
    engine = build_engine("llama-gqa")
    segments = rag_prompt(engine, chunk_len=40)
    config = BlendConfig.cacheblend(recompute_ratio=0.2, selection=SelectionKind.QUERY_DEVIATION, check_layers=check_layers,
                         combine=combine, **PROBE)
    result = engine.prefill(segments, PrefillMode.BLEND, config)
    cached = cached_positions(segments)
    assert len(result.stats.selected_positions) == round(0.2 * len(cached))
    assert set(result.stats.selected_positions) <= set(cached)
    assert result.stats.num_recomputed_tokens == len(result.token_ids) - len(cached) + round(0.2 * len(cached))


@cpu_exact
@pytest.mark.parametrize("heads,span", [(HeadReduce.SUM, 1), (HeadReduce.MAX, 1), (HeadReduce.SUM, 2)])
def test_probe_ranks_by_the_questions_attention_at_the_probe_layer(heads, span):
    # Chunks precomputed behind exactly the tokens before them: their reused KV is the full prefill's,
    # so the probe's attention at layer 3 is HF's own there (brute-force reference).
    engine = build_engine("llama-gqa")
    plain = rag_prompt(engine, chunk_len=25)
    segments, before = [], []
    for seg in plain:
        segments.append(Segment(seg.token_ids, engine.precompute(seg.token_ids, before) if seg.kv else None))
        before += seg.token_ids
    ratio, probe_layer, num_last = 0.2, 3, 4
    config = BlendConfig.cacheblend(recompute_ratio=ratio, selection=SelectionKind.QUERY, probe_layer=probe_layer,
                         probe_span=span, query_heads=heads, query_tokens=num_last)
    result = engine.prefill(segments, PrefillMode.BLEND, config)
    engine.model.set_attn_implementation("eager")
    with torch.no_grad():
        attentions = engine.model(torch.tensor([before]), output_attentions=True).attentions
    mass = 0
    for layer in range(probe_layer - span + 1, probe_layer + 1):  # the layers summed, each [H, N, N]
        per_head = attentions[layer][0][:, -num_last:].sum(dim=1)  # [H, N]
        mass = mass + (per_head.amax(dim=0) if heads == HeadReduce.MAX else per_head.sum(dim=0))
    cached = cached_positions(segments)
    top = torch.topk(mass[cached], round(ratio * len(cached))).indices
    assert result.stats.selected_positions == sorted(cached[i] for i in top.tolist())


def probe_plan(num_fresh_per_gap: int, chunk_len: int, budget: float | None, probe_layer: int = 20,
               num_layers: int = 28):
    """The plan of a prompt [fresh, chunk, fresh, chunk, fresh] (placeholder KV: planning reads no tensor)."""
    kv = SimpleNamespace(context_ids=(), num_tokens=chunk_len)
    segments = [Segment(tuple(range(num_fresh_per_gap))), Segment(tuple(range(chunk_len)), kv),
                Segment(tuple(range(num_fresh_per_gap))), Segment(tuple(range(chunk_len)), kv),
                Segment(tuple(range(num_fresh_per_gap)))]
    config = BlendConfig(probe_layer=probe_layer, probe_budget=budget, recompute_ratio=0.15)
    return plan_prefill(segments, PrefillMode.BLEND, config, num_layers)


def test_probe_budget_lowers_the_probe_on_short_prompts_only():
    """probe_budget: the probe's passes of the fresh tokens (one a layer) stay within that share of the blend's
    own (every layer over the fresh and recomputed tokens), a pass over fewer than MIN_PASS_ROWS rows costing
    as much as one over that many (the weights' read); a long prompt probes at probe_layer."""
    long = probe_plan(num_fresh_per_gap=20, chunk_len=1500, budget=0.3)  # 60 fresh, 450 kept
    assert long.probe_layer == 20
    short = probe_plan(num_fresh_per_gap=15, chunk_len=150, budget=0.3)  # 45 fresh, 45 kept: both passes at 128
    assert len(short.fresh_pos) == 45 and short.num_keep[-1] == 45 and MIN_PASS_ROWS == 128
    assert short.probe_layer == int(0.3 * 28) == 8
    middle = probe_plan(num_fresh_per_gap=15, chunk_len=600, budget=0.3)  # 45 fresh, 180 kept
    assert middle.probe_layer == int(0.3 * 28 * (45 + 180) / 128) == 14
    assert probe_plan(num_fresh_per_gap=15, chunk_len=150, budget=None).probe_layer == 20  # no budget: as asked
    # nothing after the check layer affordable: the check layer's own attention ranks
    assert probe_plan(num_fresh_per_gap=15, chunk_len=150, budget=0.03).probe_layer is None
    deviation = BlendConfig(probe_layer=20, probe_budget=0.3, selection=SelectionKind.DEVIATION, check_layers=(1,))
    assert plan_prefill([Segment((1, 2)), Segment((3, 4, 5), SimpleNamespace(context_ids=(), num_tokens=3)),
                         Segment((6,))], PrefillMode.BLEND, deviation, 28).probe_layer is None  # no query: no probe


@cpu_exact
@pytest.mark.parametrize("family", ["llama-gqa", "qwen2-bias"])
def test_a_probe_lowered_by_its_budget_selects_as_a_probe_asked_at_that_layer(family):
    engine = build_engine(family)
    segments = rag_prompt(engine, chunk_len=25)  # 18 fresh tokens, 75 cached: at r 0.2, 15 kept; the check at 1
    config = BlendConfig.cacheblend(recompute_ratio=0.2, selection=SelectionKind.QUERY, probe_layer=3, probe_span=1)
    budgeted = replace(config, probe_budget=0.2)  # 1 + int(0.2 * 4) = 1 + 0 (both passes under 128 rows): no probe
    assert engine.prefill(segments, PrefillMode.BLEND, budgeted).stats.selected_positions == engine.prefill(
        segments, PrefillMode.BLEND, replace(config, probe_layer=None)).stats.selected_positions
    budgeted = replace(config, probe_budget=0.3)  # 1 + int(0.3 * 4) = 2
    lowered = engine.prefill(segments, PrefillMode.BLEND, budgeted).stats
    asked = engine.prefill(segments, PrefillMode.BLEND, replace(config, probe_layer=2)).stats
    deep = engine.prefill(segments, PrefillMode.BLEND, config).stats
    assert (lowered.selected_positions, lowered.unselected_mass) == (asked.selected_positions, asked.unselected_mass)
    assert (lowered.selected_positions, lowered.unselected_mass) != (deep.selected_positions, deep.unselected_mass)
    enough = engine.prefill(segments, PrefillMode.BLEND, replace(config, probe_budget=1.0)).stats
    assert (enough.selected_positions, enough.unselected_mass) == (deep.selected_positions, deep.unselected_mass)


def test_probe_layer_must_follow_the_check_and_is_fitted_to_the_model():
    """A probe past the model's last layer is fitted to it by the engine, as its own default is (a config
    built from BlendConfig's defaults probes at layer 8: it runs on a 4-layer model, and ranks as the
    config with its probe at the last layer does); a check layer past the last is refused."""
    with pytest.raises(ValueError, match="probe_layer"):
        BlendConfig.cacheblend(check_layers=(2,), probe_layer=2)
    engine = build_engine("llama-gqa")
    segments = rag_prompt(engine)
    for config in (BlendConfig(recompute_ratio=0.15, check_layers=(1,)),
                   BlendConfig.cacheblend(selection=SelectionKind.QUERY, probe_layer=engine.num_layers)):
        assert config.probe_layer >= engine.num_layers
        result = engine.prefill(segments, PrefillMode.BLEND, config)
        fitted = engine.prefill(segments, PrefillMode.BLEND, config.probe_fitted(engine.num_layers))
        assert fitted.stats.selected_positions == result.stats.selected_positions
        assert torch.equal(fitted.logits, result.logits)
    with pytest.raises(ValueError, match="check layer"):
        engine.prefill(segments, PrefillMode.BLEND, BlendConfig.cacheblend(check_layers=(engine.num_layers,)))


def test_rank_sum_combines_the_two_rankings():
    mass, deviation = torch.tensor([0.9, 0.1, 0.5, 0.0]), torch.tensor([0.0, 100.0, 50.0, 1.0])
    assert combine_scores(mass, deviation, ScoreCombine.RANK_SUM).tolist() == [3.0, 4.0, 4.0, 1.0]
    assert combine_scores(mass, deviation, ScoreCombine.PRODUCT).argmax() == 2


def test_last_token_shift_is_zero_for_exact_caches_only():
    engine = build_engine("llama-gqa")
    plain = rag_prompt(engine, chunk_len=25)
    exact, before = [], []
    for seg in plain:  # each chunk precomputed behind exactly the tokens before it: its KV is the full prefill's
        exact.append(Segment(seg.token_ids, engine.precompute(seg.token_ids, before) if seg.kv else None))
        before += seg.token_ids
    config = BlendConfig.cacheblend(recompute_ratio=0.2, is_shift_measured=True)
    assert engine.prefill(plain, PrefillMode.BLEND, BlendConfig.cacheblend()).stats.last_token_shift is None  # off by default
    assert engine.prefill(exact, PrefillMode.BLEND, config).stats.last_token_shift < 1e-5
    assert engine.prefill(plain, PrefillMode.BLEND, config).stats.last_token_shift > 1e-3


def test_query_options_come_from_settings():
    from configs.settings import load_settings
    settings = load_settings(blend={"selection": "query_deviation", "probe_layer": 8, "query_heads": "max",
                                    "query_tokens": 4, "combine": "rank_sum"})
    config = settings.blend
    assert (config.probe_layer, config.query_heads, config.query_tokens, config.combine) == (
        8, HeadReduce.MAX, 4, ScoreCombine.RANK_SUM)
    default = load_settings().blend
    assert (default.selection, default.check_layers, default.probe_layer, default.probe_span, default.probe_budget) == (
        SelectionKind.QUERY, (0,), 8, 4, None)


def test_fitted_configs_suit_the_model():
    """The server's defaults run on any model: a probe past the last layer probes at the last one (or
    at the check, with no layer after it), and a deviation ranking never checks at layer 0."""
    config = BlendConfig.cacheblend(check_layers=(0,), selection=SelectionKind.QUERY, probe_layer=8, probe_span=4)
    assert config.fitted(30) == config
    assert config.fitted(4).probe_layer == 3
    assert config.fitted(1).probe_layer is None
    for kind in (SelectionKind.DEVIATION, SelectionKind.QUERY_DEVIATION, SelectionKind.CHUNK_START):
        fitted = BlendConfig.cacheblend(check_layers=(0,), selection=kind, probe_layer=8).fitted(30)
        assert fitted.check_layers == (1,) and fitted.probe_layer == 8
    assert BlendConfig.cacheblend(check_layers=(0, 1, 2)).fitted(30).check_layers == (1, 2)
    assert BlendConfig.cacheblend(check_layers=(0,), probe_layer=1).fitted(30).probe_layer is None
    engine = build_engine("llama-gqa")  # 4 layers: the defaults' probe at 8 is fitted
    segments = rag_prompt(engine)
    fitted = BlendEngine.from_model(engine.model, blend=config).blend
    assert fitted.probe_layer == engine.num_layers - 1
    assert engine.prefill(segments, PrefillMode.BLEND, fitted).stats.num_recomputed_tokens > 0


@pytest.mark.parametrize("asked", [1e-320, 0.0, 0.001, 0.15, 0.5])
def test_the_reported_ratio_is_the_share_that_ran(asked):
    """A requested 1e-320 keeps round(1e-320 * n) = 0 tokens: the stats say 0.0, not the number asked."""
    engine = build_engine("llama-gqa")
    segments = rag_prompt(engine, chunk_len=40)
    num_cached = len(cached_positions(segments))
    stats = engine.prefill(segments, PrefillMode.BLEND, BlendConfig.cacheblend(recompute_ratio=asked)).stats
    assert stats.recompute_ratio == len(stats.selected_positions) / num_cached
    assert stats.recompute_ratio == pytest.approx(asked, abs=1 / num_cached)
