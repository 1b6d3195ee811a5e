"""Speculation inside the server's scheduler, without HTTP: a speculating slot's drafts
ride in the batched step, and every job's tokens equal a plain single-sequence
Session's, whatever rides with it (speculating or plain jobs, prompt chunks). A drafter
that always proposes the true continuation puts max_tokens and stop strings inside
accepted blocks; one that proposes wrong tokens exercises the rollback; the KV a
finished job leaves is what plain steps leave."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from minfer.errors import MinferError
from minfer.model import Model
from minfer.sampling import SamplingParams
from minfer.engine import SeqSpec
from minfer.server.scheduler import Job, Scheduler, SpecRequest
from minfer.session import Session
from minfer.testing import write_model

from scheduler_helpers import collect_events

CTX = 192
GREEDY = SamplingParams(temperature=0.0)
# The target and its draft share everything but the layer count (same seed: the draft is
# the target's first layer).
SHAPE = dict(n_embd=128, n_head=4, n_head_kv=2, n_ff=256, seed=5, types={"ffn_up": "Q8_0", "attn_q": "Q4_0"})


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Model:
    path = tmp_path_factory.mktemp("sched_spec") / "m.gguf"
    write_model(path, n_layer=3, **SHAPE)
    return Model.open(path, n_threads=2)


def prompts(n: int, seed: int) -> list[list[int]]:
    """Random prompts with a repeated stretch, so prompt lookup finds matches."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        a = [int(t) for t in rng.integers(3, 250, size=int(rng.integers(4, 14)))]
        b = [int(t) for t in rng.integers(3, 250, size=int(rng.integers(0, 5)))]
        out.append(a + b + a + b + a[: int(rng.integers(1, len(a) + 1))])
    return out


_REFS: dict = {}


def alone(model, p, n, stop=None):
    key = (tuple(p), n, tuple(stop or ()))
    if key not in _REFS:
        _REFS[key] = Session(model, n_ctx=CTX).generate(p, n, GREEDY, stop=stop, stop_at_eog=False)
    return _REFS[key]


def run_jobs(sched: Scheduler, specs: list[dict]) -> list[dict]:
    """Submit every job at once (dicts of Job fields); each one's ids, text, final event."""
    q: queue.Queue = queue.Queue()
    for k, spec in enumerate(specs):
        sched.submit(Job(sampling=spec.pop("sampling", GREEDY), stop_at_eog=False,
                         emit=lambda ev, k=k: q.put((k, ev)), **spec))
    return collect_events(q, len(specs), timeout=120)


@contextmanager
def running(model, **kw) -> Iterator[Scheduler]:
    """A started scheduler (4 slots, CTX, chunk 8 unless given), stopped cleanly after."""
    sched = Scheduler(model, **{"n_slots": 4, "n_ctx": CTX, "chunk": 8, **kw})
    sched.start()
    try:
        yield sched
    finally:
        assert sched.stop()


def test_mixed_speculating_and_plain_jobs_equal_each_alone(model):
    """Eight jobs on four slots (they queue, join and leave between steps), speculating
    at several depths or not at all, prompts chunked into others' steps."""
    ps = prompts(8, seed=1)
    depths = [8, None, 1, 3, None, 8, 5, 2]
    specs = [dict(prompt_ids=p, n_predict=24 + 3 * i,
                  speculate=SpecRequest("ngram", d) if d else None) for i, (p, d) in enumerate(zip(ps, depths))]
    with running(model) as sched:
        got = run_jobs(sched, [dict(s) for s in specs])
    drafted = accepted = 0
    for s, g in zip(specs, got):
        ref = alone(model, s["prompt_ids"], s["n_predict"])
        assert g["ids"] == ref.ids and g["text"] == ref.text
        assert g["done"].reason == "length" and g["done"].usage["completion_tokens"] == s["n_predict"]
        sp = g["done"].usage.get("speculation")
        assert (sp is not None) == (s["speculate"] is not None)
        if sp:
            assert 0 <= sp["accepted"] <= sp["drafted"]
            det = g["done"].usage["completion_tokens_details"]
            assert det["accepted_prediction_tokens"] + det["rejected_prediction_tokens"] == sp["drafted"]
            drafted += sp["drafted"]
            accepted += sp["accepted"]
    assert drafted > 0 and accepted > 0  # prompt lookup found something, and some of it held


