"""The mixture-of-experts steps on CUDA (GPU suite, marker `cuda`): csrc/cuda/k_moe.cu and
the expert matvec in k_matvec.cu (matvec_id), against the CPU backend's same steps and
NumPy float64, then whole MoE models against the CPU.

Op level, on random inputs (one-step plans, as tests/test_moe_kernels.py runs the CPU's):
- MATMUL_ID for every weight type CUDA runs, x shared by a token's slots or one per slot,
  1, 3, 64 and 300 tokens (decode blocks take the expert matvec, larger ones the device
  grouping and the tiled f16 matmul), k = 1, 2, 8 of 8 or 128 experts, with an expert
  every token picks and one none picks. Decode rows are checked tightly against float64
  over the kernel's own int8 rounding of x; prefill rows against float64 within the f16
  GEMM bound; both against the CPU within the sum of the two sides' bounds. Decode rows
  do not depend on the block's other slots, and with 32 lanes a row are the plain
  matvec's bits;
- MOE_TOPK equal to the CPU's ids (ties, NaN, infinities); MOE_WEIGHTS (three gatings,
  norm, scale), MOE_SUM and SIGMOID within a few ulps of the CPU;
- the step merges (router top-k + weights, gate|up + SwiGLU, sum + residual) bitwise the
  steps apart; graph replays read the ids the plan's own MOE_TOPK writes; whole runs equal
  step-by-step runs (a prefill's grouping shared by MATMUL_IDs, a norm's deferred copy).

Model level: qwen2moe, qwen3moe and Mixtral (tests/gpu_models.py) at Q8_0 and Q4_K_M,
CUDA against CPU over a prompt and a dozen decode steps, greedy picks, a batched decode
of three sequences, and the identity gates (fused / unfused, replay / direct, a block's
rows / single steps).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from minfer import _core
from minfer.backends import cuda as cuda_backend

sys.path.insert(0, str(Path(__file__).parent))
import gpu_models  # tests/ helper: the MoE checkpoints, carried to the GPU machine
from test_cuda import Rig as CudaOpRig, make_weight  # noqa: E402
from test_moe_kernels import Rig as CpuOpRig  # noqa: E402

pytestmark = pytest.mark.cuda

Q = gguf.GGMLQuantizationType
OPS = _core.OPS
U = 2.0**-24
ALL_TYPES = [Q.F32, Q.F16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]
KQUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
# f32 rounding of a dot product's scale products and fixed-order sums: c * n * U * |x||w|
# (tests/test_cuda.py's MATVEC_C); the prefill matmul rounds both operands to f16.
SUM_C = 8.0
GEMM_REL = 2 * 2.0**-11
ROW_EXACT = 64  # _core.CUDA_ROW_EXACT_MAX_TOKENS (read at run time, checked below)
FUSE_QKV, FUSE_FFN, FUSE_RESIDUAL, FUSE_QUANT = 1, 2, 4, 8  # cuda/executor.h PlanFlags


@pytest.fixture(scope="module", autouse=True)
def cuda_required():
    e = cuda_backend.ENTRY
    assert e.compiled and e.usable, f"pytest -m cuda needs the CUDA backend here: {e.unusable_reason}"
    assert _core.CUDA_ROW_EXACT_MAX_TOKENS == ROW_EXACT


# ---------------------------------------------------------------- rigs and references

@functools.cache
def expert_weight(qtype, n_expert: int, in_dim: int, out: int):
    """An expert tensor (n_expert * out rows of in_dim) and its float64 [n_expert, out, in]."""
    rng = np.random.default_rng(1000 + 7 * int(qtype) + n_expert + in_dim + out)
    raw, deq = make_weight(qtype, n_expert * out, in_dim, rng)
    return raw, deq.reshape(n_expert, out, in_dim).astype(np.float64)


class CudaRig(CudaOpRig):
    """test_cuda's rig (outputs poisoned with NaN, so an unwritten row fails), plus
    rewrites and step-by-step runs."""

    def write(self, bid, arr):
        self.pool.write(bid, np.ascontiguousarray(arr))

    def run_steps(self, plan, n):
        """Step by step (partial runs, as tracing runs a plan)."""
        for i in range(n):
            self.run(plan, i, i + 1)


class CpuRig(CpuOpRig):
    def run(self, steps, n_threads=2):
        super().run(steps, n_threads)


def q8_roundtrip(x):
    """The CUDA kernels' int8 copy of x (blocks of 32, d = amax / 127, q = rint(x / d)),
    in float32 as the device computes it, back in float64."""
    b = x.astype(np.float32).reshape(-1, 32)
    d = (np.abs(b).max(axis=1) / np.float32(127.0)).astype(np.float32)
    q = np.zeros_like(b)
    nz = d > 0
    q[nz] = np.rint(b[nz] / d[nz, None])
    return (d[:, None].astype(np.float64) * q).reshape(x.shape)


def make_ids(rng, nt: int, n_expert: int, k: int) -> np.ndarray:
    """Distinct experts per token. With k >= 2 every token's last slot is expert 0 (an
    expert all pick) and, where there is room, expert 1 is never picked."""
    ids = np.empty((nt, k), np.int32)
    for t in range(nt):
        if k >= 2 and n_expert - 2 >= k - 1:
            ids[t, :k - 1] = rng.permutation(np.arange(2, n_expert))[:k - 1]
            ids[t, k - 1] = 0
        elif k >= 2:
            ids[t] = rng.permutation(n_expert)[:k]
        else:
            ids[t, 0] = rng.integers(2, n_expert) if n_expert > 2 else 0
    return ids


def per_slot(mats: np.ndarray, ids: np.ndarray, xs: np.ndarray) -> np.ndarray:
    """Row p = mats[ids[p]] @ xs[p] for every slot p (grouped by expert)."""
    flat = ids.reshape(-1)
    out = np.zeros((flat.size, mats.shape[1]))
    for e in np.unique(flat):
        m = flat == e
        out[m] = xs[m] @ mats[e].T
    return out


def x_of_slots(x: np.ndarray, nt: int, k: int) -> np.ndarray:
    """Each slot's x row: x holds nt rows (shared by a token's slots) or nt * k."""
    return x if x.shape[0] == nt * k else np.repeat(x, k, axis=0)


def block_bound(x_s: np.ndarray, deq3: np.ndarray, ids: np.ndarray, block: int) -> np.ndarray:
    """The int8 rounding of x in blocks of `block` (half a step each, amax / 254), times |w|."""
    n = x_s.shape[1] // block
    amax = np.abs(x_s).reshape(x_s.shape[0], n, block).max(axis=2)
    wsum = np.abs(deq3).reshape(deq3.shape[0], deq3.shape[1], n, block).sum(axis=3)
    return (1 / 254 + 2.0**-20) * per_slot(wsum, ids, amax)


def cuda_matmul_id(rig, wh, x, ids, out, n_expert):
    nt, k = ids.shape
    ix, ii, iy = rig.buf(x.astype(np.float32)), rig.buf(ids), rig.out(nt * k * out)
    rig.run(rig.plan([("matmul_id", [iy, ix, ii], [x.shape[1], out, x.shape[0], n_expert, k, nt], [], [wh])]))
    return rig.read(iy, nt * k * out).reshape(nt * k, out)


def cpu_matmul_id(raw, wtype, x, ids, out, n_expert):
    nt, k = ids.shape
    rig = CpuRig()
    wh = rig.weight("exps", raw, wtype, x.shape[1], n_expert * out)
    ix, ii, iy = rig.buf(x.astype(np.float32)), rig.buf(ids), rig.out(nt * k * out)
    rig.run([("matmul_id", [iy, ix, ii], [x.shape[1], out, x.shape[0], n_expert, k, nt], [], [wh])])
    return rig.read(iy, nt * k * out).reshape(nt * k, out)


# ---------------------------------------------------------------- MATMUL_ID


def check_matmul_id(wtype, nt, n_expert, k, shared, in_dim, out, seed):
    raw, deq3 = expert_weight(wtype, n_expert, in_dim, out)
    rng = np.random.default_rng(seed)
    ids = make_ids(rng, nt, n_expert, k)
    x = rng.standard_normal((nt if shared else nt * k, in_dim)).astype(np.float32)
    rig = CudaRig()
    wh = rig.weight("exps", raw, wtype, in_dim, n_expert * out)
    got = cuda_matmul_id(rig, wh, x, ids, out, n_expert).astype(np.float64)
    cpu = cpu_matmul_id(raw, wtype, x, ids, out, n_expert).astype(np.float64)
    assert np.isfinite(got).all(), "unwritten (NaN-poisoned) rows"
    xs = x_of_slots(x.astype(np.float64), nt, k)
    want = per_slot(deq3, ids, xs)
    absd = np.abs(deq3)
    mag = per_slot(absd, ids, np.abs(xs))
    sums = SUM_C * in_dim * U * mag + 1e-30
    quant = wtype not in (Q.F32, Q.F16)
    what = f"{wtype.name} nt={nt} experts={n_expert} k={k} {'shared' if shared else 'per-slot'} x"
    if nt <= ROW_EXACT:
        # The expert matvec: exact integer dots over the kernel's own int8 copy of x.
        xa = x_of_slots(q8_roundtrip(x), nt, k) if quant else xs
        tight = per_slot(deq3, ids, xa)
        tol = SUM_C * in_dim * U * per_slot(absd, ids, np.abs(xa)) + 1e-30
        err = np.abs(got - tight)
        assert np.all(err <= tol), f"{what}: max err/tol vs float64 over the int8 copy {np.max(err / tol):.3g}"
        cuda_tol = (block_bound(xs, deq3, ids, 32) if quant else 0) + sums
    else:
        cuda_tol = GEMM_REL * mag + sums
        err = np.abs(got - want)
        assert np.all(err <= cuda_tol), f"{what}: max err/tol vs float64 (f16 operands) {np.max(err / cuda_tol):.3g}"
    # The CPU rounds x per 32 (legacy types) or per 256 (K-quants, Q8_K) for quantized
    # weights; F16 rows are allowed f16 rounding of x as well.
    if quant:
        cpu_tol = block_bound(xs, deq3, ids, 256 if wtype in KQUANTS else 32) + sums
    else:
        cpu_tol = (2.0**-11 * mag if wtype == Q.F16 else 0) + sums
    err = np.abs(got - cpu)
    bound = cuda_tol + cpu_tol
    assert np.all(err <= bound), f"{what}: max |CUDA - CPU| / bound {np.max(err / bound):.3g}"


@pytest.mark.parametrize("wtype", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("nt", [1, 3, 64, 300])
@pytest.mark.parametrize("n_expert,k", [(8, 1), (8, 2), (8, 8), (128, 8)], ids=lambda v: str(v))
@pytest.mark.parametrize("shared", [True, False], ids=["shared-x", "per-slot-x"])
def test_matmul_id_vs_cpu_and_float64(wtype, nt, n_expert, k, shared):
    """Rows of 256 (K-quants: one superblock; the matvec's 8-lane groups), 48 outputs per
    expert (less than one 64-row tile of the prefill matmul)."""
    check_matmul_id(wtype, nt, n_expert, k, shared, 256, 48, seed=nt * 31 + n_expert + k)


@pytest.mark.parametrize("wtype", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("nt", [5, 80])
@pytest.mark.parametrize("shared", [True, False], ids=["shared-x", "per-slot-x"])
def test_matmul_id_wider_rows_and_several_tiles(wtype, nt, shared):
    """Rows of 768 (three K-quant superblocks: the padded last group of the device layout,
    16-lane groups; 24 units of the 32-element types: 32 lanes) and 200 outputs per expert
    (four 64-row tiles, the last partial); 16 experts, 4 per token."""
    check_matmul_id(wtype, nt, 16, 4, shared, 768, 200, seed=nt + int(wtype))


@pytest.mark.parametrize("wtype", [Q.F32, Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.Q5_0], ids=lambda t: t.name)
@pytest.mark.parametrize("shared", [True, False], ids=["shared-x", "per-slot-x"])
def test_matmul_id_decode_rows_are_slot_independent_and_matvec_bits(wtype, shared):
    """A decode block's slot rows are those of its tokens run alone, bit for bit (so a
    speculative block picks what single steps pick), and with rows of 32 units or more
    (32 lanes a row) each is the plain matvec of that expert's rows, bit for bit."""
    in_dim, out, n_expert, k, nt = 2048, 40, 8, 2, 5
    raw, _ = expert_weight(wtype, n_expert, in_dim, out)
    rng = np.random.default_rng(int(wtype))
    ids = make_ids(rng, nt, n_expert, k)
    x = rng.standard_normal((nt if shared else nt * k, in_dim)).astype(np.float32)
    rig = CudaRig()
    wh = rig.weight("exps", raw, wtype, in_dim, n_expert * out)
    per = [rig.weight(f"e{e}", raw[e * out:(e + 1) * out], wtype, in_dim, out) for e in range(n_expert)]
    block = cuda_matmul_id(rig, wh, x, ids, out, n_expert)
    for t in range(nt):
        xt = x[t:t + 1] if shared else x[t * k:(t + 1) * k]
        alone = cuda_matmul_id(rig, wh, xt, ids[t:t + 1], out, n_expert)
        assert alone.tobytes() == block[t * k:(t + 1) * k].tobytes(), f"token {t}: block row != the token alone"
        for j in range(k):
            xi, yi = rig.buf(xt[0 if shared else j][None].copy()), rig.out(out)
            rig.run(rig.plan([("matmul", [yi, xi], [in_dim, out, 1], [], [per[ids[t, j]], -1])]))
            assert rig.read(yi, out).tobytes() == block[t * k + j].tobytes(), f"slot ({t}, {j}) != its matvec"


