"""Decode batches padded to buckets (session.Context.PAD_STEP): a context that pads
(the default on CUDA; here asked for on the CPU, whose rows are exact either way) runs
batches of more than 16 rows as multiples of 8 rows, its padding rows writing and
reading only cells past the sequences', so the outputs are those of the unpadded batch
and a shrinking batch reuses a few kept graphs instead of building one per size."""

from __future__ import annotations

import numpy as np
import pytest

from minfer.engine import Engine, Sequence
from minfer.model import Model
from minfer.sampling import SamplingParams
from minfer.session import Context
from minfer.testing import write_model

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Model:
    path = tmp_path_factory.mktemp("buckets") / "m.gguf"
    write_model(path, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, types={"ffn_up": "Q8_0", "attn_q": "Q4_0"})
    return Model.open(path, n_threads=2)


def started(ctx):
    """22 sequences ending one by one (budgets 6..27), all started before the first step."""
    eng = Engine(ctx, [ctx.session(i) for i in range(22)], chunk=256)
    rng = np.random.default_rng(5)
    seqs = [Sequence([int(t) for t in rng.integers(3, 200, size=8)], 6 + i, GREEDY, stop_at_eog=False)
            for i in range(22)]
    for i, s in enumerate(seqs):
        eng.add(s, i)
    return eng, seqs


def run(model, pad: bool):
    ctx = Context(model, n_ctx=48, n_seq=22, pad_batches=pad)
    eng, seqs = started(ctx)
    rows = []
    real = ctx.run

    def spy(tokens, *a, **kw):
        rows.append(int(tokens.size))
        return real(tokens, *a, **kw)
    ctx.run = spy
    builds = ctx.builds
    eng.run()
    return [s.ids for s in seqs], rows, ctx.builds - builds, ctx


def test_padded_batches_give_the_unpadded_outputs_with_fewer_builds(model):
    plain, plain_rows, plain_builds, _ = run(model, False)
    padded, padded_rows, padded_builds, ctx = run(model, True)
    assert padded == plain
    decode_sizes = {r for r in padded_rows if r > 16 and r != 22 * 8}
    assert decode_sizes == {24}, sorted(set(padded_rows))       # 22 .. 17 rows all run as 24
    assert set(plain_rows) >= set(range(17, 23))                # the unpadded batch took every size
    assert padded_builds < plain_builds, (padded_builds, plain_builds)
    # The padding cells lie past every sequence's and the graph's KV holds them.
    assert ctx.cparams.n_ctx == ctx.n_cells + Context.PAD_MAX
    assert all(b + c <= ctx.n_cells for b, c in ctx.ranges)


def test_small_batches_are_not_padded_and_mixed_ones_are_bucketed(model):
    ctx = Context(model, n_ctx=48, n_seq=4, pad_batches=True)
    seen = []
    real = ctx.run
    ctx.run = lambda tokens, *a, **kw: (seen.append((int(tokens.size), kw["n_out"])), real(tokens, *a, **kw))[1]
    eng = Engine(ctx, [ctx.session(i) for i in range(4)], chunk=64)
    for i in range(4):
        eng.add(Sequence([5 + i] * 6, 4, GREEDY, stop_at_eog=False), i)
    eng.run()
    # The prompts (24 rows, 4 of them outputs) run as 24 rows with 8 logits rows; the
    # 4-row decode steps as they are.
    assert seen[0] == (24, 8) and all(r <= 4 for r, _ in seen[1:]), seen
    assert Context(model, n_ctx=48, n_seq=4).pad_from is None    # the CPU's default: no padding


def test_mixed_steps_in_buckets_give_the_unbucketed_outputs(model):
    """Decode rows beside prompt chunks of every length (sequences arriving while others
    decode): bucketed, the wanted rows first and padding after, every output equals the
    unbucketed run's, and the steps take a few shapes instead of one per mix."""
    def go(pad: bool):
        ctx = Context(model, n_ctx=64, n_seq=12, pad_batches=pad)
        shapes = set()
        real = ctx.run
        ctx.run = lambda tokens, *a, **kw: (shapes.add((int(tokens.size), kw["n_out"])), real(tokens, *a, **kw))[1]
        eng = Engine(ctx, [ctx.session(i) for i in range(12)], chunk=7)
        rng = np.random.default_rng(9)
        seqs = [Sequence([int(t) for t in rng.integers(3, 200, size=3 + i % 5)], 5 + i, GREEDY, stop_at_eog=False)
                for i in range(12)]
        for i, s in enumerate(seqs[:6]):
            eng.add(s, i)
        n = 6
        while eng.step():
            if n < 12:             # one newcomer a step, while the first ones decode
                eng.add(seqs[n], n)
                n += 1
        return [s.ids for s in seqs], shapes

    plain, plain_shapes = go(False)
    bucketed, shapes = go(True)
    assert bucketed == plain
    big = {s for s in shapes if s[0] > 8}
    assert all(r % 8 == 0 and o % 8 == 0 and o <= r for r, o in big), sorted(shapes)
    assert len(shapes) < len(plain_shapes), (sorted(shapes), sorted(plain_shapes))


