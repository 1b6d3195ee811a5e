"""The scheduler's picks from logits left on the device (DeviceRows), on CI: the CPU
device wrapped with the CUDA device's picking calls (argmax_rows, top_k_rows), computed
here from the rows in the CPU's buffer as the CUDA ones must answer (_core.top_k's
order). The same jobs give the same tokens as the host path (every row read back),
greedy, seeded sampling and penalties alike; a broken row fails only its job, with the
host path's error; and a step so picked reads no logits row back."""

from __future__ import annotations

import collections
import queue

import numpy as np
import pytest

from minfer import _core
from minfer.model import Model
from minfer.sampling import HostRow, Sampler, SamplingParams, sample_rows
from minfer.server.scheduler import Job, Scheduler
from minfer.session import DeviceRows, Session
from minfer.testing import write_model
from scheduler_helpers import pick_mix, poison_token_row, prompts

CTX = 96
SMALL = dict(n_embd=128, n_head=4, n_head_kv=2, n_ff=256)


class PickingCpu:
    """The CPU device plus argmax_rows / top_k_rows as the CUDA device has them (same
    arguments, limits and answers), counting every call and every read of a buffer
    (host_view and copy_to_host go through view and read)."""

    top_k_max = 256
    argmax_checks_finite = True

    def __init__(self, dev):
        self._dev = dev
        self.calls: collections.Counter = collections.Counter()
        self.flagged = 0                # rows answered -1 / None (NaN or Inf)

    def __getattr__(self, name):
        return getattr(self._dev, name)

    def view(self, *a):
        self.calls["view"] += 1
        return self._dev.view(*a)

    def read(self, *a):
        self.calls["read"] += 1
        return self._dev.read(*a)

    def _rows(self, buf, n, rows):
        return np.array(self._dev.view(buf, "float32", n * rows)).reshape(rows, n)

    def argmax_rows(self, buf, n, rows):
        if not 1 <= rows <= 64:
            raise ValueError("argmax_rows: rows must be in 1..64")
        self.calls["argmax_rows"] += 1
        x = self._rows(buf, n, rows)
        out = [int(np.argmax(r)) if np.isfinite(r).all() else -1 for r in x]
        self.flagged += out.count(-1)
        return out

    def top_k_rows(self, buf, n, rows, k, gather):
        if not 1 <= rows <= 64:
            raise ValueError("top_k_rows: rows must be in 1..64")
        if not 1 <= k <= min(n, self.top_k_max):
            raise ValueError("top_k_rows: k must be in 1..min(n, 256)")
        gather = np.asarray(gather)
        if gather.dtype != np.int32 or gather.ndim != 2 or gather.shape[0] != rows or gather.shape[1] > 256:
            raise ValueError("top_k_rows: gather must be rows x g int32 ids, g <= 256")
        if gather.size and (gather.min() < -1 or gather.max() >= n):
            raise ValueError("top_k_rows: a gather id outside the row")
        self.calls["top_k_rows"] += 1
        out = []
        for r, row in enumerate(self._rows(buf, n, rows)):
            ids = _core.top_k(np.ascontiguousarray(row), k)
            if ids is None:
                self.flagged += 1
                out.append(None)
                continue
            g = gather[r]
            at = np.where(g >= 0, row[np.maximum(g, 0)], 0.0).astype(np.float32)
            out.append((ids.astype(np.int64), row[ids].astype(np.float32), at))
        return out

    def mask_rows(self, buf, n, rows, which, words):
        which, words = np.asarray(which), np.asarray(words)
        if which.dtype != np.int32 or words.dtype != np.int32 or words.shape != (which.size, (n + 31) // 32):
            raise ValueError("mask_rows: int32 row ids and ceil(n / 32) int32 words per row")
        if which.size == 0 or which.min() < 0 or which.max() >= rows:
            raise ValueError("mask_rows: a row id outside the rows")
        self.calls["mask_rows"] += 1
        x = self._rows(buf, n, rows)
        for r, w in zip(which, words):
            allowed = np.unpackbits(w.view(np.uint8), bitorder="little", count=n).astype(bool)
            x[r, ~allowed & np.isfinite(x[r])] = np.float32(-3.0e38)   # kMaskedLogit
        self._dev.write(buf, x, 0)

    def reset(self):
        self.calls.clear()
        self.flagged = 0


def picking(ctx) -> PickingCpu:
    """Give ctx's (only) device the picking calls; before its first forward."""
    devs = ctx.cache.alloc.devices
    (bid,) = devs
    devs[bid] = PickingCpu(devs[bid])
    return devs[bid]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Model:
    path = tmp_path_factory.mktemp("devpicks") / "m.gguf"
    write_model(path, types={"ffn_up": "Q8_0", "attn_q": "Q4_0"}, **SMALL)
    return Model.open(path, n_threads=2)




def run(sched: Scheduler, specs: list[tuple[list[int], int, SamplingParams]], usage: list | None = None,
        speculate=None, masks=None) -> list[list]:
    """Submit every job at once; each job's events (kind, id, text, reason, message).
    `usage` gets each job's final usage; masks[k], job k's token-mask hook."""
    q: queue.Queue = queue.Queue()
    for k, (p, n, sp) in enumerate(specs):
        sched.submit(Job(prompt_ids=p, n_predict=n, sampling=sp, stop_at_eog=False, speculate=speculate,
                         mask=masks[k] if masks else None, emit=lambda ev, k=k: q.put((k, ev))))
    out: list[list] = [[] for _ in specs]
    left = len(specs)
    while left:
        k, ev = q.get(timeout=120)
        out[k].append((ev.kind, ev.id, ev.text, ev.reason, ev.message))
        if ev.kind != "token":
            left -= 1
            if usage is not None:
                usage.append((k, ev.usage))
    return out


# A first job on the picking device: the device path starts once a forward has shown
# where the logits live. It starts with a token no prompt has: no prompt reuses its KV.
WARM = [([1, 2, 3], 1, SamplingParams(temperature=0.0))]


class Both:
    """The jobs through a scheduler on the plain CPU (the host path: `want`) and through
    one on the picking device (`got`, after WARM; `fake`'s counts and `steps` cover the
    jobs only)."""

    def __init__(self, model, specs, speculate=None, masks=None, **kw):
        self.host, self.dev = Scheduler(model, **kw), Scheduler(model, **kw)
        self.fake = picking(self.dev.ctx)
        self.usage: list = []
        self.host.start()
        self.dev.start()
        try:
            self.want = run(self.host, specs, speculate=speculate, masks=masks)
            run(self.dev, WARM)
            self.fake.reset()
            steps = self.dev.steps
            self.got = run(self.dev, specs, self.usage, speculate, masks)
            self.steps = self.dev.steps - steps
        finally:
            assert self.host.stop() and self.dev.stop()


P = prompts(8, seed=21)
MIX = pick_mix(P)


def test_device_picks_equal_the_host_path_and_read_no_row(model, monkeypatch):
    made = []
    real_init = DeviceRows.__init__

    def init(self, ctx):
        made.append(ctx)
        real_init(self, ctx)

    monkeypatch.setattr(DeviceRows, "__init__", init)
    b = Both(model, MIX, n_slots=4, n_ctx=CTX, chunk=8)
    assert b.got == b.want
    for evs in b.want:
        assert evs[-1][0] == "done" and evs[-1][3] == "length"
    # Sampling really sampled: the seeded draw left the greedy path on the same prompt.
    assert [e[1] for e in b.want[0]] != [e[1] for e in b.want[1]]
    # Greedy rows came from argmax_rows, sampled rows' candidates from top_k_rows: at
    # most one call of each per step, and no logits row was read back.
    fake = b.fake
    assert fake.calls["view"] == 0 and fake.calls["read"] == 0, fake.calls
    assert 0 < fake.calls["argmax_rows"] <= b.steps and 0 < fake.calls["top_k_rows"] <= b.steps, (fake.calls, b.steps)
    # Every step after the first forward picked on the device; the plain CPU never did
    # (it has no top_k_rows).
    assert len(made) == b.dev.steps - 1 and all(c is b.dev.ctx for c in made)


class _Mask:
    """A token mask that changes with the sequence: about a third of the ids, drawn from
    the ids so far (so both paths see the same masks, and a test can redraw them)."""

    def __init__(self, seed: int, n_vocab: int):
        self.seed, self.n_vocab = seed, n_vocab

    def allowed(self, ids: list[int]) -> np.ndarray:
        return np.random.default_rng([self.seed, len(ids), *ids[-3:]]).random(self.n_vocab) < 0.33

    def __call__(self, seq) -> np.ndarray:
        return self.allowed(seq.ids)


def test_masked_picks_on_the_device_equal_the_host_path_and_read_no_row(model):
    """A token mask applied where the logits are (mask_rows): greedy and sampled masked
    jobs beside an unmasked one pick as the host path does (the mask over the row read
    back), every pick obeys its mask, and no row is read back (but for the whole-row
    filter top_k=0, which reads its row on both paths)."""
    masks = [_Mask(k, model.hp.n_vocab) for k in range(4)]
    masks[2] = None
    for top_k in (40, 0):
        specs = [(P[0], 8, SamplingParams(temperature=0.0)), (P[1], 8, SamplingParams(temperature=0.9, seed=4)),
                 (P[2], 8, SamplingParams(temperature=0.0)),
                 (P[3], 8, SamplingParams(temperature=0.8, top_k=top_k, seed=5))]
        b = Both(model, specs, n_slots=4, n_ctx=CTX, chunk=16, masks=masks)
        assert b.got == b.want
        for k, m in enumerate(masks):
            toks = [e[1] for e in b.got[k] if e[0] == "token"]
            assert len(toks) == 8
            if m is not None:
                assert all(m.allowed(toks[:i])[t] for i, t in enumerate(toks)), k
        assert 0 < b.fake.calls["mask_rows"] <= b.steps, (b.fake.calls, b.steps)
        if top_k:
            assert b.fake.calls["view"] == 0 and b.fake.calls["read"] == 0, b.fake.calls


def test_device_calls_only_when_a_row_needs_them(model):
    greedy = [(p, 6, SamplingParams(temperature=0.0)) for p in P[:3]]
    b = Both(model, greedy, n_slots=3, n_ctx=CTX, chunk=16)
    assert b.got == b.want and b.fake.calls["top_k_rows"] == 0 and b.fake.calls["argmax_rows"] > 0
    sampled = [(p, 6, SamplingParams(temperature=0.9, seed=i)) for i, p in enumerate(P[:3])]
    b = Both(model, sampled, n_slots=3, n_ctx=CTX, chunk=16)
    assert b.got == b.want and b.fake.calls["argmax_rows"] == 0 and b.fake.calls["top_k_rows"] > 0


def test_rows_a_selection_cannot_serve_are_read_back_and_pick_the_same(model):
    """No top-k (the whole row), and more candidates than one selection takes (top-k plus
    penalized ids past 256): those rows are read back; the others still pick on the device."""
    specs = [
        (P[0], 8, SamplingParams(temperature=0.9, top_k=0, seed=1)),
        (P[1], 8, SamplingParams(temperature=0.9, top_k=250, top_p=1.0, min_p=0.0, repeat_penalty=1.2,
                                 repeat_last_n=64, seed=2)),
        (P[2], 8, SamplingParams(temperature=0.9, seed=3)),
        (P[3], 8, SamplingParams(temperature=0.0)),
    ]
    b = Both(model, specs, n_slots=4, n_ctx=CTX, chunk=16)
    assert b.got == b.want
    assert b.fake.calls["view"] > 0 and b.fake.calls["top_k_rows"] > 0 and b.fake.calls["argmax_rows"] > 0


def test_a_batched_row_answers_as_the_host_row(model):
    """Row by row, DeviceRows answers best(k, ids) with HostRow's ids and values: the
    penalized ids looked up by id in any order, k below the selection's, and ids the plan
    did not gather (read back); argmax as np.argmax."""
    ses = Session(model, n_ctx=CTX)
    fake = picking(ses.context)
    ses.forward(P[0][:20], n_out=4, copy=None)
    host = np.array(ses.context.cache.alloc.copy_to_host(ses.context.cache.graph.outputs[0]))
    fake.reset()
    rows = DeviceRows(ses.context)
    samplers = []
    for r in range(4):
        s = Sampler(SamplingParams(temperature=1.0, top_k=10 + 5 * r, repeat_penalty=1.3, seed=r))
        for t in P[r + 1][:8]:
            s.accept(t)
        rows.plan(r, s)
        samplers.append(s)
    assert rows.k == max(10 + 5 * r + len(set(P[r + 1][:8])) for r in range(4)) and set(rows.gather) == {0, 1, 2, 3}
    rng = np.random.default_rng(0)
    for r in range(4):
        src, ref = rows.source(r, 7), HostRow(host[r])
        pen = rng.permutation(np.fromiter(set(samplers[r].recent), dtype=np.int64))
        for k, ids in ((rows.k, pen), (3, pen[::-1].copy()), (1, None), (rows.k, None)):
            for a, b in zip(src.best(k, ids), ref.best(k, ids)):
                assert (a is None and b is None) or (a.dtype == b.dtype and np.array_equal(a, b)), (r, k)
        assert src.argmax() == ref.argmax()
    assert fake.calls["top_k_rows"] == 1 and fake.calls["argmax_rows"] == 1 and fake.calls["view"] == 0
    # An id outside the plan, or more candidates than selected: the row read back.
    src = rows.source(2, 7)
    assert src.takes(rows.k) and not src.takes(rows.k + 1)
    for k, ids in ((3, np.array([1, 2, 3], np.int64)), (rows.k + 1, None)):
        for a, b in zip(src.best(k, ids), HostRow(host[2]).best(k, ids)):
            assert (a is None and b is None) or np.array_equal(a, b)
    assert fake.calls["view"] == 1 and fake.calls["top_k_rows"] == 1
    # Each sampler draws the same tokens from the batched rows, all four at once
    # (sample_rows), as from the host rows one at a time.
    a, b = ([Sampler(s.params) for s in samplers] for _ in range(2))
    for r in range(4):
        for t in samplers[r].recent:
            a[r].accept(t)
            b[r].accept(t)
    for _ in range(5):
        assert sample_rows(a, [rows.source(r, 7) for r in range(4)]) == [b[r].sample(host[r]) for r in range(4)]


def test_a_broken_row_fails_only_its_job_with_the_host_paths_error(tmp_path):
    """NaN logits in one slot's row (the embedding of its first greedy pick, or the last
    prompt token of a sampled job): that job ends with the same error as on the host
    path, naming its step; the job batched beside it finishes as it does there."""
    path = write_model(tmp_path / "ok.gguf", **SMALL).path
    ok = Model.open(path, n_threads=2)
    a, b = prompts(2, seed=9)
    g0 = Session(ok, n_ctx=CTX).generate(a, 1, SamplingParams(temperature=0.0), stop_at_eog=False).ids[0]
    want_b = Session(ok, n_ctx=CTX).generate(b, 6, SamplingParams(temperature=0.0), stop_at_eog=False).ids
    assert g0 not in want_b and g0 not in b, "pick other prompts"
    poisoned = poison_token_row(path, tmp_path / "row.gguf", g0, SMALL["n_embd"])
    bad = Model.open(poisoned, n_threads=2)
    cases = [
        ([(a, 6, SamplingParams(temperature=0.0)), (b, 6, SamplingParams(temperature=0.0))],
         "at step 1", "argmax_rows"),
        ([(a + [g0], 6, SamplingParams(temperature=0.8, seed=1)), (b, 6, SamplingParams(temperature=0.8, seed=2))],
         "at the prompt (step 0)", "top_k_rows"),
        ([(a, 6, SamplingParams(temperature=0.0)), (b, 6, SamplingParams(temperature=0.9, top_k=0, seed=2))],
         "at step 1", "argmax_rows"),
    ]
    for specs, where, call in cases:
        r = Both(bad, specs, n_slots=3, n_ctx=CTX, chunk=16)
        assert r.got == r.want
        end_a = r.got[0][-1]
        assert end_a[0] == "error" and f"non-finite logits {where}" in end_a[4], end_a
        assert r.got[1][-1][0] == "done" and r.got[1][-1][3] == "length"
        # The device flagged the row, which was then read back to word the error.
        assert r.fake.flagged == 1 and r.fake.calls[call] > 0 and r.fake.calls["view"] >= 1, r.fake.calls


def test_speculating_steps_keep_the_host_path(model):
    """A step carrying drafts verifies whole rows: it reads them back; the others pick on
    the device. Same tokens as the host path either way."""
    from minfer.server.scheduler import SpecRequest

    specs = [(p, 16, SamplingParams(temperature=t, seed=3)) for p in P[:3] for t in (0.0, 0.9)]
    b = Both(model, specs, SpecRequest("ngram", 4), n_slots=3, n_ctx=CTX, chunk=16)
    assert b.got == b.want
    drafted = sum(u["speculation"]["drafted"] for _, u in b.usage)
    assert drafted > 0 and b.fake.calls["view"] > 0 and b.fake.calls["argmax_rows"] > 0, (drafted, b.fake.calls)


def test_the_device_path_is_only_taken_where_it_can_be(model):
    """Nothing before the context's first forward (its device is unknown), never on a
    device without top_k_rows (the CPU), never past MAX_ROWS rows, with drafts only when
    every pick is a plain argmax, never for a sequence that reads whole rows."""
    from minfer.engine import Sequence

    sched = Scheduler(model, n_slots=2, n_ctx=CTX)
    eng = sched.engine
    s0, s1 = (Sequence([1], 4) for _ in range(2))
    items = [(s0, [1], 1), (s1, [2], 1)]
    assert eng._copy_mode(items) is False             # no forward yet
    sched.slots[0].session.forward([1, 2, 3], copy=None)
    assert hasattr(sched.ctx._out[0], "argmax_rows") and eng._copy_mode(items) is False  # the CPU
    sched.ctx._out = (PickingCpu(sched.ctx._out[0]),) + sched.ctx._out[1:]
    assert eng._copy_mode(items) is None
    assert eng._copy_mode([(s0, list(range(65)), DeviceRows.MAX_ROWS + 1)]) is False
    s0.draft = [4]
    assert eng._copy_mode(items) is None              # greedy drafts: argmax_rows
    sampled = Sequence([1], 4, SamplingParams(temperature=0.9))
    sampled.draft = [4]
    assert eng._copy_mode([(sampled, [1, 4], 2), (s1, [2], 1)]) is False
    assert eng._copy_mode([(Sequence([1], 4, logprobs=2), [1], 1), (s1, [2], 1)]) is False
