"""The run-time guards below the CLI: the non-finite logits check (what step it names,
that it is exact) and the sampler's arithmetic at extreme but valid settings."""

from __future__ import annotations

import math

import numpy as np
import pytest

from minfer.errors import NumericsError
from minfer.logits_check import check_logits_finite
from minfer.sampling import Sampler, SamplingParams


def test_finite_rows_pass_even_at_the_float32_extremes():
    row = np.full(151936, np.finfo(np.float32).max, np.float32)
    row[::2] = -np.finfo(np.float32).max
    check_logits_finite(row, 3)  # no overflow in the float64 sum: not reported
    check_logits_finite(np.zeros(4, np.float32), 0)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("step,where", [(0, "at the prompt (step 0)"), (7, "at step 7")])
def test_one_bad_value_is_caught_and_the_step_named(bad, step, where):
    row = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    row[611] = bad
    with pytest.raises(NumericsError, match=re_escape(where)):
        check_logits_finite(row, step)


def test_perplexity_names_the_chunk():
    with pytest.raises(NumericsError, match="at chunk 2: 1 NaN and 0 Inf"):
        check_logits_finite(np.array([[0.0, math.nan]], np.float32), 2, what="chunk")


def re_escape(s: str) -> str:
    import re

    return re.escape(s)


@pytest.mark.parametrize("kw", [
    dict(temperature=5e-324), dict(temperature=1e-300), dict(temperature=1e300),
    dict(temperature=0.8, repeat_penalty=5e-324), dict(temperature=0.8, repeat_penalty=1e300),
    dict(temperature=0.0, repeat_penalty=5e-324), dict(temperature=0.8, top_p=5e-324, min_p=0.999999),
])
def test_sampler_stays_finite_at_extreme_valid_settings(kw):
    logits = np.random.default_rng(1).standard_normal(300).astype(np.float32) * 4
    s = Sampler(SamplingParams(seed=3, **kw))
    for t in (5, 17, int(np.argmax(logits))):
        s.accept(t)
    picks = {s.sample(logits) for _ in range(5)}
    assert all(0 <= p < 300 for p in picks)
    if kw.get("temperature", 0.8) < 1e-100 and kw.get("repeat_penalty", 1.0) == 1.0:
        assert picks == {int(np.argmax(logits))}  # a vanishing temperature is greedy