def test_attention_steps_carry_the_context_of_one_sequence(model):
    """ATTN's seq_ctx (plan.h ip[8]): the cells one row's span may hold, the context per
    sequence, beside the arena's n_ctx (every sequence's cells and the padding's). CUDA
    cuts its decode splits by it, so a row's bits do not depend on the arena."""
    from minfer.backends.plan_steps import lower_node
    from minfer.graph.ir import Op

    class Stub:  # resolves every buffer and weight to 0, the KV regions to (0, 1)
        def out(self, node):
            return 0

        def src(self, node, i):
            return 0

        def kv(self, node, layer):
            return 0, 1

        def weight(self, name, node):
            return 0

    ctx = Context(model, n_ctx=48, n_seq=4, pad_batches=True)
    graph = model.defn.build_graph(ctx.params(12, 4))
    attn = [n for n in graph.nodes if n.op is Op.Attn]
    assert attn and all(n.meta.seq_ctx == 48 and n.meta.n_ctx == 4 * 48 + Context.PAD_MAX for n in attn)
    for n in attn:
        (code, _, ip, _, _), = lower_node(n, graph, Stub())
        assert ip[4] == 4 * 48 + Context.PAD_MAX and ip[8] == 48


def test_a_bucketed_step_returns_and_reads_only_the_wanted_rows(model):
    """The bucket adds logits rows after the wanted ones; the caller gets the wanted
    rows only, equal to the unbucketed step's, and copy_to_host reads only those."""
    got = {}
    for pad in (False, True):
        ctx = Context(model, n_ctx=48, n_seq=3, pad_batches=pad)
        items = [(ctx.session(i), [7 + i] * (5 + 4 * i), 1 + (i == 1)) for i in range(3)]   # 21 rows, 4 wanted
        reads = []
        real = ctx.cache.alloc.copy_to_host
        ctx.cache.alloc.copy_to_host = lambda node, rows=None: (reads.append(rows), real(node, rows=rows))[1]
        got[pad] = ctx.decode_batch(items, copy=True)
        assert got[pad].shape == (4, model.hp.n_vocab)
        assert reads == [4]
    assert np.array_equal(got[True], got[False])


def test_a_bucketed_host_view_asks_the_device_for_the_wanted_rows_only(model):
    """copy=False (a host view): a device whose view is a D2H of what it covers (CUDA's
    pinned mirror) is asked for the wanted rows' elements, not the bucket's."""
    ctx = Context(model, n_ctx=48, n_seq=3, pad_batches=True)
    items = [(ctx.session(i), [7 + i] * (5 + 4 * i), 1 + (i == 1)) for i in range(3)]   # 21 rows, 4 wanted
    ctx.decode_batch(items, copy=True)   # the buffers exist from here on
    dev = next(iter(ctx.cache.alloc.devices.values()))
    asked = []

    class Counting:
        def __getattr__(self, name):
            return getattr(dev, name)

        def view(self, buf, dtype, count, offset=0):
            asked.append(count)
            return dev.view(buf, dtype, count, offset)

    ctx.cache.alloc.devices = {k: Counting() for k in ctx.cache.alloc.devices}
    rows = ctx.decode_batch([(ctx.session(i), [11 + i] * 6, 1 + (i == 2)) for i in range(3)], copy=False)
    assert rows.shape == (4, model.hp.n_vocab)
    assert asked == [4 * model.hp.n_vocab]


def test_warmed_buckets_build_nothing_later_and_change_no_output(model):
    """warm_buckets (a server's start on a GPU): every bucket and small decode shape built
    beforehand on the padding cells, so the batched steps that follow build nothing, and
    the sequences' outputs are a cold context's; a context that does not pad warms nothing."""
    cold, cold_rows, cold_builds, _ = run(model, True)
    ctx = Context(model, n_ctx=48, n_seq=22, pad_batches=True)
    n = ctx.warm_buckets()
    assert n == 8 + sum(r // 8 for r in range(16, Context.PAD_MAX + 1, 8)) and ctx.builds == n
    eng, seqs = started(ctx)
    builds = ctx.builds
    eng.run()
    assert [s.ids for s in seqs] == cold
    # Only the prompt step (22 x 8 rows, past the buckets) builds.
    assert ctx.builds - builds == 1 and cold_builds > 1, (ctx.builds - builds, cold_builds)
    assert Context(model, n_ctx=48, n_seq=22).warm_buckets() == 0
