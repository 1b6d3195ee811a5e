"""K-quant (Q4_K, Q5_K, Q6_K) prefill on the AMX tiles against the vector (VNNI) kernel,
in one process, alternating: `minfer`'s prefill of 512 random tokens through MODEL with the tiles on
and off (`_core.testing.cpu_set_amx`, the switch the tests use), ROUNDS rounds.

    python bench/amx_prefill.py MODEL.gguf [-t THREADS] [--rounds 3] [-n 512]

Prints each round's tok/s and the medians. On a build or machine without AMX both
columns run the vector kernel (the script says so).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", "--tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    from minfer import _core
    from minfer.session import Session

    if not _core.testing.cpu_amx_available():
        print("(no AMX in this build or on this machine: both columns are the vector kernel)")
    s = Session.open(a.model, n_ctx=a.tokens + 16, n_threads=a.threads)
    toks = [int(t) for t in np.random.default_rng(0).integers(100, min(20000, s.model.hp.n_vocab), a.tokens)]
    s.forward(toks[:32], n_out=1)  # warm-up: graphs built, weights repacked
    got: dict = {True: [], False: []}
    try:
        for r in range(a.rounds):
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                _core.testing.cpu_set_amx(on)
                s.reset()
                t0 = time.perf_counter()
                s.forward(toks, n_out=1)
                got[on].append(a.tokens / (time.perf_counter() - t0))
    finally:
        _core.testing.cpu_set_amx(True)
    for on, name in ((True, "AMX tiles"), (False, "vector")):
        print(f"{name:>10}: pp{a.tokens} {statistics.median(got[on]):8.1f} tok/s  (rounds {[round(x, 1) for x in got[on]]})")
    print(f"ratio {statistics.median(got[True]) / statistics.median(got[False]):.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
