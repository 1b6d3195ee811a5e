"""Speculative decoding: greedy output identical to plain greedy decoding (prompt lookup
and a draft model made by truncating the target's layers, draft depths 1..8), the
rejection rule's output distribution equal to the target sampler's (exact joint
distribution from plain forwards, chi-square), stop strings / EOG / cancel and the KV
left as a plain stream leaves it, and two models in one process keeping their weights
apart."""

from __future__ import annotations

import math

import numpy as np
import pytest

from minfer.errors import MinferError
from minfer.model import Model
from minfer.sampling import Sampler, SamplingParams
from minfer.session import Session
from minfer.speculate import Drafter, NgramDrafter, Speculation
from minfer.testing import write_model

GREEDY = SamplingParams(temperature=0.0)
SHAPE = dict(n_embd=128, n_head=4, n_head_kv=2, n_ff=256, types={"ffn_down": "Q8_0", "attn_q": "Q4_0"})


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("spec")
    # Same seed, fewer layers: synth writes tensors in file order from one generator,
    # so the draft's embedding, output and first layer are the target's.
    write_model(d / "target.gguf", n_layer=4, seed=11, **SHAPE)
    write_model(d / "draft.gguf", n_layer=1, seed=11, **SHAPE)
    return Model.open(d / "target.gguf", n_threads=2), Model.open(d / "draft.gguf", n_threads=2)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Random prompts with a repeated stretch in them, so prompt lookup finds matches."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        a = [int(t) for t in rng.integers(3, 250, size=int(rng.integers(4, 16)))]
        b = [int(t) for t in rng.integers(3, 250, size=int(rng.integers(0, 6)))]
        out.append(a + b + a[: int(rng.integers(1, len(a) + 1))])
    return out


_SESSIONS: dict = {}


def plain(model, p, n, sp=GREEDY, **kw):
    """generate() from an empty KV, in one session per model: its graphs (one per block
    size) are built once for the whole module."""
    s = _SESSIONS.setdefault(id(model), Session(model, n_ctx=256))
    return s.generate(p, n, sp, stop_at_eog=False, **kw), s


def test_ngram_drafter_proposes_the_longest_most_recent_match():
    d = NgramDrafter(1, 3)
    d.extend([1, 2, 3, 9, 9, 2, 3, 7, 7, 1, 2, 3])
    # Suffix [1, 2, 3] occurred at the start: its continuation is 9, 9, 2, ...
    assert d.propose(3) == ([9, 9, 2], 3)
    d.extend([5])
    # No longer n-gram ends in 5 anywhere before; neither does the 1-gram [5].
    assert d.propose(4) == ([], 0)
    d.extend([2, 3])
    # [5, 2, 3] is new; the most recent earlier [2, 3] is at 10-11, followed by 5, 2.
    assert d.propose(2) == ([5, 2], 2)


@pytest.mark.parametrize("mode", ["ngram", "draft"])
def test_greedy_output_is_plain_greedy_for_every_depth(models, mode):
    target, draft = models
    # A draft model costs a forward per drafted token: fewer prompts there.
    ps = prompts(8 if mode == "ngram" else 3, seed=1)
    n = 40 if mode == "ngram" else 24
    refs = [plain(target, p, n)[0].ids for p in ps]
    for depth, adaptive in [(d, False) for d in range(1, 9)] + [(8, True)]:
        spec = Speculation(mode, draft_max=depth, draft_model=draft if mode == "draft" else None,
                           adaptive=adaptive)
        for p, ref in zip(ps, refs):
            r, s = plain(target, p, n, speculate=spec)
            assert r.ids == ref, (mode, depth, adaptive)
            assert s.tokens == p + ref[:-1]  # the KV holds what a plain stream leaves
            assert r.timings.accepted <= r.timings.drafted
    # Prompt lookup found something to verify in these prompts (the test is not vacuous).
    r, _ = plain(target, ps[0], 40, speculate=Speculation("ngram", draft_max=8, adaptive=False))
    assert r.timings.drafted > 0 and r.timings.accepted > 0


def test_draft_equal_to_the_target_is_always_accepted(models):
    target, _ = models
    spec = Speculation("draft", draft_max=5, draft_model=target, adaptive=False)
    for p in prompts(3, seed=2):
        r, _ = plain(target, p, 30, speculate=spec)
        assert r.ids == plain(target, p, 30)[0].ids
        assert r.timings.drafted > 0 and r.timings.accepted == r.timings.drafted


