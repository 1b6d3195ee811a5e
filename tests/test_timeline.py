"""bench/timeline.py's arithmetic over in-kernel timeline records (the records themselves
come from the MINFER_CUDA_TIMELINE build on the GPU machine): phases between the marks a
record holds, the clock rate from the global timer, launches in start order."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
import timeline as tl  # noqa: E402

M = tl.M


def record(marks: dict, t0: int, t1: int, blocks: int, sm: int = 3) -> np.ndarray:
    r = np.zeros(M + 4, np.uint64)
    for i, v in marks.items():
        r[i] = v
    r[M], r[M + 1], r[M + 2], r[M + 3] = t0, t1, blocks, sm
    return r


def kinds(**by_kind) -> list:
    out = [np.zeros((0, M + 4), np.uint64) for _ in range(8)]
    for k, rows in by_kind.items():
        out[int(k[1:])] = np.stack(rows)
    return out


def test_phases_between_the_marks_each_record_holds():
    # Matvec launches of one grid size: two wait after their rows' loads (marks 0, 1, 3),
    # two before them (0, 1, 2, 3). Clocks at 2 GHz: 2,000 cycles over 1,000 ns.
    rows = [record({0: 1000, 1: 1200, 3: 3000}, 0, 1000, 224),
            record({0: 1000, 1: 1300, 3: 3000}, 5000, 6000, 224),
            record({0: 1000, 1: 1100, 2: 1500, 3: 3000}, 9000, 10000, 224),
            record({0: 1000, 1: 1100, 2: 1700, 3: 3000}, 12000, 13000, 224)]
    [line] = tl.summarize(kinds(k2=rows))
    assert line.startswith("matvec ") and "blocks   224 n     4" in line
    assert "total 2,000 cyc (1.00 us, 2.00 GHz)" in line
    assert "pre-wait 150," in line  # mark 0 -> 1 in all four
    assert "wait 500 (n 2)" in line  # 1 -> 2 in the two that have mark 2
    assert "wait+rows 1,750 (n 2)" in line  # 1 -> 3 where mark 2 is missing
    assert "rows 1,400 (n 2)" in line


def test_grid_sizes_are_apart():
    a = record({0: 10, 1: 20}, 0, 100, 19)
    b = record({0: 10, 1: 30}, 0, 100, 74)
    lines = tl.summarize(kinds(k5=[a, b]))
    assert [ln.split()[2] for ln in lines] == ["19", "74"]


def test_launches_in_start_order_with_the_wait_placed_by_the_clock():
    # A norm (kind 4) then a q|k|v launch (kind 1) that waits 2 us after its start.
    norm = record({0: 100, 1: 200, 2: 2100, 7: 4100}, 10_000, 12_000, 1, 5)
    qkv = record({0: 1, 1: 1001, 2: 4001, 3: 6001}, 10_500, 13_500, 288, 9)
    lines = tl.one_layer(kinds(k4=[norm], k1=[qkv]), 4)
    assert len(lines) == 2
    assert "rms_norm" in lines[0] and "start +   0.00" in lines[0] and "end +   2.00" in lines[0]
    # The norm's clock runs 2 cycles a ns: its wait returned 1.0 us after its start.
    assert "waited +   1.00" in lines[0]
    assert "q|k|v+rope" in lines[1] and "start +   0.50" in lines[1] and "waited +   2.50" in lines[1]