def test_greedy_with_a_repeat_penalty_equals_plain(model):
    """Temperature 0 with a penalty: the verify reads the penalised argmax, with the
    block's own accepted drafts in the penalty window, as plain steps would."""
    sp = SamplingParams(temperature=0.0, repeat_penalty=1.3, repeat_last_n=16)
    ps = prompts(3, seed=8)
    with running(model) as sched:
        got = run_jobs(sched, [dict(prompt_ids=p, n_predict=30, sampling=sp, speculate=SpecRequest("ngram", 6))
                               for p in ps])
    for p, g in zip(ps, got):
        assert g["ids"] == Session(model, n_ctx=CTX).generate(p, 30, sp, stop_at_eog=False).ids
    assert sum(g["done"].usage["speculation"]["drafted"] for g in got) > 0


def test_the_same_job_alone_or_batched_with_speculating_neighbours(model):
    p = prompts(1, seed=2)[0]
    with running(model) as sched:
        lone = run_jobs(sched, [dict(prompt_ids=p, n_predict=40, speculate=SpecRequest("ngram", 8))])[0]
        crowd = run_jobs(sched, [dict(prompt_ids=q, n_predict=40, speculate=SpecRequest("ngram", 8))
                                 for q in [p] + prompts(3, seed=3)])
    assert lone["ids"] == crowd[0]["ids"] == alone(model, p, 40).ids


class Oracle(SeqSpec):
    """Proposes the job's true greedy continuation (so every draft is accepted), past
    max_tokens when `ignore_limit`; `wrong_every` k: every k-th draft is corrupted."""

    refs: dict = {}
    ignore_limit = False
    wrong_every = 0

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.n = 0

    def propose(self, limit):
        # The sequence's tokens are its prompt, then what was handed out so far.
        prompt = next(p for p in self.refs if tuple(self.toks[:len(p)]) == p)
        picks = self.toks[len(prompt):]
        ref = self.refs[prompt]
        k = self.draft_max if self.ignore_limit else min(limit, self.draft_max)
        draft = list(ref[len(picks):len(picks) + k])
        for i in range(len(draft)):
            self.n += 1
            if self.wrong_every and self.n % self.wrong_every == 0:
                draft[i] = (draft[i] + 1) % 250
        return draft


@pytest.fixture
def oracle(monkeypatch):
    import minfer.server.scheduler as sch

    monkeypatch.setattr(sch, "SeqSpec", Oracle)
    Oracle.refs, Oracle.ignore_limit, Oracle.wrong_every = {}, False, 0
    return Oracle


@pytest.mark.parametrize("ignore_limit", [False, True])
def test_max_tokens_inside_an_accepted_block(model, oracle, ignore_limit):
    """Blocks of 6 fully accepted drafts; max_tokens falls inside one of them for most n.
    With ignore_limit the block itself runs past max_tokens (the scheduler normally caps
    the depth): the picks past it are still never handed out."""
    oracle.ignore_limit = ignore_limit
    p = prompts(1, seed=4)[0]
    full = alone(model, p, 40).ids
    oracle.refs[tuple(p)] = full
    with running(model, n_slots=2, n_ctx=CTX) as sched:
        for n in (1, 2, 5, 8, 9, 13, 20):
            g = run_jobs(sched, [dict(prompt_ids=p, n_predict=n, speculate=SpecRequest("ngram", 6))])[0]
            assert g["ids"] == full[:n], n
            assert g["done"].reason == "length" and g["done"].usage["completion_tokens"] == n
            sp = g["done"].usage["speculation"]
            assert sp["accepted"] == sp["drafted"] and (n < 3 or sp["drafted"] > 0)
            # The slot's KV holds what plain steps leave: the prompt and all picks but the last.
            held = [s.session.tokens for s in sched.slots if s.session.tokens[:len(p)] == p]
            assert held and held[0] == p + full[:n - 1]


