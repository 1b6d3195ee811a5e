"""Two CUDA contexts on two threads (two models' server schedulers): both capture,
replay and read back at the same time, and each thread's greedy output is its output
run alone. Each context's device pool runs on a lane of its own (csrc/cuda/context.h:
its own stream, cuBLAS handle, pick slot and readback staging), which the bindings hold
for the call (bindings_cuda.cpp, LaneGuard), so the two run concurrently, no capture
records the other thread's launches and no pick reads the other's argmax. (GPU suite.)"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from minfer import _core
from minfer.backends import cuda as cuda_backend
from minfer.engine import Engine, Sequence
from minfer.model import Model
from minfer.sampling import SamplingParams
from minfer.session import Context, Session
from minfer.testing import write_model

pytestmark = pytest.mark.cuda

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    e = cuda_backend.ENTRY
    assert e.compiled and e.usable, f"pytest -m cuda needs the CUDA backend here: {e.unusable_reason}"
    d = tmp_path_factory.mktemp("threads")
    out = []
    for i, types in enumerate(({"attn_q": "Q4_K", "ffn_down": "Q6_K"}, {"ffn_up": "Q8_0", "attn_v": "Q5_0"})):
        write_model(d / f"m{i}.gguf", n_layer=3, n_embd=256, n_head=8, n_head_kv=2, n_ff=512, n_vocab=2048,
                    seed=21 + i, types=types)
        out.append(Model.open(d / f"m{i}.gguf", backends=["cuda"]))
    return out


def _stream(ctx: Context) -> int:
    """The stream the context's CUDA pool runs its work on."""
    pools = [d.pool for d in ctx.cache.alloc.devices.values() if isinstance(getattr(d, "pool", None), _core.CudaPool)]
    assert len(pools) == 1
    return _core.testing.cuda_stream_id(pools[0])


def test_contexts_have_streams_of_their_own(models):
    """Two models' contexts, and two contexts of one model, never share a stream."""
    ctxs = [Context(models[0], n_ctx=32), Context(models[1], n_ctx=32), Context(models[0], n_ctx=32)]
    before = [_stream(c) for c in ctxs]
    assert len(set(before)) == 3 and 0 not in before, before
    for c in ctxs:  # the lane is the pool's for good: running keeps it
        c.session(0).forward([5, 6, 7])
    assert [_stream(c) for c in ctxs] == before


def _prompts(seed: int, n: int):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, 2000, size=10 + 3 * i)] for i in range(n)]


def _batched(model, prompts):
    """A fresh context's engine over every prompt at once (captures of its own)."""
    ctx = Context(model, n_ctx=96, n_seq=len(prompts))
    eng = Engine(ctx, [ctx.session(i) for i in range(len(prompts))], chunk=16)
    seqs = [Sequence(p, 24, GREEDY, stop_at_eog=False) for p in prompts]
    for i, s in enumerate(seqs):
        eng.add(s, i)
    eng.run()
    return [s.ids for s in seqs]


def test_two_contexts_on_two_threads_give_their_outputs_alone(models):
    prompts = [_prompts(1, 5), _prompts(2, 5)]
    alone = [[Session(m, n_ctx=96).generate(p, 24, GREEDY, stop_at_eog=False).ids for p in ps]
             for m, ps in zip(models, prompts)]
    got: dict = {}
    errors: list = []
    start = threading.Barrier(2)

    def work(k: int) -> None:
        try:
            start.wait()
            got[k] = [_batched(models[k], prompts[k]) for _ in range(3)]
            got[k].append([Session(models[k], n_ctx=96).generate(p, 24, GREEDY, stop_at_eog=False).ids
                           for p in prompts[k]])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads), "a thread never finished (the stream turn is not released)"
    assert not errors, errors
    for k in range(2):
        for r, outs in enumerate(got[k]):
            assert outs == alone[k], f"model {k}, run {r}: a thread's output differs from its output alone"