def test_two_models_in_one_process_keep_their_weights(models, tmp_path):
    """Same tensor names, different weights: each Model registers into its own store."""
    target, _ = models
    write_model(tmp_path / "other.gguf", n_layer=2, seed=99, **SHAPE)
    other = Model.open(tmp_path / "other.gguf", n_threads=2)
    assert other.weights is not target.weights
    p = prompts(1, seed=3)[0]
    lo = Session(other, n_ctx=64).forward(p)[-1].copy()
    lt = Session(target, n_ctx=64).forward(p)[-1].copy()
    assert not np.array_equal(lo, lt)
    ref = plain(target, p, 24)[0].ids
    r, _ = plain(target, p, 24, speculate=Speculation("draft", draft_max=4, draft_model=other, adaptive=False))
    assert r.ids == ref
    assert np.array_equal(Session(other, n_ctx=64).forward(p)[-1], lo)
    assert np.array_equal(Session(target, n_ctx=64).forward(p)[-1], lt)


def test_penalty_and_logprobs_match_plain(models):
    target, draft = models
    sp = SamplingParams(temperature=0.0, repeat_penalty=1.3, repeat_last_n=16)
    for p in prompts(3, seed=4):
        s = Session(target, n_ctx=256)
        ref = list(s.stream(p, 30, sp, stop_at_eog=False, logprobs=True))
        for spec in (Speculation("ngram", draft_max=6, adaptive=False),
                     Speculation("draft", draft_max=3, draft_model=draft, adaptive=False)):
            got = list(Session(target, n_ctx=256).stream(p, 30, sp, stop_at_eog=False, logprobs=True,
                                                         speculate=spec))
            assert [(e.id, e.logprob) for e in got[:-1]] == [(e.id, e.logprob) for e in ref[:-1]]


