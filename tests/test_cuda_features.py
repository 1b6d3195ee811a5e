"""The sampler's features through the engine on CUDA (GPU suite): each against the same
backend's own forward rows, taken step by step the way the engine takes them (a prefill,
then one-token steps), so the comparison is exact: logprobs and alternatives, logit
bias, presence / frequency penalties picked from the candidates the device selects
(equal to the host's pick from the row read back), n choices sharing one prefill, the
token-mask hook, and a batched engine mixing them."""

from __future__ import annotations

import numpy as np
import pytest

from minfer.backends import cuda as cuda_backend
from minfer.engine import Engine, Sequence
from minfer.model import Model
from minfer.sampling import Sampler, SamplingParams
from minfer.session import Context, Session
from minfer.testing import write_model

pytestmark = pytest.mark.cuda

SMALL = dict(n_layer=2, n_embd=128, n_head=4, n_head_kv=2, n_ff=256, n_vocab=4096)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Model:
    e = cuda_backend.ENTRY
    assert e.compiled and e.usable, f"pytest -m cuda needs the CUDA backend here: {e.unusable_reason}"
    path = tmp_path_factory.mktemp("cuda-features") / "m.gguf"
    write_model(path, types={"ffn_up": "Q8_0", "attn_q": "Q4_0"}, seed=5, **SMALL)
    m = Model.open(path, backends=["cuda"])
    assert Session(m, n_ctx=64).backend_names[0] == "CUDA"
    return m


def prompt(seed: int, n: int = 12) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 4000, size=n)]


def step_rows(model, p: list[int], ids: list[int]) -> list[np.ndarray]:
    """The rows a lone stream picks from: after the prompt, then after each id."""
    s = Session(model, n_ctx=128)
    rows = [s.forward(p)[-1].astype(np.float64)]
    for t in ids[:-1]:
        rows.append(s.forward([t])[-1].astype(np.float64))
    return rows


def log_softmax(x):
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def test_logprobs_are_the_rows_log_softmax(model):
    p = prompt(1)
    evs = [e for e in Session(model, n_ctx=128).stream(p, 6, SamplingParams(temperature=0.0), stop_at_eog=False,
                                                        logprobs=4) if not e.done]
    ids = [e.id for e in evs]
    assert ids == Session(model, n_ctx=128).generate(p, 6, SamplingParams(temperature=0.0), stop_at_eog=False).ids
    for e, row in zip(evs, step_rows(model, p, ids)):
        lsm = log_softmax(row)
        assert e.id == int(np.argmax(row)) and abs(e.logprob - lsm[e.id]) < 1e-9
        assert [t for t, _ in e.top_logprobs] == np.argsort(-lsm, kind="stable")[:4].tolist()


def test_logit_bias_and_penalties_pick_as_the_host_does(model):
    p = prompt(2)
    forced = Session(model, n_ctx=128).generate(p, 5, SamplingParams(temperature=0.0, logit_bias=((77, 100.0),)),
                                                stop_at_eog=False).ids
    assert forced == [77] * 5
    sp = SamplingParams(temperature=0.9, seed=3, presence_penalty=1.2, frequency_penalty=0.6,
                        logit_bias=((9, 2.0),))
    got = Session(model, n_ctx=128).generate(p, 8, sp, stop_at_eog=False).ids
    # The host reference: the same sampler over the rows read back.
    ref, s = Sampler(sp), Session(model, n_ctx=128)
    ref.accept_prompt(p)
    row = s.forward(p)[-1]
    want = []
    for _ in range(8):
        t = ref.sample(row)
        ref.accept(t)
        want.append(t)
        row = s.forward([t])[-1]
    assert got == want


def test_n_choices_share_one_prefill_and_each_equals_its_seed_alone(model):
    p = prompt(3, 20)
    n, steps, seed = 3, 6, 11
    ctx = Context(model, n_ctx=128, n_seq=n)
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
        assert s.timings.cached_tokens == (len(p) if i else 0)


def test_mask_hook_constrains_every_pick(model):
    p = prompt(4)
    allowed = np.zeros(model.hp.n_vocab, dtype=bool)
    allowed[np.random.default_rng(0).choice(model.hp.n_vocab, 40, replace=False)] = True
    got = [e.id for e in Session(model, n_ctx=128).stream(p, 6, SamplingParams(temperature=0.0), stop_at_eog=False,
                                                             mask=lambda s: allowed) if not e.done]
    for t, row in zip(got, step_rows(model, p, got)):
        row[~allowed] = -np.inf
        assert t == int(np.argmax(row))


