"""Microbenchmark of the quantized matmul kernel: MATMUL plans through _core.

    PYTHONPATH=python [MINFER_CORE_DIR=/tmp/build-x] python3 bench/quant_dot.py \
        [--types Q5_0,Q8_0] [--threads 2] [--nt 1,4,32] [--cold] [--cpu-time]

Decode (nt=1) is memory-bound: the useful figure is weight GB/s. Prefill (nt>1) is
compute-bound: GOP/s counts 2*in*out*nt operations.

Warm mode (default) runs one weight matrix over and over, so it sits in L2/L3: it
measures the kernel's compute ceiling. --cold chains enough distinct copies of the
matrix in one plan (all reading the same input, as sibling matmuls do in a decode step)
that their total exceeds the last-level cache several times over, so every weight byte
comes from DRAM, as it does in real decoding.

Timing: with one thread the work runs on the calling thread, whose CPU time is immune
to other processes taking the core; with more threads wall time is the only honest
clock, so run those on an idle machine (or pass --cpu-time to report process CPU time
per thread, which ignores time spent waiting for a preempted worker).
"""

import argparse
import os
import time

import numpy as np
import gguf

from minfer import _core

Q = gguf.GGMLQuantizationType
COLD_BYTES = 160 << 20  # ~5x a 32 MiB L3


def weight_bytes(qtype, rows, cols, rng):
    if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):  # gguf cannot quantize K types: random blocks
        bs, ts = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(rows, cols // bs * ts), dtype=np.uint8)
        # Keep the f16 block scales finite and small (random bytes can be inf/NaN).
        scale_off = {Q.Q4_K: (0, 4), Q.Q5_K: (0, 4), Q.Q6_K: (ts - 2, ts)}[qtype]
        blocks = raw.reshape(rows, -1, ts)
        d = (rng.standard_normal(blocks.shape[:2] + ((scale_off[1] - scale_off[0]) // 2,)) * 1e-3)
        blocks[:, :, scale_off[0]:scale_off[1]] = d.astype(np.float16).view(np.uint8)
        return raw
    w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    return np.ascontiguousarray(gguf.quants.quantize(w, qtype)).view(np.uint8).reshape(rows, -1)


def bench(qtype, in_dim, out_dim, nt, threads, path, cold=False, cpu_time=False, min_time=0.5):
    rng = np.random.default_rng(0)
    raw = weight_bytes(qtype, out_dim, in_dim, rng)
    copies = max(1, -(-COLD_BYTES // raw.nbytes)) if cold else 1
    pool, ws = _core.Pool("bench"), _core.WeightStore()
    x = pool.alloc(in_dim * nt * 4)
    pool.write(x, rng.standard_normal(in_dim * nt).astype(np.float32))
    plan = _core.Plan("mm")
    for i in range(copies):
        y = pool.alloc(out_dim * nt * 4)
        h = ws.add(f"w{i}", raw.reshape(-1).copy(), int(qtype), in_dim, out_dim)
        plan.add(_core.OPS["matmul"], i, [y, x], [in_dim, out_dim, nt], [], [h, -1])
    _core.testing.set_kernel_path(path)
    if threads == 1:
        clock, div = time.thread_time, 1
    elif cpu_time:
        clock, div = time.process_time, threads
    else:
        clock, div = time.perf_counter, 1
    reps = 1 if cold else 5
    try:
        _core.run(plan, pool, ws, threads)
        best, t_end = float("inf"), time.perf_counter() + min_time
        while time.perf_counter() < t_end:
            t0 = clock()
            for _ in range(reps):
                _core.run(plan, pool, ws, threads)
            best = min(best, (clock() - t0) / div / reps / copies)
    finally:
        _core.testing.set_kernel_path("simd")
    return best, raw.nbytes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default="Q4_0,Q4_1,Q5_0,Q5_1,Q8_0,F16,Q4_K,Q6_K")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--nt", default="1,4,32")
    ap.add_argument("--shapes", default="896x4864,4864x896", help="IN x OUT pairs")
    ap.add_argument("--cold", action="store_true", help="weights from DRAM (distinct copies > L3)")
    ap.add_argument("--cpu-time", action="store_true", help="process CPU time / threads instead of wall")
    ap.add_argument("--min-time", type=float, default=0.5)
    ap.add_argument("--scalar", action="store_true", help="also time the scalar path")
    args = ap.parse_args()
    print(f"simd path: {_core.testing.cpu_features()['simd_path']}, threads {args.threads}, "
          f"{'cold (DRAM)' if args.cold else 'warm (cache)'}, core {os.environ.get('MINFER_CORE_DIR', '-')}")
    print(f"{'type':6} {'shape':>10} {'nt':>3} {'path':>6} {'ms':>8} {'GB/s':>7} {'GOP/s':>7}")
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    for name in args.types.split(","):
        qtype = Q[name]
        for in_dim, out_dim in shapes:
            if in_dim % gguf.GGML_QUANT_SIZES[qtype][0]:
                continue
            for nt in map(int, args.nt.split(",")):
                for path in ("simd", "scalar") if args.scalar else ("simd",):
                    t, nbytes = bench(qtype, in_dim, out_dim, nt, args.threads, path, args.cold, args.cpu_time,
                                      args.min_time)
                    print(f"{name:6} {in_dim:>4}x{out_dim:<5} {nt:>3} {path:>6} {t * 1e3:8.3f} "
                          f"{nbytes / t / 1e9:7.2f} {2 * in_dim * out_dim * nt / t / 1e9:7.1f}", flush=True)


if __name__ == "__main__":
    main()
