"""The mixture-of-experts CPU kernels (csrc/cpu/moe.cpp) through one-step plans:

- MATMUL_ID (the grouped expert matmul) against NumPy float64 on the `gguf` package's
  dequantization of the expert weights, with the engine's 8-bit rounding of the
  activations applied the same way (reference_forward's fake Q8_0 / Q8_K);
- MATMUL_ID bitwise equal to a plain MATMUL of each (token, slot) with its expert's own
  rows registered as a separate weight, for 1, 2 and 3 threads, decode (one token) and
  batches, inputs shared by a token's slots or one per slot;
- MOE_TOPK / MOE_WEIGHTS against NumPy (softmax, sigmoid, softmax of the picked; with and
  without renormalisation and scale; ties and NaN), MOE_SUM and SIGMOID.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from minfer import _core
from reference_forward import _fake_q8_0, _fake_q8_k

OPS = _core.OPS
QT = gguf.GGMLQuantizationType


class Rig:
    def __init__(self):
        self.pool = _core.Pool("moe-test")
        self.weights = _core.WeightStore()

    def buf(self, arr):
        arr = np.ascontiguousarray(arr)
        bid = self.pool.alloc(max(arr.nbytes, 4))
        self.pool.write(bid, arr)
        return bid

    def out(self, n):
        return self.pool.alloc(max(4, n * 4))

    def read(self, bid, n, dtype="float32"):
        return self.pool.read(bid, dtype, n)

    def weight(self, name, raw, wtype, ne0, ne1):
        return self.weights.add(name, np.ascontiguousarray(raw).view(np.uint8).reshape(-1), int(wtype), ne0, ne1)

    def run(self, steps, n_threads=1):
        plan = _core.Plan("t")
        for i, (op, bufs, ip, fp, w) in enumerate(steps):
            plan.add(OPS[op], i, list(bufs), list(ip), list(fp), list(w))
        _core.run(plan, self.pool, self.weights, n_threads)


def _quantized(wtype: QT, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(GGUF bytes of w's rows in wtype, their gguf dequantization as float64)."""
    if wtype == QT.F32:
        raw = w.astype(np.float32)
        return raw, raw.astype(np.float64)
    if wtype == QT.F16:
        raw = w.astype(np.float16)
        return raw, raw.astype(np.float64)
    raw = np.asarray(_core.quantize(int(wtype), w.astype(np.float32)), dtype=np.uint8)
    deq = gguf.quants.dequantize(raw.reshape(w.shape[0], -1), wtype)
    return raw, np.asarray(deq, dtype=np.float64).reshape(w.shape)


def _fake_act(wtype: QT, x: np.ndarray) -> np.ndarray:
    if wtype in (QT.F32, QT.F16):
        return x.astype(np.float64)
    if wtype.name.endswith("_K"):
        return _fake_q8_k(x.astype(np.float64))
    return _fake_q8_0(x.astype(np.float64))


@pytest.fixture(params=["simd", "scalar"])
def kernel_path(request):
    """The SIMD path (repacked weights where the type has them) and the portable one."""
    _core.testing.set_kernel_path(request.param)
    yield request.param
    _core.testing.set_kernel_path("simd")


TYPES = [QT.F32, QT.F16, QT.Q8_0, QT.Q4_0, QT.Q5_0, QT.Q4_K, QT.Q5_K, QT.Q6_K]
IN, OUT, N_EXP, K = 256, 40, 6, 2   # OUT is no multiple of 16: expert rows straddle repacked groups


def _ids(rng, nt: int, n_exp: int, k: int) -> np.ndarray:
    return np.stack([rng.permutation(n_exp)[:k] for _ in range(nt)]).astype(np.int32)


def _matmul_id(rig, wh, x, ids, out, n_exp, n_threads):
    nt, k = ids.shape
    ix, ii, iy = rig.buf(x.astype(np.float32)), rig.buf(ids), rig.out(nt * k * out)
    rig.run([("matmul_id", [iy, ix, ii], [x.shape[1], out, x.shape[0], n_exp, k, nt], [], [wh])], n_threads)
    return rig.read(iy, nt * k * out).reshape(nt * k, out)


