"""The reshaped prefill: same selection as before, no host reads inside the layer loop, one
attention call per layer on the CUDA path, both attention backends exact against a full prefill,
and the decode step (eager and CUDA-graph-shaped) against forward_tokens."""

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from blend_engine.attention import AttentionBackend
from blend_engine.engine import BlendEngine
from blend_engine.types import BlendConfig, DeviationKind, HeadReduce, PrefillMode, ScoreCombine, SelectionKind, Segment
from engine_models import cpu_exact, tol, MODEL_BUILDERS, build_engine, random_ids
from host_reads import HostReadCounter
from test_engine_blend import assert_same_prefill, rag_prompt

RECORDED = Path(__file__).parent / "data" / "selected_positions.json"


def golden_prompt(engine, seed=7):
    """The prompt the recorded selections were made on (by the engine before the reshaping)."""
    segments = [Segment(random_ids(6, seed))]
    for i in range(4):
        if i:
            segments.append(Segment(random_ids(3, seed + 100 + i)))
        ids = random_ids(37 + 11 * i, seed + i + 1)
        segments.append(Segment(ids, engine.precompute(ids)))
    segments.append(Segment(random_ids(9, seed + 50)))
    return segments


@cpu_exact
@pytest.mark.parametrize("backend", list(AttentionBackend))
@pytest.mark.parametrize("family", list(MODEL_BUILDERS))
def test_selected_positions_match_the_engine_before_reshaping(family, backend):
    recorded = json.loads(RECORDED.read_text())
    engine = build_engine(family)
    engine.attention_backend = backend
    segments = golden_prompt(engine)
    num_checked = 0
    for key, expected in recorded.items():
        name, deviation, checks, ratio = key.split("|")
        if name != family:
            continue
        config = BlendConfig.cacheblend(recompute_ratio=float(ratio), check_layers=tuple(int(c) for c in checks.split(",")),
                             deviation=DeviationKind(deviation))
        result = engine.prefill(segments, PrefillMode.BLEND, config)
        assert result.stats.selected_positions == expected, key
        num_checked += 1
    assert num_checked == 24


@pytest.mark.parametrize("family", list(MODEL_BUILDERS))
@pytest.mark.parametrize("mode", [PrefillMode.REUSE, PrefillMode.PREFIX])
def test_masked_backend_equals_grouped(family, mode):
    engine = build_engine(family)
    segments = rag_prompt(engine, chunk_len=90)  # long enough for several query groups
    grouped = engine.prefill(segments, mode)
    engine.attention_backend = AttentionBackend.MASKED
    assert_same_prefill(engine.prefill(segments, mode), grouped)


@pytest.mark.parametrize("family", list(MODEL_BUILDERS))
@pytest.mark.parametrize("mode", [PrefillMode.REUSE, PrefillMode.PREFIX, PrefillMode.BLEND])
def test_bulk_layout_equals_layer_by_layer(family, mode):
    """The CUDA default (every layer's reused KV laid out before the loop) against the CPU one."""
    engine = build_engine(family)
    segments = rag_prompt(engine)
    per_layer = engine.prefill(segments, mode)
    engine.is_bulk_layout = True
    bulk = engine.prefill(segments, mode)
    assert_same_prefill(bulk, per_layer)
    assert bulk.stats.selected_positions == per_layer.stats.selected_positions


@pytest.mark.parametrize("family", list(MODEL_BUILDERS))
def test_masked_backend_blend_at_ratio_one_equals_full(family):
    engine = build_engine(family)
    engine.attention_backend = AttentionBackend.MASKED
    segments = rag_prompt(engine)
    full = engine.prefill(segments, PrefillMode.FULL)
    assert_same_prefill(engine.prefill(segments, PrefillMode.BLEND, BlendConfig.cacheblend(recompute_ratio=1.0)), full)


def tiny_llama(num_layers: int) -> BlendEngine:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=4096)
    return BlendEngine.from_model(LlamaForCausalLM(config).eval(), name=f"tiny-{num_layers}", blend=BlendConfig.cacheblend())


def count_blend_prefill(num_layers: int, backend: AttentionBackend, check_layers: tuple[int, ...], **changes):
    engine = tiny_llama(num_layers)
    engine.attention_backend = backend
    segments = [Segment(random_ids(8, 1))]
    for i in range(5):
        ids = random_ids(120, 2 + i)
        segments.append(Segment(ids, engine.precompute(ids)))
    segments.append(Segment(random_ids(12, 9)))
    config = BlendConfig.cacheblend(recompute_ratio=0.15, check_layers=check_layers, **changes)
    engine.prefill(segments, PrefillMode.BLEND, config)  # warm-up
    counter = HostReadCounter(engine.model)
    try:
        with counter:
            result = engine.prefill(segments, PrefillMode.BLEND, config)
    finally:
        counter.remove()
    assert len(result.stats.selected_positions) == round(0.15 * 600)
    return counter


@pytest.mark.parametrize("check_layers", [(1,), (1, 2, 3)])
def test_no_host_reads_in_the_layer_loop_on_the_cuda_path(check_layers):
    for num_layers in (4, 12):
        counter = count_blend_prefill(num_layers, AttentionBackend.MASKED, check_layers)
        assert counter.reads["loop"] == 0, counter.reads
        assert counter.reads["after"] == 1  # the selected positions, read once after the loop
        assert counter.attention["loop"] == num_layers  # one attention call per layer


