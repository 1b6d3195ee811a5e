"""The CUDA backend on a GPU (marker `cuda`; CI deselects it, `pytest -m cuda` runs it).

Without a CUDA build or a visible device every test here fails, naming what is missing:
the GPU suite never passes by skipping.

References are independent of the CUDA code: NumPy float64 over gguf's dequantization
for the kernels, the float64 reference forward and the CPU backend for whole models.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import gguf  # noqa: E402
from minfer import _core  # noqa: E402
from minfer.backends import cuda as cuda_backend  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))

pytestmark = pytest.mark.cuda

Q = gguf.GGMLQuantizationType
OPS = _core.OPS
U = 2.0**-24
FAMILY32 = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0]
KQUANTS = [Q.Q4_K, Q.Q5_K, Q.Q6_K]
ALL_TYPES = [Q.F32, Q.F16] + FAMILY32 + KQUANTS

# Decode matvec: F32/F16 weights meet the f32 activation; quantized weights meet its
# int8 copy (blocks of 32, d = amax/127, q = rint(x/d), as the CPU's Q8 activations)
# through exact integer dot products. Against the reference over that same int8 copy
# the only error is f32 rounding of the scale products and the fixed-order sums: a
# recursive-summation bound c * n * 2^-24 * |x||w| (c = 8 for the scale products and
# the split reduction). The int8 rounding itself is bounded per element by
# amax(block) / 254 (half a step), checked against the exact product.
MATVEC_C = 8.0


def q8_roundtrip(x):
    """The kernel's activation quantization, in NumPy float32 like the GPU does it."""
    b = x.astype(np.float32).reshape(-1, 32)
    d = (np.abs(b).max(axis=1) / np.float32(127.0)).astype(np.float32)
    q = np.zeros_like(b)
    nz = d > 0
    q[nz] = np.rint(b[nz] / d[nz, None])
    return (d[:, None].astype(np.float64) * q).reshape(x.shape)


def check_matvec(got, x, deq, qtype, bias=None):
    x64, w64 = x.astype(np.float64), deq.astype(np.float64)
    b = 0.0 if bias is None else bias.astype(np.float64)
    quant = qtype not in (Q.F32, Q.F16)
    xa = q8_roundtrip(x) if quant else x64
    tight = xa @ w64.T + b
    tol = MATVEC_C * x.shape[1] * U * (np.abs(xa) @ np.abs(w64).T + np.abs(b)) + 1e-30
    err = np.abs(got - tight)
    assert np.all(err <= tol), f"{qtype.name}: max err/tol vs the int8-activation reference {np.max(err / tol):.3g}"
    if quant:
        nb = x.shape[1] // 32
        amax = np.abs(x64).reshape(x.shape[0], nb, 32).max(axis=2)
        wsum = np.abs(w64).reshape(deq.shape[0], nb, 32).sum(axis=2)
        bound = (1 / 254 + 2.0**-20) * (amax @ wsum.T) + tol
        err = np.abs(got - (x64 @ w64.T + b))
        assert np.all(err <= bound), f"{qtype.name}: max err/bound vs exact {np.max(err / bound):.3g}"
# Prefill GEMM: weights and activations rounded to f16 (2^-11 relative each) before an
# f32-accumulating tensor-core GEMM.
GEMM_REL = 2 * 2.0**-11
F16_KV = 1  # the KV steps' kv_type: CUDA keeps K/V in f16


@pytest.fixture(scope="module", autouse=True)
def cuda_required():
    e = cuda_backend.ENTRY
    assert e.compiled and e.usable, f"pytest -m cuda needs the CUDA backend here: {e.unusable_reason}"


F16_FIELDS = {
    Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q8_0: [0],
    Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208],
}


