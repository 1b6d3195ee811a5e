"""A KV pool shared by a context's sequences (kv_pool.py, Engine.reserve): ranges are
placed first-fit and never overlap, grow in place or move with their kept prefix, take
idle sequences' room least recently used first, and a sequence that does not fit waits
(the scheduler) or is refused (KvPoolFull) without touching the running ones; every
output equals the prompt's alone."""

from __future__ import annotations

import queue

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minfer.engine import Engine, Sequence
from minfer.errors import KvPoolFull, MinferError
from minfer.kv_pool import first_fit, place
from minfer.model import Model
from minfer.sampling import SamplingParams
from minfer.server.scheduler import Job, Scheduler
from minfer.session import Context, Session
from scheduler_helpers import token_ids

GREEDY = SamplingParams(temperature=0.0)


# -- placement -------------------------------------------------------------------------

def test_first_fit_growth_moves_and_eviction():
    ranges = [(0, 10), (20, 10), (0, 0)]
    assert first_fit(ranges, 40, 10, set()) == 10
    assert first_fit(ranges, 40, 11, set()) is None
    assert first_fit(ranges, 40, 20, {1}) == 10
    p = place(ranges, 40, 0, 20, 10, [])            # grows into the free cells after it
    assert (p.base, p.cap, p.evict, p.moved) == (0, 20, [], False)
    assert place(ranges, 40, 2, 11, 0, []) is None  # no gap of 11
    packed = [(0, 10), (10, 10), (0, 0)]
    p = place(packed, 40, 0, 15, 10, [])            # blocked: moves past its own old range, kept cells copied
    assert (p.base, p.cap, p.moved) == (20, 15, True)
    p = place(packed, 40, 0, 15, 0, [])             # nothing kept: its old cells may be reused
    assert (p.base, p.cap, p.moved) == (20, 15, False)
    p = place(packed, 30, 2, 25, 0, [1, 0])         # idle ones give room, least recently used first
    assert p.evict == [1, 0] and (p.base, p.cap) == (0, 25)
    p = place(packed, 30, 2, 20, 0, [1, 0])
    assert p.evict == [1] and (p.base, p.cap) == (10, 20)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 30), st.integers(0, 30), st.booleans()), max_size=40))
def test_placed_ranges_never_overlap(ops):
    n_cells, n_seq = 64, 6
    ranges = [(0, 0)] * n_seq
    for seq, need, keep, idle_ok in ops:
        keep = min(keep, need, ranges[seq][1])
        idle = [i for i in range(n_seq) if i != seq and ranges[i][1] > 0] if idle_ok else []
        p = place(ranges, n_cells, seq, need, keep, idle)
        if p is None:
            continue
        for j in p.evict:
            ranges[j] = (0, 0)
        ranges[seq] = (p.base, p.cap)
        assert p.cap >= need and 0 <= p.base and p.base + p.cap <= n_cells
        spans = sorted((b, b + c) for b, c in ranges if c > 0)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), ranges


# -- the engine ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model(mixed_model) -> Model:
    return mixed_model


ids = token_ids


def alone(model, prompt: list[int], n: int) -> list[int]:
    return Session(model, n_ctx=128).generate(prompt, n, GREEDY, stop_at_eog=False).ids


def test_many_short_sequences_share_a_small_pool(model):
    """8 slots of a 128-token context in 160 cells: eight 10 + 8 token sequences run
    at once in ranges that do not overlap, each as it runs alone."""
    ctx = Context(model, n_ctx=128, n_seq=8, n_cells=160)
    assert ctx.pooled and ctx.cparams.n_ctx == 160
    eng = Engine(ctx, [ctx.session(i) for i in range(8)], chunk=32)
    seqs = [Sequence(ids(i, 10), 8, GREEDY, stop_at_eog=False) for i in range(8)]
    for i, s in enumerate(seqs):
        eng.add(s, i)
    spans = sorted((b, b + c) for b, c in ctx.ranges)
    assert all(c == 18 for _, c in ctx.ranges) and all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    eng.run()
    for i, s in enumerate(seqs):
        assert s.ids == alone(model, ids(i, 10), 8), i