def test_stop_strings_eog_and_cancel(models):
    target, _ = models
    tok = target.tokenizer
    spec = Speculation("ngram", draft_max=8, adaptive=False)
    for p in prompts(4, seed=5):
        ref, _ = plain(target, p, 40)
        text = tok.decode(ref.ids)
        stop = text[len(text) // 2: len(text) // 2 + 3]
        if not stop.strip():
            continue
        a = Session(target, n_ctx=256).generate(p, 40, GREEDY, stop=[stop], stop_at_eog=False)
        b = Session(target, n_ctx=256).generate(p, 40, GREEDY, stop=[stop], stop_at_eog=False, speculate=spec)
        assert (a.text, a.ids, a.stop_reason) == (b.text, b.ids, b.stop_reason) and b.stop_reason == "stop"
        # EOG: make the 10th greedy token an end-of-generation token by treating it as one.
        tok_eot = tok.eot_ids
        try:
            tok.eot_ids = frozenset(tok_eot | {ref.ids[9]})
            a = Session(target, n_ctx=256).generate(p, 40, GREEDY)
            b = Session(target, n_ctx=256).generate(p, 40, GREEDY, speculate=spec)
        finally:
            tok.eot_ids = tok_eot
        assert (a.ids, a.stop_reason) == (b.ids, b.stop_reason) and b.stop_reason == "eos"
        # Closing mid-block leaves the KV as a plain stream's close would.
        s = Session(target, n_ctx=256)
        gen = s.stream(p, 40, GREEDY, stop_at_eog=False, speculate=spec)
        got = [next(gen) for _ in range(5)]
        gen.close()
        assert s.tokens == p + [e.id for e in got[:4]]
        # cancel() stops between tokens, also inside a verified block.
        s = Session(target, n_ctx=256)
        evs = []
        for ev in s.stream(p, 40, GREEDY, stop_at_eog=False, speculate=spec):
            evs.append(ev)
            if len(evs) == 3:
                s.cancel()
        assert evs[-1].stop_reason == "cancelled" and [e.id for e in evs[:-1]] == ref.ids[:3]
        assert s.tokens == p + ref.ids[:2]


class FixedDrafter(Drafter):
    def __init__(self, toks):
        self.toks = toks

    def extend(self, tokens) -> None:
        pass

    def propose(self, k):
        return self.toks[:k], 1


class FixedSpeculation(Speculation):
    def __init__(self, toks):
        super().__init__("ngram", draft_max=len(toks), adaptive=False)
        self.toks = toks

    def drafter(self, session):
        return FixedDrafter(self.toks)


def _chi2_quantile(df: int, p: float) -> float:
    # Wilson-Hilferty: accurate to a few percent for df >= 3, enough for a bound.
    z = {1e-4: 3.719}[p]
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_sampling_keeps_the_target_distribution(tmp_path):
    """Joint law of the first three tokens with a fixed two-token draft (one likely, one
    not): the exact law comes from plain forwards through the same sampler filters;
    the speculative draws must fit it (chi-square, p = 1e-4), and they must not fit the
    law of accepting the drafts blindly."""
    write_model(tmp_path / "tiny.gguf", n_layer=1, n_embd=64, n_head=2, n_head_kv=1, n_ff=64, seed=4)
    target = Model.open(tmp_path / "tiny.gguf", n_threads=1)
    sp = SamplingParams(temperature=1.8, top_k=5, top_p=1.0, min_p=0.0, seed=0)
    p = prompts(1, seed=6)[0]
    ref = Session(target, n_ctx=64)

    def dist(ctx):
        row = ref.forward(ctx)[-1].copy()
        ref.reset()
        ids, probs = Sampler(sp).distribution(row)
        return dict(zip(ids.tolist(), probs.tolist()))

    p0 = dist(p)
    mode0 = max(p0, key=p0.get)
    p1_mode = dist(p + [mode0])
    x1 = sorted(p1_mode, key=p1_mode.get)[-2]          # a likely but not the likeliest token
    x2 = 7                                              # usually outside the top 5
    law: dict = {}
    for a, pa in p0.items():
        pb = dist(p + [a])
        for b, pbb in pb.items():
            for c, pc in dist(p + [a, b]).items():
                law[(a, b, c)] = pa * pbb * pc
    n = 1500
    spec = FixedSpeculation([x1, x2])
    s = Session(target, n_ctx=64)
    counts: dict = {}
    drafted = accepted = 0
    for i in range(n):
        r = s.generate(p, 4, SamplingParams(**{**sp.__dict__, "seed": i}), stop_at_eog=False,
                       reuse_prefix=True, speculate=spec)
        key = tuple(r.ids[:3])
        counts[key] = counts.get(key, 0) + 1
        drafted += r.timings.drafted
        accepted += r.timings.accepted
    assert set(counts) <= set(law)
    assert accepted > 0 and accepted < drafted

    def chi2(expected_law):
        # Cells with expectation < 5 are pooled into one.
        stat, df, pool_e, pool_o = 0.0, -1, 0.0, 0
        for k, pk in expected_law.items():
            e, o = pk * n, counts.get(k, 0)
            if e < 5:
                pool_e, pool_o = pool_e + e, pool_o + o
                continue
            stat += (o - e) ** 2 / e
            df += 1
        if pool_e > 0:
            stat += (pool_o - pool_e) ** 2 / pool_e
            df += 1
        return stat, df

    stat, df = chi2(law)
    assert stat < _chi2_quantile(df, 1e-4), (stat, df)
    # The wrong rule (keep x1 whenever it is in the support) must be rejected by the same test.
    wrong: dict = {}
    for (a, b, c), pk in law.items():
        wrong[(a, b, c)] = 0.0
    for a, pa in p0.items():
        pb = dist(p + [a])
        if x1 in pb:
            for c, pc in dist(p + [a, x1]).items():
                wrong[(a, x1, c)] += pa * pc
        else:
            for b, pbb in pb.items():
                for c, pc in dist(p + [a, b]).items():
                    wrong[(a, b, c)] += pa * pbb * pc
    wrong = {k: v for k, v in wrong.items() if v > 0}
    stat_w, df_w = chi2(wrong)
    assert stat_w > _chi2_quantile(df_w, 1e-4)


def test_seeded_speculative_sampling_repeats(models):
    target, draft = models
    sp = SamplingParams(temperature=1.0, seed=5)
    p = prompts(1, seed=7)[0]
    # Adaptive depth decides from acceptance, not the clock, when sampling: one seed,
    # one output, whatever the load.
    runs = [plain(target, p, 20, sp, speculate=Speculation("draft", draft_max=3, draft_model=draft))[0]
            for _ in range(2)]
    assert runs[0].ids == runs[1].ids and runs[0].timings.drafted > 0


def test_timings_report_drafted_and_accepted(models):
    target, _ = models
    r, _ = plain(target, prompts(1, seed=8)[0], 30, speculate=Speculation("ngram", adaptive=False))
    d = r.timings.as_dict()
    assert d["drafted"] == r.timings.drafted > 0 and 0 <= d["accepted"] <= d["drafted"]
    assert "drafted" not in plain(target, [5, 6, 7], 3)[0].timings.as_dict()


def test_bad_arguments(models, tmp_path):
    target, _ = models
    with pytest.raises(MinferError):
        Speculation("bogus")
    with pytest.raises(MinferError):
        Speculation("ngram", draft_max=0)
    with pytest.raises(MinferError):
        Speculation("draft")
    write_model(tmp_path / "v.gguf", n_layer=1, n_vocab=400, seed=1, **SHAPE)
    spec = Speculation("draft", draft_model=Model.open(tmp_path / "v.gguf", n_threads=2))
    with pytest.raises(MinferError, match="vocabulary"):
        plain(target, [5, 6, 7], 5, speculate=spec)


def _cli(*args):
    import os
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "minfer.cli", *args], capture_output=True, text=True, timeout=180,
                          env=dict(os.environ))