def make_weight(qtype, rows, cols, rng):
    """(raw bytes [rows, row_bytes], dequantized f32 [rows, cols] by gguf)."""
    if qtype == Q.F32:
        w = (rng.standard_normal((rows, cols)) * 0.1).astype(np.float32)
        return w.view(np.uint8).reshape(rows, -1), w
    if qtype == Q.F16:
        w = (rng.standard_normal((rows, cols)) * 0.1).astype(np.float16)
        return w.view(np.uint8).reshape(rows, -1), w.astype(np.float32)
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // bs, ts), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        d = (rng.standard_normal((rows, cols // bs)) * 0.02).astype(np.float16)
        raw[:, :, off:off + 2] = d.view(np.uint8).reshape(rows, cols // bs, 2)
    raw = raw.reshape(rows, -1)
    return raw, gguf.quants.dequantize(raw, qtype).reshape(rows, cols).astype(np.float32)


class Rig:
    """One CUDA pool, one weight store, one-step plans; buffers are poisoned (NaN)
    before each run so an unwritten output cannot pass."""

    def __init__(self):
        self.pool = _core.CudaPool("test")
        self.weights = _core.WeightStore()

    def buf(self, arr):
        arr = np.ascontiguousarray(arr)
        bid = self.pool.alloc(max(arr.nbytes, 4))
        self.pool.write(bid, arr)
        return bid

    def out(self, n, itemsize=4):
        bid = self.pool.alloc(max(4, n * itemsize))
        self.pool.write(bid, np.full(max(1, n * itemsize // 4), np.nan, np.float32))
        return bid

    def read(self, bid, n, dtype="float32"):
        return self.pool.read(bid, dtype, n)

    def weight(self, name, raw, wtype, ne0, ne1):
        return self.weights.add(name, np.ascontiguousarray(raw).view(np.uint8).reshape(-1), int(wtype), ne0, ne1)

    def plan(self, steps, flags=0):
        plan = _core.Plan("t")
        for i, (op, bufs, ip, fp, w) in enumerate(steps):
            plan.add(OPS[op], i, list(bufs), list(ip), list(fp), list(w))
        plan.flags = flags
        _core.cuda_validate(plan, self.pool, self.weights)
        return plan

    def run(self, plan, begin=0, end=-1):
        _core.cuda_run(plan, self.pool, self.weights, begin, end)
        _core.cuda_sync()


def in_dim_for(qtype):
    # K-quants: three superblocks, so the device layout's last 8-unit group is half
    # padding (cuda/layout.h).
    return {Q.F32: 96, Q.F16: 96}.get(qtype, 768 if qtype in KQUANTS else 224)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("nt", [1, 5, 11, 33, 70])
def test_matmul_vs_float64(qtype, nt):
    rng = np.random.default_rng(int(qtype) * 100 + nt)
    in_dim, out_dim = in_dim_for(qtype), 300
    raw, deq = make_weight(qtype, out_dim, in_dim, rng)
    x = rng.standard_normal((nt, in_dim)).astype(np.float32)
    bias = rng.standard_normal(out_dim).astype(np.float32)
    r = Rig()
    wh = r.weight("w", raw, qtype, in_dim, out_dim)
    bh = r.weight("b", bias, Q.F32, out_dim, 1)
    xi, yi = r.buf(x), r.out(nt * out_dim)
    r.run(r.plan([("matmul", [yi, xi], [in_dim, out_dim, nt], [], [wh, bh])]))
    got = r.read(yi, nt * out_dim).reshape(nt, out_dim).astype(np.float64)
    if nt <= _core.CUDA_ROW_EXACT_MAX_TOKENS:
        # Small batches run the decode matvec with the rows as columns (speculative blocks
        # must pick what single steps pick): each row bitwise the row computed alone.
        check_matvec(got, x, deq, qtype, bias)
        for k in range(nt):
            r1 = Rig()
            w1 = r1.weight("w", raw, qtype, in_dim, out_dim)
            b1 = r1.weight("b", bias, Q.F32, out_dim, 1)
            x1, y1 = r1.buf(x[k:k + 1].copy()), r1.out(out_dim)
            r1.run(r1.plan([("matmul", [y1, x1], [in_dim, out_dim, 1], [], [w1, b1])]))
            assert np.array_equal(r1.read(y1, out_dim), got[k].astype(np.float32)), f"row {k}"
        return
    x64, w64 = x.astype(np.float64), deq.astype(np.float64)
    want = x64 @ w64.T + bias
    mag = np.abs(x64) @ np.abs(w64).T + np.abs(bias)
    if qtype == Q.F32:
        tol = MATVEC_C * in_dim * U * mag + 1e-30
    else:
        tol = (GEMM_REL + MATVEC_C * in_dim * U) * mag
    err = np.abs(got - want)
    assert np.all(err <= tol), f"{qtype.name} nt={nt}: max err/tol {np.max(err / tol):.3g}"


class mmq_min_cols:
    """Blocks of at least n token columns on the tensor cores (k_mmq.cu) inside the block."""

    def __init__(self, n):
        self.n = n

    def __enter__(self):
        self.old = _core.testing.cuda_set_mmq_min_cols(self.n)

    def __exit__(self, *exc):
        _core.testing.cuda_set_mmq_min_cols(self.old)


# Rows of fewer than 32 units (idle butterfly lanes), of ragged unit counts per lane, a
# 7B-like long row; 300 rows leave a partial 16-row tile.
MMQ_DIMS = {t: [224, 2080] for t in FAMILY32} | {t: [768, 4864, 18944] for t in KQUANTS}


@pytest.mark.parametrize("nt", [9, 16, 17, 40, 64])
@pytest.mark.parametrize("qtype", FAMILY32 + KQUANTS, ids=lambda t: t.name)
def test_mmq_columns_bitwise_the_matvec(qtype, nt):
    """A block of 9 to 64 token columns on the int8 tensor cores: every column bitwise
    what the matvec's column launches give (four rows a block or one a warp alike;
    which the test above holds to one-token
    runs), with a bias and after an RMSNorm's deferred copy (its per-column scale), and
    within the int8-activation bound of float64 over gguf's dequantization."""
    for in_dim in MMQ_DIMS[qtype]:
        rng = np.random.default_rng(int(qtype) * 1000 + nt + in_dim)
        out_dim, eps = 300, 1e-6
        raw, deq = make_weight(qtype, out_dim, in_dim, rng)
        x = rng.standard_normal((nt, in_dim)).astype(np.float32)
        bias = rng.standard_normal(out_dim).astype(np.float32)
        nw = rng.standard_normal(in_dim).astype(np.float32)
        got = {}
        # 10_000: the matvec's column launches (k_matvec_x4's layout); 10_001: the same
        # with one row a warp (x4 off), which must agree bit for bit.
        for n_min in (2, 10_000, 10_001):
            old_x4 = _core.testing.cuda_set_x4_cols_units(1 << 30 if n_min == 10_001 else 0)
            with mmq_min_cols(n_min):
                r = Rig()
                wh = r.weight("w", raw, qtype, in_dim, out_dim)
                bh = r.weight("b", bias, Q.F32, out_dim, 1)
                wn = r.weight("norm", nw, Q.F32, in_dim, 1)
                xi, yi, hn, zi = r.buf(x), r.out(nt * out_dim), r.out(nt * in_dim), r.out(nt * out_dim)
                steps = [("matmul", [yi, xi], [in_dim, out_dim, nt], [], [wh, bh])]
                if in_dim <= 4096:  # the norm's deferred copy takes rows of at most 4096
                    steps += [("rms_norm", [hn, xi], [in_dim, nt], [eps], [wn]),
                              ("matmul", [zi, hn], [in_dim, out_dim, nt], [], [wh, -1])]
                _core.testing.cuda_reset_counters()
                r.run(r.plan(steps))
                assert _core.testing.cuda_counters()["mmq"] == (len(steps) + 1) // 2 * (n_min == 2)
                got[n_min] = [r.read(yi, nt * out_dim).tobytes()]
                if len(steps) > 1:
                    got[n_min].append(r.read(zi, nt * out_dim).tobytes())
            _core.testing.cuda_set_x4_cols_units(old_x4)
        assert got[10_000] == got[10_001], f"{qtype.name} in {in_dim}: four rows a block != one row a warp"
        assert got[2][0] == got[10_000][0], f"{qtype.name} in {in_dim}: tensor cores != matvec"
        if len(got[2]) > 1:
            assert got[2][1] == got[10_000][1], f"{qtype.name} in {in_dim}: after the norm, tensor cores != matvec"
            z = np.frombuffer(got[2][1], np.float32).reshape(nt, out_dim).astype(np.float64)
            for c in range(nt):
                check_after_norm(z[c:c + 1], x[c], nw, eps, deq)
        y = np.frombuffer(got[2][0], np.float32).reshape(nt, out_dim).astype(np.float64)
        check_matvec(y, x, deq, qtype, bias)


@pytest.mark.parametrize("in_dim", [512, 4096])
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0, Q.Q5_0, Q.Q4_0])
def test_matvec_one_type_and_pair_kernels(qtype, in_dim):
    """One-column launches whose jobs share a type take that type's own kernel (rows of at
    most 64 units, here every 512-wide row and the 4096-wide K-quant rows, loaded into
    registers before the kernel's wait); a launch of two types (q|k|v with a Q6_K v beside
    Q4_K, a Q8_0 v beside Q5_0) takes a two-type instantiation, other mixes the switch
    kernel. A row's bits do not depend on the launch: alone, beside a job of another type,
    and gate|up + SwiGLU in one launch against gate, up and SwiGLU launched apart; and the
    row is within the matvec tolerance of float64."""
    rng = np.random.default_rng(int(qtype) + in_dim)
    rows = 320
    vtype = Q.Q6_K if qtype == Q.Q4_K else Q.Q8_0
    w_raw, w_deq = make_weight(qtype, rows, in_dim, rng)
    u_raw, _ = make_weight(qtype, rows, in_dim, rng)
    m_raw, _ = make_weight(vtype, rows, in_dim, rng)
    x = rng.standard_normal((1, in_dim)).astype(np.float32)
    outs = {}
    for flags in (0, 1 | 2):
        r = Rig()
        w = r.weight("w", w_raw, qtype, in_dim, rows)
        u = r.weight("u", u_raw, qtype, in_dim, rows)
        m = r.weight("m", m_raw, vtype, in_dim, rows)
        xi = r.buf(x)
        y, g, h, sw, y2, ym = (r.out(rows) for _ in range(6))
        one = r.plan([("matmul", [y, xi], [in_dim, rows, 1], [], [w, -1]),  # alone
                      ("matmul", [g, xi], [in_dim, rows, 1], [], [w, -1]),  # gate|up + SwiGLU
                      ("matmul", [h, xi], [in_dim, rows, 1], [], [u, -1]),
                      ("swiglu", [sw, g, h], [rows], [], [])])
        one.flags = flags & 2
        mixed = r.plan([("matmul", [y2, xi], [in_dim, rows, 1], [], [w, -1]),
                        ("matmul", [ym, xi], [in_dim, rows, 1], [], [m, -1])])
        mixed.flags = flags & 1
        _core.cuda_sync()
        _core.testing.cuda_reset_counters()
        for p in (one, mixed):
            _core.cuda_validate(p, r.pool, r.weights)
            r.run(p)
        pairs = _core.testing.cuda_counters()["pair"]
        assert _core.testing.cuda_plan_info(one)["launches"] == (2 if flags else 4)
        assert _core.testing.cuda_plan_info(mixed)["launches"] == (1 if flags else 2)
        paired = flags and (qtype, vtype) in ((Q.Q4_K, Q.Q6_K), (Q.Q5_0, Q.Q8_0))
        assert pairs == (1 if paired else 0), pairs
        outs[flags] = [r.read(b, rows) for b in (y, sw, y2, ym)]
    for a, b in zip(outs[0], outs[1 | 2]):
        assert a.tobytes() == b.tobytes(), "fused launches vs apart"
    assert outs[3][0].tobytes() == outs[3][2].tobytes()  # alone == beside a Q8_0 / Q6_K job
    check_matvec(outs[3][0].reshape(1, -1).astype(np.float64), x, w_deq, qtype)


def make_raw(qtype, rows, cols, rng):
    """make_weight's raw bytes alone (a big matrix whose dequantization is checked on a
    few rows: gguf_deq)."""
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // bs, ts), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        d = (rng.standard_normal((rows, cols // bs)) * 0.02).astype(np.float16)
        raw[:, :, off:off + 2] = d.view(np.uint8).reshape(rows, cols // bs, 2)
    return raw.reshape(rows, -1)


def gguf_deq(qtype, raw, cols):
    return gguf.quants.dequantize(raw, qtype).reshape(raw.shape[0], cols).astype(np.float32)


@pytest.mark.parametrize("xr", [True, False], ids=["rows<=64units", "longer"])
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0, Q.Q5_0, Q.Q4_0])
def test_matvec_staged_bitwise(qtype, xr):
    """Launches streaming more than 16 MiB in rows of 0.5-8 KB (2-8 KB when a row is longer
    than 64 units) take the staged matvec (rows streamed into shared memory by bulk
    copies, several rows a slot, slots dealt to the warps round-robin; rows of at most 64
    units keep the lanes' activation chunks in registers): its rows have the bits of the
    same rows in a small launch (the plain or early-loaded kernel), the first and the last
    rows (short slots at the end); gate|up + SwiGLU staged in one launch, writing down's
    int8 input by a quantization launch after it, and down + residual add, give the bits
    of the steps launched apart; direct, captured and replayed; and the rows are within
    the matvec tolerance of float64."""
    rng = np.random.default_rng(100 + int(qtype) + 7 * xr)
    units_elems = 64 if qtype in KQUANTS else 32
    in_dim = units_elems * (64 if xr else 128)
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    row_bytes = in_dim // bs * ts
    rows = ((17 << 20) // row_bytes + 32) // 32 * 32
    few = 96
    w_raw = make_raw(qtype, rows, in_dim, rng)
    u_raw = make_raw(qtype, rows, in_dim, rng)
    d_raw = make_raw(Q.Q8_0, in_dim, rows, rng)
    x = rng.standard_normal((1, in_dim)).astype(np.float32)
    bias = rng.standard_normal(rows).astype(np.float32)
    res = rng.standard_normal(in_dim).astype(np.float32)
    outs, staged = {}, {}
    for flags in (2 | 4 | 8, 0):
        r = Rig()
        w = r.weight("w", w_raw, qtype, in_dim, rows)
        b = r.weight("b", bias, Q.F32, rows, 1)
        u = r.weight("u", u_raw, qtype, in_dim, rows)
        d = r.weight("d", d_raw, Q.Q8_0, rows, in_dim)
        xi, ri = r.buf(x), r.buf(res)
        y, g, h, sw, yd, z = (r.out(n) for n in (rows, rows, rows, rows, in_dim, in_dim))
        plan = r.plan([("matmul", [y, xi], [in_dim, rows, 1], [], [w, b]),
                       ("matmul", [g, xi], [in_dim, rows, 1], [], [w, -1]),
                       ("matmul", [h, xi], [in_dim, rows, 1], [], [u, -1]),
                       ("swiglu", [sw, g, h], [rows], [], []),
                       ("matmul", [yd, sw], [rows, in_dim, 1], [], [d, -1]),
                       ("add", [z, yd, ri], [in_dim], [], [])])
        plan.flags = flags
        _core.cuda_validate(plan, r.pool, r.weights)
        _core.cuda_sync()
        _core.testing.cuda_reset_counters()
        runs = []
        for _ in range(3):
            r.pool.write(sw, np.full(rows, np.nan, np.float32))
            r.run(plan)
            runs.append([r.read(k, n).tobytes() for k, n in ((y, rows), (sw, rows), (z, in_dim))])
        assert runs[0] == runs[1] == runs[2], f"flags {flags}: runs differ"
        staged[flags] = _core.testing.cuda_counters()["staged"]
        outs[flags] = runs[0]
    # Staged: the matvec + bias, gate|up (fused, when its two rows fit a slot of 8 KB) or
    # gate and up (apart); never down (rows of 16 KB).
    assert staged[2 | 4 | 8] >= 1 + (2 * row_bytes <= 8192) and staged[0] >= 3, staged
    assert outs[2 | 4 | 8] == outs[0], "fused launches vs apart"
    got = np.frombuffer(outs[0][0], np.float32)
    # The same rows in small launches (plain or early-loaded kernels): the first and the last.
    for part in (slice(0, few), slice(rows - few, rows)):
        r = Rig()
        w = r.weight("w", w_raw[part].copy(), qtype, in_dim, few)
        b = r.weight("b", bias[part].copy(), Q.F32, few, 1)
        xi, yf = r.buf(x), r.out(few)
        _core.cuda_sync()
        _core.testing.cuda_reset_counters()
        r.run(r.plan([("matmul", [yf, xi], [in_dim, few, 1], [], [w, b])]))
        assert _core.testing.cuda_counters()["staged"] == 0
        assert r.read(yf, few).tobytes() == got[part].tobytes(), f"rows {part}: staged vs plain bits"
        check_matvec(got[part].reshape(1, -1).astype(np.float64), x, gguf_deq(qtype, w_raw[part], in_dim), qtype,
                     bias[part])


@pytest.mark.parametrize("qtype", KQUANTS + [Q.Q8_0, Q.Q5_0, Q.Q4_0], ids=lambda t: t.name)
def test_matvec_x4_bitwise(qtype):
    """Rows of 200 units or more (the 7B's down projection) go four to a block, each row's
    32 lanes spread over the block's four warps and reduced through shared memory: a
    matvec with a bias and one with a residual add, with a row count that leaves the last
    block short, give the bits of the same rows one a warp (two jobs in one launch, which
    k_matvec_x4 does not take); direct, captured, replayed. The result is within the
    matvec tolerance of float64."""
    rng = np.random.default_rng(400 + int(qtype))
    in_dim, rows = 12800, 203  # 200 K-quant units or 400 blocks a row
    w_raw, w_deq = make_weight(qtype, rows, in_dim, rng)
    x = rng.standard_normal((1, in_dim)).astype(np.float32)
    bias = rng.standard_normal(rows).astype(np.float32)
    res = rng.standard_normal(rows).astype(np.float32)
    outs, x4 = {}, {}
    for flags in (4, 1):  # matvec + residual add in one launch (x4); two jobs in one launch (one row a warp)
        r = Rig()
        w = r.weight("w", w_raw, qtype, in_dim, rows)
        b = r.weight("b", bias, Q.F32, rows, 1)
        xi, ri = r.buf(x), r.buf(res)
        y, yd, z = r.out(rows), r.out(rows), r.out(rows)
        plan = r.plan([("matmul", [y, xi], [in_dim, rows, 1], [], [w, b]),
                       ("matmul", [yd, xi], [in_dim, rows, 1], [], [w, -1]),
                       ("add", [z, yd, ri], [rows], [], [])])
        plan.flags = flags
        _core.cuda_validate(plan, r.pool, r.weights)
        assert _core.testing.cuda_plan_info(plan)["launches"] == 2
        _core.cuda_sync()
        _core.testing.cuda_reset_counters()
        runs = []
        for _ in range(3):
            for k in (y, yd, z):
                r.pool.write(k, np.full(rows, np.nan, np.float32))
            r.run(plan)
            runs.append([r.read(k, rows).tobytes() for k in (y, yd, z)])
        assert runs[0] == runs[1] == runs[2], f"flags {flags}: runs differ"
        outs[flags] = runs[0]
        x4[flags] = _core.testing.cuda_counters()["x4"]
    assert x4[4] >= 2 and x4[1] == 0, x4  # both matvec launches of the direct run
    assert outs[4][0] == outs[1][0], "four rows a block vs one row a warp"
    yd1 = np.frombuffer(outs[1][1], np.float32)
    assert outs[4][2] == (yd1 + res).astype(np.float32).tobytes(), "x4 + residual vs one row a warp, then the add"
    got = np.frombuffer(outs[4][0], np.float32)
    check_matvec(got.reshape(1, -1).astype(np.float64), x, w_deq, qtype, bias)


@pytest.mark.parametrize("rows", [3000, 5000, 9000, 60000])
def test_matvec_many_rows_bitwise_and_fused_ffn(rows):
    """A row's bits do not depend on the row count of its launch. The same rows alone, and gate|up +
    SwiGLU with down's int8 input made by a quantization launch after it, against the
    unfused steps."""
    rng = np.random.default_rng(rows)
    in_dim, few = 64, 96
    raw, deq = make_weight(Q.Q8_0, rows, in_dim, rng)
    x = rng.standard_normal((1, in_dim)).astype(np.float32)
    r = Rig()
    wh = r.weight("w", raw, Q.Q8_0, in_dim, rows)
    w_few = r.weight("w_few", raw[:few].copy(), Q.Q8_0, in_dim, few)
    xi, yi, yf = r.buf(x), r.out(rows), r.out(few)
    r.run(r.plan([("matmul", [yi, xi], [in_dim, rows, 1], [], [wh, -1]),
                  ("matmul", [yf, xi], [in_dim, few, 1], [], [w_few, -1])]))
    got = r.read(yi, rows)
    assert got[:few].tobytes() == r.read(yf, few).tobytes()
    check_matvec(got.reshape(1, -1).astype(np.float64), x, deq, Q.Q8_0)

    # FFN: gate|up (rows x in_dim), SwiGLU, down (in_dim x rows), fused vs not.
    n_ff = rows // 32 * 32
    g_raw, _ = make_weight(Q.Q8_0, n_ff, in_dim, rng)
    u_raw, _ = make_weight(Q.Q4_K if in_dim % 256 == 0 else Q.Q5_0, n_ff, in_dim, rng)
    d_raw, _ = make_weight(Q.Q5_0, in_dim, n_ff, rng)
    outs = {}
    for flags in (0, 2 | 8):
        r = Rig()
        g = r.weight("g", g_raw, Q.Q8_0, in_dim, n_ff)
        u = r.weight("u", u_raw, Q.Q4_K if in_dim % 256 == 0 else Q.Q5_0, in_dim, n_ff)
        d = r.weight("d", d_raw, Q.Q5_0, n_ff, in_dim)
        xi = r.buf(x)
        gi, ui, si, yi = r.out(n_ff), r.out(n_ff), r.out(n_ff), r.out(in_dim)
        plan = r.plan([("matmul", [gi, xi], [in_dim, n_ff, 1], [], [g, -1]),
                       ("matmul", [ui, xi], [in_dim, n_ff, 1], [], [u, -1]),
                       ("swiglu", [si, gi, ui], [n_ff], [], []),
                       ("matmul", [yi, si], [n_ff, in_dim, 1], [], [d, -1])])
        plan.flags = flags
        _core.cuda_validate(plan, r.pool, r.weights)
        for _ in range(3):  # direct, captured, replayed
            r.run(plan)
            y = r.read(yi, in_dim)
            assert outs.setdefault(flags, y).tobytes() == y.tobytes()
        if flags:
            assert _core.testing.cuda_plan_info(plan)["launches"] < 4
    assert outs[0].tobytes() == outs[2 | 8].tobytes()


def test_prefill_gemm_pipeline_bitwise_and_vs_float64(monkeypatch):
    """Prefill GEMMs dequantize their weights ahead on a side stream into two buffers
    (events order each GEMM after its dequantization and each dequantization after the
    GEMM that last read its buffer) and reuse the f16 copy of an input that the GEMM
    before them converted or that the RMSNorm producing it wrote. A plan of 7 quantized
    GEMMs of different types and sizes (so both buffers are refilled, bigger and
    smaller), with an F16 and an F32 GEMM among them, three over one input, three over
    a norm of that input after it is rewritten, and GEMMs over other GEMMs' outputs,
    runs direct, captured and replayed, without graphs, and step by step (partial runs:
    dequantization in line, every input converted): every output is bitwise the same
    each time (outputs poisoned before every run), and within the f16 GEMM tolerance of
    float64 over gguf's dequantization."""
    rng = np.random.default_rng(2026)
    nt, d = 80, 1024  # more rows than CUDA_ROW_EXACT_MAX_TOKENS: the GEMM path
    x = rng.standard_normal((nt, d)).astype(np.float32)
    z = rng.standard_normal((nt, d)).astype(np.float32)
    bias = rng.standard_normal(1536).astype(np.float32)
    norm_w = rng.standard_normal(d).astype(np.float32)
    # name: (type, out rows, input)
    spec = {"w0": (Q.Q4_K, 1536, "x"), "w1": (Q.Q8_0, 256, "x"), "w2": (Q.Q6_K, d, "x"),
            "w3": (Q.F16, 512, "xn"), "w4": (Q.Q5_0, 768, "xn"), "w5": (Q.F32, 256, "y2"),
            "w6": (Q.Q4_1, 2048, "xn"), "w7": (Q.Q5_K, d, "y2"), "w8": (Q.Q4_0, 384, "xn")}
    mats = {k: make_weight(t, rows, d, rng) for k, (t, rows, _) in spec.items()}
    poison = {k: np.full(nt * rows, np.nan, np.float32) for k, (_, rows, _) in spec.items()}

    def build(r):
        h = {k: r.weight(k, mats[k][0], spec[k][0], d, spec[k][1]) for k in spec}
        hb = r.weight("b0", bias, Q.F32, 1536, 1)
        hn = r.weight("n", norm_w, Q.F32, d, 1)
        xi, x0, zi = r.buf(x), r.buf(x), r.buf(z)
        y = {k: r.out(nt * spec[k][1]) for k in spec}
        y["xn"] = r.out(nt * d)
        mm = lambda k, src, b=-1: ("matmul", [y[k], src], [d, spec[k][1], nt], [], [h[k], b])  # noqa: E731
        steps = [mm("w0", xi, hb), mm("w1", xi), mm("w2", xi),
                 ("add", [xi, x0, zi], [nt * d], [], []),  # x rewritten ...
                 ("rms_norm", [y["xn"], xi], [d, nt], [1e-6], [hn]),  # ... normed: the norm writes xn's f16 copy
                 mm("w3", y["xn"]), mm("w4", y["xn"]), mm("w5", y["w2"]), mm("w6", y["xn"]),  # (an F32 GEMM leaves xh alone)
                 mm("w7", y["w2"]), mm("w8", y["xn"])]  # (a GEMM of a GEMM of a GEMM overflows f16 here)
        return r.plan(steps), xi, y

    def run_all(r, plan, xi, y, steps=None):
        r.pool.write(xi, x)  # the plan rewrites x (with x + z)
        for k in spec:
            r.pool.write(y[k], poison[k])
        r.pool.write(y["xn"], np.full(nt * d, np.nan, np.float32))
        if steps is None:
            r.run(plan)
        else:
            for i in range(steps):
                _core.cuda_run(plan, r.pool, r.weights, i, i + 1)
            _core.cuda_sync()
        out = {k: r.read(y[k], nt * spec[k][1]) for k in spec}
        out["xn"] = r.read(y["xn"], nt * d)
        return out

    r = Rig()
    plan, xi, y = build(r)
    info = _core.testing.cuda_plan_info(plan)
    assert info["gemm_pipelined"] == 7, info  # every quantized GEMM (not the F16, not the F32)
    assert info["gemm_inputs_reused"] == 5, info  # w1, w2 (x); w3 (from the norm), w4, w6 (xn)
    base = run_all(r, plan, xi, y)
    for k in range(2):  # captured, replayed
        again = run_all(r, plan, xi, y)
        for name in base:
            assert again[name].tobytes() == base[name].tobytes(), f"{name}: {'replay' if k else 'capture'} vs direct"
    assert _core.testing.cuda_plan_info(plan)["captured"]
    stepwise = run_all(r, plan, xi, y, steps=11)
    for name in base:
        assert stepwise[name].tobytes() == base[name].tobytes(), f"{name}: step by step vs whole"

    # float64 over gguf's dequantization, each GEMM from the inputs it was given.
    np.testing.assert_allclose(base["xn"].reshape(nt, d), _rms64(x + z, norm_w, 1e-6), rtol=1e-6, atol=1e-6)
    inputs = {"x": x, "xn": base["xn"].reshape(nt, d), "y2": base["w2"].reshape(nt, d)}
    for name, (qtype, rows, src) in spec.items():
        a = inputs[src].astype(np.float64)
        w64 = mats[name][1].astype(np.float64)
        b = bias.astype(np.float64) if name == "w0" else 0.0
        want = a @ w64.T + b
        mag = np.abs(a) @ np.abs(w64).T + np.abs(b)
        rel = MATVEC_C * d * U if qtype == Q.F32 else GEMM_REL + MATVEC_C * d * U
        err = np.abs(base[name].reshape(nt, rows) - want)
        assert np.all(err <= rel * mag + 1e-30), f"{name} ({qtype.name}): max err/tol {np.max(err / (rel * mag)):.3g}"

    monkeypatch.setenv("MINFER_NO_CUDA_GRAPH", "1")
    r2 = Rig()
    plan2, xi2, y2 = build(r2)
    for run in range(3):
        got = run_all(r2, plan2, xi2, y2)
        for name in base:
            assert got[name].tobytes() == base[name].tobytes(), f"{name}: direct launches, run {run}"


def check_after_norm(got, h, nw, eps, deq):
    """A matvec reading RMSNorm(h) * nw on CUDA meets the norm's deferred int8 copy: the
    int8 copy of h * nw (f32 products, per 32-element block), the exact dot products,
    then the norm's scale on the row sums. Against that reference (float64 scale) only
    f32 rounding is left; against the exact product, the int8 rounding of each block."""
    h64 = h.astype(np.float64)
    r = 1.0 / np.sqrt((h64 * h64).mean() + eps)
    u = (h.astype(np.float32) * nw.astype(np.float32))[None]
    ua, w64 = q8_roundtrip(u), deq.astype(np.float64)
    tight = (ua @ w64.T) * r
    tol = (MATVEC_C * h.size * U * (np.abs(ua) @ np.abs(w64).T) + 1e-30) * r + 4 * U * np.abs(tight)
    err = np.abs(got - tight)
    assert np.all(err <= tol), f"max err/tol vs the deferred-copy reference {np.max(err / tol):.3g}"
    xn = (h64 * r * nw.astype(np.float64))[None]
    amax = np.abs(xn).reshape(1, -1, 32).max(axis=2)
    wsum = np.abs(w64).reshape(deq.shape[0], -1, 32).sum(axis=2)
    err = np.abs(got - xn @ w64.T)
    bound = (1 / 254 + 2.0**-20) * (amax @ wsum.T) + tol
    assert np.all(err <= bound), f"max err/bound vs exact {np.max(err / bound):.3g}"


@pytest.mark.parametrize("d,inplace", [(32, False), (896, True), (1024, False), (3584, True), (4096, False)])
def test_matvec_add_norm_matvec_fused_equals_unfused(d, inplace):
    """A matvec + residual add whose output a one-row RMSNorm reads (then a matvec reads
    the norm's deferred int8 copy): the residual and quant fusions give the unfused bits,
    with the add written over the matvec's own input too, direct, captured, replayed and
    step by step. The norm is against float64; the matvec after it against NumPy's
    float64 over the same deferred copy."""
    rng = np.random.default_rng(d + int(inplace))
    k_in, n2, eps = (d if inplace else 256), 96, 1e-6
    o_raw, _ = make_weight(Q.Q5_0, d, k_in, rng)
    n_raw, n_deq = make_weight(Q.Q4_0, n2, d, rng)
    x = rng.standard_normal(k_in).astype(np.float32)
    res = (rng.standard_normal(d) * 4).astype(np.float32)
    nw = rng.standard_normal(d).astype(np.float32)
    outs = {}
    launches = {0: 4, 4: 3, 4 | 8: 3}
    for flags in launches:
        r = Rig()
        wo = r.weight("o", o_raw, Q.Q5_0, k_in, d)
        wn = r.weight("norm", nw, Q.F32, d, 1)
        w2 = r.weight("next", n_raw, Q.Q4_0, d, n2)
        xi, ri = r.buf(x), r.buf(res)
        yo, hn, z = r.out(d), r.out(d), r.out(n2)
        h = xi if inplace else r.out(d)
        plan = r.plan([("matmul", [yo, xi], [k_in, d, 1], [], [wo, -1]),
                       ("add", [h, yo, ri], [d], [], []),
                       ("rms_norm", [hn, h], [d, 1], [eps], [wn]),
                       ("matmul", [z, hn], [d, n2, 1], [], [w2, -1])])
        plan.flags = flags
        _core.cuda_validate(plan, r.pool, r.weights)
        assert _core.testing.cuda_plan_info(plan)["launches"] == launches[flags]
        for _ in range(3):  # direct, captured, replayed
            r.pool.write(xi, x)
            r.run(plan)
            got = [r.read(b, n).tobytes() for b, n in ((h, d), (z, n2), (hn, d))]
            assert outs.setdefault(flags, got) == got, f"flags {flags}: runs differ"
        # Step by step (tracing's partial runs launch each step alone): the same bits.
        r.pool.write(xi, x)
        for k in range(4):
            r.run(plan, k, k + 1)
        assert [r.read(b, n).tobytes() for b, n in ((h, d), (z, n2), (hn, d))] == got, flags
    for flags in launches:
        assert outs[flags] == outs[0], f"flags {flags}: bits differ from the unfused run"
    hv = np.frombuffer(outs[0][0], np.float32)
    np.testing.assert_allclose(np.frombuffer(outs[0][2], np.float32), _rms64(hv[None], nw, eps)[0], rtol=1e-6,
                               atol=1e-6)
    check_after_norm(np.frombuffer(outs[0][1], np.float32)[None].astype(np.float64), hv, nw, eps, n_deq)


def test_matvec_wide_rows_and_repeat_bitwise():
    """A 7B-like shape (in 18944: the split reduction across warps), run twice: same bits."""
    rng = np.random.default_rng(7)
    in_dim, out_dim = 18944, 256
    raw, deq = make_weight(Q.Q6_K, out_dim, in_dim, rng)
    x = rng.standard_normal((1, in_dim)).astype(np.float32)
    r = Rig()
    wh = r.weight("w", raw, Q.Q6_K, in_dim, out_dim)
    xi, yi = r.buf(x), r.out(out_dim)
    plan = r.plan([("matmul", [yi, xi], [in_dim, out_dim, 1], [], [wh, -1])])
    r.run(plan)
    a = r.read(yi, out_dim)
    r.run(plan)
    b = r.read(yi, out_dim)
    assert a.tobytes() == b.tobytes()
    check_matvec(a.reshape(1, -1).astype(np.float64), x, deq, Q.Q6_K)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_get_rows_from_quantized_table(qtype):
    rng = np.random.default_rng(int(qtype))
    d, n_rows = in_dim_for(qtype), 50
    raw, deq = make_weight(qtype, n_rows, d, rng)
    ids = np.array([3, 0, 49, 3, 17], np.int32)
    r = Rig()
    th = r.weight("t", raw, qtype, d, n_rows)
    ii, yi = r.buf(ids), r.out(len(ids) * d)
    r.run(r.plan([("get_rows_w", [yi, ii], [d, len(ids), n_rows], [], [th])]))
    got = r.read(yi, len(ids) * d).reshape(len(ids), d)
    # Decoding is exact up to one f32 rounding (a contracted d*q - m may differ by an ulp).
    np.testing.assert_allclose(got, deq[ids], rtol=2e-7, atol=1e-7 * np.abs(deq).max())


def test_bad_token_id_is_an_error_at_readback():
    rng = np.random.default_rng(0)
    raw, _ = make_weight(Q.Q8_0, 10, 64, rng)
    r = Rig()
    th = r.weight("t", raw, Q.Q8_0, 64, 10)
    ii, yi = r.buf(np.array([1, 10], np.int32)), r.out(2 * 64)
    plan = r.plan([("get_rows_w", [yi, ii], [64, 2, 10], [], [th])])
    _core.cuda_run(plan, r.pool, r.weights)
    with pytest.raises(ValueError, match="token id outside the vocabulary"):
        r.read(yi, 2 * 64)
    r.pool.write(ii, np.array([1, 9], np.int32))
    r.run(plan)  # the flag was consumed: a good run reads back cleanly
    assert np.isfinite(r.read(yi, 128)).all()


def _rms64(x, w, eps):
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


@pytest.mark.parametrize("d,nrows", [(896, 1), (256, 7), (64, 28), (3584, 3)])
def test_rms_norm(d, nrows):
    rng = np.random.default_rng(d)
    x = rng.standard_normal((nrows, d)).astype(np.float32) * 3
    w = rng.standard_normal(d).astype(np.float32)
    r = Rig()
    wh = r.weight("n", w, Q.F32, d, 1)
    xi, yi = r.buf(x), r.out(nrows * d)
    r.run(r.plan([("rms_norm", [yi, xi], [d, nrows], [1e-6], [wh])]))
    got = r.read(yi, nrows * d).reshape(nrows, d)
    np.testing.assert_allclose(got, _rms64(x, w, 1e-6), rtol=1e-6, atol=1e-6)


def _rope64(x, pos, nh, hd, n_rot, base):
    x = x.astype(np.float64).reshape(len(pos), nh, hd).copy()
    half = n_rot // 2
    inv = base ** (-2.0 * np.arange(half) / n_rot)
    th = np.asarray(pos, np.float64)[:, None] * inv[None, :]
    c, s = np.cos(th)[:, None, :], np.sin(th)[:, None, :]
    x0, x1 = x[..., :half].copy(), x[..., half:n_rot].copy()
    x[..., :half] = x0 * c - x1 * s
    x[..., half:n_rot] = x0 * s + x1 * c
    return x.reshape(len(pos), -1)


@pytest.mark.parametrize("nh,hd,n_rot", [(14, 64, 64), (4, 128, 64)])
def test_rope_neox(nh, hd, n_rot):
    rng = np.random.default_rng(hd)
    pos = np.array([0, 1, 77, 4095, 30000], np.int32)
    x = rng.standard_normal((len(pos), nh * hd)).astype(np.float32)
    r = Rig()
    xi, pi, yi = r.buf(x), r.buf(pos), r.out(x.size)
    r.run(r.plan([("rope", [yi, xi, pi], [len(pos), nh, hd, n_rot], [1e6], [])]))
    got = r.read(yi, x.size).reshape(x.shape)
    np.testing.assert_allclose(got, _rope64(x, pos, nh, hd, n_rot, 1e6), rtol=0, atol=2e-6)


def _silu64(x):
    x = x.astype(np.float64)
    return x / (1 + np.exp(-x))


def test_elementwise():
    rng = np.random.default_rng(1)
    n = 4097
    a = rng.standard_normal(n).astype(np.float32) * 5
    b = rng.standard_normal(n).astype(np.float32)
    r = Rig()
    ai, bi = r.buf(a), r.buf(b)
    outs = {k: r.out(n) for k in ("add", "mul", "silu", "swiglu")}
    r.run(r.plan([("add", [outs["add"], ai, bi], [n], [], []), ("mul", [outs["mul"], ai, bi], [n], [], []),
                  ("silu", [outs["silu"], ai], [n], [], []), ("swiglu", [outs["swiglu"], ai, bi], [n], [], [])]))
    assert np.array_equal(r.read(outs["add"], n), a + b)
    assert np.array_equal(r.read(outs["mul"], n), a * b)
    np.testing.assert_allclose(r.read(outs["silu"], n), _silu64(a), rtol=2e-6, atol=1e-30)
    np.testing.assert_allclose(r.read(outs["swiglu"], n), _silu64(a) * b, rtol=3e-6, atol=1e-30)


def _attn64(q, K, V, pos, nh, nkv, hd, span=None):
    """float64 causal GQA attention over f16-rounded K/V rows (span: rows of four ints,
    common/attn_span.h)."""
    from test_cpu_ops import span_cells

    nt = q.shape[0]
    out = np.zeros((nt, nh * hd))
    g = nh // nkv
    for t in range(nt):
        cells = np.arange(pos[t] + 1) if span is None else span_cells(tuple(span[t]))
        for h in range(nh):
            kh = h // g
            k = K[cells, kh * hd:(kh + 1) * hd].astype(np.float64)
            v = V[cells, kh * hd:(kh + 1) * hd].astype(np.float64)
            s = k @ q[t, h * hd:(h + 1) * hd].astype(np.float64) / np.sqrt(hd)
            p = np.exp(s - s.max())
            out[t, h * hd:(h + 1) * hd] = p @ v / p.sum()
    return out


def _tensor_core_attention(nt, hd):
    """Blocks the tensor-core kernel (k_attn_prefill.cu) takes: Q and P rounded to f16."""
    return nt > _core.CUDA_ROW_EXACT_MAX_TOKENS and hd in (32, 64, 128)


# Tensor-core attention: the reference gets the f16-rounded q the kernel multiplies; what
# is left is P's f16 rounding (relative 2^-11 of each weight, |V| <= ~4 here).
TC_ATTN_ATOL = 2e-3


@pytest.mark.parametrize("pos", [13, 37])
@pytest.mark.parametrize("hd,n_rot", [(64, 64), (128, 128), (128, 64), (64, 40), (64, 38)])
def test_qkv_rope_store_tail_bitwise(hd, n_rot, pos):
    """q|k|v in one matvec launch that also ropes q and k and stores k and v into the f16
    KV cache (FUSE_QKV | FUSE_ROPE) gives the bits of the three matvecs, the two ropes and
    the KV store launched apart: with each block roping whole pairs of its own rows (when
    n_rot and hd - n_rot are multiples of 4) or else the last block of each head, found by
    a ticket (n_rot 38), the angles taken before the wait from the table of angles by
    position (which covers positions below n_ctx: 13, not 37) or worked out; partial
    rotary dims pass through. Runs direct, captured and replayed."""
    rng = np.random.default_rng(hd + n_rot)
    d, nh, nkv, n_ctx, cell = 256, 4, 2, 16, 5
    qd, kd = nh * hd, nkv * hd
    raws = [make_weight(t, n, d, rng)[0] for t, n in ((Q.Q4_K, qd), (Q.Q5_0, kd), (Q.Q8_0, kd))]
    biases = [rng.standard_normal(n).astype(np.float32) for n in (qd, kd, kd)]
    x = rng.standard_normal(d).astype(np.float32)
    outs = {}
    for flags in (0, 1, 1 | 32):
        r = Rig()
        ws = [r.weight(n, raw, t, d, rows) for n, raw, t, rows in
              zip("qkv", raws, (Q.Q4_K, Q.Q5_0, Q.Q8_0), (qd, kd, kd))]
        bs = [r.weight("b" + n, b, Q.F32, b.size, 1) for n, b in zip("qkv", biases)]
        xi, pi, ci = r.buf(x), r.buf(np.array([pos], np.int32)), r.buf(np.array([cell], np.int32))
        yq, yk, yv, rq, rk = r.out(qd), r.out(kd), r.out(kd), r.out(qd), r.out(kd)
        kc, vc = r.out(n_ctx * kd, 2), r.out(n_ctx * kd, 2)
        plan = r.plan([("matmul", [yq, xi], [d, qd, 1], [], [ws[0], bs[0]]),
                       ("matmul", [yk, xi], [d, kd, 1], [], [ws[1], bs[1]]),
                       ("matmul", [yv, xi], [d, kd, 1], [], [ws[2], bs[2]]),
                       ("rope", [rq, yq, pi], [1, nh, hd, n_rot], [1e6], []),
                       ("rope", [rk, yk, pi], [1, nkv, hd, n_rot], [1e6], []),
                       ("kv_store", [kc, rk, yv, ci, vc], [1, kd, n_ctx, F16_KV], [], [])])
        plan.flags = flags
        _core.cuda_validate(plan, r.pool, r.weights)
        assert _core.testing.cuda_plan_info(plan)["launches"] == {0: 6, 1: 2, 33: 1}[flags]
        for _ in range(3):
            r.run(plan)
            got = [r.read(rq, qd).tobytes(), r.read(rk, kd).tobytes(),
                   r.read(kc, n_ctx * kd, "float16").tobytes(), r.read(vc, n_ctx * kd, "float16").tobytes()]
            assert outs.setdefault(flags, got) == got
    base = outs[0]
    for key, got in outs.items():
        assert got == base, key
    k16 = np.frombuffer(base[2], np.float16).reshape(n_ctx, kd)
    assert np.array_equal(k16[cell], np.frombuffer(base[1], np.float32).astype(np.float16))


@pytest.mark.parametrize("nt,start,nh,nkv,hd,n_ctx", [
    (1, 0, 14, 2, 64, 640), (1, 600, 14, 2, 64, 640), (1, 1500, 28, 4, 128, 2048),
    (37, 0, 8, 2, 64, 64), (33, 100, 4, 1, 32, 256), (3, 9, 4, 2, 256, 300),
    (200, 300, 28, 4, 128, 1024), (130, 0, 14, 2, 64, 130), (17, 40, 4, 4, 128, 64), (40, 5, 4, 2, 256, 64)])
def test_kv_store_and_attention(nt, start, nh, nkv, hd, n_ctx):
    """KV store then attention against float64, and the same bits run after run (the
    decode kernel with head dims up to 64 issues q's load, then a warp's first group's K
    and V loads, before q is in shared memory; a one-split head is merged by the block's
    warps side by side)."""
    rng = np.random.default_rng(nt * 1000 + start)
    kv_dim = nkv * hd
    # A history already in the cache, then nt new tokens stored and attended.
    hist = start
    pos = np.arange(start, start + nt, dtype=np.int32)
    Kall = rng.standard_normal((n_ctx, kv_dim)).astype(np.float32)
    Vall = rng.standard_normal((n_ctx, kv_dim)).astype(np.float32)
    q = rng.standard_normal((nt, nh * hd)).astype(np.float32)
    r = Rig()
    Kreg = r.buf(np.where(np.arange(n_ctx)[:, None] < hist, Kall, 0).astype(np.float16))
    # Cells beyond the last position were never written: NaN there must not leak in.
    Vreg = r.buf(np.where(np.arange(n_ctx)[:, None] < hist, Vall,
                          np.where(np.arange(n_ctx)[:, None] >= start + nt, np.nan, 0)).astype(np.float16))
    ki, vi = r.buf(Kall[pos]), r.buf(Vall[pos])
    pi, qi, yi = r.buf(pos), r.buf(q), r.out(nt * nh * hd)
    plan = r.plan([("kv_store", [Kreg, ki, vi, pi, Vreg], [nt, kv_dim, n_ctx, F16_KV], [], []),
                   ("attn", [yi, qi, Kreg, Vreg, pi, -1], [nt, nh, nkv, hd, n_ctx, nh * hd, F16_KV], [hd**-0.5], [])])
    r.run(plan)
    got = r.read(yi, nt * nh * hd).reshape(nt, nh * hd)
    K16 = Kall.astype(np.float16).astype(np.float32)
    V16 = Vall.astype(np.float16).astype(np.float32)
    if _tensor_core_attention(nt, hd):
        want = _attn64(q.astype(np.float16), K16, V16, pos, nh, nkv, hd)
        np.testing.assert_allclose(got, want, rtol=0, atol=TC_ATTN_ATOL)
    else:
        want = _attn64(q, K16, V16, pos, nh, nkv, hd)
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)
    r.run(plan)
    assert r.read(yi, nt * nh * hd).tobytes() == got.tobytes()


@pytest.mark.parametrize("nt,hd", [(3, 64), (70, 64), (90, 128), (20, 32)])
def test_attention_explicit_span(nt, hd):
    """Per-row spans (several sequences in one block): empty, one cell, disjoint, ragged,
    and every other row after a shared prefix read in place (anywhere in the arena)."""
    rng = np.random.default_rng(5 + nt)
    nh, nkv, n_ctx = 4, 2, 160
    K = rng.standard_normal((n_ctx, nkv * hd)).astype(np.float16)
    V = rng.standard_normal((n_ctx, nkv * hd)).astype(np.float16)
    q = rng.standard_normal((nt, nh * hd)).astype(np.float32)
    pos = np.arange(10, 10 + nt, dtype=np.int32)
    lo = rng.integers(0, n_ctx, nt)
    hi = np.minimum(n_ctx, lo + rng.integers(0, 90, nt))
    plo = rng.integers(0, n_ctx, nt)
    phi = np.where(np.arange(nt) % 2 == 1, np.minimum(n_ctx, plo + rng.integers(1, 70, nt)), plo)
    span = np.stack([lo, hi, plo, phi], 1).astype(np.int32)
    span[0] = [0, 11, 0, 0]
    span[1 % nt] = [12, 13, 100, 140]
    if nt > 2:
        span[2] = [7, 7, 3, 3]  # no cell: output zeros
    r = Rig()
    Ki, Vi, qi, pi, si, yi = r.buf(K), r.buf(V), r.buf(q), r.buf(pos), r.buf(span), r.out(nt * nh * hd)
    r.run(r.plan([("attn", [yi, qi, Ki, Vi, pi, si], [nt, nh, nkv, hd, n_ctx, nh * hd, F16_KV], [hd**-0.5], [])]))
    got = r.read(yi, nt * nh * hd).reshape(nt, -1)
    tc = _tensor_core_attention(nt, hd)
    want = np.zeros((nt, nh * hd))
    ok = (span[:, 1] > span[:, 0]) | (span[:, 3] > span[:, 2])
    want[ok] = _attn64((q.astype(np.float16) if tc else q)[ok], K.astype(np.float32), V.astype(np.float32),
                       pos[ok], nh, nkv, hd, span=span[ok])
    np.testing.assert_allclose(got, want, rtol=0, atol=TC_ATTN_ATOL if tc else 2e-5)
    assert not got[~ok].any()


@pytest.mark.parametrize("nt,hd,window", [(1, 64, 0), (5, 128, 0), (7, 64, 700), (3, 256, 0), (40, 96, 0)])
def test_a_prefix_read_in_place_gives_the_bits_of_the_same_cells_copied(nt, hd, window):
    """The row-exact decode kernel (up to 64 rows, split over a 2048-cell context): a
    row whose first cells are another sequence's, read in place, gets bitwise what it
    gets with those cells copied in front of its own, whatever the split lengths, and
    a window cutting into the prefix cuts the same cells."""
    rng = np.random.default_rng(31 + nt + hd)
    nh, nkv, n_ctx, n_pre = 4, 2, 2048, 900
    K = rng.standard_normal((n_ctx, nkv * hd)).astype(np.float16)
    V = rng.standard_normal((n_ctx, nkv * hd)).astype(np.float16)
    q = rng.standard_normal((nt, nh * hd)).astype(np.float32)
    own = 1000 + n_pre + 3 * np.arange(nt)           # each row's own cells: [1000 + n_pre, own + 1)
    K[1000:1000 + n_pre], V[1000:1000 + n_pre] = K[:n_pre], V[:n_pre]   # the prefix, copied in front
    pos = (own - 1000).astype(np.int32)
    shared = np.stack([np.full(nt, 1000 + n_pre), own + 1, np.zeros(nt), np.full(nt, n_pre)], 1).astype(np.int32)
    copied = np.stack([np.full(nt, 1000), own + 1, np.zeros(nt), np.zeros(nt)], 1).astype(np.int32)
    outs = []
    for span in (shared, copied):
        r = Rig()
        Ki, Vi, qi, pi, si, yi = r.buf(K), r.buf(V), r.buf(q), r.buf(pos), r.buf(span), r.out(nt * nh * hd)
        r.run(r.plan([("attn", [yi, qi, Ki, Vi, pi, si], [nt, nh, nkv, hd, n_ctx, nh * hd, F16_KV, window, n_ctx],
                       [hd**-0.5], [])]))
        outs.append(r.read(yi, nt * nh * hd).reshape(nt, -1))
    assert outs[0].tobytes() == outs[1].tobytes()
    want = _attn64(q, K.astype(np.float32), V.astype(np.float32), pos, nh, nkv, hd,
                   span=np.stack([np.maximum(1000, own + 1 - window) if window else np.full(nt, 1000), own + 1,
                                  np.zeros(nt), np.zeros(nt)], 1))
    np.testing.assert_allclose(outs[0], want, rtol=0, atol=2e-5)


@pytest.mark.parametrize("nt,nh,nkv,hd", [(1, 14, 2, 64), (4, 28, 4, 128), (1, 8, 8, 32)])
def test_split_attention_is_one_launch_and_reusable(nt, nh, nkv, hd):
    """Decode attention over several KV chunks merges them inside its one launch (the
    last chunk to finish, by an integer ticket). Two attention steps share the plan's
    tickets; the plan runs direct, is captured, and replays, with fresh q and positions
    each time and the outputs poisoned in between: every run must match float64 (a
    ticket left nonzero would leave the poison in place), and a replay at the direct
    run's inputs must give its bits."""
    n_ctx = 2048
    rng = np.random.default_rng(nt * 7 + hd)
    kv_dim = nkv * hd
    K = rng.standard_normal((n_ctx, kv_dim)).astype(np.float16)
    V = rng.standard_normal((n_ctx, kv_dim)).astype(np.float16)
    r = Rig()
    Ki, Vi = r.buf(K), r.buf(V)
    qa, qb = r.buf(np.zeros((nt, nh * hd), np.float32)), r.buf(np.zeros((nt, nh * hd), np.float32))
    pi = r.buf(np.zeros(nt, np.int32))
    ya, yb = r.out(nt * nh * hd), r.out(nt * nh * hd)
    ip = [nt, nh, nkv, hd, n_ctx, nh * hd, F16_KV]
    plan = r.plan([("attn", [ya, qa, Ki, Vi, pi, -1], ip, [hd**-0.5], []),
                   ("attn", [yb, qb, Ki, Vi, pi, -1], ip, [hd**-0.5], [])])
    Kf, Vf = K.astype(np.float32), V.astype(np.float32)
    poison = np.full(nt * nh * hd, np.nan, np.float32)
    n = nt * nh * hd
    qs = [rng.standard_normal((2, nt, nh * hd)).astype(np.float32) for _ in range(4)]
    runs = [(1000, qs[0]), (5, qs[1]), (2047 - nt, qs[2]), (300, qs[3]), (1000, qs[0])]
    outs = []
    for k, (p0, (q1, q2)) in enumerate(runs):
        pos = np.arange(p0, p0 + nt, dtype=np.int32)
        for bid, arr in ((qa, q1), (qb, q2), (pi, pos), (ya, poison), (yb, poison)):
            r.pool.write(bid, arr)
        if k == 0:
            _core.cuda_sync()
            _core.testing.cuda_reset_counters()
        r.run(plan)
        if k == 0:
            assert _core.testing.cuda_counters()["launches"] == 2, "one launch per attention step"
        for y, q in ((ya, q1), (yb, q2)):
            got = r.read(y, n).reshape(nt, -1)
            np.testing.assert_allclose(got, _attn64(q, Kf, Vf, pos, nh, nkv, hd), rtol=0, atol=2e-5,
                                       err_msg=f"run {k} at position {p0}")
        outs.append(r.read(ya, n).tobytes() + r.read(yb, n).tobytes())
    assert outs[4] == outs[0], "graph replay vs the direct run at the same inputs"
    info = _core.testing.cuda_plan_info(plan)
    assert info["captured"] and info["launches"] == 2


def test_pool_group_writes_adjacent_members_in_one_copy():
    """alloc_group carves buffers from one block; write_many sends consecutive members
    as one H2D (the padding between them rides along, nothing else), others apart; a
    freed group comes back whole and zero-filled; plain alloc never takes a member."""
    pool = _core.CudaPool("grp")
    ids = pool.alloc_group([4, 4, 12, 40])
    assert len(set(ids)) == 4
    rng = np.random.default_rng(2)
    vals = [rng.integers(-9, 9, size=k, dtype=np.int32) for k in (1, 1, 3, 10)]
    _core.cuda_sync()
    _core.testing.cuda_reset_counters()
    pool.write_many(ids[:3], vals[:3])
    c = _core.testing.cuda_counters()
    assert c["h2d"] == 1 and c["h2d_bytes"] == 16 + 16 + 12, c
    for i, v in zip(ids[:3], vals[:3]):
        assert np.array_equal(pool.read(i, "int32", v.size), v)
    assert np.array_equal(pool.read(ids[3], "int32", 10), np.zeros(10, np.int32)), "an unwritten member is untouched"
    _core.testing.cuda_reset_counters()
    other = pool.alloc(4)
    assert other not in ids
    new = [v + 100 for v in vals]
    pool.write_many([ids[3], ids[0], other], [new[3], new[0], new[1]])  # not adjacent: one copy each
    assert _core.testing.cuda_counters()["h2d"] == 3
    assert np.array_equal(pool.read(ids[0], "int32", 1), new[0])
    assert np.array_equal(pool.read(ids[1], "int32", 1), vals[1]), "the member between was not overwritten"
    assert np.array_equal(pool.read(ids[3], "int32", 10), new[3])
    assert np.array_equal(pool.read(other, "int32", 1), new[1])
    with pytest.raises(ValueError, match="whole buffers"):
        pool.write_many([ids[2]], [vals[0]])
    for i in ids:
        pool.free(i)
    assert pool.alloc(4) not in ids, "plain alloc takes no group member"
    again = pool.alloc_group([4, 4, 12, 40])
    assert again == ids
    assert np.array_equal(pool.read(ids[3], "int32", 10), np.zeros(10, np.int32)), "zero-filled on reuse"


def test_device_argmax_first_on_ties():
    r = Rig()
    x = np.random.default_rng(3).standard_normal(151936).astype(np.float32)
    x[[70000, 90000]] = 50.0
    xi = r.buf(x)
    assert _core.argmax(r.pool, xi, x.size, 1) == 70000
    x[5] = 60.0
    r.pool.write(xi, x)
    assert _core.argmax(r.pool, xi, x.size, 1) == 5


@pytest.mark.parametrize("n", [1, 7, 2048, 2049, 32000, 300001])
def test_device_argmax_sizes_and_ties(n):
    """The argmax folds many blocks' winners: the first maximum wins wherever the ties
    fall (one slice, neighbouring slices, far apart), at sizes around the slicing."""
    r = Rig()
    rng = np.random.default_rng(n)
    x = rng.integers(-50, 50, n).astype(np.float32)  # many exact ties below the max
    xi = r.buf(x)
    assert _core.argmax(r.pool, xi, n, 1) == int(np.argmax(x))
    for picks in ([n - 1], [n // 2, n - 1], [n // 3, n // 3 + 1, n // 2], [0, n - 1]):
        picks = [k for k in picks if k < n]
        y = x.copy()
        y[picks] = 99.0
        r.pool.write(xi, y)
        assert _core.argmax(r.pool, xi, n, 1) == min(picks), picks


def test_device_argmax_rows():
    """A verified block's greedy picks: every row's argmax in one launch (first on ties,
    each row its own slice of the scratch), -1 for exactly the rows holding NaN/Inf."""
    r = Rig()
    rng = np.random.default_rng(9)
    n, rows = 151936, 9
    x = rng.integers(-50, 50, (rows, n)).astype(np.float32)
    for i in range(rows):
        x[i, [(i * 7919) % n, (i * 7919 + 3) % n]] = 60.0 + i  # a tie per row
    xi = r.buf(x)
    want = [int(np.argmax(row)) for row in x]
    assert _core.argmax_rows(r.pool, xi, n, rows) == want
    assert _core.argmax_rows(r.pool, xi, n, 1) == want[:1]
    y = x.copy()
    y[3, 100] = np.nan
    y[8, n - 1] = np.inf
    r.pool.write(xi, y)
    got = _core.argmax_rows(r.pool, xi, n, rows)
    assert got == [-1 if i in (3, 8) else want[i] for i in range(rows)]
    r.pool.write(xi, x)
    assert _core.argmax_rows(r.pool, xi, n, rows) == want  # tickets left at zero
    with pytest.raises(ValueError):
        _core.argmax_rows(r.pool, xi, n, 65)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_device_argmax_flags_non_finite(bad):
    """The greedy loop's NaN/Inf check rides on the argmax's 4-byte answer: -1 for a
    row holding a non-finite value anywhere (first, last, beside the max), the index
    otherwise; the buffer is rewritten in between so a stale answer cannot pass."""
    r = Rig()
    x = np.random.default_rng(4).standard_normal(151936).astype(np.float32)
    x[1234] = 40.0
    xi = r.buf(x)
    for k in (0, 1235, x.size - 1):
        y = x.copy()
        y[k] = bad
        r.pool.write(xi, y)
        assert _core.argmax(r.pool, xi, y.size, 1) == -1, f"{bad} at {k}"
        r.pool.write(xi, x)
        assert _core.argmax(r.pool, xi, x.size, 1) == 1234


def _top_k_want(row, k):
    """The CPU's candidates: _core.top_k's ids (best first, ties by lower index)."""
    ids = _core.top_k(np.ascontiguousarray(row, np.float32), k)
    return None if ids is None else ids.astype(np.int64)


@pytest.mark.parametrize("n,k", [(1, 1), (7, 3), (2048, 40), (2049, 256), (32000, 1), (151936, 40),
                                 (151936, 104), (151936, 256), (300001, 64)])
def test_device_top_k_equals_cpu_top_k(n, k):
    """Sampling's candidates on the device are the CPU top_k's, in its order, on rows
    with many exact ties (integers), ties straddling the k-th place, -0 beside +0 and
    a slice boundary inside the winners; the gathered values are the row's."""
    r = Rig()
    rng = np.random.default_rng(n + k)
    rows = 3
    x = rng.integers(-60, 60, (rows, n)).astype(np.float32)
    x[1] = rng.standard_normal(n).astype(np.float32)
    if n > 4100:
        x[2, 2040:2060] = 500.0  # winners on both sides of a 2048-value slice boundary
        x[2, 4090:4100] = -0.0
        x[2, 4100:4105] = 0.0
    xi = r.buf(x)
    g = min(5, n)
    gather = rng.integers(0, n, (rows, g)).astype(np.int32)
    gather[0, 0] = -1
    k = min(k, n)
    got = _core.top_k_rows(r.pool, xi, n, rows, k, gather)
    assert len(got) == rows
    for i in range(rows):
        ids, vals, gv = got[i]
        want = _top_k_want(x[i], k)
        assert np.array_equal(ids, want), (i, ids[:8], want[:8])
        assert np.array_equal(vals, x[i][want])
        assert np.array_equal(gv, np.where(gather[i] >= 0, x[i][np.maximum(gather[i], 0)], 0.0).astype(np.float32))
    one = _core.top_k_rows(r.pool, xi, n, 1, k, gather[:1])
    assert np.array_equal(one[0][0], _top_k_want(x[0], k))
    with pytest.raises(ValueError):
        _core.top_k_rows(r.pool, xi, n, 1, _core.top_k_max + 1, gather[:1])
    with pytest.raises(ValueError):
        _core.top_k_rows(r.pool, xi, n, 1, 1, np.array([[n]], np.int32))


def test_device_top_k_from_two_threads():
    """Two threads selecting candidates at once (two contexts of one process), with
    different k and gathers so the shared readback buffers also grow meanwhile: each
    thread gets its own row's answer every time."""
    import threading
    rigs = [Rig(), Rig()]
    n = 151936
    rng = np.random.default_rng(12)
    rows = [rng.standard_normal(n).astype(np.float32) for _ in rigs]
    bufs = [rig.buf(row) for rig, row in zip(rigs, rows)]
    bad = []

    def work(i):
        for j in range(60):
            k = 40 + 37 * i + j
            gather = np.array([[i, 7 + j]], np.int32)
            ids, vals, gv = _core.top_k_rows(rigs[i].pool, bufs[i], n, 1, k, gather)[0]
            if not (np.array_equal(ids, _top_k_want(rows[i], k)) and np.array_equal(gv, rows[i][gather[0]])):
                bad.append((i, j))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad, bad[:5]


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_device_top_k_flags_non_finite(bad):
    """A row holding NaN or Inf anywhere answers None (the sampler then reads the row
    to word the error); the other rows and the next call are unaffected."""
    r = Rig()
    n = 151936
    x = np.random.default_rng(5).standard_normal((2, n)).astype(np.float32)
    xi = r.buf(x)
    none = np.zeros((2, 0), np.int32)
    for at in (0, 70000, n - 1):
        y = x.copy()
        y[1, at] = bad
        r.pool.write(xi, y)
        got = _core.top_k_rows(r.pool, xi, n, 2, 40, none)
        assert got[1] is None, f"{bad} at {at}"
        assert np.array_equal(got[0][0], _top_k_want(x[0], 40))
        r.pool.write(xi, x)
        got = _core.top_k_rows(r.pool, xi, n, 2, 40, none)
        assert np.array_equal(got[1][0], _top_k_want(x[1], 40)), "the flag was left set"


# ------------------------------------------------------------------ whole models

from test_e2e_synthetic import IDEAL_TOL, MARGIN, MODELS, _row_err, _sequences  # noqa: E402
from reference_forward import ReferenceModel  # noqa: E402

from minfer.session import Session  # noqa: E402
from minfer.testing.synth import write_model  # noqa: E402

# CUDA vs CPU logits, max |diff| / std per position. The CPU rounds every quantized
# matmul input to 8 bits (up to 0.12 from the float64 reference, see IDEAL_TOL), CUDA
# feeds f32 (decode) or f16 (prefill) activations, so their distance is bounded by the
# CPU's own error plus CUDA's (measured on the GPU machine, see the report in the test
# output); 0.2 keeps the same margin against O(1) bugs as IDEAL_TOL.
CUDA_CPU_TOL = 0.2


@pytest.fixture(scope="module", params=sorted(MODELS))
def synth(request, tmp_path_factory):
    name = request.param
    path = tmp_path_factory.mktemp("cuda-synth") / f"{name}.gguf"
    write_model(path, **MODELS[name])
    return name, path, ReferenceModel(str(path))


def _engine(path, backends, **kw):
    return Session.open(path, n_ctx=kw.pop("n_ctx", 128), backends=backends, **kw)


def test_engine_runs_on_cuda_by_priority(synth):
    _, path, _ = synth
    eng = _engine(path, None)
    assert eng.backend_names[0] == "CUDA"
    eng.forward([1, 2, 3])
    regions = list(eng.context.cache.alloc.kv.values())
    assert regions and all(r.kv_type.value == "f16" for r in regions)  # CUDA holds f16 K/V
    splits = eng.context.cache.splits
    assert len(splits) == 1 and splits[0].backend == cuda_backend.ENTRY.id, "qwen graphs are one CUDA split"


def test_prefill_and_decode_vs_reference_and_cpu(synth):
    name, path, ref = synth
    gpu, cpu = _engine(path, ["cuda"]), _engine(path, ["cpu"])
    errs = []
    for seq in _sequences(ref.n_vocab, 10):
        for eng in (gpu, cpu):
            eng.reset()
        # chunked prefill then decode steps
        cut = max(1, len(seq) // 2)
        g = np.concatenate([gpu.forward(seq[:cut], n_out=cut)] + [gpu.forward([t]) for t in seq[cut:]])
        c = np.concatenate([cpu.forward(seq[:cut], n_out=cut)] + [cpu.forward([t]) for t in seq[cut:]])
        want = ref.logits(seq)
        ideal = _row_err(g, want)
        assert ideal.max() < IDEAL_TOL, f"{name}: CUDA vs float64 reference {np.round(ideal, 4)}"
        vs_cpu = _row_err(g, c.astype(np.float64))
        assert vs_cpu.max() < CUDA_CPU_TOL, f"{name}: CUDA vs CPU {np.round(vs_cpu, 4)}"
        top2 = np.sort(want, axis=-1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > MARGIN
        assert np.array_equal(g.argmax(-1)[clear], want.argmax(-1)[clear])
        errs.append((ideal.max(), vs_cpu.max()))
    print(f"\n{name}: max err vs float64 {max(e[0] for e in errs):.4f}, vs CPU {max(e[1] for e in errs):.4f}")


def _decode_run(path, seq, n_steps, **kw):
    eng = _engine(path, ["cuda"], **kw)
    out = [eng.forward(seq, n_out=len(seq))]
    t = int(out[0][-1].argmax())
    for _ in range(n_steps):
        lg = eng.forward([t])
        out.append(lg)
        t = int(lg[-1].argmax())
    return np.concatenate(out)


def test_bitwise_run_vs_run_replay_vs_direct_reuse_vs_rebuild(synth, monkeypatch):
    _, path, ref = synth
    seq = _sequences(ref.n_vocab, 3)[2]
    a = _decode_run(path, seq, 6)
    b = _decode_run(path, seq, 6)
    assert a.tobytes() == b.tobytes(), "run vs run"
    c = _decode_run(path, seq, 6, reuse=False)
    assert a.tobytes() == c.tobytes(), "reuse vs rebuild"
    monkeypatch.setenv("MINFER_NO_CUDA_GRAPH", "1")
    d = _decode_run(path, seq, 6)
    assert a.tobytes() == d.tobytes(), "graph replay vs direct launches"


def test_one_call_step_equals_the_general_path(synth, monkeypatch):
    """A reused decode step in one core call (cuda_step: the three inputs' H2D and the
    replay) gives the general path's bits (fill_inputs + execute)."""
    _, path, ref = synth
    seq = _sequences(ref.n_vocab, 3)[2]
    eng = _engine(path, ["cuda"])
    out = [eng.forward(seq, n_out=len(seq))]
    t = int(out[0][-1].argmax())
    for copy in (True, False, True, None, True, False):
        lg = eng.forward([t], copy=copy)
        t = eng.argmax_last() if copy is None else int(lg[-1].argmax())
        out.append(np.array(lg) if copy is not None else eng.context.cache.alloc.copy_to_host(
            eng.context.cache.graph.outputs[0]))
    assert eng.context._step is not None, "the decode graph bound its one-call step"
    monkeypatch.setattr(cuda_backend.CudaDevice, "bind_step", None)
    slow = _engine(path, ["cuda"])
    want = [slow.forward(seq, n_out=len(seq))]
    t = int(want[0][-1].argmax())
    for _ in range(6):
        want.append(slow.forward([t]))
        t = int(want[-1][-1].argmax())
    assert slow.context._step is None
    assert np.concatenate(out).tobytes() == np.concatenate(want).tobytes()


def test_prefill_gemm_pipeline_bitwise_on_models(synth, monkeypatch):
    """An 80-token prefill (the f16 GEMM path, logits of every row: the output GEMM too)
    with the weight dequantization pipelined on the side stream and the f16 inputs
    shared (or written by the RMSNorm producing them), direct, captured and replayed,
    gives bitwise the logits of direct launches (MINFER_NO_CUDA_GRAPH=1), and stays within
    CUDA_CPU_TOL of the CPU. (In-line dequantization, which partial runs take, is checked
    against the pipeline step by step in test_prefill_gemm_pipeline_bitwise_and_vs_float64.)"""
    name, path, ref = synth
    seq = (_sequences(ref.n_vocab, 6)[3] * 2)[:80]
    assert len(seq) > _core.CUDA_ROW_EXACT_MAX_TOKENS

    def prefills(env):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        eng = _engine(path, ["cuda"])
        outs = []
        for _ in range(3):  # direct, captured, replayed
            eng.reset()
            outs.append(eng.forward(seq, n_out=len(seq)))
        info = _core.testing.cuda_plan_info(eng.context.cache.lowered.splits[0].plan)
        for k in env:
            monkeypatch.delenv(k)
        return outs, info

    on, info = prefills({})
    quantized = any(t not in ("F16", "F32") for t in MODELS[name].get("types", {}).values())
    assert (info["gemm_pipelined"] > 0) == quantized, info
    # per layer: q and gate from their norm's f16 copy; k, v and up from the GEMM before
    assert info["gemm_inputs_reused"] >= 5 * MODELS[name]["n_layer"] * quantized, info
    assert info["captured"], info
    for k in (1, 2):
        assert on[k].tobytes() == on[0].tobytes(), f"{name}: {'replay' if k == 2 else 'capture'} vs direct"
    outs, _ = prefills({"MINFER_NO_CUDA_GRAPH": "1"})
    for k, o in enumerate(outs):
        assert o.tobytes() == on[0].tobytes(), f"{name}: direct launches, run {k} vs the pipelined prefill"
    cpu = _engine(path, ["cpu"]).forward(seq, n_out=len(seq))
    vs_cpu = _row_err(on[0], cpu.astype(np.float64))
    assert vs_cpu.max() < CUDA_CPU_TOL, f"{name}: CUDA vs CPU {np.round(vs_cpu, 4)}"


def test_decode_graph_is_captured_and_replayed(synth):
    _, path, _ = synth
    eng = _engine(path, ["cuda"])
    eng.forward([5, 6, 7], n_out=1)
    for t in range(4):
        eng.forward([t])
    ls = eng.context.cache.lowered.splits[0]
    info = _core.testing.cuda_plan_info(ls.plan)
    assert info["captured"] and info["graph_nodes"] >= info["launches"] > 0


def test_reused_greedy_step_budget(synth):
    """What a reused greedy decode step costs the host, as the generation loop runs it."""
    _, path, _ = synth
    eng = _engine(path, ["cuda"])
    eng.forward([5, 6, 7], n_out=1)
    t = 1
    for _ in range(3):  # direct run, capture, first replay
        eng.forward([t], copy=None)
        t = eng.argmax_last()
    n = 16
    _core.cuda_sync()
    _core.testing.cuda_reset_counters()
    for _ in range(n):
        eng.forward([t], copy=None)
        t = eng.argmax_last()
    c = _core.testing.cuda_counters()
    print(f"\nper-step counters over {n} steps: {c}")
    assert c["graph_launches"] == n            # one split, one replay
    assert c["launches"] == 0                  # the argmax is the replayed graph's last node
    assert c["allocs"] == 0
    # token id, position, cell: three inputs in one group of the pool, one H2D a step
    # (the issue budgets two of <= 64 bytes).
    assert c["h2d"] == n and c["h2d_bytes"] <= 64 * n
    assert c["d2h"] == n and c["d2h_bytes"] == 4 * n
    assert c["syncs"] == n
    # The in-graph pick is the argmax of the logits the replay left (first on ties).
    ctx = eng.context
    assert t == int(np.argmax(ctx.cache.alloc.copy_to_host(ctx.cache.graph.outputs[0])[-1]))
    # Written logits are picked afresh (the graph's answer was for the old ones).
    dev, buf, nv, _ = ctx._out
    row = np.zeros(nv, np.float32)
    row[nv - 3] = 1.0
    dev.write(buf, row)
    assert eng.argmax_last() == nv - 3


def test_greedy_generation_reads_back_four_bytes_per_pick(synth):
    """The generation loop's greedy pick is the device argmax, which also checks the row
    for NaN/Inf: a reused generation reads back 4 bytes per token and nothing else."""
    _, path, ref = synth
    eng = _engine(path, ["cuda"])
    p = [int(t) for t in _sequences(ref.n_vocab, 1)[0]]
    n = 8
    first = eng.generate_ids(p, n)
    _core.cuda_sync()
    _core.testing.cuda_reset_counters()
    assert eng.generate_ids(p, n) == first
    c = _core.testing.cuda_counters()
    assert c["d2h"] == n and c["d2h_bytes"] == 4 * n, c


@pytest.mark.parametrize("params", [
    dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
    dict(temperature=1.0, top_k=5, top_p=1.0, min_p=0.0, repeat_penalty=1.3, repeat_last_n=16),
    dict(temperature=0.0, top_k=40, repeat_penalty=1.5),
], ids=["default", "penalty", "greedy-penalty"])
def test_device_sampling_picks_what_the_row_picks(synth, params):
    """A sampled step on CUDA takes its candidates from the device (DeviceRow): the
    sampler draws exactly the tokens it draws from the same logits read back (HostRow),
    seed for seed, penalties included, and the loop reads back the candidates, not rows."""
    from minfer.sampling import HostRow, Sampler, SamplingParams
    from minfer.session import DeviceRow
    _, path, ref = synth
    eng = _engine(path, ["cuda"])
    sp = SamplingParams(seed=11, **params)
    p = [int(t) for t in _sequences(ref.n_vocab, 1)[0]]
    a, b = Sampler(sp), Sampler(sp)
    eng.forward(p, n_out=1, copy=None)
    ctx = eng.context
    picks = []
    for _ in range(12):
        src = ctx.last_row(len(picks))
        assert isinstance(src, DeviceRow)
        row = ctx.cache.alloc.copy_to_host(ctx.cache.graph.outputs[0])[-1]
        t = a.sample(src)
        assert b.sample(HostRow(row)) == t
        a.accept(t)
        b.accept(t)
        picks.append(t)
        eng.forward([t], n_out=1, copy=None)
    assert len(set(picks)) > 1 or params["temperature"] == 0.0
    # The generation loop on CUDA: candidates only (<= 2 x 256 x 4 bytes + a flag a step).
    n = 6
    _core.cuda_sync()
    _core.testing.cuda_reset_counters()
    res = eng.generate(p, n, sampling=sp)
    c = _core.testing.cuda_counters()
    steps = len(res.ids)
    assert 1 <= steps <= n
    assert c["d2h"] <= steps + 1 and c["d2h_bytes"] <= (steps + 1) * (8 * 256 + 4 + 4 * 256), c


def _nan_message(fn):
    from minfer.errors import NumericsError
    with pytest.raises(NumericsError) as e:
        fn()
    return str(e.value)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_logits_raise_as_on_cpu(tmp_path, bad):
    """Poisoned logits stop a greedy pick with the CPU's one-line error: word for word
    for a row poisoned in place (the hook); for a model whose output norm is poisoned
    (the prompt) and one whose first greedy pick has a poisoned embedding row (decode
    step 1) the same error naming the same step (the NaN/Inf split of the counts may
    follow each backend's arithmetic)."""
    from minfer.io.gguf_file import GGUFFile

    small = dict(n_layer=1, n_embd=128, n_head=4, n_head_kv=2, n_ff=256)  # head dim 32: CUDA has kernels from 32
    path = write_model(tmp_path / "ok.gguf", **small).path
    msgs = {}
    for b in ("cuda", "cpu"):
        eng = _engine(path, [b])
        eng.forward([1, 2, 3], copy=None)
        dev, buf, nv, _ = eng.context._out
        row = np.random.default_rng(9).standard_normal(nv).astype(np.float32)
        row[[7, nv - 1]] = bad
        dev.write(buf, row)
        msgs[b] = _nan_message(lambda: eng.argmax_last(4))
    assert msgs["cuda"] == msgs["cpu"] and "at step 4: " in msgs["cuda"], msgs

    nan_norm = write_model(tmp_path / "nan.gguf", fill={"output_norm.weight": float(bad)}, **small).path
    got = {b: _nan_message(lambda: _engine(nan_norm, [b]).generate_ids([5, 6, 7], 4)) for b in ("cuda", "cpu")}
    assert got["cuda"].split(":")[0] == got["cpu"].split(":")[0], got
    assert got["cuda"].endswith(got["cpu"].split(" of ")[-1]) and "at the prompt (step 0)" in got["cuda"], got

    # Decode step 1: NaN in the embedding row of the prompt's greedy pick (not a prompt token).
    prompt = next(q for q in ([5, 6, 7], [9, 10, 11, 12], [20, 3]) if
                  _engine(path, ["cpu"]).generate_ids(q, 1)[0] not in q)
    g0 = _engine(path, ["cpu"]).generate_ids(prompt, 1)[0]
    poisoned = tmp_path / "row.gguf"
    poisoned.write_bytes(Path(path).read_bytes())
    with GGUFFile.open(poisoned) as g:
        off = g.tensors["token_embd.weight"].offset + g0 * small["n_embd"] * 4
    with open(poisoned, "r+b") as f:
        f.seek(off)
        f.write(np.full(small["n_embd"], bad, np.float32).tobytes())
    got = {b: _nan_message(lambda: _engine(poisoned, [b]).generate_ids(prompt, 4)) for b in ("cuda", "cpu")}
    assert got["cuda"].split(":")[0] == got["cpu"].split(":")[0] and "at step 1: " in got["cuda"], got


def test_greedy_generation_cuda_vs_cpu(synth):
    name, path, ref = synth
    prompts = _sequences(ref.n_vocab, 30)
    gpu, cpu = _engine(path, ["cuda"]), _engine(path, ["cpu"])
    n = 12
    for p in prompts:
        g, c = gpu.generate_ids(p, n), cpu.generate_ids(p, n)
        lg = ref.logits_batch([p + g[:-1]], [len(p) - 1])[0]
        top2 = np.sort(lg, axis=-1)[:, -2:]
        ok = top2[:, 1] - top2[:, 0] > MARGIN
        bad = [k for k in range(n) if ok[k] and g[k] != int(lg[k].argmax())]
        assert not bad, f"{name}: CUDA left the reference's greedy path at {bad}"
        # The CPU agrees up to the first near-tie.
        first_tie = next((k for k in range(n) if not ok[k]), n)
        assert g[:first_tie] == c[:first_tie]


def test_fused_equals_unfused_bitwise(synth, monkeypatch):
    """Each decode fusion (step merge) alone and all together give the unfused bits."""
    _, path, ref = synth
    seq = _sequences(ref.n_vocab, 4)[2]
    monkeypatch.setenv("MINFER_CUDA_FUSE", "none")
    base = _decode_run(path, seq, 5)
    for fz in ("qkv", "ffn", "residual", "quant", "qkv,rope", "residual,quant", "all"):
        monkeypatch.setenv("MINFER_CUDA_FUSE", fz)
        got = _decode_run(path, seq, 5)
        assert got.tobytes() == base.tobytes(), f"fusion {fz} changed the logits"


@pytest.mark.parametrize("qkv", [("Q4_K", "Q6_K"), ("Q5_0", "Q8_0")], ids=lambda t: "+".join(t))
def test_two_type_qkv_kernel_keeps_the_bits(qkv, tmp_path, monkeypatch):
    """A q|k|v launch of two weight types (the Q4_K_M files' layers with a Q6_K or Q8_0 v)
    takes a two-type instantiation with its rows loaded before its wait, RoPE + KV-store
    tail included: the logits of the unfused run (q, k and v launched apart on one-type
    kernels, MINFER_CUDA_FUSE=none), bit for bit, over a prompt and decode steps."""
    qk, v = qkv
    path = tmp_path / "pair.gguf"
    write_model(path, arch="qwen2", n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, seed=7,
                types={"attn_q": qk, "attn_k": qk, "attn_v": v})
    seq = [3, 17, 40, 99, 5]
    outs, pairs = {}, {}
    for fuse in ("none", "all"):
        monkeypatch.setenv("MINFER_CUDA_FUSE", fuse)
        _core.testing.cuda_reset_counters()
        outs[fuse] = _decode_run(path, seq, 5)
        pairs[fuse] = _core.testing.cuda_counters()["pair"]
    assert pairs["none"] == 0 and pairs["all"] >= 2, pairs  # a q|k|v launch a layer, direct runs
    assert outs["all"].tobytes() == outs["none"].tobytes()


def test_diag_skip_is_loud_and_not_the_logits(synth):
    """MINFER_CUDA_DIAG_SKIP (a timing diagnostic) leaves launches out of whole runs: a
    subprocess with it set warns on stderr and its logits differ from a normal run's
    (which match the CPU: test_prefill_and_decode_vs_reference_and_cpu); the env is read
    once a process, hence the subprocess."""
    _, path, _ = synth
    code = ("import sys; from minfer.session import Session; "
            "s = Session.open(sys.argv[1], n_ctx=64, backends=['cuda']); s.forward([1, 2, 3]); s.forward([4]); "
            "sys.stdout.write(s.forward([5]).tobytes().hex())")
    outs = {}
    for env in ("", "null:attn,rms_norm_copy"):
        p = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "MINFER_CUDA_DIAG_SKIP": env})
        assert p.returncode == 0, p.stderr
        assert ("MINFER_CUDA_DIAG_SKIP" in p.stderr) == bool(env), p.stderr
        outs[env] = p.stdout
    assert outs[""] != outs["null:attn,rms_norm_copy"]


@pytest.mark.parametrize("env,kind", [({"MINFER_CUDA_PROFILE": "1", "MINFER_NO_CUDA_GRAPH": "1"}, "rms_norm_copy"),
                                      ({"MINFER_CUDA_STAMP": "1"}, "graph: rms_norm_copy")])
def test_profile_and_stamps_book_the_launches(synth, env, kind):
    """The diagnostics bench/cuda_profile.py reads: MINFER_CUDA_PROFILE=1 (direct launches,
    each timed with events) and MINFER_CUDA_STAMP=1 (device clock stamps between the
    launches of the replayed graph) book every launch kind of the decode steps, with
    positive times, into _core.testing.cuda_profile(); the logits stay the normal run's.
    Both are read once a process, hence the subprocess."""
    _, path, _ = synth
    code = ("import sys, json; from minfer import _core; from minfer.session import Session; "
            "s = Session.open(sys.argv[1], n_ctx=64, backends=['cuda']); s.forward([1, 2, 3]); "
            "_core.testing.cuda_profile(); [s.forward([4 + k]) for k in range(3)]; lg = s.forward([9]); "
            "p = _core.testing.cuda_profile(); "
            "print(json.dumps({'logits': lg.tobytes().hex(), 'profile': {k: list(v) for k, v in p.items()}}))")
    outs = {}
    for e in ({}, env):
        p = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=300,
                           env={**os.environ, **e})
        assert p.returncode == 0, p.stderr
        outs[bool(e)] = json.loads(p.stdout.strip().splitlines()[-1])
    assert not outs[False]["profile"], "nothing is booked without the diagnostics"
    prof = outs[True]["profile"]
    assert kind in prof and prof[kind][0] > 0 and prof[kind][1] >= 4, prof
    assert outs[True]["logits"] == outs[False]["logits"]


def test_fusions_reduce_decode_launches(synth, monkeypatch):
    name, path, _ = synth
    counts = {}
    no_rope = ",".join(f for f in cuda_backend.FUSIONS if f != "rope")
    for fz in ("none", "all", no_rope):
        monkeypatch.setenv("MINFER_CUDA_FUSE", fz)
        eng = _engine(path, ["cuda"])
        eng.forward([1, 2])
        eng.forward([3])
        eng.forward([4])
        ls = eng.context.cache.lowered.splits[0]
        info = _core.testing.cuda_plan_info(ls.plan)
        counts[fz] = (info["launches"], info["graph_nodes"])
    n_layer = MODELS[synth[0]]["n_layer"]
    print(f"\n{name}: decode launches/graph nodes unfused {counts['none']}, without rope {counts[no_rope]}, "
          f"fused {counts['all']}")
    # per layer at least: q|k|v 3 -> 1, rope+rope+store 3 -> 1, gate|up+swiglu 3 -> 1, one residual add
    assert counts["all"][0] <= counts["none"][0] - 7 * n_layer
    # The q|k|v launch's tail: rope q + rope k + KV store ride on the q|k|v matvec, one launch
    # less per layer (Qwen2; Qwen3's QK norms sit between the matvec and the rope: no fold)
    fold = n_layer if MODELS[synth[0]]["arch"] == "qwen2" else 0
    assert counts["all"][0] == counts[no_rope][0] - fold


def test_small_blocks_are_row_exact_and_speculation_is_identical(synth):
    """A block of up to CUDA_ROW_EXACT_MAX_TOKENS rows gives each row's logits bitwise as a
    single decode step would, so prompt-lookup speculation picks exactly what plain
    greedy decoding picks on CUDA (issue 14: identical on every backend)."""
    from minfer.sampling import SamplingParams
    from minfer.speculate import Speculation

    _, path, ref = synth
    seq = [int(t) for t in _sequences(ref.n_vocab, 1)[0]]
    block = [3, 4, 5, 6, 7, 8, 9, 10, 11]
    a = _engine(path, ["cuda"], n_ctx=256)
    a.forward(seq)
    rows = a.forward(block, n_out=len(block))
    b = _engine(path, ["cuda"], n_ctx=256)
    b.forward(seq)
    for k, t in enumerate(block):
        assert np.array_equal(b.forward([t])[-1], rows[k]), f"row {k} of the block"
    prompt = (seq[:6] * 4 + [7, 8, 9] + seq[:6] * 3)[:60]
    sp = SamplingParams(temperature=0.0)
    plain = _engine(path, ["cuda"], n_ctx=256).generate(prompt, 48, sp, stop_at_eog=False)
    for depth in (1, 4, 8):
        for adaptive in (False, True):
            got = _engine(path, ["cuda"], n_ctx=256).generate(
                prompt, 48, sp, stop_at_eog=False, speculate=Speculation("ngram", draft_max=depth, adaptive=adaptive))
            assert got.ids == plain.ids, f"depth {depth} adaptive {adaptive}"
            assert got.timings.drafted and got.timings.drafted > 0
