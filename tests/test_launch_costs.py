"""bench/launch_costs.py's arithmetic: a launch kind's cost is the step time its absence
saves over its count, paired round by round (the device runs are the GPU machine's)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
import launch_costs as lc  # noqa: E402


def test_variants_put_the_defaults_first():
    assert lc.variants(["attn", "rms_norm_copy"]) == ["", "attn", "rms_norm_copy", "null:attn", "null:rms_norm_copy"]


def test_per_launch_cost_pairs_rounds():
    # Round 1: 1000 -> 800 us a step, round 2 (a slower machine): 2000 -> 1600; 24 launches.
    got = lc.per_launch_us([1000.0, 500.0], [1250.0, 625.0], 24)
    assert got == pytest.approx((200 + 400) / 2 / 24)


def test_table_rows_and_boundary():
    counts = {"rms_norm_copy": 49, "attn": 24}
    tgs = {"": [1000.0, 1000.0], "attn": [1250.0, 1250.0], "null:attn": [1200.0, 1200.0],
           "rms_norm_copy": [1000.0, 1000.0]}
    rows = lc.table(counts, tgs)
    assert [r["kind"] for r in rows] == ["attn", "rms_norm_copy"]  # the costliest first
    attn, norm = rows
    assert attn["left_out_us"] == pytest.approx(200 / 24)
    assert attn["own_work_us"] == pytest.approx((1000 - 1e6 / 1200) / 24)
    assert attn["boundary_us"] == pytest.approx(attn["left_out_us"] - attn["own_work_us"])
    assert norm["left_out_us"] == pytest.approx(0.0)
    assert norm["own_work_us"] is None and norm["boundary_us"] is None
    text = lc.render("m.gguf", tgs[""], rows)
    assert "8.33" in text and "attn" in text.splitlines()[2]
