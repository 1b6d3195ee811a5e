"""Where a decode step's wall time goes outside the replayed graph, on CUDA: the same
positions run four ways, medians per step (µs).

    python bench/host_gap.py MODEL.gguf [--steps 128] [--rounds 3]

- tg: `forward([t], copy=False)` as `minfer bench` times tg (the logits read back);
- greedy: `forward([t], copy=None)` then the device argmax (4 bytes back), as generation runs;
- synced: `forward([t], copy=None)` then a stream sync (nothing read back);
- ahead: `forward([t], copy=None)` for every step, one sync at the end: the host runs
  ahead, so this is the replay's device time (inputs' H2D included) with no idle gap.

tg - ahead is what a bench step spends with the GPU idle: the logits' D2H, the host's
turnaround (wake-up, Python, the inputs' H2D and graph launch) and the launch latency.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    from minfer import _core
    from minfer.session import Session

    s = Session.open(a.model, n_ctx=a.steps + 64, backends=["cuda"])
    n = a.steps

    def start():
        s.reset()
        s.forward([1], copy=None)
        s.forward([2], copy=None)  # the decode graph: built, run directly, captured
        s.forward([3], copy=None)
        _core.cuda_sync()

    def per_step(step) -> float:
        """Median wall of step(i) over the n steps after start()."""
        start()
        out = []
        for i in range(n):
            t0 = time.perf_counter()
            step(i)
            out.append(time.perf_counter() - t0)
        return statistics.median(out)

    def tg():
        return per_step(lambda i: s.forward([4 + i], copy=False))

    picked = [4]

    def greedy():
        def step(i):
            s.forward([picked[0]], copy=None)
            picked[0] = s.argmax_last() % 1000
        picked[0] = 4
        return per_step(step)

    enq = []

    def synced():
        def step(i):
            t0 = time.perf_counter()
            s.forward([4 + i], copy=None)
            enq.append(time.perf_counter() - t0)
            _core.cuda_sync()
        return per_step(step)

    def ahead():
        start()
        t0 = time.perf_counter()
        for i in range(n):
            s.forward([4 + i], copy=None)
        _core.cuda_sync()
        return (time.perf_counter() - t0) / n

    kinds = {"tg": tg, "greedy": greedy, "synced": synced, "ahead": ahead}
    res = {k: [] for k in kinds}
    for _ in range(a.rounds):
        for k, fn in kinds.items():
            res[k].append(fn() * 1e6)
    med = {k: statistics.median(v) for k, v in res.items()}
    print(f"{a.model}: per step (us, median of {a.rounds} rounds of {n} steps): "
          + ", ".join(f"{k} {v:.1f}" for k, v in med.items())
          + f"; tg - ahead {med['tg'] - med['ahead']:.1f}, greedy - ahead {med['greedy'] - med['ahead']:.1f},"
          f" tg - synced (the logits' D2H) {med['tg'] - med['synced']:.1f}; synced's enqueue (forward) "
          f"{statistics.median(enq) * 1e6:.1f}")
    # The C++ floor around the same capture: no Python between the wait and the launch.
    ctx = s.context
    start()
    for i in range(8):
        s.forward([4 + i], copy=None)
    _core.cuda_sync()
    plan = ctx.cache.lowered.splits[0].plan
    _, dev, bid = ctx.cache.alloc.input_buffers()["token_ids"]
    r = _core.testing.cuda_replay_probe(plan, dev.pool, bid, 128)
    nb = 4 * s.model.hp.n_vocab
    d = _core.testing.cuda_d2h_probe(nb, 64)
    print(f"{a.model}: a {nb}-byte D2H + wait (us, medians of 64): copy engine {d[0]:.1f}, SM copy with 132 / 264 / "
          f"528 blocks {d[1]:.1f} / {d[2]:.1f} / {d[3]:.1f}")
    print(f"{a.model}: C++ around the capture (us, medians of 128): launch+sync {r[0]:.1f}, "
          f"H2D+launch+sync {r[1]:.1f}, H2D+sync {r[2]:.1f}, launched ahead {r[3]:.1f}")


if __name__ == "__main__":
    main()