def test_stop_string_inside_an_accepted_block(model, oracle):
    p = prompts(1, seed=5)[0]
    ref = alone(model, p, 40)
    oracle.refs[tuple(p)] = ref.ids
    text = ref.text
    accepted = 0
    with running(model, n_slots=1) as sched:
        for k in (4, 10, 17, 25):  # the stop string starts after the k-th token's text
            at = len(alone(model, p, k).text)
            stop = text[at:at + 3]
            assert len(stop) == 3
            want = alone(model, p, 40, stop=[stop])
            g = run_jobs(sched, [dict(prompt_ids=p, n_predict=40, stop=[stop],
                                      speculate=SpecRequest("ngram", 8))])[0]
            assert g["text"] == want.text == text[:text.index(stop)]
            assert g["done"].reason == "stop"
            assert g["done"].usage["completion_tokens"] == want.timings.generated_tokens
            accepted += g["done"].usage["speculation"]["accepted"]
            # The token that completed the stop string was picked, not fed: the KV holds
            # the prompt and the picks before it, as plain steps leave it.
            assert sched.slots[0].session.tokens == p + ref.ids[:len(g["ids"])]
    assert accepted > 0


def test_rejected_drafts_are_rolled_back(model, oracle):
    """Every third draft wrong: blocks end early, the rejected cells are overwritten by
    later steps, and the output is still plain greedy's; the KV at the end is too."""
    oracle.wrong_every = 3
    ps = prompts(3, seed=6)
    for p in ps:
        oracle.refs[tuple(p)] = alone(model, p, 30).ids
    with running(model, n_slots=3) as sched:
        got = run_jobs(sched, [dict(prompt_ids=p, n_predict=30, speculate=SpecRequest("ngram", 5)) for p in ps])
        for p, g in zip(ps, got):
            sp = g["done"].usage["speculation"]
            assert g["ids"] == oracle.refs[tuple(p)]
            assert 0 < sp["accepted"] < sp["drafted"]
        for p in ps:
            held = [s.session.tokens for s in sched.slots if s.session.tokens[:len(p)] == p]
            assert held == [p + oracle.refs[tuple(p)][:-1]]


def test_sampled_speculation_repeats_with_a_seed_and_keeps_the_target_support(model):
    """Sampling with speculation (the rejection rule, speculate.verify): a seed repeats
    its output, and every token is one the target's sampler could pick (top_k 5)."""
    p = prompts(1, seed=7)[0]
    sp = SamplingParams(temperature=0.9, top_k=5, seed=42)
    job = dict(prompt_ids=p, n_predict=30, speculate=SpecRequest("ngram", 4))
    with running(model, n_slots=2) as sched:
        a = run_jobs(sched, [dict(job, sampling=sp)])[0]
        b = run_jobs(sched, [dict(job, sampling=sp)])[0]
    assert a["ids"] == b["ids"] and len(a["ids"]) == 30
    s = Session(model, n_ctx=CTX)
    rows = s.forward(p + a["ids"][:-1], n_out=30)
    for t, row in zip(a["ids"], rows):
        assert t in np.argsort(row)[-5:]


def test_a_scheduler_default_must_be_one_it_can_do(model):
    with pytest.raises(MinferError):
        Scheduler(model, n_slots=1, n_ctx=64, speculate=SpecRequest("draft", 8))  # no draft model
    with pytest.raises(MinferError):
        Scheduler(model, n_slots=1, n_ctx=64, speculate=SpecRequest("lookahead", 8))
    with pytest.raises(MinferError):
        Scheduler(model, n_slots=1, n_ctx=64, speculate=SpecRequest("ngram", 0))