@pytest.mark.parametrize("nt", [2, 80])
def test_matmul_id_ids_outside_the_experts_give_zero_rows(nt):
    """As on the CPU (MOE_TOPK never writes such an id): decode and prefill."""
    in_dim, out, n_expert, k = 256, 48, 8, 2
    raw, _ = expert_weight(Q.Q4_K, n_expert, in_dim, out)
    rng = np.random.default_rng(nt)
    ids = make_ids(rng, nt, n_expert, k)
    ids[0, 1] = -1
    ids[nt - 1, 0] = n_expert
    x = rng.standard_normal((nt, in_dim)).astype(np.float32)
    rig = CudaRig()
    wh = rig.weight("exps", raw, Q.Q4_K, in_dim, n_expert * out)
    got = cuda_matmul_id(rig, wh, x, ids, out, n_expert)
    cpu = cpu_matmul_id(raw, Q.Q4_K, x, ids, out, n_expert)
    bad = [1, (nt - 1) * k]
    assert not got[bad].any() and not cpu[bad].any()
    good = np.setdiff1d(np.arange(nt * k), bad)
    assert np.isfinite(got[good]).all() and np.abs(got[good]).max() > 0


# ---------------------------------------------------------------- the router, sum, sigmoid


def route_steps(ii, iw, ix, n_expert, k, nt, gating, norm, scale):
    return [("moe_topk", [ii, ix], [n_expert, k, nt], [], []),
            ("moe_weights", [iw, ix], [n_expert, k, nt, gating, int(norm)], [scale], [])]


