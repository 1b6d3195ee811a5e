"""Python overhead of a reused decode step as the generation loop runs it (forward with
nothing read back, then the greedy pick, checked for NaN/Inf): the time spent outside `_core.run`
(reuse check, input fills, the greedy pick) as a fraction of the step.

    python bench/python_overhead.py [MODEL] [--steps 64] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

from minfer.session import Session


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--ctx", type=int, default=512)
    a = ap.parse_args()
    if a.model is None:
        from minfer.io.model_cache import default_model_path
        a.model = default_model_path(pull=True, progress=True)
    eng = Session.open(a.model, n_ctx=a.ctx, n_threads=a.threads)
    eng.forward(list(range(100, 116)))
    eng.forward([7])  # builds the decode graph; later steps reuse it

    # Wrap what the scheduler calls per split (the plan bound to its device) and the
    # backend's greedy pick: both are C++ and count as inside.
    inside = []

    def timed(fn):
        def wrapper(*args):
            t = time.perf_counter()
            r = fn(*args)
            inside.append(time.perf_counter() - t)
            return r
        return wrapper

    cache = eng.context.cache
    for ls in cache.lowered.splits:
        ls.run = timed(ls.run)
    for dev in cache.alloc.devices.values():
        dev.argmax = timed(dev.argmax)
    totals, outs = [], []
    tok = 200
    for i in range(a.steps):
        inside.clear()
        t = time.perf_counter()
        eng.forward([tok], copy=None)
        tok = eng.argmax_last(i + 1)  # what Session.stream does for greedy decoding
        total = time.perf_counter() - t
        totals.append(total)
        outs.append(total - sum(inside))
    builds = eng.builds
    med_total, med_out = statistics.median(totals), statistics.median(outs)
    print(f"decode step: median {med_total * 1e3:.3f} ms, outside _core {med_out * 1e6:.1f} us "
          f"({100 * med_out / med_total:.2f}% of the step), graph builds {builds}")


if __name__ == "__main__":
    main()