def test_drafts_stay_within_the_backends_row_exact_limit(model):
    """Where a backend computes only up to N rows exactly (CUDA: 16), a decode-only step
    never exceeds N rows with its drafts, and a step with a prompt chunk drafts nothing.
    Set here on the CPU context, whose rows are exact at any count."""
    ps = prompts(4, seed=9)
    sched = Scheduler(model, n_slots=3, n_ctx=CTX, chunk=8)
    sched.ctx.row_exact_max = 6
    seen = []
    real = sched.ctx.decode_batch

    def spy(items, copy=True):
        seen.append([(len(it[1]), it[2]) for it in items])
        return real(items, copy)

    sched.ctx.decode_batch = spy
    sched.start()
    try:
        got = run_jobs(sched, [dict(prompt_ids=p, n_predict=30, speculate=SpecRequest("ngram", 8)) for p in ps])
    finally:
        assert sched.stop()
    for p, g in zip(ps, got):
        assert g["ids"] == alone(model, p, 30).ids
    drafted_steps = [step for step in seen if any(k > 1 for _, k in step)]
    assert drafted_steps  # the cap left room to draft
    for step in drafted_steps:
        assert sum(n for n, _ in step) <= 6 and all(n == k for n, k in step)  # no prompt chunk rode along


@pytest.mark.parametrize("speculate", [False, True])
def test_cancel_between_the_picks_of_a_block(model, oracle, speculate):
    """A job cancelled while its k-th token is handed out ends right after it, whether
    that token came from a plain step or from the middle of an accepted block."""
    p = prompts(1, seed=10)[0]
    full = alone(model, p, 40).ids
    oracle.refs[tuple(p)] = full
    with running(model, n_slots=1) as sched:
        for k in (1, 4, 11):
            q: queue.Queue = queue.Queue()
            got = []

            def emit(ev, k=k):
                if ev.kind == "token":
                    got.append(ev.id)
                    if len(got) == k:
                        job.cancel()
                q.put(ev)

            job = Job(prompt_ids=p, n_predict=40, sampling=GREEDY, stop_at_eog=False, emit=emit,
                      speculate=SpecRequest("ngram", 8) if speculate else None)
            sched.submit(job)
            while (ev := q.get(timeout=60)).kind == "token":
                pass
            assert ev.kind == "done" and ev.reason == "cancelled"
            assert got == full[:k] and ev.usage["completion_tokens"] == k
            if speculate and k > 4:
                assert ev.usage["speculation"]["accepted"] > 0
            assert sched.slots[0].session.tokens == p + full[:k - 1]


def test_a_job_that_fills_the_context_exactly(model, oracle):
    """prompt + max_tokens = the slot's context: drafts shrink to the room that is left
    and the job ends with all its tokens, as plain greedy's."""
    ctx = 64
    p = prompts(1, seed=11)[0]
    n = ctx - len(p)
    s = Session(model, n_ctx=ctx)
    full = s.generate(p, n, GREEDY, stop_at_eog=False).ids
    oracle.refs[tuple(p)] = full
    with running(model, n_slots=2, n_ctx=ctx) as sched:
        g = run_jobs(sched, [dict(prompt_ids=p, n_predict=n, speculate=SpecRequest("ngram", 8))])[0]
    assert g["ids"] == full and g["done"].reason == "length"
    sp = g["done"].usage["speculation"]
    assert sp["drafted"] == sp["accepted"] > 0



@pytest.fixture(scope="module")
def draft(tmp_path_factory) -> Model:
    """The target's embedding, head and first layer (same seed, one layer)."""
    path = tmp_path_factory.mktemp("sched_spec") / "draft.gguf"
    write_model(path, n_layer=1, **SHAPE)
    return Model.open(path, n_threads=2)


