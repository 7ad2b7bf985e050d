"""Batched decode (`BlendEngine.start_sequence` / `decode_step`): a request's tokens do not depend on
what else is in the batch, on every model family, weight format and decode cache format."""

import copy

import pytest
import torch

from blend_engine.batch_decode import batch_step
from blend_engine.engine import BlendEngine
from blend_engine.types import BlendConfig, FinishReason, PrefillMode, SamplingParams
from blend_engine.weights import convert_linears
from configs.enums import DecodeCache, WeightFormat
from engine_models import MODEL_BUILDERS, build_engine, cpu_exact, random_ids
from test_engine_blend import rag_prompt

pytestmark = cpu_exact  # exact token equality and the quantized kernels: CPU

FAMILIES = list(MODEL_BUILDERS)
# (weights, decode cache): fp32 over each cache format, the quantized ones over the caches they use
FORMATS = [(WeightFormat.FP32, DecodeCache.MODEL), (WeightFormat.FP32, DecodeCache.BF16),
           (WeightFormat.FP32, DecodeCache.INT8), (WeightFormat.INT8, DecodeCache.INT8),
           (WeightFormat.INT4, DecodeCache.INT8), (WeightFormat.INT4, DecodeCache.BF16)]
SCALED = BlendConfig.cacheblend(reused_attention_scale=0.5)  # leaves a column bias on the cache: decode must honour it
# mixed prompt lengths and modes; the last prompt's cache has room for 2 new tokens only (it grows)
REQUESTS = [
    (PrefillMode.BLEND, dict(seed=10), 0),
    (PrefillMode.FULL, dict(seed=20, num_chunks=2, chunk_len=30), 0),
    (PrefillMode.REUSE, dict(seed=30, num_chunks=4, chunk_len=12), 0),
    (PrefillMode.BLEND, dict(seed=40, num_chunks=1, chunk_len=9), 2),
]
MAX_TOKENS = [6, 11, 17, 40]  # they finish at different steps: the batch shrinks


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models gain nothing from a second thread, and on a loaded machine OpenMP's spinning threads
    made these tests ~30x slower (measured: 6 s against 0.2 s for the same prefills)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def engine_for(family: str, weights: WeightFormat, cache: DecodeCache) -> BlendEngine:
    """A tiny engine of `family` with `weights` (converted in place) decoding over `cache`."""
    fp32 = build_engine(family)
    model = copy.deepcopy(fp32.model)
    convert_linears(model, weights)
    return BlendEngine.from_model(model, name=family, decode_cache=cache, blend=BlendConfig.cacheblend())


def prefills(engine: BlendEngine) -> list:
    return [engine.prefill(rag_prompt(engine, **prompt), mode, SCALED, max_new_tokens=room)
            for mode, prompt, room in REQUESTS]


def decode_alone(engine: BlendEngine, result, params: SamplingParams) -> list[int]:
    sequence, delta = engine.start_sequence(result, params)
    while not sequence.is_finished:
        engine.decode_step([sequence])
    return sequence.token_ids


@pytest.mark.parametrize("weights,cache", FORMATS, ids=[f"{w.value}-{c.value}" for w, c in FORMATS])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_alone_equal_tokens_in_a_batch(family, weights, cache):
    """Four requests of different prompt lengths and modes, one joining two steps late, each finishing
    at its own step, one growing its cache mid-batch: each gets the tokens it gets alone."""
    engine = engine_for(family, weights, cache)
    params = [SamplingParams(max_tokens=n) for n in MAX_TOKENS]
    alone = [decode_alone(engine, result, p) for result, p in zip(prefills(engine), params)]

    results = prefills(engine)  # fresh caches (a MODEL-format decode writes into the prefill's)
    capacity_before = results[3].cache.capacity
    sequences = [engine.start_sequence(r, p)[0] for r, p in zip(results[:3], params[:3])]
    num_steps, batch_sizes = 0, []
    while True:
        if num_steps == 2:  # admitted while the others run
            sequences.append(engine.start_sequence(results[3], params[3])[0])
        running = [s for s in sequences if not s.is_finished]
        if not running:
            break
        deltas = engine.decode_step(running)
        assert len(deltas) == len(running)
        assert [d.num_tokens for d in deltas] == [s.num_tokens for s in running]
        batch_sizes.append(len(running))
        num_steps += 1
    assert [s.token_ids for s in sequences] == alone
    assert max(batch_sizes) == 4 and batch_sizes[-1] < 4  # it ran as a batch, and shrank
    if len(alone[3]) == MAX_TOKENS[3]:  # no EOS cut it short: its cache grew while in the batch
        assert len(results[3].token_ids) + len(alone[3]) > capacity_before