def test_masks_apply_on_the_device_as_on_the_host_rows(model, monkeypatch):
    """Masked greedy and sampled sequences batched beside an unmasked one: the masks
    applied where the logits are (Context.mask_rows) give the picks of the same masks
    over the rows read back, every pick obeys its mask, and only the first forward's
    rows come back (before it, the engine cannot know where the logits will be)."""
    from types import SimpleNamespace

    from minfer import _core

    n = model.hp.n_vocab
    real = Engine._masks_on_device

    def hook(seed):
        return lambda s: np.random.default_rng([seed, len(s.ids), *s.ids[-2:]]).random(n) < 0.2

    def run(on_device: bool):
        monkeypatch.setattr(Engine, "_masks_on_device", lambda self, rows: on_device and real(self, rows))
        ctx = Context(model, n_ctx=128, n_seq=3)
        eng = Engine(ctx, [ctx.session(i) for i in range(3)])
        sps = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=7), SamplingParams(temperature=0.0)]
        masks = [hook(1), hook(2), None]
        seqs = [Sequence(prompt(20 + i), 10, sps[i], stop_at_eog=False, mask=masks[i]) for i in range(3)]
        for i, s in enumerate(seqs):
            eng.add(s, i)
        _core.testing.cuda_reset_counters()
        eng.run()
        return [s.ids for s in seqs], _core.testing.cuda_counters()["d2h_bytes"], masks

    host, host_bytes, _ = run(False)
    dev, dev_bytes, masks = run(True)
    assert dev == host
    for ids, m in zip(dev, masks):
        if m is not None:
            assert all(m(SimpleNamespace(ids=ids[:i]))[t] for i, t in enumerate(ids))
    assert dev_bytes <= 3 * 4 * n + 65536 < host_bytes, (dev_bytes, host_bytes)


def test_a_prefix_held_by_another_slot_is_read_in_place_then_copied_on_the_device(model):
    """Engine.add lends a prefix another slot holds (no copy, no prefill); when the
    lender takes another prompt, the borrower first gets those cells by a device copy
    (CudaPool.copy_within, D2D): outputs equal the prompts' alone, and no KV crossed to
    the host."""
    from minfer import _core

    shared, tail_a, tail_b = prompt(40, 48), [7, 8, 9], [11, 12, 13, 14]

    def engine(n):
        ctx = Context(model, n_ctx=128, n_seq=n)
        return Engine(ctx, [ctx.session(i) for i in range(n)], chunk=16)

    def alone(p):
        eng = engine(1)
        s = Sequence(p, 10, SamplingParams(temperature=0.0), stop_at_eog=False)
        eng.add(s)
        eng.run()
        return s.ids

    eng = engine(2)
    a = Sequence(shared + tail_a, 10, SamplingParams(temperature=0.0), stop_at_eog=False)
    eng.add(a, 0)
    while a.picks < 2:
        eng.step()
    b = Sequence(shared + tail_b, 10, SamplingParams(temperature=0.0), stop_at_eog=False)
    _core.testing.cuda_reset_counters()
    eng.add(b, 1)
    c = _core.testing.cuda_counters()
    assert b.timings.cached_tokens == len(shared) and eng.ctx.borrowed[1] == (0, len(shared))
    assert c["d2d"] == 0 and c["d2h_bytes"] == 0
    eng.run()
    assert b.ids == alone(shared + tail_b) and a.ids == alone(shared + tail_a)
    other = prompt(30, 49)
    _core.testing.cuda_reset_counters()
    o = Sequence(other, 10, SamplingParams(temperature=0.0), stop_at_eog=False)
    eng.add(o, 0, reuse_prefix=False)
    c = _core.testing.cuda_counters()
    assert eng.ctx.borrowed[1] is None and c["d2d"] >= 2 * model.hp.n_layer and c["d2h_bytes"] == 0
    nxt = shared + tail_b + b.ids + [5, 6]
    b2 = Sequence(nxt, 8, SamplingParams(temperature=0.0), stop_at_eog=False)
    eng.add(b2, 1)
    eng.run()
    assert b2.ids == alone(nxt)[:8] and o.ids == alone(other)
