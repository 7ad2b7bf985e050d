"""Repetition control (blend_engine/generate.py RepetitionControl, applied by each sequence's TokenSampler):
the penalties against a hand computation and Hugging Face's own logits processors, end-of-sequence ids
never penalized, n-gram blocking, a looping greedy answer that stops looping, each sequence of a batch
with its own penalties getting what it gets alone."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import NoRepeatNGramLogitsProcessor, RepetitionPenaltyLogitsProcessor

from blend_engine.generate import RepetitionControl
from blend_engine.sequence import TokenSampler
from blend_engine.types import PrefillMode, SamplingParams
from configs.enums import RepetitionScope
from engine_models import MODEL_BUILDERS, build_engine, cpu_exact
from test_batch_decode import decode_alone, engine_for, prefills, run_batch
from test_engine_blend import rag_prompt
from configs.enums import DecodeCache, WeightFormat

CPU = torch.device("cpu")
OFF = dict(no_repeat_ngram_size=0, stop=())  # the server's defaults (an n-gram block, a stop string) off


@pytest.fixture(autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def control_after(params: SamplingParams, generated: list[int], prompt: tuple[int, ...] = (),
                  exempt: tuple[int, ...] = (), vocab: int = 12) -> RepetitionControl:
    """A RepetitionControl that has seen `generated` (each sampled from some logits of `vocab`)."""
    control = RepetitionControl(params, prompt, exempt)
    for token in generated:
        control.apply(torch.zeros(vocab))
        control.observe(token)
    return control


LOGITS = torch.tensor([1.5, -0.5, 2.0, 0.25, -1.0, 3.0, 0.0, 0.75, -2.0, 1.0, 0.5, -0.25])


def test_frequency_and_presence_penalties_are_openais_formula():
    """logit - count * frequency - (count > 0) * presence, over the generated tokens only."""
    generated = [2, 2, 5, 2, 7]  # token 2 three times, 5 and 7 once
    params = SamplingParams(frequency_penalty=0.4, presence_penalty=0.7)
    out = control_after(params, generated, prompt=(1, 3, 4)).apply(LOGITS.clone())
    expected = LOGITS.clone()
    expected[2] -= 3 * 0.4 + 0.7
    expected[5] -= 1 * 0.4 + 0.7
    expected[7] -= 1 * 0.4 + 0.7
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)  # the prompt's 1, 3, 4 untouched
    frequency = control_after(SamplingParams(frequency_penalty=0.4), generated).apply(LOGITS.clone())
    presence = control_after(SamplingParams(presence_penalty=0.4), generated).apply(LOGITS.clone())
    assert float(LOGITS[2] - frequency[2]) == pytest.approx(1.2) and float(LOGITS[5] - frequency[5]) == pytest.approx(0.4)
    assert float(LOGITS[2] - presence[2]) == pytest.approx(0.4) and float(LOGITS[5] - presence[5]) == pytest.approx(0.4)
    negative = control_after(SamplingParams(frequency_penalty=-0.5), generated).apply(LOGITS.clone())
    assert float(negative[2] - LOGITS[2]) == pytest.approx(1.5)  # a negative penalty favours repeats


@pytest.mark.parametrize("scope", list(RepetitionScope))
def test_the_repetition_penalty_is_ctrls_as_hugging_face_computes_it(scope):
    """A seen token's positive logit divided, a negative one multiplied; over the answer, or the prompt
    too: what Hugging Face's RepetitionPenaltyLogitsProcessor gives over those ids."""
    prompt, generated = (1, 3, 9), [2, 8, 2]
    params = SamplingParams(repetition_penalty=1.5, repetition_scope=scope)
    out = control_after(params, generated, prompt).apply(LOGITS.clone())
    covered = list(prompt) + generated if scope is RepetitionScope.PROMPT_AND_ANSWER else generated
    reference = RepetitionPenaltyLogitsProcessor(1.5)(torch.tensor([covered]), LOGITS[None].clone())[0]
    torch.testing.assert_close(out, reference, atol=1e-6, rtol=0)
    assert float(out[2]) == pytest.approx(2.0 / 1.5) and float(out[8]) == pytest.approx(-2.0 * 1.5)
    assert float(out[1]) == (-0.75 if scope is RepetitionScope.PROMPT_AND_ANSWER else -0.5)


def test_end_of_sequence_ids_are_never_penalized():
    """An answer can always end: the EOS ids keep their logit, in the prompt or generated (ignore_eos)."""
    params = SamplingParams(repetition_penalty=2.0, repetition_scope=RepetitionScope.PROMPT_AND_ANSWER,
                            frequency_penalty=1.0, presence_penalty=1.0, no_repeat_ngram_size=1)
    out = control_after(params, [5, 6, 5], prompt=(0, 5, 2), exempt=(5, 99)).apply(LOGITS.clone())
    assert float(out[5]) == float(LOGITS[5])  # exempt, though in the prompt and generated twice
    assert float(out[0]) == pytest.approx(1.5 / 2.0) and out[6] == float("-inf")  # the others are


