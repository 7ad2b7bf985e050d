"""A request's sampling: each field it leaves out is the server's `generation` setting, each it gives
wins, on /v1/query and /v1/chat/completions alike (app/query/serving.py build_rag_request)."""

from __future__ import annotations

import pytest

from app.chat.protocol import ChatCompletionRequest
from app.query.protocol import QueryRequest
from app.query.serving import build_rag_request
from configs.enums import RepetitionScope
from configs.settings import load_settings

CONFIGURED = {"repetition_penalty": 1.3, "repetition_scope": "prompt_and_answer", "frequency_penalty": 0.4,
              "presence_penalty": -0.5, "no_repeat_ngram_size": 5, "stop": ["\n\n", "END"]}
GIVEN = {"repetition_penalty": 1.05, "repetition_scope": "answer", "frequency_penalty": -1.5,
         "presence_penalty": 2.0, "no_repeat_ngram_size": 0, "stop": ["Q:"]}


def both(**fields):
    return [QueryRequest(question="q", **fields), ChatCompletionRequest(messages=[{"role": "user", "content": "q"}],
                                                                       **fields)]


@pytest.mark.parametrize("kind", ["query", "chat"])
def test_left_out_fields_are_the_configured_ones_and_given_ones_win(kind):
    settings = load_settings(generation=CONFIGURED)
    index = ["query", "chat"].index(kind)
    defaults = build_rag_request(settings, "q", both()[index]).sampling
    assert (defaults.repetition_penalty, defaults.repetition_scope, defaults.frequency_penalty,
            defaults.presence_penalty, defaults.no_repeat_ngram_size, defaults.stop) == (
        1.3, RepetitionScope.PROMPT_AND_ANSWER, 0.4, -0.5, 5, ("\n\n", "END"))
    given = build_rag_request(settings, "q", both(**GIVEN)[index]).sampling
    assert (given.repetition_penalty, given.repetition_scope, given.frequency_penalty, given.presence_penalty,
            given.no_repeat_ngram_size, given.stop) == (1.05, RepetitionScope.ANSWER, -1.5, 2.0, 0, ("Q:",))
    assert build_rag_request(settings, "q", both(stop=[])[index]).sampling.stop == ()  # none at all
    assert build_rag_request(settings, "q", both(stop="###")[index]).sampling.stop == ("###",)
    # ignore_eos promises max_tokens tokens: the configured stops left out, a request's own kept
    assert build_rag_request(settings, "q", both(ignore_eos=True)[index]).sampling.stop == ()
    assert build_rag_request(settings, "q", both(ignore_eos=True, stop=["Q:"])[index]).sampling.stop == ("Q:",)


def test_the_shipped_defaults_are_the_generation_sections():
    settings = load_settings()
    sampling = build_rag_request(settings, "q", both()[0]).sampling
    gen = settings.generation
    assert (sampling.repetition_penalty, sampling.frequency_penalty, sampling.presence_penalty,
            sampling.no_repeat_ngram_size, sampling.stop) == (gen.repetition_penalty, gen.frequency_penalty,
                                                              gen.presence_penalty, gen.no_repeat_ngram_size, gen.stop)


@pytest.mark.parametrize("field,value", [("frequency_penalty", 2.01), ("presence_penalty", -3.0),
                                         ("repetition_penalty", 0.0), ("no_repeat_ngram_size", 33)])
def test_a_setting_out_of_range_is_refused_at_start_up(field, value):
    with pytest.raises(ValueError, match=field):
        load_settings(generation={field: value})
