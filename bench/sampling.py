"""The host's share of a batched step's sampled picks: one Sampler.sample per row
against one sample_rows call over the rows, side by side in one loop.

    python bench/sampling.py [--rows 1,4,16,64] [--steps 400] [--vocab 151936]

Each row's candidates come from a source that answers `best` from a selection made
beforehand, as a device's top_k_rows call answers for all rows at once, so the times
are the filters, the softmaxes and the draws alone (what a GPU step's picks cost the
host after the one selection call). Both ways draw the same ids (checked). Settings:
the CLI's defaults (top-k 40, top-p 0.95, min-p 0.05, temperature 0.8), then the same
with a repetition penalty over 64 recent tokens. Medians per step, the two ways
alternating within each step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from minfer.sampling import HostRow, Sampler, SamplingParams, sample_rows


class Selected(HostRow):
    """A row whose best candidates were selected beforehand (the device's answer)."""

    def __init__(self, row, k):
        super().__init__(row)
        self.top = np.lexsort((np.arange(self.n), -self.data))[:k]

    def best(self, k, ids):
        top = self.top[:k]
        return top, self.data[top].astype(np.float64), None if ids is None else self.data[ids].astype(np.float64)


def run(n_rows: int, steps: int, vocab: int, params: SamplingParams) -> tuple[float, float]:
    rng = np.random.default_rng(n_rows)
    rows = [Selected(rng.standard_normal(vocab).astype(np.float32) * 3, 256) for _ in range(n_rows)]
    one = [Sampler(params) for _ in range(n_rows)]
    many = [Sampler(params) for _ in range(n_rows)]
    for a, b in zip(one, many):
        for t in rng.integers(0, 1000, size=64) if params.repeat_penalty != 1.0 else ():
            a.accept(int(t))
            b.accept(int(t))
    t_one, t_many = [], []
    for i in range(steps):
        for first in ((0, 1) if i % 2 else (1, 0)):
            t0 = time.perf_counter()
            if first:
                got_one = [s.sample(r) for s, r in zip(one, rows)]
                t_one.append(time.perf_counter() - t0)
            else:
                got_many = sample_rows(many, rows)
                t_many.append(time.perf_counter() - t0)
        assert got_one == got_many, "sample_rows drew other ids than sample()"
    return statistics.median(t_one), statistics.median(t_many)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,16,64")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--vocab", type=int, default=151936)
    a = ap.parse_args()
    print(f"{'settings':<22} {'rows':>4} {'sample() each':>14} {'sample_rows':>12} {'per row':>9} {'ratio':>6}")
    for name, params in (("defaults", SamplingParams(seed=1)),
                         ("defaults + penalty", SamplingParams(seed=1, repeat_penalty=1.1))):
        for n in (int(x) for x in a.rows.split(",")):
            each, batch = run(n, a.steps, a.vocab, params)
            print(f"{name:<22} {n:>4} {each * 1e6:>11.0f} us {batch * 1e6:>9.0f} us "
                  f"{batch / n * 1e6:>6.1f} us {each / batch:>5.2f}x")


if __name__ == "__main__":
    main()