def tie_logits(rng, nt, n_expert):
    """Logits drawn from a few values (ties everywhere), with NaN, infinities and signed
    zeros sprinkled in."""
    x = rng.integers(-2, 3, size=(nt, n_expert)).astype(np.float32)
    special = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0], np.float32)
    m = rng.random((nt, n_expert)) < 0.1
    x[m] = rng.choice(special, size=int(m.sum()))
    return x


@pytest.mark.parametrize("n_expert,k", [(8, 1), (8, 2), (8, 8), (60, 4), (128, 8), (1000, 8)], ids=lambda v: str(v))
@pytest.mark.parametrize("nt", [1, 5, 300])
def test_moe_topk_equals_the_cpu_with_ties(n_expert, k, nt):
    rng = np.random.default_rng(n_expert * 7 + k + nt)
    for x in (tie_logits(rng, nt, n_expert), rng.standard_normal((nt, n_expert)).astype(np.float32)):
        c = CpuRig()
        ci, cx = c.out(nt * k), c.buf(x)
        c.run([("moe_topk", [ci, cx], [n_expert, k, nt], [], [])])
        r = CudaRig()
        gi, gx = r.out(nt * k), r.buf(x)
        r.run(r.plan([("moe_topk", [gi, gx], [n_expert, k, nt], [], [])]))
        want, got = c.read(ci, nt * k, "int32"), r.read(gi, nt * k, "int32")
        assert np.array_equal(got, want), f"first differing slot {np.flatnonzero(got != want)[:1]}"
        assert all(len(set(row)) == k for row in got.reshape(nt, k).tolist())


