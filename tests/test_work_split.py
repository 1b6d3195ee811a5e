"""The repacked matmul's thread split (csrc/cpu/work_split.h), simulated for thread counts
this machine does not have: every (row, token) is computed by exactly one thread, and the
shares of (16-row group, token tile) items differ by at most one, so 16 threads all work
on the default model's 896- and 128-row matrices in a 512-token prefill."""

import numpy as np
import pytest

from minfer import _core

SHAPES = [(896, 512), (128, 512), (4864, 512), (896, 1), (37, 9), (151936, 1), (17, 3)]


def items(rect, tile):
    r0, r1, t0, t1 = rect
    return ((r1 - r0 + 15) // 16) * ((t1 - t0 + tile - 1) // tile)


@pytest.mark.parametrize("out,nt", SHAPES)
@pytest.mark.parametrize("nth", [1, 2, 3, 4, 8, 16, 64])
def test_split_covers_every_result_once_and_balances(out, nt, nth):
    tile = 8
    split = _core.testing.matmul_split(out, nt, tile, nth)
    assert len(split) == nth
    seen = np.zeros((nt, out), np.int32)
    counts = []
    for rects in split:
        assert len(rects) <= 3
        n = 0
        for r0, r1, t0, t1 in rects:
            assert r0 % 16 == 0 and t0 % tile == 0  # whole groups and tiles (bitwise contract)
            assert 0 <= r0 < r1 <= out and 0 <= t0 < t1 <= nt
            seen[t0:t1, r0:r1] += 1
            n += items((r0, r1, t0, t1), tile)
        counts.append(n)
    assert np.all(seen == 1)
    assert max(counts) - min(counts) <= 1, counts
    n_items = ((out + 15) // 16) * ((nt + tile - 1) // tile)
    assert sum(counts) == n_items


def test_sixteen_threads_all_busy_in_prefill():
    for out in (896, 128):
        counts = [sum(items(r, 8) for r in rects) for rects in _core.testing.matmul_split(out, 512, 8, 16)]
        assert min(counts) > 0 and max(counts) * 16 <= sum(counts) + 16


def check_walk(pieces, out, nt, tile):
    seen = np.zeros((nt, out), np.int32)
    for per_thread in pieces:
        for r0, r1, t0, t1, _ in per_thread:
            assert r0 % 16 == 0 and t0 % tile == 0  # whole groups and tiles (bitwise contract)
            assert 0 <= r0 < r1 <= out and 0 <= t0 < t1 <= nt
            seen[t0:t1, r0:r1] += 1
    assert np.all(seen == 1)  # every (row, token) computed exactly once


def static_cover(out, nt, tile, nth, ith):
    m = np.zeros((nt, out), bool)
    for r0, r1, t0, t1 in _core.testing.matmul_split(out, nt, tile, nth)[ith]:
        m[t0:t1, r0:r1] = True
    return m


@pytest.mark.parametrize("out,nt", [(896, 512), (128, 512), (4864, 512), (896, 1), (37, 9), (17, 3), (40, 64)])
@pytest.mark.parametrize("nth", [2, 3, 5])
def test_stealing_walk_covers_every_result_once(out, nt, nth):
    tile = 8
    pieces = _core.testing.steal_walk(out, nt, tile, nth)
    check_walk(pieces, out, nt, tile)
    # What a thread computes as its own lies in its static run.
    for ith, per_thread in enumerate(pieces):
        mine = static_cover(out, nt, tile, nth, ith)
        for r0, r1, t0, t1, stolen in per_thread:
            if not stolen:
                assert mine[t0:t1, r0:r1].all()


def test_prefill_pieces_are_token_slabs_of_the_whole_run():
    # 4 token tiles or more: a piece spans all the rows of its run and an eighth of the
    # tokens, so the activations of a slab are read once for all of those rows.
    out, nt, tile = 896, 512, 8
    (alone,) = _core.testing.steal_walk(out, nt, tile, 1)
    assert [p[:4] for p in alone] == [(0, out, t0, t0 + 64) for t0 in range(0, nt, 64)]
    nth = 4
    for ith, per_thread in enumerate(_core.testing.steal_walk(out, nt, tile, nth)):
        run_rows = {(r[0], r[1]) for r in _core.testing.matmul_split(out, nt, tile, nth)[ith]}
        for r0, r1, t0, t1, stolen in per_thread:
            if not stolen:  # (a thread that started late may have none of its own left)
                assert (r0, r1) in run_rows and t1 - t0 <= 64


def test_a_late_thread_has_its_run_taken_by_the_others():
    out, nt, tile, nth = 896, 512, 8, 3
    pieces = _core.testing.steal_walk(out, nt, tile, nth, slow=1, delay_ms=100.0)
    check_walk(pieces, out, nt, tile)
    slow_run = static_cover(out, nt, tile, nth, 1)
    taken = np.zeros_like(slow_run)
    for t, per_thread in enumerate(pieces):
        if t != 1:
            for r0, r1, t0, t1, stolen in per_thread:
                if stolen:
                    taken[t0:t1, r0:r1] = True
    # The other two finish their own runs in microseconds and then take the late one's.
    assert (taken & slow_run).sum() >= slow_run.sum() // 2
