"""Greedy output of every sequence in a batch equals its output alone, on CUDA (GPU
suite), at batch 1, 7, 16, 20 (padded to 24 rows) and 64. Forwards of up to
CUDA_ROW_EXACT_MAX_TOKENS (64) rows give each row the bits a lone step gives (the matvec
with the rows as columns; decode attention split by the sequence's own context, from
its own first cell), and the engine fills a step's prompt rows beside its decode rows
only up to that limit, so prompts of 12 tokens prefill exactly too."""

from __future__ import annotations

import numpy as np
import pytest

from minfer.backends import cuda as cuda_backend
from minfer.engine import Engine, Sequence
from minfer.model import Model
from minfer.sampling import SamplingParams
from minfer.session import Context, Session
from minfer.testing import write_model

pytestmark = pytest.mark.cuda

GREEDY = SamplingParams(temperature=0.0)
STEPS = 24


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Model:
    e = cuda_backend.ENTRY
    assert e.compiled and e.usable, f"pytest -m cuda needs the CUDA backend here: {e.unusable_reason}"
    path = tmp_path_factory.mktemp("batch-eq") / "m.gguf"
    write_model(path, n_layer=3, n_embd=256, n_head=8, n_head_kv=2, n_ff=512, n_vocab=4096, seed=11,
                types={"attn_q": "Q4_K", "ffn_up": "Q8_0", "ffn_down": "Q6_K", "ffn_gate": "Q5_0"})
    return Model.open(path, backends=["cuda"])


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(3)
    return [[int(t) for t in rng.integers(3, 4000, size=12)] for _ in range(64)]


@pytest.fixture(scope="module")
def alone(model, prompts):
    return [Session(model, n_ctx=64).generate(p, STEPS, GREEDY, stop_at_eog=False).ids for p in prompts]


@pytest.mark.parametrize("batch", [1, 7, 16, 20, 64])
def test_greedy_in_a_batch_equals_alone(model, prompts, alone, batch):
    ctx = Context(model, n_ctx=64, n_seq=batch)
    eng = Engine(ctx, [ctx.session(i) for i in range(batch)], chunk=16)
    seqs = [Sequence(p, STEPS, GREEDY, stop_at_eog=False) for p in prompts[:batch]]
    for i, s in enumerate(seqs):
        eng.add(s, i)
    eng.run()
    differ = [i for i, s in enumerate(seqs) if s.ids != alone[i]]
    assert not differ, f"{len(differ)} of {batch} sequences differ from alone: {differ[:8]}"


def test_warmed_buckets_change_no_output_and_save_builds(model, prompts, alone):
    """A server's start on the GPU (Context.warm_buckets): the bucket graphs built and
    captured on the padding cells beforehand; a batch of 20 then gives the sequences'
    outputs alone and builds fewer graphs than a cold context."""
    def batch(warm: bool):
        ctx = Context(model, n_ctx=64, n_seq=20)
        if warm:
            assert ctx.warm_buckets() == 43
        builds = ctx.builds
        eng = Engine(ctx, [ctx.session(i) for i in range(20)], chunk=16)
        seqs = [Sequence(p, STEPS, GREEDY, stop_at_eog=False) for p in prompts[:20]]
        for i, s in enumerate(seqs):
            eng.add(s, i)
        eng.run()
        return [s.ids for s in seqs], ctx.builds - builds

    cold, cold_builds = batch(False)
    warm, warm_builds = batch(True)
    assert warm == cold == alone[:20]
    assert warm_builds < cold_builds, (warm_builds, cold_builds)


def test_sequences_reading_a_shared_prefix_in_place_get_their_outputs_alone(model):
    """Eight sequences whose prompts start with one 40-token system prompt: the first
    prefills it, the others borrow its cells (no copy) while it decodes, and every
    greedy output, the first's included, is its output alone (the decode kernel reads a
    borrowed prefix in the bits of the same cells copied in front)."""
    rng = np.random.default_rng(9)
    system = [int(t) for t in rng.integers(3, 4000, size=40)]
    tails = [[int(t) for t in rng.integers(3, 4000, size=int(rng.integers(2, 12)))] for _ in range(8)]
    prompts = [system + t for t in tails]
    want = [Session(model, n_ctx=96).generate(p, STEPS, GREEDY, stop_at_eog=False).ids for p in prompts]
    ctx = Context(model, n_ctx=96, n_seq=8)
    eng = Engine(ctx, [ctx.session(i) for i in range(8)], chunk=16)
    seqs = [Sequence(p, STEPS, GREEDY, stop_at_eog=False) for p in prompts]
    eng.add(seqs[0], 0)
    while seqs[0].picks < 1:
        eng.step()
    copied: list = []
    orig = ctx.copy_cells
    ctx.copy_cells = lambda *a: (copied.append(a), orig(*a))
    for i in range(1, 8):
        eng.add(seqs[i], i)
        assert ctx.borrowed[i] == (0, 40) and seqs[i].timings.cached_tokens == 40
    eng.run()
    assert copied == []
    differ = [i for i, s in enumerate(seqs) if s.ids != want[i]]
    assert not differ, f"sequences {differ} differ from alone"
