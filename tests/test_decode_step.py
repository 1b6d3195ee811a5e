"""The one-call decode step (Context.run_one through a device's bind_step): a reused
one-token forward writes its three inputs and runs the plan in one core call. Same
logits, same checks and the same fallbacks as the general path (run)."""

import numpy as np
import pytest

from minfer.errors import MinferError
from minfer.session import Session
from minfer.testing.synth import write_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("step") / "m.gguf", n_layer=2, seed=3).path


def _general(path, **kw):
    """A session whose device binds no step: every forward takes run()."""
    s = Session.open(path, n_ctx=64, backends=["cpu"], **kw)
    (dev,) = s.context.cache.alloc.devices.values()
    dev.bind_step = None
    return s


def _decode(s, steps=6, copy=True):
    out = [np.array(s.forward([1, 2, 3], n_out=3))]
    t = 4
    for _ in range(steps):
        lg = s.forward([t], copy=copy)
        if copy is None:
            t = s.argmax_last()
            out.append(np.array([t]))
        else:
            out.append(np.array(lg))
            t = int(np.argmax(lg[-1])) % 50 + 1
    return np.concatenate([o.ravel() for o in out])


@pytest.mark.parametrize("copy", [True, False, None])
def test_step_logits_equal_the_general_path(model, copy):
    fast, slow = Session.open(model, n_ctx=64, backends=["cpu"]), _general(model)
    a, b = _decode(fast, copy=copy), _decode(slow, copy=copy)
    assert a.tobytes() == b.tobytes()
    assert fast.context._step is not None, "the decode graph bound a step"
    assert slow.context._step is None
    assert fast.tokens == slow.tokens


def test_step_is_taken_and_survives_other_graphs(model):
    s = Session.open(model, n_ctx=64, backends=["cpu"])
    s.forward([1, 2, 3])
    s.forward([4])                     # builds the decode graph: run(), then binds
    ctx = s.context
    calls = []
    step = ctx._step
    ctx._step = lambda *a: (calls.append(a), step(*a))[1]
    s.forward([5])
    assert calls == [(5, 4, 4)], "token, position, cell"
    s.forward([6, 7])                  # another graph installed: no step for it
    assert ctx._step is None and ctx.cache.graph is ctx._step_graph
    got = [s.forward([8])]             # run() reinstalls the kept decode graph and binds again
    assert ctx._step is not None and calls == [(5, 4, 4)]
    got.append(s.forward([9]))
    ref = _general(model)
    for toks in ([1, 2, 3], [4], [5], [6, 7]):
        ref.forward(toks)
    assert [g.tobytes() for g in got] == [ref.forward([8]).tobytes(), ref.forward([9]).tobytes()]
    s.reset()                          # the KV and graphs go: a fresh decode graph binds afresh
    s.forward([1])
    s.forward([2])
    assert ctx._step is not None and ctx.cache.graph is ctx._step_graph and len(calls) == 1


def test_step_refuses_a_bad_token_and_keeps_nothing(model):
    s = Session.open(model, n_ctx=64, backends=["cpu"])
    s.forward([1, 2])
    s.forward([3])
    s.forward([4])
    n = s.n_past
    runs = s.context.runs
    vocab = s.model.hp.n_vocab
    for bad in (-1, vocab, 2**40):
        with pytest.raises(MinferError, match="token id out of range"):
            s.forward([bad])
    assert s.n_past == n and s.context.runs == runs


def test_step_is_not_taken_without_reuse_or_while_tracing(model):
    s = Session.open(model, n_ctx=64, backends=["cpu"], reuse=False)
    ref = _general(model)
    a, b = _decode(s), _decode(ref)
    assert a.tobytes() == b.tobytes()
    builds = s.context.builds
    s.forward([9])
    assert s.context.builds == builds + 1, "reuse off: every forward builds, the step is never reused"