def test_greedy_picks_the_argmax_of_the_penalized_logits():
    """Greedy stays greedy: the top token after the penalties; with none set, the logits are untouched."""
    sampler = TokenSampler(None, frozenset(), SamplingParams(max_tokens=8, presence_penalty=1.0), 100, CPU)
    logits = torch.tensor([0.0, 2.0, 1.5, 1.2])
    picked = [sampler.push(logits)[1] for _ in range(4)]
    assert picked == [1, 2, 3, 1]  # 2.0; then 1 at 1.0 < 2 at 1.5; then 3 at 1.2 > 1.0, 0.5; then 1 at 1.0 > 0.5, 0.2, 0
    plain = RepetitionControl(SamplingParams(), (1, 2), ())
    assert plain.apply(logits) is logits


def test_ngram_blocking_matches_hugging_face_and_never_emits_a_blocked_ngram():
    generated = [4, 7, 4, 9, 4, 7, 3, 4]
    for n in (1, 2, 3):
        out = control_after(SamplingParams(no_repeat_ngram_size=n), generated).apply(LOGITS.clone())
        reference = NoRepeatNGramLogitsProcessor(n)(torch.tensor([generated]), LOGITS[None].clone())[0]
        assert torch.equal(out, reference), n
    assert control_after(SamplingParams(no_repeat_ngram_size=3), generated).apply(LOGITS.clone())[7] != float("-inf")
    assert control_after(SamplingParams(no_repeat_ngram_size=2), generated).apply(LOGITS.clone())[7] == float("-inf")


def decode(engine, params: SamplingParams) -> list[int]:
    return decode_alone(engine, engine.prefill(rag_prompt(engine), PrefillMode.BLEND), params)


def ngrams(tokens: list[int], n: int) -> Counter:
    return Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))


@pytest.mark.parametrize("family", list(MODEL_BUILDERS))
def test_ngram_blocking_on_a_model_never_repeats_an_ngram(family):
    """Greedy and sampled answers of a tiny model: with no_repeat_ngram_size=n, every n-gram once."""
    engine = build_engine(family)
    for n in (2, 3):
        for extra in ({}, {"temperature": 1.5, "seed": 3}):
            tokens = decode(engine, SamplingParams(max_tokens=40, no_repeat_ngram_size=n, **extra))
            assert len(tokens) == 40 and max(ngrams(tokens, n).values()) == 1, (n, extra, tokens)
    assert max(ngrams(decode(engine, SamplingParams(max_tokens=40, **OFF)), 3).values()) > 1  # without it, a loop


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=30, repetition_penalty=2.0, **OFF),
                                    SamplingParams(max_tokens=30, presence_penalty=0.5, **OFF),
                                    SamplingParams(max_tokens=30, frequency_penalty=0.3, **OFF),
                                    SamplingParams(max_tokens=30)],  # the server's default: the n-gram block
                         ids=["repetition", "presence", "frequency", "default"])
def test_a_greedy_answer_that_repeats_a_token_stops_repeating_it(params):
    """The tiny Llama's greedy answer is one token 29 times over; each penalty breaks the loop, and so does
    the default n-gram block."""
    engine = build_engine("llama-gqa")
    plain = decode(engine, SamplingParams(max_tokens=30, **OFF))
    token, count = Counter(plain).most_common(1)[0]
    assert count >= 25  # the loop the penalties are for
    penalized = decode(engine, params)
    assert penalized[:2] == plain[:2]  # the same answer until the repeat
    if params.no_repeat_ngram_size:  # the token comes back, but never six times in a row again
        assert Counter(penalized)[token] < 15 and max(ngrams(penalized, params.no_repeat_ngram_size).values()) == 1
    else:
        assert Counter(penalized)[token] <= 2 and max(Counter(penalized).values()) <= 2


BATCH_PARAMS = [
    SamplingParams(max_tokens=6, repetition_penalty=1.8, repetition_scope=RepetitionScope.PROMPT_AND_ANSWER, **OFF),
    SamplingParams(max_tokens=11, frequency_penalty=0.6, presence_penalty=-0.2, **OFF),
    SamplingParams(max_tokens=17, **OFF),
    SamplingParams(max_tokens=40, no_repeat_ngram_size=2, presence_penalty=0.3, temperature=0.8, seed=5),
]


@cpu_exact
@pytest.mark.parametrize("family", list(MODEL_BUILDERS))
def test_each_sequence_of_a_batch_gets_its_own_penalties(family):
    """Four requests with different penalties (one with none, one sampled) in one batch: each gets the
    tokens it gets alone, and the penalties changed what they get."""
    engine = engine_for(family, WeightFormat.INT8, DecodeCache.INT8)
    alone = [decode_alone(engine, r, p) for r, p in zip(prefills(engine), BATCH_PARAMS)]
    sequences, _ = run_batch(engine, prefills(engine), BATCH_PARAMS)
    assert [s.token_ids for s in sequences] == alone
    plain = [decode_alone(engine, r, SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, seed=p.seed,
                                                    **OFF))
             for r, p in zip(prefills(engine), BATCH_PARAMS)]
    assert alone[2] == plain[2]
    assert sum(a != p for a, p in zip(alone, plain)) >= 2  # the penalties did something
