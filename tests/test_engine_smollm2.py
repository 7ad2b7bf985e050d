"""The real SmolLM2-135M: fused answers match full prefill; streaming text; loading."""

import pytest
import torch

from blend_engine.engine import BlendEngine
from blend_engine.generate import IncrementalDetokenizer, StopStringFilter
from blend_engine.loader import embedded_tokenizer_dir, load_model
from blend_engine.types import BlendConfig, FinishReason, PrefillMode, SamplingParams, Segment
from blend_engine.config import ModelConfig
from configs.enums import SinkMode


pytestmark = pytest.mark.smollm2

FACTS = [
    "Zorvan Quell is a painter who lives in the town of Brindlemoor. He paints only blue birds.",
    "The town of Brindlemoor lies on the river Aster. Its bridge was built in 1832 by Ilsa Varn.",
    "Ilsa Varn was an engineer born in Kettering. She designed eleven bridges in her life.",
]
QUESTION = "In which year was the bridge of Brindlemoor built?"


@pytest.fixture(scope="module")
def engine():
    return BlendEngine.from_config(ModelConfig(name="smollm2"))


def answer(engine, segments, mode, max_tokens=20, blend=None):
    result = engine.prefill(segments, mode, blend, max_new_tokens=max_tokens)
    return "".join(d.text for d in engine.generate(result, SamplingParams(max_tokens=max_tokens)))


@pytest.mark.parametrize("sink", list(SinkMode))
def test_blend_answers_like_full_over_facts_in_three_chunks(engine, sink):
    """CacheBlend's blend (deviation ranking, no scale) gives full's answer word for word. The server's
    default (query ranking, reused attention scaled by 0.5) agrees with full on more answer tokens over
    the MuSiQue questions (README), but not word for word on every prompt: here the fact itself must
    be in its answer."""
    context = engine.sink_ids(sink)
    chunks = [Segment(tuple(engine.tokenize(f)), engine.precompute(engine.tokenize(f), context)) for f in FACTS]
    segments = engine.build_segments(QUESTION, chunks)
    full = answer(engine, segments, PrefillMode.FULL)
    assert "1832" in full
    blend = engine.prefill(segments, PrefillMode.BLEND)
    assert blend.stats.num_reused_tokens > 0
    cacheblend = BlendConfig.cacheblend(recompute_ratio=engine.blend.recompute_ratio)  # CacheBlend's own selection, no scale
    assert answer(engine, segments, PrefillMode.BLEND, blend=cacheblend) == full
    assert "1832" in answer(engine, segments, PrefillMode.BLEND)


def test_streamed_pieces_join_to_the_whole_answer_and_stop(engine):
    segments = [Segment(engine.prompts.chat_ids([{"role": "user", "content": "Say hello in French."}]))]
    result = engine.prefill(segments, PrefillMode.FULL)
    deltas = list(engine.generate(result, SamplingParams(max_tokens=30)))
    text = "".join(d.text for d in deltas)
    assert text and deltas[-1].finish_reason is not None
    assert all(d.finish_reason is None for d in deltas[:-1])
    # the same prefill decodes again from the prompt's end
    assert "".join(d.text for d in engine.generate(result, SamplingParams(max_tokens=30))) == text
    short = list(engine.generate(result, SamplingParams(max_tokens=3)))
    assert short[-1].finish_reason == FinishReason.LENGTH and short[-1].num_tokens == 3


def test_stop_string_ends_generation_before_it(engine):
    segments = [Segment(engine.prompts.chat_ids([{"role": "user", "content": "Count from 1 to 10."}]))]
    result = engine.prefill(segments, PrefillMode.FULL)
    free = "".join(d.text for d in engine.generate(result, SamplingParams(max_tokens=40)))
    assert "5" in free
    deltas = list(engine.generate(result, SamplingParams(max_tokens=40, stop=("5",))))
    assert deltas[-1].finish_reason == FinishReason.STOP
    assert "".join(d.text for d in deltas) == free[: free.index("5")]


def test_sampling_is_reproducible_with_a_seed(engine):
    segments = [Segment(engine.prompts.chat_ids([{"role": "user", "content": "Write a word."}]))]
    result = engine.prefill(segments, PrefillMode.FULL)
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=7)
    one = "".join(d.text for d in engine.generate(result, params))
    two = "".join(d.text for d in engine.generate(result, params))
    assert one == two


def test_incremental_detokenizer_never_splits_a_character(engine):
    text = "Café 東京 🚀 naïve — ok"
    ids = engine.tokenize(text)
    detok = IncrementalDetokenizer(engine.tokenizer)
    pieces = [detok.push(i) for i in ids]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_stop_filter_holds_back_partial_matches():
    f = StopStringFilter(("STOP",))
    assert f.push("abc ST") == ("abc ", False)
    assert f.push("OP tail") == ("", True)
    g = StopStringFilter(("STOP",))
    assert g.push("ST") == ("", False)
    assert g.push("ay") == ("STay", False)


def test_warm_load_reads_the_kept_config_and_tokenizer(tmp_path):
    """The GGUF's config, tokenizer and tensor table are read once into model.cache_dir; a later load reads
    them from there (no second parse of the file), and the directory is a tokenizer for the tests."""
    settings = ModelConfig(name="smollm2")
    directory = embedded_tokenizer_dir(settings.cache_dir)
    assert {"config.json", "tokenizer.json", "tensors.json"} <= {p.name for p in directory.iterdir()}
    assert not list(directory.glob("*.safetensors"))  # no weights: they are read from the GGUF itself
    loaded = load_model(ModelConfig(name="smollm2"))
    assert loaded.model.config.num_hidden_layers == 30
    assert embedded_tokenizer_dir(settings.cache_dir) == directory


@pytest.mark.slow  # ~70 s on 2 cores: one layer of Llama-3-8B with its 128k-token embedding, in bf16
def test_random_shape_builds_the_architecture():
    loaded = load_model(ModelConfig(name="random:llama-3-8b:1", dtype="bfloat16"))
    config = loaded.model.config
    assert loaded.is_random and config.num_key_value_heads == 8 and config.hidden_size == 4096
    assert config.rope_parameters["rope_type"] == "llama3"
    engine = BlendEngine(loaded, BlendConfig.cacheblend())
    ids = tuple(engine.tokenize("a short prompt"))
    torch.testing.assert_close(engine.prefill([Segment(ids)], PrefillMode.FULL).logits.isfinite().all(), torch.tensor(True))


def test_unknown_model_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="neither"):
        load_model(ModelConfig(name="/no/such/model"))
    with pytest.raises(ValueError, match="unknown random shape"):
        load_model(ModelConfig(name="random:gpt-17"))