@pytest.mark.parametrize("gating", [1, 2, 3], ids=["softmax", "sigmoid", "softmax-picked"])
@pytest.mark.parametrize("norm,scale", [(False, 0.0), (True, 0.0), (False, 1.0), (True, 2.5)])
@pytest.mark.parametrize("n_expert,k", [(8, 2), (60, 4), (128, 8)], ids=lambda v: str(v))
def test_moe_weights_vs_cpu(gating, norm, scale, n_expert, k):
    """Within a few ulps of the CPU (expf's rounding, gating 1's warp-ordered sum); the
    picks are the same, so a wrong pick would move a weight by O(1)."""
    rng = np.random.default_rng(gating * 100 + n_expert + k)
    for nt in (1, 7, 300):
        x = (rng.standard_normal((nt, n_expert)) * 3).astype(np.float32)
        x[0, 3] = x[0, 5] = x[0].max() + 1  # a tie for the first pick
        if nt > 1:
            x[1, 2] = np.nan  # NaN: last in rank; gating 1's whole row NaN on both sides
        c = CpuRig()
        ci, cw, cx = c.out(nt * k), c.out(nt * k), c.buf(x)
        c.run(route_steps(ci, cw, cx, n_expert, k, nt, gating, norm, scale))
        r = CudaRig()
        gi, gw, gx = r.out(nt * k), r.out(nt * k), r.buf(x)
        r.run(r.plan(route_steps(gi, gw, gx, n_expert, k, nt, gating, norm, scale)))
        assert np.array_equal(r.read(gi, nt * k, "int32"), c.read(ci, nt * k, "int32"))
        np.testing.assert_allclose(r.read(gw, nt * k), c.read(cw, nt * k), rtol=1e-5, atol=1e-8, equal_nan=True)


@pytest.mark.parametrize("d,k,nt", [(256, 1, 1), (256, 2, 7), (1000, 8, 3), (2048, 8, 300)])
def test_moe_sum_and_sigmoid_vs_cpu(d, k, nt):
    rng = np.random.default_rng(d + k + nt)
    x = rng.standard_normal((nt * k, d)).astype(np.float32)
    w = rng.random((nt, k)).astype(np.float32)
    c = CpuRig()
    cy, cx, cw = c.out(nt * d), c.buf(x), c.buf(w)
    c.run([("moe_sum", [cy, cx, cw], [d, k, nt], [], [])])
    r = CudaRig()
    gy, gx, gw = r.out(nt * d), r.buf(x), r.buf(w)
    r.run(r.plan([("moe_sum", [gy, gx, gw], [d, k, nt], [], [])]))
    want = np.einsum("tk,tkd->td", w.astype(np.float64), x.reshape(nt, k, d).astype(np.float64))
    got = r.read(gy, nt * d).reshape(nt, d)
    mag = np.einsum("tk,tkd->td", w.astype(np.float64), np.abs(x.reshape(nt, k, d)).astype(np.float64))
    assert np.all(np.abs(got - want) <= 2 * k * U * mag + 1e-30), "MOE_SUM vs float64"
    np.testing.assert_allclose(got, c.read(cy, nt * d).reshape(nt, d), rtol=1e-5, atol=1e-6 * np.abs(want).max())
    s = np.concatenate([np.array([-1000, -88, -30, -1, -0.0, 0.0, 1, 30, 88, 1000, np.inf, -np.inf, np.nan],
                                 np.float32), rng.standard_normal(d).astype(np.float32) * 8])
    cs, co = c.buf(s), c.out(s.size)
    c.run([("sigmoid", [co, cs], [s.size], [], [])])
    gs, go = r.buf(s), r.out(s.size)
    r.run(r.plan([("sigmoid", [go, gs], [s.size], [], [])]))
    np.testing.assert_allclose(r.read(go, s.size), c.read(co, s.size), rtol=1e-6, atol=1e-30, equal_nan=True)


