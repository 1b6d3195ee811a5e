"""Where a CUDA decode step goes: per-launch-kind device time (CUDA events around each
launch, MINFER_CUDA_PROFILE=1, direct launches) and the weight bandwidth of matvecs.

    MINFER_CUDA_PROFILE=1 MINFER_NO_CUDA_GRAPH=1 python bench/cuda_profile.py MODEL.gguf [steps]
"""

from __future__ import annotations

import sys
import time

import numpy as np


def main() -> int:
    from minfer import _core
    from minfer.session import Session

    path = sys.argv[1]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    s = Session.open(path, n_ctx=256, backends=["cuda"])
    s.forward([1, 2, 3, 4], n_out=1)
    for t in range(3):
        s.forward([t], copy=None)
    _core.cuda_sync()
    _core.testing.cuda_profile()
    t0 = time.perf_counter()
    for t in range(steps):
        s.forward([t + 5], copy=None)
        s.argmax_last()
    wall = (time.perf_counter() - t0) / steps
    prof = _core.testing.cuda_profile()
    tot = sum(v[0] for v in prof.values()) / steps
    print(f"{path}: {steps} steps, wall {wall * 1e3:.3f} ms/step, launches timed {tot:.3f} ms/step")
    for k, (ms, n, b) in sorted(prof.items(), key=lambda kv: -kv[1][0]):
        bw = f"{b / (ms * 1e-3) / 1e9:8.1f} GB/s" if b else ""
        print(f"  {k:22s} {ms / steps:8.3f} ms/step  {n // steps:4d}/step  {ms / n * 1e3:8.1f} us each  {bw}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
