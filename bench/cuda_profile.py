"""Where a CUDA decode step goes: per-launch-kind device time (CUDA events around each
launch, MINFER_CUDA_PROFILE=1, direct launches) and the weight bandwidth of matvecs.

    MINFER_CUDA_PROFILE=1 MINFER_NO_CUDA_GRAPH=1 python bench/cuda_profile.py MODEL.gguf [steps] [--prefill N]

--prefill N profiles `steps` prefills of N tokens (each into a fresh context) instead of
decode steps; entries starting with "  gemm:" are parts of the "gemm" entry, except
"  gemm: dequant (side stream)": the weight dequantizations that the GEMM pipeline runs
on the side stream, overlapped with the main stream ("  gemm: dequant wait" is what the
main stream stalls on them; a GEMM of a partial run, which dequantizes in line, books
"  gemm: dequant").

--stamp (MINFER_CUDA_STAMP=1, graphs on) times the launches inside the replayed graph
instead: a one-thread kernel after each launch writes the device clock once the launch
has finished, so "graph: X" is X's share of a replay with its real neighbours (PDL
overlap included), plus one stamp's cost ("graph: (stamp)", booked apart). Use it
without MINFER_CUDA_PROFILE and MINFER_NO_CUDA_GRAPH.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np


def main() -> int:
    from minfer import _core
    from minfer.session import Session

    args = sys.argv[1:]
    if "--stamp" in args:
        args.remove("--stamp")
        os.environ["MINFER_CUDA_STAMP"] = "1"
    at = 4  # decode steps start after a prompt of this many tokens (--at N)
    if "--at" in args:
        k = args.index("--at")
        at = int(args[k + 1])
        del args[k:k + 2]
    prefill = 0
    if "--prefill" in args:
        k = args.index("--prefill")
        prefill = int(args[k + 1])
        del args[k:k + 2]
    path = args[0]
    steps = int(args[1]) if len(args) > 1 else 16
    if prefill:
        return profile_prefill(path, steps, prefill)
    s = Session.open(path, n_ctx=at + steps + 64, backends=["cuda"])
    s.forward([(7 * i + 3) % 1000 + 10 for i in range(at)], n_out=1)
    for t in range(3):
        s.forward([t], copy=None)
    _core.cuda_sync()
    _core.testing.cuda_profile()
    t0 = time.perf_counter()
    for t in range(steps):
        s.forward([t + 5], copy=None)
        s.argmax_last()
    wall = (time.perf_counter() - t0) / steps
    report(path, f"{steps} steps", steps, wall, _core.testing.cuda_profile())
    return 0


def profile_prefill(path: str, reps: int, n: int) -> int:
    from minfer import _core
    from minfer.session import Session

    s = Session.open(path, n_ctx=n + 8, backends=["cuda"])
    toks = [(7 * i + 3) % 1000 + 10 for i in range(n)]
    s.forward(toks, n_out=1)  # warm: plans, cuBLAS heuristics, scratch
    _core.cuda_sync()
    _core.testing.cuda_profile()
    t0 = time.perf_counter()
    for _ in range(reps):
        s.reset()
        s.forward(toks, n_out=1)
    _core.cuda_sync()
    wall = (time.perf_counter() - t0) / reps
    report(path, f"prefill {n} x {reps}", reps, wall, _core.testing.cuda_profile())
    return 0


def report(path: str, what: str, steps: int, wall: float, prof: dict) -> None:
    if "graph: (whole run)" in prof:
        steps = max(1, prof["graph: (whole run)"][1])  # stamps come from replays only, not the capture
    tot = sum(v[0] for k, v in prof.items() if not k.startswith((" ", "graph: ("))) / steps
    print(f"{path}: {what}, wall {wall * 1e3:.3f} ms/step, launches timed {tot:.3f} ms/step")
    for k, (ms, n, b) in sorted(prof.items(), key=lambda kv: -kv[1][0]):
        bw = f"{b / (ms * 1e-3) / 1e9:8.1f} GB/s" if b else ""
        each = f"{ms / n * 1e3:8.1f} us each" if n else ""
        print(f"  {k:30s} {ms / steps:8.3f} ms/step  {n // steps:4d}/step  {each}  {bw}")


if __name__ == "__main__":
    raise SystemExit(main())