# ---------------------------------------------------------------- merges, replays, partial runs


def launches(plan) -> int:
    return _core.testing.cuda_plan_info(plan)["launches"]


@pytest.mark.parametrize("nt", [1, 4])
@pytest.mark.parametrize("n_expert,k", [(8, 2), (16, 8)], ids=lambda v: str(v))
@pytest.mark.parametrize("wtype", [Q.Q4_K, Q.Q8_0, Q.F16], ids=lambda t: t.name)
def test_moe_step_merges_are_bitwise_the_steps(nt, wtype, n_expert, k):
    """Router top-k + weights (FUSE_QKV), gate|up MATMUL_IDs + SwiGLU (FUSE_FFN), the down
    MATMUL_ID + the weighted sum of its rows (FUSE_FFN; a block takes an output row for
    all of a token's slots) and that sum + the residual add (FUSE_RESIDUAL): each merge
    one launch, with the bits of the steps launched apart; so does the whole
    decode-shaped MoE block, down's rows included, with down's int8 input written by the
    gate|up launch (FUSE_QUANT) or made by down's own quantization."""
    d, ff = 256, 512
    rng = np.random.default_rng(nt + k)
    graw, _ = expert_weight(wtype, n_expert, d, ff)
    uraw, _ = make_weight(wtype, n_expert * ff, d, rng)
    draw, _ = expert_weight(wtype, n_expert, ff, d)
    h = rng.standard_normal((nt, d)).astype(np.float32)
    logits = (rng.standard_normal((nt, n_expert)) * 2).astype(np.float32)
    outs = {}
    all_flags = FUSE_QKV | FUSE_FFN | FUSE_RESIDUAL | FUSE_QUANT
    no_quant = all_flags & ~FUSE_QUANT
    nodes = {}
    for flags in (0, FUSE_FFN, no_quant, all_flags):
        r = CudaRig()
        g = r.weight("gate", graw, wtype, d, n_expert * ff)
        u = r.weight("up", uraw, wtype, d, n_expert * ff)
        dn = r.weight("down", draw, wtype, ff, n_expert * d)
        ih, il = r.buf(h), r.buf(logits)
        ids, w = r.out(nt * k), r.out(nt * k)
        yg, yu, act, yd, s, y = (r.out(n) for n in (nt * k * ff, nt * k * ff, nt * k * ff, nt * k * d, nt * d,
                                                     nt * d))
        mm = [d, ff, nt, n_expert, k, nt]
        steps = route_steps(ids, w, il, n_expert, k, nt, 1, True, 0.0) + [
            ("matmul_id", [yg, ih, ids], mm, [], [g]),
            ("matmul_id", [yu, ih, ids], mm, [], [u]),
            ("swiglu", [act, yg, yu], [nt * k * ff], [], []),
            ("matmul_id", [yd, act, ids], [ff, d, nt * k, n_expert, k, nt], [], [dn]),
            ("moe_sum", [s, yd, w], [d, k, nt], [], []),
            ("add", [y, ih, s], [nt * d], [], [])]
        p = r.plan(steps, flags)
        assert launches(p) == {0: 8, FUSE_FFN: 5, no_quant: 3, all_flags: 3}[flags], launches(p)
        for _ in range(3):  # direct, captured, replayed
            r.run(p)
        nodes[flags] = _core.testing.cuda_plan_info(p)["graph_nodes"]
        outs[flags] = [r.read(b, n) for b, n in ((ids, nt * k), (w, nt * k), (act, nt * k * ff), (yd, nt * k * d),
                                                  (s, nt * d), (y, nt * d))]
        if flags:
            assert np.isfinite(outs[flags][5]).all()
    # Quantized down weights: gate|up writes down's int8 input, one kernel fewer.
    assert nodes[all_flags] == nodes[no_quant] - (wtype != Q.F16), nodes
    names = ("ids", "weights", "swiglu", "down", "sum", "out")
    for flags in (FUSE_FFN, no_quant, all_flags):
        for a, b, name in zip(outs[0], outs[flags], names):
            if flags & FUSE_RESIDUAL and name == "sum":
                continue  # the residual merge does not write the sum apart
            assert a.tobytes() == b.tobytes(), f"{name}: merged launches ({flags}) vs steps apart"


def _softmax_route64(logits, ids, gating, norm, scale):
    """MOE_WEIGHTS in float64 from given logits and picks (plan.h's gatings)."""
    x = logits.astype(np.float64)
    picked = np.take_along_axis(x, ids, axis=1)
    if gating == 1:
        w = np.take_along_axis(np.exp(x - x.max(axis=1, keepdims=True)), ids, axis=1)
        w /= np.exp(x - x.max(axis=1, keepdims=True)).sum(axis=1, keepdims=True)
    elif gating == 2:
        w = 1 / (1 + np.exp(-picked))
    else:
        w = np.exp(picked - picked.max(axis=1, keepdims=True))
        w /= w.sum(axis=1, keepdims=True)
    if norm:
        w /= w.sum(axis=1, keepdims=True)
    return w * (scale if scale not in (0.0, 1.0) else 1.0)