def test_draft_model_jobs_beside_prompt_lookup_and_plain_ones(model, draft):
    """The server's draft model drafts for several slots in batched draft forwards; every
    job still gets exactly its plain greedy tokens."""
    ps = prompts(7, seed=12)
    modes = ["draft", "draft", None, "ngram", "draft", None, "draft"]
    specs = [dict(prompt_ids=p, n_predict=20 + 2 * i, speculate=SpecRequest(m, 2 + i % 5) if m else None)
             for i, (p, m) in enumerate(zip(ps, modes))]
    with running(model, draft_model=draft) as sched:
        got = run_jobs(sched, [dict(s) for s in specs])
    drafted = accepted = 0
    for s, g in zip(specs, got):
        assert g["ids"] == alone(model, s["prompt_ids"], s["n_predict"]).ids
        if s["speculate"] is not None and s["speculate"].mode == "draft":
            sp = g["done"].usage["speculation"]
            assert sp["mode"] == "draft"
            drafted += sp["drafted"]
            accepted += sp["accepted"]
    # The one-layer draft is mostly wrong here: rejected blocks are rolled back (the test
    # below has a draft that is always right).
    assert drafted > 0 and accepted < drafted


def test_a_draft_equal_to_the_target_is_always_accepted(model):
    ps = prompts(3, seed=13)
    with running(model, n_slots=3, draft_model=model) as sched:
        got = run_jobs(sched, [dict(prompt_ids=p, n_predict=25, speculate=SpecRequest("draft", 4)) for p in ps])
    for p, g in zip(ps, got):
        assert g["ids"] == alone(model, p, 25).ids
        sp = g["done"].usage["speculation"]
        assert sp["drafted"] > 0 and sp["accepted"] == sp["drafted"]


def test_a_draft_model_of_another_vocabulary_is_refused(model, tmp_path):
    write_model(tmp_path / "other.gguf", n_layer=1, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_vocab=300)
    with pytest.raises(MinferError, match="vocabulary"):
        Scheduler(model, n_slots=1, n_ctx=64, draft_model=Model.open(tmp_path / "other.gguf", n_threads=2))


def test_prompt_rows_stay_within_the_row_exact_limit_even_alone(model):
    """Where a backend computes only up to N rows exactly (CUDA: 64), a server's step
    never exceeds N rows, also when it holds prompt chunks alone: a long prompt is
    prefilled in exact steps whether or not others decode, so its output does not depend
    on the load. Set here on the CPU context, whose rows are exact at any count."""
    ps = prompts(3, seed=12)
    sched = Scheduler(model, n_slots=3, n_ctx=CTX, chunk=64)
    sched.ctx.row_exact_max = 6
    seen = []
    real = sched.engine._forward

    def spy(items, copy):
        seen.append(sum(len(toks) for _, toks, _ in items))
        return real(items, copy)

    sched.engine._forward = spy
    sched.start()
    try:
        got = run_jobs(sched, [dict(prompt_ids=p, n_predict=12) for p in ps])
    finally:
        assert sched.stop()
    for p, g in zip(ps, got):
        assert g["ids"] == alone(model, p, 12).ids
    assert len(seen) > 12 and max(seen) <= 6, seen


def test_a_waiting_prompt_gets_half_a_step_at_least(model):
    """With the step at the row-exact limit, decode rows leave a waiting prompt at least
    half of it (the rows left out decode a step later, in turn): a long prompt beside
    five decoding sequences is not prefilled a row a step. Every step stays within the
    limit and every output is its sequence's alone. Set on a CPU context (limit 6)."""
    short = [p[:4] for p in prompts(5, seed=13)]
    long = sum(prompts(6, seed=14), [])[:40]
    specs = [dict(prompt_ids=p, n_predict=40) for p in short] + [dict(prompt_ids=long, n_predict=8)]
    sched = Scheduler(model, n_slots=6, n_ctx=CTX, chunk=64)
    sched.ctx.row_exact_max = 6
    seen = []
    real = sched.engine._forward

    def spy(items, copy):
        pr = [(len(toks), len(s.pending)) for s, toks, _ in items if s.pending and toks == s.pending[:len(toks)]]
        seen.append((len(items) - len(pr), sum(n for n, _ in pr), sum(w for _, w in pr)))
        return real(items, copy)

    sched.engine._forward = spy
    sched.start()
    try:
        got = run_jobs(sched, [dict(d) for d in specs])
    finally:
        assert sched.stop()
    for d, g in zip(specs, got):
        assert g["ids"] == alone(model, d["prompt_ids"], d["n_predict"]).ids
    assert all(d + n <= 6 for d, n, _ in seen), seen
    # The long prompt's chunks beside decode rows: >= 3 rows each while more waits.
    beside = [(d, n, w) for d, n, w in seen if n and d and w > n]
    assert all(n >= 3 for d, n, w in beside), seen
    assert sum(d == 3 for d, n, w in beside) >= 5, seen   # five decode, three of them step