@pytest.mark.parametrize("wtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("nt", [1, 3, 19])
@pytest.mark.parametrize("per_slot", [False, True], ids=["shared-x", "per-slot-x"])
def test_matmul_id_matches_numpy_on_gguf_dequantized_weights(wtype, nt, per_slot, kernel_path):
    rng = np.random.default_rng(100 * nt + int(wtype))
    w = rng.standard_normal((N_EXP * OUT, IN)).astype(np.float32) * 0.1
    raw, deq = _quantized(wtype, w)
    ids = _ids(rng, nt, N_EXP, K)
    x = rng.standard_normal((nt * K if per_slot else nt, IN)).astype(np.float32)
    rig = Rig()
    wh = rig.weight("exps", raw, wtype, IN, N_EXP * OUT)
    got = _matmul_id(rig, wh, x, ids, OUT, N_EXP, 2)
    xa = _fake_act(wtype, x)
    deq = deq.reshape(N_EXP, OUT, IN)
    want = np.empty((nt * K, OUT))
    for t in range(nt):
        for j in range(K):
            want[t * K + j] = deq[ids[t, j]] @ xa[t * K + j if per_slot else t]
    # Only float32 accumulation order differs (measured at most 3e-7 of the output scale),
    # except where an activation lands on a rounding boundary of its 8-bit block: the
    # reference rounds x / d in float64, ggml's quantizer x * (1 / d) in float32, so the
    # code may differ by one step (measured once over these cases: 8e-4 in one row).
    row_err = np.abs(got - want).max(axis=1) / np.abs(want).max()
    assert (row_err > 2e-6).sum() <= 1 and row_err.max() < 2e-3, \
        f"{wtype.name}: per-row error {np.round(row_err, 8)} of the output scale"


@pytest.mark.parametrize("wtype", [QT.F32, QT.Q8_0, QT.Q4_0, QT.Q4_K, QT.Q6_K, QT.Q5_K], ids=lambda t: t.name)
@pytest.mark.parametrize("per_slot", [False, True], ids=["shared-x", "per-slot-x"])
def test_matmul_id_is_bitwise_the_per_expert_matmul(wtype, per_slot, kernel_path):
    """Each (token, slot) row equals MATMUL of its expert's rows alone, bit for bit, for
    every thread count and batch size (decode reads rows in place, batches gather them)."""
    rng = np.random.default_rng(7 + int(wtype))
    w = rng.standard_normal((N_EXP * OUT, IN)).astype(np.float32) * 0.1
    raw, _ = _quantized(wtype, w)
    row_bytes = raw.size // (N_EXP * OUT) if raw.dtype == np.uint8 else IN * raw.itemsize
    flat = np.ascontiguousarray(raw).view(np.uint8).reshape(N_EXP * OUT, row_bytes)
    for nt in (1, 2, 23):
        ids = _ids(rng, nt, N_EXP, K)
        x = rng.standard_normal((nt * K if per_slot else nt, IN)).astype(np.float32)
        rig = Rig()
        wh = rig.weight("exps", flat, wtype, IN, N_EXP * OUT)
        per = [rig.weight(f"e{e}", flat[e * OUT:(e + 1) * OUT], wtype, IN, OUT) for e in range(N_EXP)]
        want = np.empty((nt * K, OUT), np.float32)
        for t in range(nt):
            for j in range(K):
                xi = x[t * K + j if per_slot else t][None]
                ix, iy = rig.buf(xi), rig.out(OUT)
                rig.run([("matmul", [iy, ix], [IN, OUT, 1], [], [per[ids[t, j]], -1])], 1)
                want[t * K + j] = rig.read(iy, OUT)
        for n_threads in (1, 2, 3):
            got = _matmul_id(rig, wh, x, ids, OUT, N_EXP, n_threads)
            assert np.array_equal(got, want), f"{wtype.name} nt={nt} threads={n_threads}: not bitwise equal"


def test_matmul_id_gate_and_up_back_to_back():
    """Two MATMUL_IDs on the same input with no barrier between them (the executor's
    hazard analysis leaves none: they share the quantized activations) still give each
    its own product: the second's gather waits until the first is done with the scratch."""
    rng = np.random.default_rng(5)
    nt = 29
    ws = [rng.standard_normal((N_EXP * OUT, IN)).astype(np.float32) * 0.1 for _ in range(2)]
    ids = _ids(rng, nt, N_EXP, K)
    x = rng.standard_normal((nt, IN)).astype(np.float32)
    rig = Rig()
    raws = [_quantized(QT.Q4_K, w)[0] for w in ws]
    wh = [rig.weight(f"w{i}", r, QT.Q4_K, IN, N_EXP * OUT) for i, r in enumerate(raws)]
    alone = [_matmul_id(rig, h, x, ids, OUT, N_EXP, 2) for h in wh]
    ix, ii = rig.buf(x), rig.buf(ids)
    y0, y1 = rig.out(nt * K * OUT), rig.out(nt * K * OUT)
    ip = [IN, OUT, nt, N_EXP, K, nt]
    for _ in range(5):
        rig.run([("matmul_id", [y0, ix, ii], ip, [], [wh[0]]), ("matmul_id", [y1, ix, ii], ip, [], [wh[1]])], 2)
        assert np.array_equal(rig.read(y0, nt * K * OUT).reshape(nt * K, OUT), alone[0])
        assert np.array_equal(rig.read(y1, nt * K * OUT).reshape(nt * K, OUT), alone[1])


def test_matmul_id_invalid_ids_give_zero_rows():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((N_EXP * OUT, IN)).astype(np.float32)
    rig = Rig()
    wh = rig.weight("exps", w, QT.F32, IN, N_EXP * OUT)
    ids = np.array([[0, -1], [N_EXP, 2]], np.int32)
    x = rng.standard_normal((2, IN)).astype(np.float32)
    got = _matmul_id(rig, wh, x, ids, OUT, N_EXP, 2)
    assert not got[1].any() and not got[2].any()
    np.testing.assert_allclose(got[0], w[:OUT] @ x[0], rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(got[3], w[2 * OUT:3 * OUT] @ x[1], rtol=1e-5, atol=1e-4)


def test_matmul_id_plan_is_validated():
    rig = Rig()
    wh = rig.weight("exps", np.zeros((N_EXP * OUT, IN), np.float32), QT.F32, IN, N_EXP * OUT)
    ix, ii, iy = rig.buf(np.zeros((2, IN), np.float32)), rig.buf(np.zeros((2, K), np.int32)), rig.out(2 * K * OUT)
    with pytest.raises(ValueError, match="experts of"):
        rig.run([("matmul_id", [iy, ix, ii], [IN, OUT, 2, N_EXP + 1, K, 2], [], [wh])])
    with pytest.raises(ValueError, match="x_rows"):
        rig.run([("matmul_id", [iy, ix, ii], [IN, OUT, 3, N_EXP, K, 2], [], [wh])])


# ---------------------------------------------------------------- routing


def _route_numpy(x: np.ndarray, k: int, gating: int, norm: bool, scale: float):
    x = x.astype(np.float64)
    key = np.where(np.isnan(x), -np.inf, x)
    ids = np.argsort(-key, axis=1, kind="stable")[:, :k]
    sel = np.take_along_axis(x, ids, axis=1)
    if gating == 1:
        p = np.exp(x - x.max(axis=1, keepdims=True))
        w = np.take_along_axis(p / p.sum(axis=1, keepdims=True), ids, axis=1)
    elif gating == 2:
        w = 1.0 / (1.0 + np.exp(-sel))
    else:
        p = np.exp(sel - sel.max(axis=1, keepdims=True))
        w = p / p.sum(axis=1, keepdims=True)
    if norm:
        w = w / np.maximum(w.sum(axis=1, keepdims=True), 6.103515625e-5)
    if scale not in (0.0, 1.0):
        w = w * scale
    return ids.astype(np.int32), w


@pytest.mark.parametrize("gating", [1, 2, 3], ids=["softmax", "sigmoid", "softmax-topk"])
@pytest.mark.parametrize("norm,scale", [(False, 0.0), (True, 0.0), (True, 2.5)])
def test_topk_and_weights_match_numpy(gating, norm, scale):
    rng = np.random.default_rng(gating)
    n_exp, k = 60, 4
    for nt in (1, 2, 9):
        x = rng.standard_normal((nt, n_exp)).astype(np.float32) * 3
        x[0, 5] = x[0, 7] = x[0].max() + 1   # a tie for first place: the lower id first
        rig = Rig()
        ix, ii, iw = rig.buf(x), rig.out(nt * k), rig.out(nt * k)
        rig.run([("moe_topk", [ii, ix], [n_exp, k, nt], [], []),
                 ("moe_weights", [iw, ix], [n_exp, k, nt, gating, int(norm)], [scale], [])], 2)
        ids, w = _route_numpy(x, k, gating, norm, scale)
        assert np.array_equal(rig.read(ii, nt * k, "int32").reshape(nt, k), ids)
        np.testing.assert_allclose(rig.read(iw, nt * k).reshape(nt, k), w, rtol=2e-6, atol=1e-7)
        assert ids[0, 0] == 5 and ids[0, 1] == 7


def test_topk_with_nan_picks_distinct_valid_ids():
    x = np.array([[np.nan, 1.0, np.nan, -np.inf, 3.0, np.nan]], np.float32)
    rig = Rig()
    ix, ii = rig.buf(x), rig.out(4)
    rig.run([("moe_topk", [ii, ix], [6, 4, 1], [], [])])
    assert rig.read(ii, 4, "int32").tolist() == [4, 1, 0, 2]


def test_moe_sum_and_sigmoid():
    rng = np.random.default_rng(9)
    d, k, nt = 70, 3, 5
    x = rng.standard_normal((nt * k, d)).astype(np.float32)
    w = rng.random((nt, k)).astype(np.float32)
    rig = Rig()
    ix, iw, iy = rig.buf(x), rig.buf(w), rig.out(nt * d)
    for n_threads in (1, 3):
        rig.run([("moe_sum", [iy, ix, iw], [d, k, nt], [], [])], n_threads)
        want = np.einsum("tk,tkd->td", w.astype(np.float64), x.reshape(nt, k, d).astype(np.float64))
        np.testing.assert_allclose(rig.read(iy, nt * d).reshape(nt, d), want, rtol=1e-5, atol=1e-6)
    s = np.array([-1000, -30, -1, 0, 1, 30, 1000, np.inf, -np.inf], np.float32)
    i_s, i_o = rig.buf(s), rig.out(s.size)
    rig.run([("sigmoid", [i_o, i_s], [s.size], [], [])])
    with np.errstate(over="ignore"):
        want = 1.0 / (1.0 + np.exp(-s.astype(np.float64)))
    np.testing.assert_allclose(rig.read(i_o, s.size), want, rtol=1e-6, atol=0)
