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
