"""K-quant weights (Q4_K, Q5_K, Q6_K) through the compiled core, checked against the
`gguf` package's dequantizer and float64 NumPy.

The matmul quantizes activations to Q8_K (one f32 scale per 256 values, int8 codes), so
against the f32 activations each product carries at most |d_block| / 2 of rounding per
activation element; the tolerance below is that bound summed over |w|, not a guess.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize

from minfer import _core

K_TYPES = {QT.Q4_K: 144, QT.Q5_K: 176, QT.Q6_K: 210}


def random_k_rows(rng, qtype, rows, n):
    """Random blocks with random bits everywhere except finite, small f16 d/dmin."""
    size = K_TYPES[qtype]
    nblk = rows * n // 256
    b = rng.integers(0, 256, size=(nblk, size), dtype=np.uint8)
    d = rng.uniform(-0.03, 0.03, nblk).astype(np.float16).view(np.uint8).reshape(nblk, 2)
    if qtype == QT.Q6_K:
        b[:, 208:210] = d
    else:
        b[:, 0:2] = d
        b[:, 2:4] = rng.uniform(0, 0.03, nblk).astype(np.float16).view(np.uint8).reshape(nblk, 2)
    return b.reshape(rows, n // 256 * size)


def q8k_error_bound(x, w_deq):
    """Worst-case |matmul(x) - x @ w.T| from Q8_K rounding, per (token, row)."""
    xb = x.reshape(x.shape[0], -1, 256).astype(np.float64)
    half_step = np.abs(xb).max(axis=2) / 127.0 / 2.0  # |d| / 2 per block
    per_elem = np.repeat(half_step, 256, axis=1)
    return per_elem @ np.abs(w_deq.astype(np.float64)).T


def run_matmul(wbytes, qtype, n_in, n_out, x, bias=None, threads=2):
    ws = _core.WeightStore()
    hw = ws.add("w", wbytes, int(qtype), n_in, n_out)
    hb = ws.add("b", bias, 0, n_out, 1) if bias is not None else -1
    nt = x.shape[0]
    pool = _core.Pool("test")
    y_id = pool.alloc(nt * n_out * 4)
    x_id = pool.alloc(nt * n_in * 4)
    pool.write(x_id, np.ascontiguousarray(x, dtype=np.float32))
    plan = _core.Plan("kq")
    plan.add(_core.OPS["matmul"], 0, [y_id, x_id], [n_in, n_out, nt], [], [hw, hb])
    _core.validate(plan, pool, ws)
    _core.run(plan, pool, ws, threads)
    return pool.read(y_id, "float32", nt * n_out).reshape(nt, n_out)


@pytest.fixture(params=["simd", "scalar"])
def kernel_path(request):
    before = _core.testing.kernel_path()
    _core.testing.set_kernel_path(request.param)
    yield request.param
    _core.testing.set_kernel_path(before)


@pytest.mark.parametrize("qtype", list(K_TYPES))
def test_dequantize_row_bitwise_matches_gguf(qtype):
    rng = np.random.default_rng(int(qtype))
    rows = random_k_rows(rng, qtype, 4, 1024)
    ref = dequantize(rows, qtype)
    for r in range(rows.shape[0]):
        got = _core.testing.dequantize_row(int(qtype), rows[r], 1024)
        assert np.array_equal(got.view(np.uint32), ref[r].view(np.uint32))


@pytest.mark.parametrize("qtype", list(K_TYPES))
@pytest.mark.parametrize("nt", [1, 3, 6])
def test_matmul_matches_float64_reference(qtype, nt, kernel_path):
    rng = np.random.default_rng(100 + int(qtype) * 10 + nt)
    n_in, n_out = 768, 21  # 21 rows: not a multiple of any row tile
    w = random_k_rows(rng, qtype, n_out, n_in)
    w_deq = dequantize(w, qtype).astype(np.float64)
    x = (rng.standard_normal((nt, n_in)) * 3).astype(np.float32)
    x[0, 256:512] = 0.0  # an all-zero activation block (d = 0)
    x[-1, 5] = 200.0  # one outlier dominating its block's scale
    bias = rng.standard_normal(n_out).astype(np.float32)

    got = run_matmul(w, qtype, n_in, n_out, x, bias).astype(np.float64)
    ref = x.astype(np.float64) @ w_deq.T + bias
    bound = q8k_error_bound(x, w_deq)
    slack = 1e-5 * (np.abs(x).astype(np.float64) @ np.abs(w_deq).T) + 1e-5
    assert np.all(np.abs(got - ref) <= bound + slack)
    # The bound is loose; the typical error is far inside it, and a kernel that drops a
    # sub-block or mis-scales one would not be.
    assert np.abs(got - ref).mean() < 0.25 * bound.mean()


def test_simd_and_scalar_agree_closely():
    rng = np.random.default_rng(7)
    n_in, n_out, nt = 1024, 9, 4
    results = {}
    before = _core.testing.kernel_path()
    try:
        for qtype in K_TYPES:
            w = random_k_rows(rng, qtype, n_out, n_in)
            x = rng.standard_normal((nt, n_in)).astype(np.float32)
            for path in ("scalar", "simd"):
                _core.testing.set_kernel_path(path)
                results[(qtype, path)] = run_matmul(w, qtype, n_in, n_out, x)
            a, b = results[(qtype, "scalar")], results[(qtype, "simd")]
            # Same integer block sums; only the float accumulation order may differ.
            assert np.allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(a).max())
    finally:
        _core.testing.set_kernel_path(before)


@pytest.mark.parametrize("qtype", list(K_TYPES))
def test_row_length_not_multiple_of_256_is_rejected(qtype):
    with pytest.raises(ValueError):
        _core.testing.dequantize_row(int(qtype), np.zeros(K_TYPES[qtype], np.uint8), 128)
    ws = _core.WeightStore()
    with pytest.raises(ValueError):
        ws.add("w", np.zeros(K_TYPES[qtype], np.uint8), int(qtype), 128, 1)


def test_real_model_ffn_down_k_tensors(real_model_path):
    """The model's own Q4_K and Q6_K ffn_down weights (4864 wide)."""
    from minfer.io.gguf_file import GGUFFile

    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 4864)).astype(np.float32)
    seen = set()
    with GGUFFile.open(real_model_path) as f:
        for name, info in f.tensors.items():
            if not name.endswith("ffn_down.weight") or info.type in seen or info.type not in (QT.Q4_K, QT.Q6_K):
                continue
            seen.add(info.type)
            qtype = QT(info.type)
            n_in, n_out = info.shape[0], 64  # a slice of rows keeps the NumPy reference fast
            data = np.array(f.tensor_data(name)[: n_out * info.row_nbytes]).reshape(n_out, -1)
            w_deq = dequantize(data, qtype).astype(np.float64)
            assert np.array_equal(_core.testing.dequantize_row(int(qtype), data[17], n_in), w_deq[17].astype(np.float32))
            got = run_matmul(data, qtype, n_in, n_out, x).astype(np.float64)
            ref = x.astype(np.float64) @ w_deq.T
            bound = q8k_error_bound(x, w_deq)
            assert np.all(np.abs(got - ref) <= bound + 1e-4)
            assert np.abs(got - ref).mean() < 0.25 * bound.mean()
    assert seen == {QT.Q4_K, QT.Q6_K}