def test_no_room_is_refused_before_any_change(model):
    ctx = Context(model, n_ctx=128, n_seq=3, n_cells=128)
    eng = Engine(ctx, [ctx.session(i) for i in range(3)])
    a = Sequence(ids(1, 30), 60, GREEDY, stop_at_eog=False)
    eng.add(a, 0)
    before = list(ctx.ranges)
    with pytest.raises(KvPoolFull, match="KV pool of 128 cells"):
        eng.add(Sequence(ids(2, 30), 20, GREEDY, stop_at_eog=False), 1)
    assert ctx.ranges == before and eng.free_slots() == [1, 2]
    eng.run()
    assert a.ids == alone(model, ids(1, 30), 60)
    with pytest.raises(MinferError, match="must hold one context"):
        Context(model, n_ctx=128, n_seq=2, n_cells=100)


def test_a_next_turn_that_outgrows_its_range_moves_with_its_prefix(model):
    """Turn 1 takes 20 + 6 cells; a slot after it holds the next range; turn 2 (turn 1's
    tokens plus 10) needs 46: its range moves, the kept prefix copied, and it answers as
    the whole conversation does alone, with the prefix reported cached."""
    ctx = Context(model, n_ctx=128, n_seq=2, n_cells=128)
    eng = Engine(ctx, [ctx.session(i) for i in range(2)])
    p1 = ids(3, 20)
    a = Sequence(p1, 6, GREEDY, stop_at_eog=False)
    eng.add(a, 0)
    eng.run()
    b = Sequence(ids(4, 10), 6, GREEDY, stop_at_eog=False)
    eng.add(b, 1)                      # right after slot 0's range
    eng.run()
    assert ctx.ranges[1][0] == ctx.ranges[0][0] + ctx.ranges[0][1]
    p2 = p1 + a.ids[:-1] + ids(5, 10)  # what slot 0 holds (the last pick was never fed), then more
    base0 = ctx.ranges[0][0]
    c = Sequence(p2, 20, GREEDY, stop_at_eog=False)
    eng.add(c, 0)
    assert ctx.ranges[0][0] != base0 and c.timings.cached_tokens == len(p1) + len(a.ids) - 1
    eng.run()
    assert c.ids == alone(model, p2, 20)


def test_idle_conversations_give_their_room_least_recently_used_first(model):
    ctx = Context(model, n_ctx=64, n_seq=3, n_cells=64)
    eng = Engine(ctx, [ctx.session(i) for i in range(3)])
    for slot, seed in ((0, 6), (1, 7)):
        s = Sequence(ids(seed, 20), 4, GREEDY, stop_at_eog=False)
        eng.add(s, slot)
        eng.run()
    # [0, 24) and [24, 48) held, 16 cells free: 20 more take the older one's room only.
    c = Sequence(ids(8, 10), 10, GREEDY, stop_at_eog=False)
    eng.add(c, 2)
    assert eng.slots[0].n_past == 0 and ctx.ranges[0] == (0, 0) and ctx.ranges[2] == (0, 20)
    assert eng.slots[1].n_past == 23 and ctx.ranges[1] == (24, 24)
    eng.run()
    assert c.ids == alone(model, ids(8, 10), 10)


def test_the_server_waits_for_room_and_never_overcommits(model):
    """A scheduler with 4 slots sharing 128 cells: jobs of 20 + 20 cells run three at
    a time at most, the fourth waits for one to end; every answer is the prompt's alone."""
    sched = Scheduler(model, n_slots=4, n_ctx=128, kv_cells=128, chunk=32)
    sched.start()
    peak = [0]
    real_step = sched.engine.step

    def step():
        peak[0] = max(peak[0], len(sched.engine.seqs))
        return real_step()
    sched.engine.step = step
    q: queue.Queue = queue.Queue()
    try:
        for k in range(4):
            sched.submit(Job(prompt_ids=ids(10 + k, 20), n_predict=20, sampling=GREEDY, stop_at_eog=False,
                             emit=lambda ev, k=k: q.put((k, ev))))
        out: dict = {k: [] for k in range(4)}
        left = 4
        while left:
            k, ev = q.get(timeout=120)
            if ev.kind == "token":
                out[k].append(ev.id)
            else:
                assert ev.kind == "done", ev.message
                left -= 1
    finally:
        assert sched.stop()
    assert peak[0] == 3
    for k in range(4):
        assert out[k] == alone(model, ids(10 + k, 20), 20), k
