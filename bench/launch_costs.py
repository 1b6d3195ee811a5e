"""What each launch kind of a CUDA decode step costs inside the replayed graph, where
programmatic dependent launch overlaps every launch with its neighbours (the stamps of
`bench/cuda_profile.py --stamp` break that overlap, and overstate short launches).

    python bench/launch_costs.py MODEL.gguf [MODEL ...] [--rounds 2] [--reps 3] [--kinds a,b]

Per model: the launch kinds of a decode step and how many of each (one profiled direct
step), then tg128 (`minfer bench -p 0 -n 128`) with the defaults, with each kind left out
(MINFER_CUDA_DIAG_SKIP=KIND) and with an empty kernel in its place (null:KIND), the
variants alternating within each round. A kind's cost per launch is the step time its
absence saves, over its count, the median of the rounds' paired differences: left out,
its work and its launch boundary; null, its own work. Leaving a launch out makes the
logits wrong (the diagnostic says so on stderr); only the time is read.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

DIAG = "MINFER_CUDA_DIAG_SKIP"

# One profiled step's launches by kind (direct launches, MINFER_CUDA_PROFILE=1), as the
# tg loop runs it: a one-token forward, logits read back.
_COUNTS = """
import json, sys
from minfer import _core
from minfer.session import Session
s = Session.open(sys.argv[1], n_ctx=64, backends=["cuda"])
s.forward([1, 2, 3, 4], n_out=1)
for t in range(3):
    s.forward([t + 5], copy=False)
_core.cuda_sync()
_core.testing.cuda_profile()
for t in range(4):
    s.forward([t + 9], copy=False)
_core.cuda_sync()
prof = _core.testing.cuda_profile()
print(json.dumps({k: v[1] / 4 for k, v in prof.items() if not k.startswith((" ", "graph: "))}))
"""


def launch_counts(model: str) -> dict[str, float]:
    env = {**os.environ, "MINFER_CUDA_PROFILE": "1", "MINFER_NO_CUDA_GRAPH": "1"}
    out = subprocess.run([sys.executable, "-c", _COUNTS, model], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def tg128(model: str, skip: str, reps: int) -> float:
    """Median tok/s of `minfer bench -p 0 -n 128` with MINFER_CUDA_DIAG_SKIP=skip."""
    env = {**os.environ, DIAG: skip}
    out = subprocess.run([sys.executable, "-m", "minfer.cli", "bench", model, "--backend", "cuda", "-p", "0",
                          "-n", "128", "-r", str(reps), "-o", "json"], env=env, capture_output=True, text=True,
                         check=True)
    return statistics.median(json.loads(out.stdout)[0]["samples_ts"])


def variants(kinds: list[str]) -> list[str]:
    return ["", *kinds, *(f"null:{k}" for k in kinds)]


def per_launch_us(base_ts: list[float], var_ts: list[float], count: float) -> float:
    """Median over rounds of (step time with the kind - step time without) / count, in
    microseconds; base_ts[i] and var_ts[i] come from the same round."""
    return statistics.median((1e6 / b - 1e6 / v) / count for b, v in zip(base_ts, var_ts))


def table(counts: dict[str, float], tgs: dict[str, list[float]]) -> list[dict]:
    """Rows per kind: launches a step, us a launch left out and as an empty kernel, and
    the boundary (left out - null). tgs: variant -> tok/s per round ("" = defaults)."""
    base = tgs[""]
    rows = []
    for kind, n in counts.items():
        row = {"kind": kind, "count": n}
        for key, var in (("left_out_us", kind), ("own_work_us", f"null:{kind}")):
            row[key] = per_launch_us(base, tgs[var], n) if var in tgs else None
        lo, nu = row["left_out_us"], row["own_work_us"]
        row["boundary_us"] = lo - nu if lo is not None and nu is not None else None
        rows.append(row)
    rows.sort(key=lambda r: -(r["left_out_us"] or 0.0) * r["count"])
    return rows


def render(model: str, base: list[float], rows: list[dict]) -> str:
    f = lambda v: "" if v is None else f"{v:.2f}"  # noqa: E731
    lines = [f"{model}: tg128 defaults {', '.join(f'{t:.1f}' for t in base)} tok/s",
             f"  {'launch kind':28s} {'a step':>7s} {'left out us':>12s} {'own work us':>12s} {'boundary us':>12s}"]
    for r in rows:
        lines.append(f"  {r['kind']:28s} {r['count']:7.1f} {f(r['left_out_us']):>12s} {f(r['own_work_us']):>12s} "
                     f"{f(r['boundary_us']):>12s}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--kinds", default=None, help="comma-separated launch kinds (default: every kind but argmax)")
    a = ap.parse_args()
    for model in a.models:
        counts = launch_counts(model)
        if a.kinds:
            counts = {k: counts[k] for k in a.kinds.split(",") if k in counts}
        counts = {k: n for k, n in counts.items() if n > 0 and k != "argmax"}
        tgs: dict[str, list[float]] = {v: [] for v in variants(list(counts))}
        for _ in range(a.rounds):
            for v in tgs:
                tgs[v].append(tg128(model, v, a.reps))
        print(render(model, tgs[""], table(counts, tgs)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
