"""Sampling filters against their definitions, on hand-made logits."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

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


# ---- the candidate selection against a plain full sort -------------------------------

def reference_distribution(sp: SamplingParams, logits: np.ndarray, recent) -> tuple:
    """The filter chain over the whole row sorted in float64 (value desc, id asc)."""
    x = logits.astype(np.float64)
    if sp.repeat_penalty != 1.0 and recent:
        ids = np.array(sorted(set(recent)))
        with np.errstate(over="ignore", under="ignore"):
            x[ids] = np.where(x[ids] > 0, x[ids] / sp.repeat_penalty, x[ids] * sp.repeat_penalty)
        x = np.clip(x, -np.finfo(np.float64).max / 4, np.finfo(np.float64).max / 4)
    order = np.lexsort((np.arange(x.size), -x))
    if sp.temperature <= 0:
        return int(order[0]), None
    if 0 < sp.top_k < x.size:
        order = order[: sp.top_k]
    vals = x[order]
    probs = np.exp(vals - vals.max()) / np.exp(vals - vals.max()).sum()
    if sp.top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(probs), sp.top_p) + 1)
        order, vals, probs = order[:keep], vals[:keep], probs[:keep]
    if sp.min_p > 0.0:
        keep = probs >= sp.min_p * probs[0]
        order, vals = order[keep], vals[keep]
    z = (vals - vals.max()) / sp.temperature
    return order, np.exp(z) / np.exp(z).sum()


@pytest.mark.parametrize("n", [1, 3, 40, 41, 1000, 151936])
@pytest.mark.parametrize("ties", [False, True])
def test_distribution_equals_a_full_sort(n, ties):
    rng = np.random.default_rng(n + ties)
    settings = [dict(temperature=0.8), dict(temperature=0.8, top_k=0), dict(temperature=1.3, top_k=0, min_p=0.0),
                dict(temperature=0.5, top_k=1), dict(temperature=0.7, top_k=n), dict(temperature=1.0, top_p=0.5),
                dict(temperature=0.9, top_k=0, top_p=0.99, min_p=0.0), dict(temperature=0.0, repeat_penalty=1.3),
                dict(temperature=0.8, repeat_penalty=1.3), dict(temperature=0.8, top_k=0, repeat_penalty=0.7),
                dict(temperature=0.8, repeat_penalty=5e-324), dict(temperature=0.6, top_k=3, repeat_penalty=2.0)]
    if n <= 1000:  # the whole row sorted: a plain temperature draw
        settings.append(dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0))
    for kw in settings:
        sp = SamplingParams(**kw)
        x = rng.standard_normal(n).astype(np.float32) * 3
        if ties:
            x = np.round(x)
        recent = [int(t) for t in rng.integers(0, n, size=min(n, 70))] + [int(np.argmax(x))]
        s = Sampler(sp)
        for t in recent:
            s.accept(t)
        got_ids, got_p = s.distribution(x)
        want_ids, want_p = reference_distribution(sp, x, list(s.recent))
        assert np.array_equal(got_ids, want_ids), kw
        if want_p is None:
            assert got_p is None
        else:
            np.testing.assert_allclose(got_p, want_p, rtol=1e-9, atol=1e-15, err_msg=str(kw))


def test_draw_is_generator_choice():
    """The sampler's draw is Generator.choice(n, p=probs): the same index from the same
    state, over many shapes of distribution (peaked, flat, one entry, tiny tails)."""
    from minfer.sampling import draw
    shapes = np.random.default_rng(1)
    for seed in range(300):
        n = int(shapes.integers(1, 80))
        p = shapes.random(n) ** float(shapes.choice([1.0, 3.0, 12.0]))
        p /= p.sum()
        a, b = np.random.default_rng(seed), np.random.default_rng(seed)
        for _ in range(20):
            assert draw(a, p) == int(b.choice(n, p=p))


class CountingSource:
    """A row kept 'elsewhere', as a device keeps it: answers through HostRow's methods
    and counts what the sampler asked for; takes candidates up to `cap` at once."""

    def __init__(self, row, cap):
        from minfer.sampling import HostRow
        self.host, self.cap, self.n = HostRow(row), cap, np.asarray(row).size
        self.calls = {"argmax": 0, "best": 0, "row": 0}

    def argmax(self):
        self.calls["argmax"] += 1
        return self.host.argmax()

    def takes(self, k):
        return k <= self.cap

    def best(self, k, ids):
        assert k <= self.cap
        self.calls["best"] += 1
        return self.host.best(k, ids)

    def row(self):
        self.calls["row"] += 1
        return self.host.row()


@pytest.mark.parametrize("cap", [256, 8])
def test_a_source_kept_elsewhere_is_asked_once_and_draws_the_same(cap):
    """What a device answering for its row (session.DeviceRow) sees of the sampler: one
    `best` call for a top-k (or penalized greedy) pick within its cap, the whole row
    otherwise (no top-k, or more candidates than it takes), and the same distribution
    as from the row itself."""
    rng = np.random.default_rng(cap)
    n = 5000
    for kw in [dict(temperature=0.8), dict(temperature=0.8, repeat_penalty=1.3), dict(temperature=0.0),
               dict(temperature=0.0, repeat_penalty=1.3), dict(temperature=0.8, top_k=0),
               dict(temperature=0.6, top_k=3, repeat_penalty=2.0)]:
        sp = SamplingParams(**kw)
        x = np.round(rng.standard_normal(n).astype(np.float32) * 3)
        recent = [int(t) for t in rng.integers(0, n, size=20)] + [int(np.argmax(x))]
        a, b = Sampler(sp), Sampler(sp)
        for t in recent:
            a.accept(t)
            b.accept(t)
        src = CountingSource(x, cap)
        got, want = a.distribution(src), b.distribution(x)
        assert np.array_equal(got[0], want[0]), kw
        assert (got[1] is None) == (want[1] is None) and (got[1] is None or np.array_equal(got[1], want[1])), kw
        k = 0 if sp.top_k == 0 else 1 if sp.temperature <= 0 else sp.top_k
        penalized = sp.repeat_penalty != 1.0
        if sp.temperature <= 0 and not penalized:
            assert src.calls == {"argmax": 1, "best": 0, "row": 0}, kw
        elif k and k + (len(set(recent)) if penalized else 0) <= cap:
            assert src.calls == {"argmax": 0, "best": 1, "row": 0}, kw
        else:
            assert src.calls == {"argmax": 0, "best": 0, "row": 1}, kw


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_sampling_refuses_non_finite_logits(bad):
    from minfer.errors import NumericsError

    x = np.random.default_rng(0).standard_normal(5000).astype(np.float32)
    x[4321] = bad
    for kw in (dict(temperature=0.8), dict(temperature=0.8, top_k=0)):
        with pytest.raises(NumericsError, match="non-finite logits at the last forward: [01] NaN and [01] Inf"):
            Sampler(SamplingParams(**kw)).sample(x)


def test_sample_rows_draws_what_each_row_draws_alone():
    """sample_rows (a batched step's picks, the filters as one padded matrix) against
    each sampler's own sample(): the same ids from the same generators, round after
    round, over rows of mixed settings side by side (top-k of several sizes, top-p and
    min-p apart and together, tiny and large temperatures, penalties, no top-k, greedy)
    and tied logits; a row with NaN gets its NumericsError, the others their picks."""
    from minfer.errors import NumericsError
    from minfer.sampling import sample_rows

    settings = [dict(temperature=0.8), dict(temperature=0.8, top_k=5), dict(temperature=1.0, top_p=0.5),
                dict(temperature=1.0, top_p=1.0, min_p=0.3), dict(temperature=0.7, top_p=0.9, min_p=0.2),
                dict(temperature=1e-300, top_p=1.0, min_p=0.0), dict(temperature=5e-324, top_k=7),
                dict(temperature=40.0, top_k=60, top_p=1.0, min_p=0.0), dict(temperature=0.8, repeat_penalty=1.3),
                dict(temperature=0.9, top_k=0), dict(temperature=0.0), dict(temperature=0.0, repeat_penalty=1.5),
                dict(temperature=0.6, top_k=1)]
    rng = np.random.default_rng(5)
    n = 3000
    for ties in (False, True):
        a = [Sampler(SamplingParams(seed=i, **kw)) for i, kw in enumerate(settings)]
        b = [Sampler(SamplingParams(seed=i, **kw)) for i, kw in enumerate(settings)]
        for _ in range(12):
            rows = rng.standard_normal((len(settings), n)).astype(np.float32) * 3
            if ties:
                rows = np.round(rows)
            got = sample_rows(a, list(rows))
            want = [s.sample(r) for s, r in zip(b, rows)]
            assert got == want
            for s, t in zip(a + b, got + got):
                s.accept(t)
        # one row broken: its own error, the rest drawn as alone
        rows = rng.standard_normal((len(settings), n)).astype(np.float32)
        rows[3, 17] = np.nan
        got = sample_rows(a, list(rows))
        assert isinstance(got[3], NumericsError)
        assert [t for i, t in enumerate(got) if i != 3] == [s.sample(r) for i, (s, r) in enumerate(zip(b, rows)) if i != 3]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
@given(st.data())
def test_sample_rows_matches_sample_on_drawn_settings(data):
    """sample_rows against sample() on rows and settings hypothesis draws: short rows
    (fewer values than top-k), heavy ties, every filter on or off, penalties, and a
    batch of up to 6 rows mixing them."""
    from minfer.sampling import sample_rows

    m = data.draw(st.integers(2, 6))
    a, b, rows = [], [], []
    for i in range(m):
        kw = dict(temperature=data.draw(st.sampled_from([0.0, 1e-300, 0.3, 1.0, 7.0])),
                  top_k=data.draw(st.integers(0, 50)),
                  top_p=data.draw(st.sampled_from([1.0, 0.999, 0.9, 0.5, 0.01])),
                  min_p=data.draw(st.sampled_from([0.0, 0.01, 0.2, 0.9])),
                  repeat_penalty=data.draw(st.sampled_from([1.0, 1.0, 1.4, 0.6])), seed=i)
        n = data.draw(st.integers(1, 120))
        x = np.asarray(data.draw(st.lists(st.integers(-6, 6), min_size=n, max_size=n)), dtype=np.float32)
        x = x * np.float32(data.draw(st.sampled_from([1.0, 0.37, 1e-3])))
        a.append(Sampler(SamplingParams(**kw)))
        b.append(Sampler(SamplingParams(**kw)))
        for t in data.draw(st.lists(st.integers(0, n - 1), max_size=10)):
            a[-1].accept(t)
            b[-1].accept(t)
        rows.append(x)
    for _ in range(3):
        got = sample_rows(a, rows)
        assert got == [s.sample(r) for s, r in zip(b, rows)]
        for s, t in zip(a + b, got + got):
            s.accept(t)