def test_cli_generate_and_bench_speculate(models):
    import json

    target, draft = models
    path = str(target.path)
    base = ["generate", path, "hello hello hello hello", "-n", "12", "--temp", "0", "--json", "--ctx", "128"]
    plain_run = _cli(*base)
    spec_run = _cli(*base, "--speculate", "ngram", "--draft-max", "4")
    draft_run = _cli(*base, "--speculate", "draft", "--draft-model", str(draft.path))
    for r in (plain_run, spec_run, draft_run):
        assert r.returncode == 0, r.stderr
    a, b, c = (json.loads(r.stdout) for r in (plain_run, spec_run, draft_run))
    assert a["ids"] == b["ids"] == c["ids"] and a["text"] == b["text"]
    assert "drafted" not in a["timings"] and c["timings"]["drafted"] > 0 and "accepted" in b["timings"]
    for bad in (["--speculate", "magic"], ["--speculate", "draft"], ["--draft-model", path],
                ["--speculate", "ngram", "--draft-max", "0"]):
        r = _cli(*base, *bad)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, (bad, r.stderr)
    r = _cli(*base, "--speculate", "draft", "--draft-model", "/nonexistent.gguf")
    assert r.returncode == 1 and r.stderr.count("\n") == 1
    r = _cli("bench", path, "-n", "8", "-r", "2", "-t", "1", "--speculate", "ngram", "-o", "json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [x["speculate"] for x in rows] == [None, "ngram"] and rows[1]["drafted"] >= rows[1]["accepted"] >= 0
    assert all(len(x["samples_ns"]) == 2 and x["avg_ts"] > 0 for x in rows)


def test_policy_uses_each_block_size_measured_cost():
    """The depth maximises expected tokens per cost; a block size's measured cost replaces
    the linear model once timed (CUDA verifies 8 rows in one launch per weight, 9 in two),
    and sampling (clock-free) decisions ignore the measurements."""
    from minfer.speculate import Policy

    p = Policy()
    for _ in range(20):
        p.record(1, 8, 8)  # everything accepted: acceptance near 1
    p.timed(1, 1.0)
    p.r = 0.05
    assert p.depth(1, 8) == 8  # linear model: the deepest block pays
    p.timed(9, 3.0)            # measured: 9 rows cost 3 steps ...
    p.timed(8, 1.3)            # ... 8 rows 1.3
    assert p.depth(1, 8) == 7
    assert p.depth(1, 8, measured=False) == 8
    assert p.rel_cost(9, p.r) == pytest.approx(3.0) and p.rel_cost(5, p.r) == pytest.approx(1 + p.r * 4)


def test_batch_gate_weighs_a_steps_drafts_by_its_measured_walls():
    """A batch size runs plain first; a row count beyond every measured one is tried;
    between measured ones the wall is interpolated; drafts that give fewer tokens per ms
    than the plain step are dropped, except every PROBE_EVERY-th time (remeasured)."""
    from minfer.speculate import BatchGate, expected_accepted

    g = BatchGate()
    assert not g.keep(16, 16, 40, 30)       # 16 rows never measured: plain first
    g.observe(16, 2.0)
    assert g.keep(16, 16, 40, 30)           # nothing at or above 40 rows yet: try it
    g.observe(64, 8.0)
    assert g.cost(40) == pytest.approx(2.0 + 6.0 * 24 / 48)
    assert g.keep(16, 16, 40, 45)           # 45 / 5.0 ms beats 16 / 2.0 ms
    for k in range(1, g.PROBE_EVERY):
        assert not g.keep(16, 16, 40, 30)   # 30 / 5.0 ms does not
    assert g.keep(16, 16, 40, 30)           # the probe
    assert not g.keep(16, 16, 40, 30)
    g.observe(16, 9.0)                      # a wall that met a pause is not what 16 rows cost
    assert g.ms[16] == 2.0
    for _ in range(g.RECENT):
        g.observe(16, 4.0)                  # walls that stay up are (the recent ones only)
    assert g.ms[16] == 4.0
    assert expected_accepted(0.5, 3) == pytest.approx(0.5 + 0.25 + 0.125)
    assert expected_accepted(0.0, 8) == 0.0
