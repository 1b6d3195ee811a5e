"""Where a CPU prefill's threads spend their time, per op: computing or waiting at barriers.

    python bench/cpu_balance.py [MODEL] [-p 512] [-t 16] [-r 3] [--json]

Runs `-r` prefills of `-p` tokens (after one warm-up) with MINFER_CPU_STATS=1, which makes
the executor time every step on every thread (csrc/cpu/step_stats.h), and prints per op:
steps per prefill, thread-time computing (summed over threads), the critical path (per step
the slowest thread, summed), balance = thread-time / (threads x critical path) (1.0: every
thread busy for the whole step; 1/threads: one thread works while the rest wait),
thread-time waiting at barriers, and how many pieces of other threads' runs the repacked
matmuls stole. "quantize" is the matmuls' activation quantization, split
out of "matmul". The summary line says how many barriers a prefill crosses and what
fraction of all thread-time went to waiting; comparing the critical path at 1 and at N
threads separates work that no longer scales (slower threads: clocks, memory) from time
lost between threads (imbalance, serial steps, wake-ups).

MODEL defaults to the cached default model; the timing itself adds ~4 clock reads per step
and thread, so compare wall times with a run without it (`minfer bench`), not with this.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ["MINFER_CPU_STATS"] = "1"  # read once, at the first run: before anything runs

import numpy as np  # noqa: E402

from minfer import _core  # noqa: E402
from minfer.session import Session  # noqa: E402


def measure(model: str, n_prompt: int, threads: int, reps: int) -> dict:
    s = Session.open(model, n_ctx=n_prompt + 8, n_threads=threads)
    n_vocab = s.hp.n_vocab
    ids = np.random.default_rng(0).integers(min(100, n_vocab - 1), min(1000, n_vocab), n_prompt).tolist()
    s.forward(ids)  # warm-up: graph, repacking, first-touch page faults
    s.reset()
    _core.testing.cpu_stats(True)
    for _ in range(reps):
        s.forward(ids)
        s.reset()
    st = _core.testing.cpu_stats(True)
    if not st["enabled"]:
        raise SystemExit("cpu_balance: the core did not collect stats (MINFER_CPU_STATS was read before this script set it)")
    return st


def report(st: dict, reps: int, n_prompt: int) -> str:
    nth, per = st["threads"], 1.0 / reps
    wall = st["wall_s"] * per
    lines = [f"{n_prompt}-token prefill, {nth} threads, {st['runs'] / reps:.0f} core call(s) per prefill, "
             f"wall in the core {wall * 1e3:.1f} ms ({n_prompt / wall:.1f} t/s), "
             f"{st['barriers'] / reps:.0f} barriers per prefill",
             "",
             "| op | steps | thread-time ms | critical path ms | balance | barrier wait ms (thread-time) | pieces stolen |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    ops = sorted(st["ops"].items(), key=lambda kv: -kv[1]["crit_s"])
    tot_work = tot_crit = tot_wait = 0.0
    for name, o in ops:
        work, crit, wait = o["work_s"] * per, o["crit_s"] * per, o["wait_s"] * per
        bal = work / (nth * crit) if crit > 0 else 1.0
        tot_work, tot_crit, tot_wait = tot_work + work, tot_crit + crit, tot_wait + wait
        lines.append(f"| {name} | {o['steps'] * per:.0f} | {work * 1e3:.1f} | {crit * 1e3:.2f} | {bal:.2f} | "
                     f"{wait * 1e3:.1f} | {o['stolen'] * per:.0f} |")
    lines.append("")
    lines.append(f"critical path {tot_crit * 1e3:.1f} ms of {wall * 1e3:.1f} ms wall; thread-time: "
                 f"{tot_work / (nth * wall):.0%} computing, {tot_wait / (nth * wall):.0%} waiting at barriers")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("-p", "--n-prompt", type=int, default=512)
    ap.add_argument("-t", "--threads", default="2", help="comma-separated thread counts")
    ap.add_argument("-r", "--reps", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.n_prompt < 1 or a.reps < 1:
        print("cpu_balance: -p and -r must be at least 1", file=sys.stderr)
        return 2
    try:
        threads = [int(x) for x in a.threads.split(",")]
    except ValueError:
        print(f"cpu_balance: bad --threads {a.threads!r}", file=sys.stderr)
        return 2
    model = a.model
    if model is None:
        from minfer.io.model_cache import default_model_path
        model = str(default_model_path())
    out = []
    for t in threads:
        st = measure(model, a.n_prompt, t, a.reps)
        if a.json:
            out.append({"threads": t, "n_prompt": a.n_prompt, "reps": a.reps, **st})
        else:
            print(report(st, a.reps, a.n_prompt), flush=True)
            print(flush=True)
    if a.json:
        print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
