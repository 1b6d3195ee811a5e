"""The one sampler's features, through the engine on a small random-weight model:
presence / frequency penalties and logit bias against a NumPy reference of OpenAI's
formula, logprobs with alternatives against the row's float64 log-softmax, n choices
that share one prefill and each equal a lone run with its seed, the token-mask hook,
and the same features from the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from minfer.engine import Engine, Sequence
from minfer.errors import MinferError
from minfer.model import Model
from minfer.sampling import History, Sampler, SamplingParams
from minfer.session import Context, Session

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def model_path(mixed_model_path):
    return mixed_model_path


@pytest.fixture(scope="module")
def model(mixed_model) -> Model:
    return mixed_model


def prompt(seed: int, n: int = 12) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 250, size=n)]


def row_after(model, ids: list[int]) -> np.ndarray:
    """The logits a fresh session computes after `ids` (the reference row)."""
    return Session(model, n_ctx=128).forward(ids)[-1].astype(np.float64)


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


# -- penalties and bias against NumPy ---------------------------------------------------


def reference_adjusted(row, recent, counts, p: SamplingParams) -> np.ndarray:
    """OpenAI's presence/frequency formula, llama.cpp's repetition rule, bias first."""
    x = row.astype(np.float64).copy()
    for t, b in p.logit_bias:
        x[t] += b
    if p.repeat_penalty != 1.0:
        for t in set(recent):
            x[t] = x[t] / p.repeat_penalty if x[t] > 0 else x[t] * p.repeat_penalty
    for t, c in counts.items():
        x[t] -= p.frequency_penalty * c + p.presence_penalty * (c > 0)
    return x


@pytest.mark.parametrize("top_k", [0, 20])
@pytest.mark.parametrize("kw", [
    dict(presence_penalty=1.5),
    dict(frequency_penalty=0.7),
    dict(presence_penalty=-1.0, frequency_penalty=2.0, repeat_penalty=1.3),
    dict(logit_bias=((3, 5.0), (17, -100.0), (40, 2.5))),
    dict(presence_penalty=0.5, logit_bias=((8, 4.0),)),
])
def test_adjusted_distribution_matches_numpy(kw, top_k):
    rng = np.random.default_rng(1)
    row = (rng.standard_normal(300) * 3).astype(np.float32)
    p = SamplingParams(temperature=0.7, top_k=top_k, top_p=1.0, min_p=0.0, **kw)
    s = Sampler(p)
    s.accept_prompt([5, 6, 7])
    gen = [3, 3, 8, 17, 40, 3, 99]
    for t in gen:
        s.accept(t)
    counts = {t: gen.count(t) for t in set(gen)}
    adj = reference_adjusted(row, [5, 6, 7] + gen, counts, p)
    ids, probs = s.distribution(row)
    order = np.argsort(-adj, kind="stable")
    keep = order if top_k == 0 else order[:top_k]
    w = np.exp((adj[keep] - adj[keep].max()) / p.temperature)
    want = dict(zip(keep.tolist(), (w / w.sum()).tolist()))
    got = dict(zip(np.asarray(ids).tolist(), np.asarray(probs).tolist()))
    assert set(got) == set(want)
    assert max(abs(got[t] - want[t]) for t in want) < 1e-12
    # Greedy picks the adjusted argmax.
    g = Sampler(SamplingParams(temperature=0.0, **kw))
    g.accept_prompt([5, 6, 7])
    for t in gen:
        g.accept(t)
    assert g.sample(row) == int(np.argmax(adj))


def test_presence_penalty_counts_generated_tokens_only():
    """The prompt is not "the text so far" for presence / frequency (as OpenAI and
    vLLM count): only the repetition penalty looks at it."""
    row = np.zeros(10, dtype=np.float32)
    row[4] = 1.0
    s = Sampler(SamplingParams(temperature=0.0, presence_penalty=2.0))
    s.accept_prompt([4])
    assert s.sample(row) == 4
    s.accept(4)
    assert s.sample(row) != 4


def test_history_copy_is_independent():
    h = History(4)
    h.recent.extend([1, 2])
    h.counts[1] = 1
    c = h.copy()
    c.recent.append(3)
    c.counts[1] = 5
    assert list(h.recent) == [1, 2] and h.counts == {1: 1}


def test_bad_sampling_values_are_refused():
    for kw in (dict(presence_penalty=2.5), dict(frequency_penalty=-3.0), dict(logit_bias=((1, 101.0),)),
               dict(logit_bias=((-1, 1.0),))):
        with pytest.raises(MinferError):
            Sampler(SamplingParams(**kw))


# -- through the engine -----------------------------------------------------------------


def test_logit_bias_forces_and_forbids(model):
    p = prompt(2)
    plain = Session(model, n_ctx=128).generate(p, 6, GREEDY, stop_at_eog=False).ids
    forced = Session(model, n_ctx=128).generate(p, 6, SamplingParams(temperature=0.0, logit_bias=((77, 100.0),)),
                                                stop_at_eog=False).ids
    assert forced == [77] * 6
    banned = plain[0]
    got = Session(model, n_ctx=128).generate(p, 1, SamplingParams(temperature=0.0, logit_bias=((banned, -100.0),)),
                                             stop_at_eog=False).ids
    row = row_after(model, p)
    row[banned] -= 100.0
    assert got == [int(np.argmax(row))] and got[0] != banned


def test_logit_bias_outside_the_vocabulary_is_an_error_before_work(model):
    s = Session(model, n_ctx=128)
    with pytest.raises(MinferError, match="outside the vocabulary"):
        s.generate(prompt(3), 4, SamplingParams(temperature=0.0, logit_bias=((10 ** 6, 1.0),)))
    assert s.tokens == []


@pytest.mark.parametrize("temp", [0.0, 0.9])
def test_logprobs_and_alternatives_are_the_rows_log_softmax(model, temp):
    p = prompt(4)
    sp = SamplingParams(temperature=temp, seed=3)
    evs = [e for e in Session(model, n_ctx=128).stream(p, 5, sp, stop_at_eog=False, logprobs=3) if not e.done]
    plain = Session(model, n_ctx=128).generate(p, 5, sp, stop_at_eog=False).ids
    assert [e.id for e in evs] == plain          # asking for logprobs changes no pick
    ctx = list(p)
    for e in evs:
        lsm = log_softmax(row_after(model, ctx))
        assert abs(e.logprob - lsm[e.id]) < 1e-9
        top = np.argsort(-lsm, kind="stable")[:3]
        assert [t for t, _ in e.top_logprobs] == top.tolist()
        assert max(abs(v - lsm[t]) for t, v in e.top_logprobs) < 1e-9
        ctx.append(e.id)


def test_n_choices_share_one_prefill_and_each_equals_its_seed_alone(model):
    p = prompt(5, 20)
    n, steps, seed = 3, 6, 11
    ctx = Context(model, n_ctx=128, n_seq=n)
    fed = []
    real = ctx.run

    def counting(tokens, *a, **kw):
        fed.append(int(tokens.size))
        return real(tokens, *a, **kw)

    ctx.run = counting
    eng = Engine(ctx, [ctx.session(i) for i in range(n)])
    seqs = [Sequence(p, steps, SamplingParams(temperature=0.9, seed=seed + i), stop_at_eog=False, index=i)
            for i in range(n)]
    for i, s in enumerate(seqs):
        eng.add(s, share=seqs[0] if i else None)
    eng.run()
    for i, s in enumerate(seqs):
        alone = Session(model, n_ctx=128).generate(p, steps, SamplingParams(temperature=0.9, seed=seed + i),
                                                   stop_at_eog=False).ids
        assert s.ids == alone, i
    assert seqs[1].timings.cached_tokens == len(p)
    # The prompt went through the model once; then one token per choice per step.
    assert sum(fed) == len(p) + n * (steps - 1)
    # The other choices read the first one's prompt cells in place (no copy).
    assert ctx.borrowed[1] == ctx.borrowed[2] == (0, len(p))


@pytest.mark.parametrize("temp", [0.0, 1.0])
def test_mask_hook_constrains_every_pick(model, temp):
    p = prompt(6)
    allowed = np.zeros(model.hp.n_vocab, dtype=bool)
    allowed[np.random.default_rng(0).choice(model.hp.n_vocab, 40, replace=False)] = True
    calls = []

    def mask(seq):
        calls.append(len(seq.ids))
        return allowed

    got = [e.id for e in Session(model, n_ctx=128).stream(p, 6, SamplingParams(temperature=temp, seed=2),
                                                             stop_at_eog=False, mask=mask) if not e.done]
    assert len(got) == 6 and all(allowed[t] for t in got)
    assert calls == list(range(6))               # asked before each pick, seeing the ids so far
    if temp == 0.0:
        ctx = list(p)
        for t in got:
            row = row_after(model, ctx)
            row[~allowed] = -np.inf
            assert t == int(np.argmax(row))
            ctx.append(t)


def test_a_mask_that_allows_nothing_fails_its_sequence(model):
    nothing = np.zeros(model.hp.n_vocab, dtype=bool)
    with pytest.raises(MinferError, match="allows no token"):
        list(Session(model, n_ctx=128).stream(prompt(7), 3, GREEDY, mask=lambda s: nothing))


def test_batched_engine_with_mixed_features_equals_each_alone(model):
    """Sequences with different features in one batched engine: each equals its lone run."""
    specs = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, seed=4, presence_penalty=1.0),
        SamplingParams(temperature=0.0, frequency_penalty=1.5, logit_bias=((9, 3.0),)),
        SamplingParams(temperature=1.1, seed=5, top_k=0),
    ]
    ps = [prompt(10 + i, 8 + 3 * i) for i in range(len(specs))]
    ctx = Context(model, n_ctx=128, n_seq=len(specs))
    eng = Engine(ctx, [ctx.session(i) for i in range(len(specs))], chunk=16)
    seqs = [Sequence(q, 7, sp, stop_at_eog=False, logprobs=2 if i == 3 else None)
            for i, (q, sp) in enumerate(zip(ps, specs))]
    for s in seqs:
        eng.add(s)
    eng.run()
    for s, q, sp in zip(seqs, ps, specs):
        assert s.ids == Session(model, n_ctx=128).generate(q, 7, sp, stop_at_eog=False).ids


# -- the CLI ----------------------------------------------------------------------------


def minfer(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "minfer.cli", *args], capture_output=True, text=True, timeout=120)


def test_cli_logprobs_and_penalties(model_path, model):
    r = minfer("generate", str(model_path), "hello", "-n", "4", "--temp", "0", "--logprobs", "2", "--json",
               "--threads", "2", "--ctx", "128", "--presence-penalty", "0.5", "--logit-bias", "5=-100")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert len(doc["logprobs"]) == len(doc["ids"]) == 4
    ctx = list(doc["prompt_ids"])
    for lp in doc["logprobs"]:
        lsm = log_softmax(row_after(model, ctx))
        assert abs(lp["logprob"] - lsm[lp["id"]]) < 1e-9 and len(lp["top"]) == 2
        ctx.append(lp["id"])
    assert 5 not in doc["ids"]


@pytest.mark.parametrize("args, word", [
    (["--logit-bias", "x=1"], "--logit-bias"),
    (["--logit-bias", "3=500"], "--logit-bias"),
    (["--presence-penalty", "9"], "--presence-penalty"),
    (["--logprobs", "50"], "--logprobs"),
])
def test_cli_bad_feature_arguments_exit_2(model_path, args, word):
    r = minfer("generate", str(model_path), "hello", "-n", "2", *args)
    assert r.returncode == 2 and word in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