@pytest.mark.parametrize("rtype", [Q.F32, Q.F16, Q.Q8_0, Q.Q4_K], ids=lambda t: t.name)
@pytest.mark.parametrize("n_expert,k,nt", [(8, 2, 1), (60, 4, 7), (128, 8, 1), (128, 8, 64), (256, 8, 4)],
                         ids=lambda v: str(v))
def test_router_matvec_and_route_in_one_launch(rtype, n_expert, k, nt):
    """A decode router (its MATMUL, then MOE_TOPK and MOE_WEIGHTS of the logits) is one
    launch under FUSE_QKV for the router types llama.cpp writes (F32; F16 and Q8_0 too):
    the logits are the matvec's bits, the last block to finish routes every token, and
    ids and weights are bitwise those of the steps apart, in direct runs and graph
    replays with new inputs (the ticket is back to zero after each). A Q4_K router stays
    a matvec plus the route launch. The ids are NumPy's top-k of the logits; the weights
    float64's from them."""
    d = 256
    rng = np.random.default_rng(n_expert + k + nt + int(rtype))
    raw, _ = make_weight(rtype, n_expert, d, rng)
    xs = [rng.standard_normal((nt, d)).astype(np.float32) * 4 for _ in range(3)]
    for gating, norm, scale in ((1, True, 0.0), (2, False, 2.5), (3, False, 0.0)):
        outs = {}
        for flags in (0, FUSE_QKV):
            r = CudaRig()
            wr = r.weight("router", raw, rtype, d, n_expert)
            ih, il, ids, w = r.buf(xs[0]), r.out(nt * n_expert), r.out(nt * k), r.out(nt * k)
            p = r.plan([("matmul", [il, ih], [d, n_expert, nt], [], [wr, -1])] +
                       route_steps(ids, w, il, n_expert, k, nt, gating, norm, scale), flags)
            fused = flags and rtype != Q.Q4_K
            assert launches(p) == (1 if fused else 2 if flags else 3), launches(p)
            runs = []
            for x in xs:
                r.write(ih, x)
                r.run(p)
                runs.append((r.read(il, nt * n_expert), r.read(ids, nt * k, "int32"), r.read(w, nt * k)))
            outs[flags] = runs
        for (la, ia, wa), (lb, ib, wb) in zip(outs[0], outs[FUSE_QKV]):
            assert la.tobytes() == lb.tobytes(), "logits: one launch vs the steps apart"
            assert ia.tobytes() == ib.tobytes(), "ids"
            assert wa.tobytes() == wb.tobytes(), "weights"
            lg = lb.reshape(nt, n_expert)
            want = np.argsort(-lg.astype(np.float64), axis=1, kind="stable")[:, :k]
            assert np.array_equal(ib.reshape(nt, k), want)
            np.testing.assert_allclose(wb.reshape(nt, k), _softmax_route64(lg, want, gating, norm, scale),
                                       rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("nt", [3, 80])
def test_ids_are_read_on_the_device_in_replays_and_partial_runs(nt):
    """A plan whose MOE_TOPK writes the ids its MATMUL_IDs read (gate and up: a prefill
    groups once for both), run directly, then captured, then replayed with new logits and
    x each time: every run equals a fresh plan's first run, and step-by-step runs (which
    group again for each MATMUL_ID) give the same bits."""
    n_expert, k, d, ff = 16, 4, 256, 96
    graw, _ = expert_weight(Q.Q4_K, n_expert, d, ff)
    uraw, _ = expert_weight(Q.Q6_K, n_expert, d, ff)

    def build(r):
        g = r.weight("gate", graw, Q.Q4_K, d, n_expert * ff)
        u = r.weight("up", uraw, Q.Q6_K, d, n_expert * ff)
        ix, il = r.buf(np.zeros((nt, d), np.float32)), r.buf(np.zeros((nt, n_expert), np.float32))
        ids, yg, yu = r.out(nt * k), r.out(nt * k * ff), r.out(nt * k * ff)
        mm = [d, ff, nt, n_expert, k, nt]
        p = r.plan([("moe_topk", [ids, il], [n_expert, k, nt], [], []),
                    ("matmul_id", [yg, ix, ids], mm, [], [g]),
                    ("matmul_id", [yu, ix, ids], mm, [], [u])])
        return p, ix, il, (ids, yg, yu)

    def read(r, bufs):
        return b"".join(r.read(b, n, dt).tobytes() for b, n, dt in zip(bufs, (nt * k, nt * k * ff, nt * k * ff),
                                                                          ("int32", "float32", "float32")))

    rng = np.random.default_rng(nt)
    r = CudaRig()
    plan, ix, il, bufs = build(r)
    for it in range(4):
        x = rng.standard_normal((nt, d)).astype(np.float32)
        lg = rng.standard_normal((nt, n_expert)).astype(np.float32)
        r.write(ix, x)
        r.write(il, lg)
        r.run(plan)
        got = read(r, bufs)
        f = CudaRig()
        fp, fx, fl, fb = build(f)
        f.write(fx, x)
        f.write(fl, lg)
        f.run_steps(fp, 3)
        assert got == read(f, fb), f"run {it}: replayed plan vs a fresh plan step by step"
    assert _core.testing.cuda_plan_info(plan)["captured"], "the plan was never captured"


@pytest.mark.parametrize("shared", [True, False], ids=["shared-x", "per-slot-x"])
def test_decode_matmul_id_reads_a_norms_deferred_copy(shared):
    """After a decode RMSNorm, a MATMUL_ID whose tokens share its output reads the norm's
    deferred int8 copy (its row scale on the sums), in whole runs and step by step alike
    (the same bits); within the int8 bound of float64."""
    nt, n_expert, k, d, out = 3, 8, 2, 512, 64
    raw, deq3 = expert_weight(Q.Q4_K, n_expert, d, out)
    rng = np.random.default_rng(11)
    h = rng.standard_normal((nt, d)).astype(np.float32)
    nw = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    ids = make_ids(rng, nt, n_expert, k)
    res = []
    for steps in (False, True):
        r = CudaRig()
        wh = r.weight("exps", raw, Q.Q4_K, d, n_expert * out)
        nh = r.weight("norm", nw, Q.F32, d, 1)
        ih, ii, xn, y = r.buf(h), r.buf(ids), r.out(nt * d), r.out(nt * k * out)
        if shared:
            mm = ("matmul_id", [y, xn, ii], [d, out, nt, n_expert, k, nt], [], [wh])
            p = r.plan([("rms_norm", [xn, ih], [d, nt], [1e-6], [nh]), mm])
        else:  # a per-slot x is not the norm's output: its own quantization
            ixs = r.buf(np.repeat(h, k, axis=0))
            p = r.plan([("rms_norm", [xn, ih], [d, nt], [1e-6], [nh]),
                        ("matmul_id", [y, ixs, ii], [d, out, nt * k, n_expert, k, nt], [], [wh])])
        if steps:
            r.run_steps(p, 2)
        else:
            r.run(p)
        res.append(r.read(y, nt * k * out))
    assert res[0].tobytes() == res[1].tobytes(), "whole run vs step by step"
    h64 = h.astype(np.float64)
    normed = h64 / np.sqrt((h64 ** 2).mean(axis=1, keepdims=True) + 1e-6) * nw
    xs = x_of_slots(normed if shared else h64, nt, k)
    want = per_slot(deq3, ids, xs)
    tol = block_bound(xs, deq3, ids, 32) * 1.01 + SUM_C * d * U * per_slot(np.abs(deq3), ids, np.abs(xs)) * 4
    assert np.all(np.abs(res[0].reshape(want.shape) - want) <= tol)


# ---------------------------------------------------------------- whole models


# CUDA against the CPU on the same file: both round every matmul input to 8 bits, but in
# different blocks (CUDA per 32 elements, the CPU's K-quant dots per 256) and CUDA's prefill
# rounds to f16 instead, so a random network's expert picks flip now and then, moving that
# position's logits. err/std (max |CUDA - CPU| over the vocabulary / the CPU logits' std)
# bounded as tests/test_moe.py bounds the CPU against transformers (measured there: median
# 0.026-0.045, p90 0.032-0.118, max up to 0.52), with room for the two sides' roundings
# adding up: median and 90th percentile over a prompt and its decode steps, and a max
# that only a flipped expert pick approaches. A wrong expert row, routing weight or sum
# moves every position by O(1).
MODEL_MEDIAN, MODEL_P90, MODEL_MAX = 0.1, 0.25, 1.0
# A greedy pick may differ only where the CPU's top-1 / top-2 gap, in logits std, is below
# this (tests/test_moe.py's MARGIN: random-weight logits are flat); after the first such
# step the continuations are no longer compared.
MARGIN = 0.3
PROMPT, STEPS = 40, 12


def _open(path, backend, **kw):
    from minfer.session import Session
    return Session.open(path, n_ctx=kw.pop("n_ctx", 128), backends=[backend], **kw)


def _prompt(seed: int, n: int, vocab: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab - 3, n)]


