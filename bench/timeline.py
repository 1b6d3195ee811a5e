"""Inside the launches of a replayed decode step, on CUDA: the in-kernel timeline of a
diagnostic build (csrc/cuda/timeline.h), built with

    pip install --no-build-isolation -C cmake.define.MINFER_CUDA=ON \\
        -C cmake.define.MINFER_CUDA_TIMELINE=ON .

    python bench/timeline.py MODEL.gguf [--steps 128]

Thread 0 of block (0, 0) of each instrumented launch notes the SM clock at its marks.
The steps run as `minfer bench` times tg (logits read back). Printed: per kind and grid
size, the median clock cycles between consecutive marks (and ns at the clock the marks
themselves measure), then one layer of one step in order, each launch's block (0, 0)
from its start on the global timer.
"""

from __future__ import annotations

import argparse

import numpy as np

KINDS = {
    0: ("attention", ["pre-wait", "wait", "q to smem", "barrier", "first group", "more groups", "merge barrier",
                      "merge+store", "int8"]),
    1: ("q|k|v+rope", ["pre-wait", "wait", "rows", "rope tail"]),
    2: ("matvec", ["pre-wait", "wait", "rows", "-", "int8 tail"]),
    3: ("matvec staged", ["pre-wait", "wait", "first slot", "first row", "the rest"]),
    4: ("rms_norm", ["pre-wait", "wait", "load+sums(+copy)", "barrier", "scale|copy", "barrier", "y"]),
    5: ("quant", ["wait", "quant"]),
}
M = 10  # marks per record (csrc/cuda/timeline.h kMarks)


def summarize(recs: list) -> list[str]:
    lines = []
    ghz = []
    for k, arr in enumerate(recs):
        if k not in KINDS or len(arr) == 0:
            continue
        name, labels = KINDS[k]
        for blocks in sorted(set(arr[:, M + 2].tolist())):
            a = arr[arr[:, M + 2] == blocks]
            marks = a[:, :M].astype(np.int64)
            ns = (a[:, M + 1] - a[:, M]).astype(np.float64)
            last = np.array([max(i for i in range(M) if r[i]) for r in marks])
            cyc = np.array([r[j] - r[0] for r, j in zip(marks, last)], dtype=np.float64)
            ok = ns > 0
            rate = float(np.median(cyc[ok] / ns[ok])) if ok.any() else float("nan")
            ghz.append(rate)
            # Each record's phases between its consecutive marks (a launch shape may skip
            # some: the early-weights matvecs wait inside their rows), by (from, to).
            spans: dict = {}
            for r in marks:
                have = [i for i in range(M) if r[i]]
                for p0, p1 in zip(have, have[1:]):
                    spans.setdefault((p0, p1), []).append(r[p1] - r[p0])
            parts = []
            for (p0, p1), v in sorted(spans.items()):
                label = "+".join(labels[i - 1] if i - 1 < len(labels) else f"m{i}" for i in range(p0 + 1, p1 + 1))
                parts.append(f"{label} {np.median(v):,.0f}" + ("" if len(v) == len(marks) else f" (n {len(v)})"))
            lines.append(f"{name:14s} blocks {int(blocks):5d} n {len(a):5d}  total {np.median(cyc):,.0f} cyc"
                         f" ({np.median(ns) / 1000:.2f} us, {rate:.2f} GHz): " + ", ".join(parts))
    return lines


WAIT_MARK = {0: 2, 1: 2, 2: 2, 3: 2, 4: 2, 5: 1}  # the mark just after pdl_wait()


def one_layer(recs: list, n: int = 20) -> list[str]:
    """n launches in start order from the middle of the records (or the last n): block
    (0, 0)'s start, its wait's return and its end on the global timer (the wait's return
    placed by the SM clock at the launch's own rate), relative to the first one's start.
    A clock of 0 is a mark not reached."""
    rows = []
    for k, arr in enumerate(recs):
        if k not in KINDS:
            continue
        for r in arr:
            m = r[:M].astype(np.int64)
            last = max(i for i in range(M) if m[i])
            ns = float(r[M + 1] - r[M])
            rate = (m[last] - m[0]) / ns if ns > 0 else float("nan")
            waited = r[M] + (m[WAIT_MARK[k]] - m[0]) / rate if rate == rate and m[WAIT_MARK[k]] else float("nan")
            rows.append((int(r[M]), waited, int(r[M + 1]), KINDS[k][0], int(r[M + 2]), int(r[M + 3])))
    if not rows:
        return []
    rows.sort()
    first = min(len(rows) // 2, max(0, len(rows) - n))
    t00 = rows[first][0]
    out = []
    for t0, tw, t1, name, blocks, sm in rows[first:first + n]:
        out.append(f"  start +{(t0 - t00) / 1000:7.2f}  waited +{(tw - t00) / 1000:7.2f}  end +{(t1 - t00) / 1000:7.2f} us"
                   f"  {name:14s} blocks {blocks:5d} sm {sm:3d}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--steps", type=int, default=128)
    a = ap.parse_args()
    from minfer import _core
    from minfer.session import Session

    if _core.testing.cuda_timeline(True) is None:
        raise SystemExit("timeline.py: this build has no timeline (MINFER_CUDA_TIMELINE=ON)")
    s = Session.open(a.model, n_ctx=a.steps + 64, backends=["cuda"])
    s.forward([1], copy=None)
    s.forward([2], copy=None)
    s.forward([3], copy=None)
    _core.cuda_sync()
    _core.testing.cuda_timeline(True)
    for i in range(a.steps):
        s.forward([4 + i], copy=False)
    recs = _core.testing.cuda_timeline(True)
    print(f"# {a.model}: {a.steps} tg steps, block (0, 0) of each launch, median clock cycles per phase")
    for line in summarize(recs):
        print(line)
    print("# launches in order from the middle of the records (global timer):")
    for line in one_layer(recs, 24):
        print(line)


if __name__ == "__main__":
    main()