class _Walls:
    """A BatchGate whose step walls are given (`ms(rows)`), not measured, and that
    never probes: what the scheduler does with each verdict, independent of the clock."""

    def __init__(self, ms):
        from minfer.speculate import BatchGate

        self.g = BatchGate()
        self.g.PROBE_EVERY = 1 << 30
        self.f = ms

    def observe(self, rows, ms):
        self.g.ms[rows] = self.f(rows)

    def keep(self, *a):
        return self.g.keep(*a)


def test_batched_greedy_drafts_ride_only_where_the_step_walls_say_they_pay(model, oracle):
    """Three greedy jobs with a drafter that is always right, batched: where each extra
    row costs next to nothing the drafts ride; where a step's wall grows with the
    square of its rows, the batched decode steps stop drafting once their walls are
    known (what a lone step drafts before the others are admitted, and a row count
    beyond every measured one, still rides). The text is plain greedy's either way."""
    ps = prompts(3, seed=11)
    for p in ps:
        oracle.refs[tuple(p)] = alone(model, p, 48).ids
    drafted, batched = {}, {}
    for pays in (True, False):
        with running(model, n_slots=3) as sched:
            sched.engine.gate = _Walls((lambda rows: 1.0) if pays else (lambda rows: float(rows) ** 2))
            rows = batched[pays] = []
            real = sched.engine._launch_items

            def spy(items, real=real, rows=rows):
                if len(items) > 1 and all(not s.pending for s, _, _ in items):
                    rows.append(sum(len(t) for _, t, _ in items) - len(items))
                return real(items)

            sched.engine._launch_items = spy
            got = run_jobs(sched, [dict(prompt_ids=p, n_predict=48, speculate=SpecRequest("ngram", 4))
                                   for p in ps])
        for p, g in zip(ps, got):
            assert g["ids"] == oracle.refs[tuple(p)]
        drafted[pays] = sum(g["done"].usage["speculation"]["drafted"] for g in got)
    # Drafts in the batched decode steps: most steps where they pay, and where they do
    # not, only the steps that measured a row count no step had reached before.
    assert sum(batched[True]) >= 2 * len(batched[True])
    late = batched[False][len(batched[False]) // 2:]
    assert late and sum(late) == 0, str(batched[False])
    assert drafted[False] < drafted[True]


def test_sampled_drafts_ride_whatever_the_step_walls_say(model):
    """The gate never drops a sampled sequence's drafts: its seed's output depends on
    what was drafted, so it must not depend on the clock."""
    ps = prompts(2, seed=12)
    sp = SamplingParams(temperature=0.9, top_k=5, seed=7)
    jobs = [dict(prompt_ids=p, n_predict=24, sampling=sp, speculate=SpecRequest("ngram", 4)) for p in ps]
    with running(model, n_slots=2) as sched:
        sched.engine.gate = _Walls(lambda rows: float(rows) ** 2)
        a = run_jobs(sched, [dict(j) for j in jobs])
    with running(model, n_slots=2) as sched:
        b = run_jobs(sched, [dict(j) for j in jobs])
    assert [g["ids"] for g in a] == [g["ids"] for g in b]
    assert sum(g["done"].usage["speculation"]["drafted"] for g in a) > 0
