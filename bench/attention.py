"""Microbenchmark of the CPU attention kernel through minfer._core (one ATTN step per run).

Shapes are the real model's (Qwen2.5-Coder-0.5B: 14 heads, 2 KV heads, head dim 64).
Usage: PYTHONPATH=python MINFER_CORE_DIR=<build dir> python3 bench/attention.py [--threads N] [--kv-type f16|f32]
"""

import argparse
import statistics
import time

import numpy as np

from minfer import _core
from minfer.backends import default_threads


def bench_case(label, nt, n_past, nh=14, nkv=2, hd=64, n_threads=2, reps=None, kv_type="f32", n_seqs=1):
    """Attention of nt new tokens at positions n_past..n_past+nt-1 over a filled KV region;
    n_seqs > 1: one decode token of each of n_seqs sequences (a batched server step), their
    cells in ranges of n_past + 38 cells one after another (bases not block-aligned), read
    through explicit spans."""
    stride = n_past + 38
    n_ctx = n_past + nt if n_seqs == 1 else n_seqs * stride
    rng = np.random.default_rng(0)
    pool, weights = _core.Pool("bench"), _core.WeightStore()

    def buf(a):
        b = pool.alloc(a.nbytes)
        pool.write(b, np.ascontiguousarray(a))
        return b

    kv_dim = nkv * hd
    kv_np, kv_code = {"f32": (np.float32, 0), "f16": (np.float16, 1)}[kv_type]
    K = buf(rng.standard_normal((n_ctx, kv_dim)).astype(kv_np))
    V = buf(rng.standard_normal((n_ctx, kv_dim)).astype(kv_np))
    q = buf(rng.standard_normal((nt, nh * hd)).astype(np.float32))
    span = -1
    if n_seqs > 1:
        nt = n_seqs
        q = buf(rng.standard_normal((nt, nh * hd)).astype(np.float32))
        pos = buf(np.full(nt, n_past, dtype=np.int32))
        span = buf(np.array([(i * stride, i * stride + n_past + 1, 0, 0) for i in range(nt)], np.int32).reshape(-1))
    else:
        pos = buf(np.arange(n_past, n_past + nt, dtype=np.int32))
    y = pool.alloc(nt * nh * hd * 4)
    plan = _core.Plan(label)
    plan.add(_core.OPS["attn"], 0, [y, q, K, V, pos, span], [nt, nh, nkv, hd, n_ctx, nh * hd, kv_code], [hd ** -0.5])

    _core.run(plan, pool, weights, n_threads)  # warm-up: scratch growth, page faults
    # Visible (query, cell) pairs: causal triangle for prefill.
    pairs = (n_seqs * (n_past + 1) if n_seqs > 1 else sum(n_past + t + 1 for t in range(nt))) * nh
    if reps is None:
        reps = max(11, min(2000, int(1e9 / (pairs * hd * 4) + 1)))
    times, cpu = [], []
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        _core.run(plan, pool, weights, n_threads)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    med = statistics.median(times)
    gflops = pairs * hd * 4 / med / 1e9  # q.k and p.v: 2 flops each per dim
    kv_mb = 2 * n_ctx * kv_dim * np.dtype(kv_np).itemsize / 1e6
    # min and CPU time alongside the median: on a shared box the median mostly measures the neighbours.
    print(f"{label:<22} threads={n_threads}  median {med * 1e3:8.3f} ms  min {min(times) * 1e3:8.3f} ms  "
          f"cpu-median {statistics.median(cpu) * 1e3:8.3f} ms  ({gflops:5.1f} GFLOP/s at median, "
          f"KV {kv_mb:.1f} MB, {reps} reps)")
    return med


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=default_threads())
    ap.add_argument("--kv-type", choices=["f32", "f16"], default="f16")
    args = ap.parse_args()
    print(f"simd path: {_core.testing.cpu_features()['simd_path']}, kernel path: {_core.testing.kernel_path()}")
    for nth in sorted({1, args.threads}):
        kw = dict(n_threads=nth, kv_type=args.kv_type)
        bench_case(f"decode, 512 cached {args.kv_type}", 1, 512, **kw)
        bench_case(f"decode, 4096 cached {args.kv_type}", 1, 4096, **kw)
        bench_case(f"prefill 512 {args.kv_type}", 512, 0, **kw)
        bench_case(f"16 seqs x 512 cached {args.kv_type}", 16, 512, n_seqs=16, **kw)
        bench_case(f"64 seqs x 256 cached {args.kv_type}", 64, 256, n_seqs=64, **kw)


if __name__ == "__main__":
    main()