@pytest.mark.parametrize("weights,cache", FORMATS, ids=[f"{w.value}-{c.value}" for w, c in FORMATS])
@pytest.mark.parametrize("family", FAMILIES)
def test_batched_logits_equal_logits_alone(family, weights, cache):
    """Row b of a batched step is what sequence b's step alone gives, within 1e-5 of the logits' scale.

    Not bit for bit: the linear layers' GEMM over B rows may sum in another order than over one row
    (measured on this CPU: fp32 rows differ by ~1e-7, a few ulps of values of order 1). Attention is
    per sequence, the same ops alone and batched. 1e-5 is ~100x that noise and ~1000x below what a
    wrong position, RoPE row, bias or cache would cause (differences of order 1e-2 and up)."""
    engine = engine_for(family, weights, cache)
    tokens = random_ids(8, 5)
    alone = []
    for result in prefills(engine):
        decoder = engine.decoder(result)
        alone.append(torch.stack([batch_step(engine.runner, [decoder], [t])[0] for t in tokens]))
    decoders = [engine.decoder(r) for r in prefills(engine)]
    batched = torch.stack([batch_step(engine.runner, decoders, [t] * len(decoders)) for t in tokens], dim=1)
    for row, reference in zip(batched, alone):  # [steps, vocab] each
        torch.testing.assert_close(row, reference, atol=1e-5 * float(reference.abs().max()), rtol=0)


@pytest.mark.parametrize("cache", [DecodeCache.MODEL, DecodeCache.BF16, DecodeCache.INT8])
def test_a_batch_of_one_is_the_single_sequence_decoder_bit_for_bit(cache):
    """decode_step on one sequence runs what `Decoder.step` runs (what generate ran before): same logits."""
    engine = engine_for("llama-gqa", WeightFormat.FP32, cache)
    tokens = random_ids(6, 9)
    decoder = engine.decoder(prefills(engine)[0])
    reference = torch.stack([decoder.step(t) for t in tokens])
    other = engine.decoder(prefills(engine)[0])
    stepped = torch.stack([batch_step(engine.runner, [other], [t])[0] for t in tokens])
    assert torch.equal(stepped, reference)


def test_decode_step_refuses_an_empty_batch_finished_and_repeated_sequences():
    engine = build_engine("llama-gqa")
    result = engine.prefill(rag_prompt(engine), PrefillMode.BLEND)
    with pytest.raises(ValueError, match="at least one"):
        engine.decode_step([])
    sequence, delta = engine.start_sequence(result, SamplingParams(max_tokens=1))
    assert sequence.is_finished and delta.finish_reason == FinishReason.LENGTH and sequence.nbytes == 0
    with pytest.raises(ValueError, match="finished"):
        engine.decode_step([sequence])
    other, _ = engine.start_sequence(engine.prefill(rag_prompt(engine), PrefillMode.BLEND), SamplingParams())
    with pytest.raises(ValueError, match="twice"):
        engine.decode_step([other, other])


@pytest.fixture(scope="module")
def tokenizer():
    """The real SmolLM2 tokenizer (no weights): a tiny model's ids 0..255 are its special tokens, ASCII
    characters and byte pieces, so its text pieces, stop strings and held-back bytes are real ones."""
    from transformers import AutoTokenizer

    from blend_engine.loader import embedded_tokenizer_dir
    from configs.settings import load_settings

    return AutoTokenizer.from_pretrained(embedded_tokenizer_dir(load_settings().model.cache_dir))


def text_engine(tokenizer, family: str = "qwen2-bias", cache: DecodeCache = DecodeCache.INT8) -> BlendEngine:
    torch.manual_seed(0)
    model = MODEL_BUILDERS[family]().eval()
    convert_linears(model, WeightFormat.INT8)
    return BlendEngine.from_model(model, tokenizer=tokenizer, name=family, decode_cache=cache, blend=BlendConfig.cacheblend())