@pytest.mark.parametrize("check_layers", [(1,), (1, 2)])
def test_query_probe_and_shift_signal_add_no_host_reads(check_layers):
    probe = dict(selection=SelectionKind.QUERY_DEVIATION, probe_layer=3, query_heads=HeadReduce.MAX,
                 combine=ScoreCombine.RANK_SUM, is_shift_measured=True)
    counter = count_blend_prefill(12, AttentionBackend.MASKED, check_layers, **probe)
    assert counter.reads["loop"] == 0, counter.reads
    assert counter.reads["after"] == 1  # the selection and the signals, in one read after the loop


@pytest.mark.parametrize("check_layers", [(0,), (1, 2)])
def test_the_servers_defaults_add_no_host_reads(check_layers):
    """Query ranking with a probe and the reused attention scaled (its bias indexed on the device)."""
    defaults = dict(selection=SelectionKind.QUERY, probe_layer=8, probe_span=4, reused_attention_scale=0.5)
    counter = count_blend_prefill(12, AttentionBackend.MASKED, check_layers, **defaults)
    assert counter.reads["loop"] == 0, counter.reads
    assert counter.reads["after"] == 1
    # one attention call per layer (the bias rides in the mask), plus the probe's, from the check up to layer 8
    assert counter.attention["loop"] == 12 + 8 - check_layers[0]


def test_grouped_backend_reads_back_only_at_check_layers():
    """The CPU backend reads the new active positions once per check (its key cut-offs), never per layer."""
    for num_layers in (4, 12):
        counter = count_blend_prefill(num_layers, AttentionBackend.GROUPED, (1, 2))
        assert counter.reads["loop"] == 2, counter.reads


@pytest.mark.parametrize("family", list(MODEL_BUILDERS))
@pytest.mark.parametrize("attention_scale", [1.0, 0.5])  # 0.5: the cache carries a column bias
def test_decoder_steps_equal_forward_tokens(family, attention_scale):
    engine = build_engine(family)
    segments = rag_prompt(engine)
    blend = BlendConfig.cacheblend(reused_attention_scale=attention_scale)
    result = engine.prefill(segments, PrefillMode.BLEND, blend, max_new_tokens=8)
    assert (result.cache.column_bias is not None) == (attention_scale != 1.0)
    tokens = random_ids(6, 77)
    reference = engine.forward_tokens(result, tokens)  # [6, vocab], one multi-token pass
    decoder = engine.decoder(result, is_graphed=False)
    eager = torch.stack([decoder.step(t) for t in tokens])
    torch.testing.assert_close(eager, reference, **tol(1e-4))
    # the CUDA graph's static-shape step (whole capacity, mask from a device position), run eagerly
    decoder = engine.decoder(result, is_graphed=False)
    static = []
    for t in tokens:
        pos = result.cache.extend(1)
        decoder.prepare_static(pos)
        decoder._token.fill_(t)
        with torch.inference_mode():
            static.append(decoder.static_step())
    torch.testing.assert_close(torch.stack(static), reference, **tol(1e-4))


def test_decoder_grows_its_rope_table_with_the_cache():
    engine = build_engine("llama-gqa")
    ids = random_ids(30, 5)
    result = engine.prefill([Segment(ids[:20])], PrefillMode.FULL)  # capacity 20: decoding must grow it
    decoder = engine.decoder(result, is_graphed=False)
    steps = torch.stack([decoder.step(t) for t in ids[20:]])
    with torch.no_grad():
        reference = engine.model(torch.tensor([ids], device=engine.device)).logits[0, 20:].float()
    torch.testing.assert_close(steps, reference, **tol(1e-4))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="SDPA's cuDNN backend exists on CUDA only")
def test_an_engine_on_cuda_turns_sdpa_cudnn_backend_off():
    """A plan per new prompt length (docs/benchmarks/gpu.md): the engine's attention must not use it."""
    torch.backends.cuda.enable_cudnn_sdp(True)
    engine = build_engine("llama-gqa")
    if engine.device.type != "cuda":
        engine.model.to("cuda", dtype=torch.bfloat16)
        engine = type(engine).from_model(engine.model, name="llama-gqa-cuda", blend=BlendConfig.cacheblend())
    assert not torch.backends.cuda.cudnn_sdp_enabled()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA graph decode needs a CUDA device")
def test_cuda_graph_decode_equals_eager():
    engine = build_engine("llama-gqa")
    if engine.device.type != "cuda":
        engine.model.to("cuda", dtype=torch.bfloat16)
        engine = type(engine).from_model(engine.model, name="llama-gqa-cuda", blend=BlendConfig.cacheblend())
    segments = rag_prompt(engine)
    result = engine.prefill(segments, PrefillMode.BLEND, max_new_tokens=8)
    tokens = random_ids(6, 77)
    eager_decoder = engine.decoder(result, is_graphed=False)
    eager = torch.stack([eager_decoder.step(t) for t in tokens])
    graphed_decoder = engine.decoder(result, is_graphed=True)
    graphed = torch.stack([graphed_decoder.step(t) for t in tokens])
    torch.testing.assert_close(graphed, eager, atol=5e-2, rtol=2e-2)


def test_stage_timers_are_exact_and_add_up():
    """Host clock on CPU; CUDA events when profiled on CUDA (`pytest --device cuda`)."""
    engine = build_engine("llama-gqa")
    result = engine.prefill(rag_prompt(engine), PrefillMode.BLEND, is_profiled=True)
    stats = result.stats
    assert stats.is_timing_exact and stats.compute_ms > 0 and stats.select_ms > 0 and stats.rope_ms > 0
    assert stats.compute_ms + stats.select_ms + stats.rope_ms <= stats.prefill_ms