def _err_std(got, want) -> np.ndarray:
    want = want.astype(np.float64)
    return np.abs(got.astype(np.float64) - want).max(axis=-1) / want.std(axis=-1)


def _margin(row) -> float:
    top2 = np.sort(row.astype(np.float64))[-2:]
    return (top2[1] - top2[0]) / row.std()


def _teacher_forced(s, prompt, cont) -> np.ndarray:
    """Logits of every prompt row (one prefill), then of each continuation token."""
    s.reset()
    rows = [s.forward(prompt, n_out=len(prompt))]
    for t in cont:
        rows.append(s.forward([t]))
    return np.concatenate(rows)


@pytest.fixture(scope="module", params=[(f, q) for f in gpu_models.MOE for q in gpu_models.QTYPES],
                ids=lambda p: f"{p[0]}-{p[1]}")
def moe_file(request):
    return request.param[0], request.param[1], gpu_models.moe_gguf(*request.param)


def test_model_logits_and_greedy_cuda_vs_cpu(moe_file):
    name, qtype, path = moe_file
    gpu, cpu = _open(path, "cuda"), _open(path, "cpu")
    gpu.forward([1, 2, 3])
    assert gpu.backend_names == ["CUDA"] and len(gpu.context.cache.splits) == 1, \
        f"{name}: every node on CUDA, in one split"
    vocab = gpu.hp.n_vocab
    for seed in (1, 2):
        prompt = _prompt(seed, PROMPT, vocab)
        cpu.reset()
        cont = cpu.generate_ids(prompt, STEPS)
        c = _teacher_forced(cpu, prompt, cont[:-1])
        g = _teacher_forced(gpu, prompt, cont[:-1])
        err = _err_std(g, c)
        what = f"{name} {qtype} seed {seed}: err/std median {np.median(err):.4f} p90 {np.quantile(err, 0.9):.4f} " \
               f"max {err.max():.4f}"
        print("\n" + what)
        assert np.median(err) < MODEL_MEDIAN and np.quantile(err, 0.9) < MODEL_P90 and err.max() < MODEL_MAX, what
        # Greedy: CUDA's own continuation follows the CPU's up to its first near-tie.
        gpu.reset()
        got = gpu.generate_ids(prompt, STEPS)
        rows = c[PROMPT - 1:]
        for j in range(STEPS):
            if got[j] != cont[j]:
                assert _margin(rows[j]) < MARGIN, \
                    f"{name} {qtype}: greedy step {j} picked {got[j]}, the CPU {cont[j]} (margin " \
                    f"{_margin(rows[j]):.3f} std)"
                break