def run_batch(engine: BlendEngine, results, params, cancel_at: dict[int, int] | None = None):
    """Decode every request in one batch until all finish; per request its deltas. `cancel_at`:
    request -> the step before which it is cancelled (left out of the batch from then on, as the
    engine loop drops a sequence whose client left)."""
    started = [engine.start_sequence(r, p) for r, p in zip(results, params)]
    sequences = [s for s, _ in started]
    deltas = [[d] for _, d in started]
    step = 0
    while running := [i for i, s in enumerate(sequences)
                      if not s.is_finished and (cancel_at or {}).get(i, step + 1) > step]:
        for i, delta in zip(running, engine.decode_step([sequences[i] for i in running])):
            deltas[i].append(delta)
        step += 1
    return sequences, deltas


def joined(deltas) -> str:
    return "".join(d.text for d in deltas)


def test_seeded_sampling_gives_the_same_tokens_alone_and_in_a_batch(tokenizer):
    """Each request samples from its own generator with its own temperature / top-p: beside greedy and
    other sampled requests it draws what it draws alone (and another seed draws otherwise)."""
    engine = text_engine(tokenizer)
    params = [SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=7),
              SamplingParams(max_tokens=18),
              SamplingParams(max_tokens=30, temperature=1.3, seed=8),
              SamplingParams(max_tokens=21, temperature=0.7, top_p=0.5, seed=7)]
    alone = [decode_alone(engine, r, p) for r, p in zip(prefills(engine), params)]
    sequences, deltas = run_batch(engine, prefills(engine), params)
    assert [s.token_ids for s in sequences] == alone
    assert [joined(d) for d in deltas] == [joined(list(engine.generate(r, p)))
                                           for r, p in zip(prefills(engine), params)]
    reseeded = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=8)
    assert decode_alone(engine, prefills(engine)[0], reseeded) != alone[0]


def test_stop_strings_max_tokens_and_cancellation_act_on_their_own_sequence(tokenizer):
    """A stop string ends its sequence (text before it, finish "stop"), max_tokens another ("length"),
    a cancelled one leaves the batch; the others' text is what it is alone."""
    engine = text_engine(tokenizer)
    free = [joined(engine.generate(r, SamplingParams(max_tokens=30))) for r in prefills(engine)]
    stop = free[0][10:12]
    assert len(free[0]) >= 12 and stop.strip()
    params = [SamplingParams(max_tokens=30, stop=("\x00never", stop)), SamplingParams(max_tokens=7),
              SamplingParams(max_tokens=30), SamplingParams(max_tokens=30)]
    sequences, deltas = run_batch(engine, prefills(engine), params, cancel_at={3: 4})
    assert joined(deltas[0]) == free[0][: free[0].index(stop)]
    assert deltas[0][-1].finish_reason == FinishReason.STOP
    assert deltas[1][-1].finish_reason == FinishReason.LENGTH and deltas[1][-1].num_tokens == 7
    assert free[1].startswith(joined(deltas[1]))
    assert joined(deltas[2]) == free[2]
    assert not sequences[3].is_finished and len(deltas[3]) == 5  # cancelled: the first token + 4 steps
    assert free[3].startswith(joined(deltas[3]))
    assert all(d.finish_reason is None for d in deltas[3])  # cancelled: no finish of its own
    assert all(d.finish_reason is None for ds in deltas for d in ds[:-1])


def test_an_eos_ends_the_answer_unless_it_is_ignored():
    from blend_engine.sequence import TokenSampler

    logits = torch.zeros(10)
    logits[5] = 1.0  # greedy picks token 5, the end of sequence here
    finishes = []
    for is_eos_ignored in (False, True):
        sampler = TokenSampler(None, frozenset({5}), SamplingParams(max_tokens=4, is_eos_ignored=is_eos_ignored),
                               100, torch.device("cpu"))
        deltas = []
        while not sampler.is_finished:
            deltas.append(sampler.push(logits)[0])
        finishes.append((len(deltas), deltas[-1].finish_reason))
    assert finishes == [(1, FinishReason.STOP), (4, FinishReason.LENGTH)]


def test_nbytes_is_the_decode_cache_the_sequence_holds():
    engine = engine_for("llama-gqa", WeightFormat.INT8, DecodeCache.INT8)
    result = prefills(engine)[1]
    sequence, _ = engine.start_sequence(result, SamplingParams(max_tokens=5))
    assert sequence.nbytes == result.cache.keys.nbytes * 2  # before its first step: the prefill's cache
    decoder = sequence.prepare()
    assert sequence.nbytes == decoder.cache.nbytes < result.cache.keys.nbytes  # int8 + scales < fp32 keys
    while not sequence.is_finished:
        engine.decode_step([sequence])
    assert sequence.nbytes == 0 and sequence.decoder is None
