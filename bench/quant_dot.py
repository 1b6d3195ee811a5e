"""Microbenchmark of the quantized matmul kernel: one-step MATMUL plans through _core.

    PYTHONPATH=python [MINFER_CORE_DIR=/tmp/build-x] python3 bench/quant_dot.py [--types Q5_0,Q8_0] [--threads 2]

Decode (nt=1) is memory-bound: the useful figure is weight GB/s. Prefill (nt>1) is
compute-bound: GOP/s counts 2*in*out*nt operations.
"""

import argparse
import time

import numpy as np
import gguf

from minfer import _core

Q = gguf.GGMLQuantizationType


def weight_bytes(qtype, rows, cols, rng):
    if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):  # gguf cannot quantize K types: random blocks
        bs, ts = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(rows, cols // bs * ts), dtype=np.uint8)
        return raw
    w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    return np.ascontiguousarray(gguf.quants.quantize(w, qtype)).view(np.uint8).reshape(rows, -1)


def bench(qtype, in_dim, out_dim, nt, threads, path, min_time=0.5):
    rng = np.random.default_rng(0)
    raw = weight_bytes(qtype, out_dim, in_dim, rng)
    pool, ws = _core.Pool("bench"), _core.WeightStore()
    y, x = pool.alloc(out_dim * nt * 4), pool.alloc(in_dim * nt * 4)
    pool.write(x, rng.standard_normal(in_dim * nt).astype(np.float32))
    h = ws.add("w", raw.reshape(-1), int(qtype), in_dim, out_dim)
    plan = _core.Plan("mm")
    plan.add(_core.OPS["matmul"], 0, [y, x], [in_dim, out_dim, nt], [], [h, -1])
    _core.set_kernel_path(path)
    try:
        _core.run(plan, pool, ws, threads)
        # With one thread the work runs on the calling thread, so its CPU time is immune
        # to other processes taking the core (shared machines); with more, use wall time.
        clock = time.thread_time if threads == 1 else time.perf_counter
        best, t_end = float("inf"), time.perf_counter() + min_time
        while time.perf_counter() < t_end:
            t0 = clock()
            for _ in range(5):
                _core.run(plan, pool, ws, threads)
            best = min(best, (clock() - t0) / 5)
    finally:
        _core.set_kernel_path("simd")
    return best, raw.nbytes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default="Q4_0,Q4_1,Q5_0,Q5_1,Q8_0,F16,Q4_K,Q6_K")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--nt", default="1,4,32")
    ap.add_argument("--scalar", action="store_true", help="also time the scalar path")
    args = ap.parse_args()
    print(f"simd path: {_core.cpu_features()['simd_path']}, threads {args.threads}")
    print(f"{'type':6} {'shape':>10} {'nt':>3} {'path':>6} {'ms':>8} {'GB/s':>7} {'GOP/s':>7}")
    for name in args.types.split(","):
        qtype = Q[name]
        for in_dim, out_dim in ((896, 4864), (4864, 896)):
            if in_dim % gguf.GGML_QUANT_SIZES[qtype][0]:
                continue
            for nt in map(int, args.nt.split(",")):
                for path in ("simd", "scalar") if args.scalar else ("simd",):
                    t, nbytes = bench(qtype, in_dim, out_dim, nt, args.threads, path)
                    print(f"{name:6} {in_dim:>4}x{out_dim:<5} {nt:>3} {path:>6} {t * 1e3:8.3f} "
                          f"{nbytes / t / 1e9:7.2f} {2 * in_dim * out_dim * nt / t / 1e9:7.1f}")


if __name__ == "__main__":
    main()