def _batched(path, backend, feed=None):
    """Batched decode rows of three sequences: 4 steps; the tokens fed are the CPU's greedy
    picks (feed: those picks, so both backends run the same inputs), and the picks."""
    from minfer.model import Model
    from minfer.session import Context

    m = Model.open(path, backends=[backend])
    ctx = Context(m, n_ctx=96, n_seq=3)
    ss = [ctx.session(i) for i in range(3)]
    prompts = [_prompt(10 + i, 20 + 7 * i, m.hp.n_vocab) for i in range(3)]
    first = [s.forward(p) for s, p in zip(ss, prompts)]
    toks = feed[0] if feed else [int(f[-1].argmax()) for f in first]
    picks, out = [toks], []
    for step in range(4):
        lg = ctx.decode_batch([(s, [t]) for s, t in zip(ss, toks)])
        out.append(lg)
        toks = feed[step + 1] if feed else [int(r.argmax()) for r in lg]
        picks.append(toks)
    return np.concatenate(out), picks, prompts


def test_model_batched_decode_of_several_sequences(moe_file):
    """Three sequences prefilled one by one, then decoded together for 4 steps (three rows
    a step, each with its own KV span), fed the CPU's greedy picks on both backends: each
    row within the bounds above of the CPU's, and of the same sequence decoded alone on
    CUDA."""
    name, qtype, path = moe_file
    cpu, picks, prompts = _batched(path, "cpu")
    gpu, _, _ = _batched(path, "cuda", feed=picks)
    err = _err_std(gpu, cpu)
    what = f"{name} {qtype}: batched rows err/std median {np.median(err):.4f} max {err.max():.4f}"
    assert np.median(err) < MODEL_MEDIAN and np.quantile(err, 0.9) < MODEL_P90 and err.max() < MODEL_MAX, what
    alone = _open(path, "cuda")
    for i, p in enumerate(prompts):
        alone.reset()
        alone.forward(p)
        seq_rows = np.concatenate([alone.forward([picks[s][i]]) for s in range(4)])
        e = _err_std(seq_rows, gpu.reshape(4, 3, -1)[:, i])
        assert e.max() < MODEL_MAX, f"{name} {qtype}: sequence {i} batched vs alone err/std {np.round(e, 4)}"


@pytest.mark.parametrize("family", gpu_models.MOE)
def test_model_identity_gates(family, monkeypatch):
    """On the Q4_K_M files: decode logits bitwise equal with every step merge and with
    none (MINFER_CUDA_FUSE=none), replayed and launched directly (MINFER_NO_CUDA_GRAPH=1);
    and a block of 5 tokens (row-exact: the expert matvec) gives each row bitwise as the
    single steps do."""
    path = gpu_models.moe_gguf(family, "Q4_K_M")

    def decode(env: dict):
        for k in ("MINFER_CUDA_FUSE", "MINFER_NO_CUDA_GRAPH"):
            monkeypatch.delenv(k, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        s = _open(path, "cuda")
        p = _prompt(5, 24, s.hp.n_vocab)
        out = [s.forward(p, n_out=len(p))]
        t = int(out[0][-1].argmax())
        for _ in range(6):
            out.append(s.forward([t]))
            t = int(out[-1][-1].argmax())
        return np.concatenate(out)

    base = decode({})
    assert decode({"MINFER_CUDA_FUSE": "none"}).tobytes() == base.tobytes(), "fused vs unfused"
    assert decode({"MINFER_NO_CUDA_GRAPH": "1"}).tobytes() == base.tobytes(), "replay vs direct launches"
    for k in ("MINFER_CUDA_FUSE", "MINFER_NO_CUDA_GRAPH"):
        monkeypatch.delenv(k, raising=False)
    s = _open(path, "cuda")
    p = _prompt(6, 20, s.hp.n_vocab)
    blk = _prompt(7, 5, s.hp.n_vocab)
    s.forward(p)
    block = s.forward(blk, n_out=len(blk))
    s.reset()
    s.forward(p)
    steps = np.concatenate([s.forward([t]) for t in blk])
    assert block.tobytes() == steps.tobytes(), f"{family}: a 5-token block's rows vs single steps"
