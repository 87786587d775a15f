"""Sampler pipeline and stop strings."""
from __future__ import annotations

import numpy as np
import pytest

from edgellm.engine.request import StopMatcher
from edgellm.errors import InvalidRequestError
from edgellm.sampling import Sampler, SamplingParams


def test_greedy_is_argmax():
    logits = np.array([0.1, 3.0, 2.9, -1.0], dtype=np.float32)
    assert Sampler(SamplingParams(temperature=0))(logits, np.array([], dtype=np.int64)) == 1


def test_repeat_penalty_changes_greedy_choice():
    logits = np.array([0.0, 3.0, 2.9], dtype=np.float32)
    p = SamplingParams(temperature=0, repeat_penalty=1.5)
    assert Sampler(p)(logits, np.array([1])) == 2  # 3.0 / 1.5 < 2.9


def test_presence_and_frequency_penalty():
    logits = np.array([1.0, 1.2], dtype=np.float32)
    p = SamplingParams(temperature=0, frequency_penalty=0.15)
    assert Sampler(p)(logits, np.array([1, 1])) == 0  # 1.2 - 2*0.15 < 1.0
    p = SamplingParams(temperature=0, presence_penalty=0.1)
    assert Sampler(p)(logits, np.array([1, 1])) == 1  # 1.2 - 0.1 > 1.0


def test_seed_reproducible_and_topk_restricts():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=1000).astype(np.float32)
    p = SamplingParams(temperature=1.0, top_k=5, top_p=1.0, min_p=0.0, seed=7)
    a = [Sampler(p)(logits, np.array([])) for _ in range(3)]
    s = Sampler(p)
    draws = {s(logits, np.array([])) for _ in range(300)}
    assert len(set(a)) == 1
    assert draws <= set(np.argsort(-logits)[:5].tolist()) and len(draws) > 1


def test_top_p_and_min_p():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=0.7, min_p=0.0, seed=1))
    assert {s(logits, np.array([])) for _ in range(200)} == {0, 1}
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.4, seed=1))
    assert {s(logits, np.array([])) for _ in range(200)} == {0, 1}  # 0.15 < 0.4 * 0.5


def test_logit_bias():
    logits = np.array([1.0, 0.0], dtype=np.float32)
    assert Sampler(SamplingParams(temperature=0, logit_bias={1: 5.0}))(logits, np.array([])) == 1


@pytest.mark.parametrize("kw", [dict(temperature=-1), dict(top_p=0), dict(top_k=-2), dict(max_tokens=-1),
                                dict(stop=[""]), dict(min_p=2)])
def test_invalid_params(kw):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kw)


def test_stop_string_split_across_pieces():
    m = StopMatcher(["###", "END"])
    out, stopped = "", False
    for piece in ["Hello #", "#", " world", " E", "N", "D more"]:
        text, stopped = m.feed(piece)
        out += text
        if stopped:
            break
    assert stopped and out == "Hello ## world "


def test_stop_holds_back_only_possible_prefixes():
    m = StopMatcher(["abc"])
    assert m.feed("xxab") == ("xx", False)
    assert m.feed("d") == ("abd", False)
    assert m.flush() == ""
