"""Sampling filters against their definitions, on hand-made logits."""

from __future__ import annotations

import numpy as np
import pytest

from minfer.errors import MinferError
from minfer.sampling import Sampler, SamplingParams


def draws(params: SamplingParams, logits, n=400, history=()):
    s = Sampler(params)
    for t in history:
        s.accept(t)
    return [s.sample(np.asarray(logits, dtype=np.float32)) for _ in range(n)]


def test_greedy_is_argmax():
    logits = np.array([0.1, 3.0, 2.9, -1.0])
    assert set(draws(SamplingParams(temperature=0.0), logits, n=5)) == {1}


def test_same_seed_same_draws_and_different_seed_differs():
    logits = np.linspace(0, 1, 50)
    p = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=42)
    a, b = draws(p, logits, 100), draws(p, logits, 100)
    c = draws(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=43), logits, 100)
    assert a == b and a != c


def test_top_k_keeps_only_k_best():
    logits = np.array([5.0, 4.0, 3.0, 2.0, 1.0, 0.0])
    got = set(draws(SamplingParams(temperature=5.0, top_k=2, top_p=1.0, min_p=0.0, seed=0), logits))
    assert got == {0, 1}


def test_top_p_keeps_the_nucleus():
    # probabilities ~ [0.5, 0.25, 0.125, 0.0625, ...]: top_p 0.7 keeps the first two.
    logits = np.log(np.array([0.5, 0.25, 0.125, 0.0625, 0.0625]))
    got = set(draws(SamplingParams(temperature=1.0, top_k=0, top_p=0.7, min_p=0.0, seed=1), logits))
    assert got == {0, 1}


def test_min_p_drops_unlikely_tokens():
    logits = np.log(np.array([0.6, 0.3, 0.05, 0.05]))
    got = set(draws(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.2, seed=2), logits))
    assert got == {0, 1}


def test_temperature_flattens_and_sharpens():
    logits = np.array([1.0, 0.0])
    hot = draws(SamplingParams(temperature=10.0, top_k=0, top_p=1.0, min_p=0.0, seed=3), logits, 2000)
    cold = draws(SamplingParams(temperature=0.1, top_k=0, top_p=1.0, min_p=0.0, seed=3), logits, 2000)
    frac_hot, frac_cold = np.mean(np.array(hot) == 1), np.mean(np.array(cold) == 1)
    # softmax([0.1, 0]) -> 0.475 for token 1; softmax([10, 0]) -> 4.5e-5
    assert abs(frac_hot - 0.475) < 0.05 and frac_cold < 0.01


def test_repetition_penalty_follows_llama_cpp_rule():
    logits = np.array([2.0, 1.9, -1.0])
    # token 0 seen: 2.0 / 1.5 = 1.33 < 1.9, so greedy switches to token 1
    assert draws(SamplingParams(temperature=0.0, repeat_penalty=1.5), logits, 1, history=[0]) == [1]
    # a negative logit is multiplied, pushing it further down: still never chosen
    assert draws(SamplingParams(temperature=0.0, repeat_penalty=1.5), [-1.0, -1.2, -5.0], 1, history=[0]) == [1]


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0.0), dict(top_p=1.5), dict(min_p=1.0),
                                 dict(top_k=-1), dict(repeat_penalty=0.0)])
def test_invalid_parameters_are_errors(bad):
    with pytest.raises(MinferError):
        Sampler(SamplingParams(**bad))
