"""Non-matmul CPU kernels (csrc/cpu/ops.cpp, attention.cpp), driven through minfer._core
one-step plans and checked against plain NumPy float64 references (and the gguf
package's dequantizers for quantized embedding tables).

Determinism contract checked here: every kernel's output is bit-identical for 1 and 2
threads (element-wise ops pad the tail into a full vector; attention aligns KV blocks to
absolute cell indices and computes each (token, head) row independently of its grouping).
"""

import gguf
import numpy as np
import pytest

from minfer import _core

OPS = _core.OPS
F32 = gguf.GGMLQuantizationType.F32


@pytest.fixture(params=["simd", "scalar"])
def kernel_path(request):
    _core.testing.set_kernel_path(request.param)
    yield request.param
    _core.testing.set_kernel_path("simd")


class Rig:
    """A pool, a weight store and one-step plans."""

    def __init__(self):
        self.pool = _core.Pool("test")
        self.weights = _core.WeightStore()

    def buf(self, arr):
        arr = np.ascontiguousarray(arr)
        bid = self.pool.alloc(max(arr.nbytes, 4))
        self.pool.write(bid, arr)
        return bid

    def out(self, n, dtype="float32"):
        return self.pool.alloc(max(4, n * np.dtype(dtype).itemsize))

    def read(self, bid, n, shape=None):
        a = self.pool.read(bid, "float32", n)
        return a.reshape(shape) if shape is not None else a

    def weight(self, name, raw, wtype, ne0, ne1):
        raw = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
        return self.weights.add(name, raw, int(wtype), ne0, ne1)

    def run(self, steps, n_threads=1):
        plan = _core.Plan("t")
        for i, (op, bufs, ip, fp, w) in enumerate(steps):
            plan.add(OPS[op], i, bufs, ip, fp, w)
        _core.run(plan, self.pool, self.weights, n_threads)


def step(op, bufs, ip=(), fp=(), w=()):
    return (op, list(bufs), list(ip), list(fp), list(w))


SIZES = [1, 7, 8, 17, 33, 1000, 4099]


# ---------------------------------------------------------------- element-wise


def _elementwise(op, a, b, n_threads):
    r = Rig()
    ia, ib, iy = r.buf(a), r.buf(b), r.out(a.size)
    bufs = [iy, ia] if op == "silu" else [iy, ia, ib]
    r.run([step(op, bufs, [a.size])], n_threads)
    return r.read(iy, a.size)


@pytest.mark.parametrize("n", SIZES)
def test_add_mul_exact(n, kernel_path):
    rng = np.random.default_rng(n)
    a = rng.standard_normal(n).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    for nth in (1, 2):
        # One IEEE op per element: float32 NumPy is an exact reference.
        np.testing.assert_array_equal(_elementwise("add", a, b, nth), a + b)
        np.testing.assert_array_equal(_elementwise("mul", a, b, nth), a * b)


def _silu64(x):
    x = x.astype(np.float64)
    return x / (1.0 + np.exp(-x))


def _silu_inputs(n, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 8).astype(np.float32)
    # Saturation and underflow regions, zero and signed zero.
    special = np.array([0.0, -0.0, 1e-30, -1e-30, 20.0, -20.0, 88.0, -87.0, 95.0, -95.0, 150.0, -150.0],
                       dtype=np.float32)
    x[: min(n, special.size)] = special[: min(n, special.size)]
    return x


@pytest.mark.parametrize("n", SIZES)
def test_silu_accuracy(n, kernel_path):
    x = _silu_inputs(n, n + 1)
    ref = _silu64(x)
    for nth in (1, 2):
        y = _elementwise("silu", x, x, nth)
        # 1e-6 relative; the absolute floor only covers results deep in the denormal range.
        np.testing.assert_allclose(y, ref, rtol=1e-6, atol=1e-40)


def test_silu_nan_and_inf_propagate(kernel_path):
    x = np.array([np.nan, np.inf, -np.inf, 1.0, np.nan, -2.0, 3.0, 4.0, np.nan], dtype=np.float32)
    y = _elementwise("silu", x, x, 1)
    assert np.isnan(y[[0, 4, 8]]).all()
    assert y[1] == np.inf and y[2] == 0.0


@pytest.mark.parametrize("n", SIZES)
def test_swiglu_bitwise_equals_silu_then_mul(n, kernel_path):
    g = _silu_inputs(n, 2 * n)
    u = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    for nth in (1, 2):
        r = Rig()
        ig, iu, iy, is_, im = r.buf(g), r.buf(u), r.out(n), r.out(n), r.out(n)
        r.run([step("swiglu", [iy, ig, iu], [n]),
               step("silu", [is_, ig], [n]),
               step("mul", [im, is_, iu], [n])], nth)
        fused, chained = r.read(iy, n), r.read(im, n)
        np.testing.assert_array_equal(fused.view(np.uint32), chained.view(np.uint32))
        np.testing.assert_allclose(fused, _silu64(g) * u, rtol=2e-6, atol=1e-38)


def test_elementwise_in_place(kernel_path):
    n = 1001
    rng = np.random.default_rng(5)
    x = rng.standard_normal(n).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    r = Rig()
    ix, ib = r.buf(x), r.buf(b)
    r.run([step("silu", [ix, ix], [n]), step("add", [ix, ix, ib], [n])], 2)
    np.testing.assert_allclose(r.read(ix, n), _silu64(x) + b, rtol=1e-6, atol=1e-6)


def test_threads_agree_bitwise_on_silu():
    x = _silu_inputs(4099, 9)
    one, two = _elementwise("silu", x, x, 1), _elementwise("silu", x, x, 2)
    np.testing.assert_array_equal(one.view(np.uint32), two.view(np.uint32))


# ---------------------------------------------------------------- greedy pick (argmax)

F32_MAX = np.finfo(np.float32).max


@pytest.mark.parametrize("n", [1, 7, 32, 33, 1023, 1024, 1025, 4099, 151936])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_argmax_is_the_first_index_of_the_max(n, threads, kernel_path):
    rng = np.random.default_rng(n * 7 + threads)
    r = Rig()
    rows = [rng.standard_normal(n).astype(np.float32),
            np.round(rng.standard_normal(n)).astype(np.float32),     # many ties: the first wins
            np.where(rng.random(n) < 0.5, -0.0, 0.0).astype(np.float32),  # -0 and +0 tie
            np.linspace(-5, 5, n, dtype=np.float32),                 # the max in the last value
            np.where(rng.random(n) < 0.1, F32_MAX, 1e-45).astype(np.float32)]  # extremes are finite
    for x in rows:
        assert _core.argmax(r.pool, r.buf(x), n, threads) == int(np.argmax(x))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("threads", [1, 2])
def test_argmax_flags_any_nan_or_inf(bad, threads, kernel_path):
    """A greedy pick never answers for broken logits: -1, wherever the value lies (any
    thread's share, inside a vector or in a tail), found by the same pass as the max."""
    n = 151936
    x = np.random.default_rng(5).standard_normal(n).astype(np.float32)
    r = Rig()
    for at in (0, 1, 31, 1023, 1024, n // 2 - 1, n // 2, n - 33, n - 1):
        y = x.copy()
        y[at] = bad
        assert _core.argmax(r.pool, r.buf(y), n, threads) == -1, at


@pytest.mark.parametrize("threads", [1, 2])
def test_argmax_rows_picks_each_row_and_flags_broken_ones(threads):
    """A verified speculative block: one pick per row, -1 for a row with NaN or Inf."""
    n, rows = 4099, 9
    x = np.round(np.random.default_rng(8).standard_normal((rows, n)) * 3).astype(np.float32)
    r = Rig()
    assert _core.argmax_rows(r.pool, r.buf(x), n, rows, threads) == [int(i) for i in np.argmax(x, axis=1)]
    x[3, 100], x[8, n - 1] = np.nan, -np.inf
    want = [-1 if i in (3, 8) else int(np.argmax(x[i])) for i in range(rows)]
    assert _core.argmax_rows(r.pool, r.buf(x), n, rows, threads) == want
    with pytest.raises(IndexError):
        _core.argmax_rows(r.pool, r.buf(x), n, rows + 1, threads)  # past the buffer


@pytest.mark.parametrize("n", [1, 5, 8, 9, 40, 1000, 151936])
@pytest.mark.parametrize("k", [1, 7, 40, 1000])
def test_top_k_is_a_stable_sort_prefix(n, k, kernel_path):
    """Sampling's candidates: the k largest, best first, equal values by index."""
    rng = np.random.default_rng(n + k)
    for x in (rng.standard_normal(n).astype(np.float32), np.round(rng.standard_normal(n) * 2).astype(np.float32),
              np.linspace(3, -3, n, dtype=np.float32), np.full(n, -F32_MAX, np.float32)):
        want = np.lexsort((np.arange(n), -x))[:k]
        assert np.array_equal(_core.top_k(x, k), want)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_top_k_refuses_nan_and_inf(bad, kernel_path):
    x = np.random.default_rng(3).standard_normal(4099).astype(np.float32)
    for at in (0, 5, 39, 40, 4095, 4098):
        y = x.copy()
        y[at] = bad
        assert _core.top_k(y, 40) is None, at
    with pytest.raises(ValueError, match="k must be"):
        _core.top_k(x, 0)


# ---------------------------------------------------------------- RMSNorm / QK-norm


def _rms64(x, w, eps):
    x = x.astype(np.float64)
    y = x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)
    return y * w.astype(np.float64) if w is not None else y


@pytest.mark.parametrize("with_weight", [True, False])
@pytest.mark.parametrize("d,nrows", [(896, 1), (896, 5), (13, 3), (4096, 2)])
def test_rms_norm(with_weight, d, nrows, kernel_path):
    rng = np.random.default_rng(d * 7 + nrows)
    x = (rng.standard_normal((nrows, d)) * 3 + 0.5).astype(np.float32)
    w = rng.standard_normal(d).astype(np.float32) if with_weight else None
    eps = 1e-6
    outs = []
    for nth in (1, 2):
        r = Rig()
        wh = [r.weight("norm", w, F32, d, 1)] if with_weight else [-1]
        ix, iy = r.buf(x), r.out(x.size)
        r.run([step("rms_norm", [iy, ix], [d, nrows], [eps], wh)], nth)
        outs.append(r.read(iy, x.size, x.shape))
    np.testing.assert_allclose(outs[0], _rms64(x, w, eps), rtol=2e-6, atol=1e-6)
    np.testing.assert_array_equal(outs[0], outs[1])


def test_qk_norm_per_head(kernel_path):
    nt, nh, hd = 5, 14, 64
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((nt, nh * hd)) * 4).astype(np.float32)
    w = (rng.standard_normal(hd) * 0.5 + 1).astype(np.float32)
    r = Rig()
    wh = r.weight("q_norm", w, F32, hd, 1)
    ix = r.buf(x)
    r.run([step("qk_norm", [ix, ix], [hd, nt * nh], [1e-6], [wh])], 2)  # in place
    ref = _rms64(x.reshape(nt, nh, hd), w, 1e-6).reshape(nt, nh * hd)
    np.testing.assert_allclose(r.read(ix, x.size, x.shape), ref, rtol=2e-6, atol=1e-6)


# ---------------------------------------------------------------- RoPE


def _rope64(x, pos, nh, hd, n_rot, base):
    nt = x.shape[0]
    x = x.reshape(nt, nh, hd).astype(np.float64)
    y = x.copy()
    half = n_rot // 2
    inv = base ** (-2.0 * np.arange(half) / n_rot)
    th = pos.astype(np.float64)[:, None] * inv[None, :]
    c, s = np.cos(th)[:, None, :], np.sin(th)[:, None, :]
    x0, x1 = x[..., :half], x[..., half:n_rot]
    y[..., :half] = x0 * c - x1 * s
    y[..., half:n_rot] = x0 * s + x1 * c
    return y.reshape(nt, nh * hd)


@pytest.mark.parametrize("nh,hd,n_rot", [(14, 64, 64), (2, 128, 128), (3, 64, 32)])
@pytest.mark.parametrize("in_place", [False, True])
def test_rope_neox(nh, hd, n_rot, in_place):
    pos = np.array([0, 1, 2, 17, 511, 4095, 29999, 30000], dtype=np.int32)
    nt = pos.size
    rng = np.random.default_rng(nh + hd)
    x = rng.standard_normal((nt, nh * hd)).astype(np.float32)
    base = 1000000.0
    outs = []
    for nth in (1, 2):
        r = Rig()
        ix, ip_ = r.buf(x), r.buf(pos)
        iy = ix if in_place else r.out(x.size)
        r.run([step("rope", [iy, ix, ip_], [nt, nh, hd, n_rot], [base])], nth)
        outs.append(r.read(iy, x.size, x.shape))
    ref = _rope64(x, pos, nh, hd, n_rot, base)
    np.testing.assert_allclose(outs[0], ref, rtol=0, atol=2e-6)
    np.testing.assert_array_equal(outs[0], outs[1])
    if n_rot < hd:  # dims past n_rot pass through untouched
        tail = outs[0].reshape(nt, nh, hd)[..., n_rot:]
        np.testing.assert_array_equal(tail, x.reshape(nt, nh, hd)[..., n_rot:])


def test_rope_rejects_odd_n_rot():
    r = Rig()
    x = np.zeros((1, 64), np.float32)
    ix, ip_ = r.buf(x), r.buf(np.zeros(1, np.int32))
    with pytest.raises(ValueError, match="n_rot"):
        r.run([step("rope", [ix, ix, ip_], [1, 1, 64, 63], [10000.0])])


# ---------------------------------------------------------------- row gathers


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q5_0"])
def test_get_rows_w(qtype):
    qt = getattr(gguf.GGMLQuantizationType, qtype)
    n_rows, d = 50, 96
    rng = np.random.default_rng(11)
    table = rng.standard_normal((n_rows, d)).astype(np.float32)
    raw = gguf.quants.quantize(table, qt)  # (n_rows, row_bytes) uint8, or the float array
    ref_table = gguf.quants.dequantize(raw, qt).reshape(n_rows, d).astype(np.float32)
    ids = np.array([0, 49, 7, 7, 23, 1], dtype=np.int32)
    outs = []
    for nth in (1, 2):
        r = Rig()
        wh = r.weight("tok_embd", raw, qt, d, n_rows)
        ii, iy = r.buf(ids), r.out(ids.size * d)
        r.run([step("get_rows_w", [iy, ii], [d, ids.size, n_rows], [], [wh])], nth)
        outs.append(r.read(iy, ids.size * d, (ids.size, d)))
    np.testing.assert_allclose(outs[0], ref_table[ids], rtol=1e-6, atol=0)
    np.testing.assert_array_equal(outs[0], outs[1])


@pytest.mark.parametrize("bad", [50, -1])
def test_get_rows_w_out_of_range_id(bad):
    n_rows, d = 50, 32
    table = np.zeros((n_rows, d), np.float32)
    r = Rig()
    wh = r.weight("tok_embd", table, F32, d, n_rows)
    ii, iy = r.buf(np.array([3, bad], np.int32)), r.out(2 * d)
    with pytest.raises(ValueError, match="vocabulary"):
        r.run([step("get_rows_w", [iy, ii], [d, 2, n_rows], [], [wh])])


def test_get_rows_f32():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((9, 40)).astype(np.float32)
    ids = np.array([8, 0, 3, 3], np.int32)
    r = Rig()
    ix, ii, iy = r.buf(x), r.buf(ids), r.out(ids.size * 40)
    r.run([step("get_rows", [iy, ix, ii], [40, ids.size, 9])], 2)
    np.testing.assert_array_equal(r.read(iy, ids.size * 40, (ids.size, 40)), x[ids])
    ii_bad = r.buf(np.array([9], np.int32))
    with pytest.raises(ValueError, match="row id"):
        r.run([step("get_rows", [iy, ix, ii_bad], [40, 1, 9])])


# ---------------------------------------------------------------- KV store + attention


def span_cells(span, window=0) -> np.ndarray:
    """The cells a row reads, in order: (lo, hi) its own, or (lo, hi, plo, phi) a shared
    prefix's [plo, phi) first; a window keeps the last `window` of them."""
    lo, hi = span[0], span[1]
    plo, phi = (span[2], span[3]) if len(span) > 2 else (0, 0)
    cells = np.concatenate([np.arange(plo, max(plo, phi)), np.arange(lo, max(lo, hi))]).astype(np.int64)
    return cells[-window:] if window > 0 else cells


def attn64(q, K, V, nh, nkv, hd, ranges, scale, softcap=0.0, window=0):
    """q [nt][nh*hd]; K, V [n_ctx][nkv*hd]; ranges[t]: a span_cells span of row t;
    softcap > 0: every scaled score s becomes softcap * tanh(s / softcap) (the CUDA
    suite's reference too)."""
    nt = q.shape[0]
    out = np.zeros((nt, nh * hd))
    r = nh // nkv
    for t in range(nt):
        cells = span_cells(ranges[t], window)
        if not len(cells):
            continue
        for h in range(nh):
            g = h // r
            qh = q[t, h * hd:(h + 1) * hd].astype(np.float64)
            k = K[cells, g * hd:(g + 1) * hd].astype(np.float64)
            v = V[cells, g * hd:(g + 1) * hd].astype(np.float64)
            s = k @ qh * scale
            if softcap > 0:
                s = softcap * np.tanh(s / softcap)
            p = np.exp(s - s.max())
            out[t, h * hd:(h + 1) * hd] = (p / p.sum()) @ v
    return out


KV_TYPES = {"f32": (0, np.float32), "f16": (1, np.float16)}


@pytest.fixture(params=["f32", "f16"])
def kv_type(request):
    return request.param


class KvRig(Rig):
    """A K/V region pair of one element type plus helpers to store rows and run attention
    steps. K_host/V_host mirror the regions as the reference sees them: f16 regions hold
    the values rounded to f16 (round to nearest even, as numpy's astype)."""

    def __init__(self, nh, nkv, hd, n_ctx, q_extra=0, kv_type="f32"):
        super().__init__()
        self.nh, self.nkv, self.hd, self.n_ctx = nh, nkv, hd, n_ctx
        self.kv_dim = nkv * hd
        self.q_stride = nh * hd + q_extra
        self.kv_code, self.kv_np = KV_TYPES[kv_type]
        self.K = self.out(n_ctx * self.kv_dim, self.kv_np)
        self.V = self.out(n_ctx * self.kv_dim, self.kv_np)
        self.K_host = np.zeros((n_ctx, self.kv_dim), np.float32)
        self.V_host = np.zeros((n_ctx, self.kv_dim), np.float32)

    def region(self, bid):
        """A whole K or V region, as stored."""
        n = self.n_ctx * self.kv_dim
        return self.pool.read(bid, np.dtype(self.kv_np).name, n).reshape(self.n_ctx, self.kv_dim)

    def forward(self, q, k, v, cells, pos, span=None, n_threads=1, scale=None):
        nt = q.shape[0]
        qbuf = np.zeros((nt, self.q_stride), np.float32)
        qbuf[:, : self.nh * self.hd] = q
        qbuf[:, self.nh * self.hd:] = 1e9  # padding that must never be read as q
        iq, ik, iv = self.buf(qbuf), self.buf(k), self.buf(v)
        ic, ipos = self.buf(np.asarray(cells, np.int32)), self.buf(np.asarray(pos, np.int32))
        # Rows given as (lo, hi) read no shared prefix.
        span4 = None if span is None else [tuple(r) + (0, 0) if len(r) == 2 else tuple(r) for r in span]
        ispan = self.buf(np.asarray(span4, np.int32).reshape(-1)) if span is not None else -1
        iy = self.out(nt * self.nh * self.hd)
        scale = 1.0 / np.sqrt(self.hd) if scale is None else scale
        self.run([
            step("kv_store", [self.K, ik, iv, ic, self.V], [nt, self.kv_dim, self.n_ctx, self.kv_code]),
            step("attn", [iy, iq, self.K, self.V, ipos, ispan],
                 [nt, self.nh, self.nkv, self.hd, self.n_ctx, self.q_stride, self.kv_code], [scale]),
        ], n_threads)
        self.K_host[cells] = k.astype(self.kv_np).astype(np.float32)
        self.V_host[cells] = v.astype(self.kv_np).astype(np.float32)
        return self.read(iy, nt * self.nh * self.hd, (nt, self.nh * self.hd))


def _qkv(rng, nt, nh, nkv, hd, peak=1.0):
    q = (rng.standard_normal((nt, nh * hd)) * peak).astype(np.float32)
    k = rng.standard_normal((nt, nkv * hd)).astype(np.float32)
    v = rng.standard_normal((nt, nkv * hd)).astype(np.float32)
    return q, k, v


ATOL = 2e-5


@pytest.mark.parametrize("nh,nkv,hd", [(4, 4, 64), (4, 2, 64), (14, 2, 64), (4, 2, 128), (6, 3, 80), (4, 1, 20)])
@pytest.mark.parametrize("nt", [1, 5, 37])
def test_attention_prefill(nh, nkv, hd, nt, kernel_path, kv_type):
    rng = np.random.default_rng(nh * 100 + nkv * 10 + hd + nt)
    q, k, v = _qkv(rng, nt, nh, nkv, hd, peak=2.0)
    pos = np.arange(nt, dtype=np.int32)
    outs = []
    # 5 threads: more than the items of the short cases, so some threads take none.
    for nth in (1, 2, 5):
        kv = KvRig(nh, nkv, hd, n_ctx=64, q_extra=2 * nkv * hd, kv_type=kv_type)
        outs.append(kv.forward(q, k, v, cells=pos, pos=pos, n_threads=nth))
    ref = attn64(q, kv.K_host, kv.V_host, nh, nkv, hd, [(0, p + 1) for p in pos], 1.0 / np.sqrt(hd))
    np.testing.assert_allclose(outs[0], ref, rtol=1e-5, atol=ATOL)
    for o in outs[1:]:
        np.testing.assert_array_equal(outs[0], o)
    # KV store landed where the cells said, rounded to the element type.
    np.testing.assert_array_equal(kv.region(kv.K)[:nt], k.astype(kv.kv_np))
    np.testing.assert_array_equal(kv.region(kv.V)[:nt], v.astype(kv.kv_np))
    assert not kv.region(kv.K)[nt:].any()


@pytest.mark.parametrize("nh,nkv,hd", [(14, 2, 64), (4, 2, 128), (4, 4, 64)])
def test_attention_decode_after_prefill(nh, nkv, hd, kernel_path, kv_type):
    """Prefill spanning several KV blocks, then single-token decode steps at pos = n_past."""
    n_ctx, n_prompt = 320, 150
    by_threads = {}
    for nth in (1, 2):
        rng = np.random.default_rng(hd + nh)
        kv = KvRig(nh, nkv, hd, n_ctx, kv_type=kv_type)
        q, k, v = _qkv(rng, n_prompt, nh, nkv, hd, peak=3.0)
        pos = np.arange(n_prompt, dtype=np.int32)
        pre = kv.forward(q, k, v, cells=pos, pos=pos, n_threads=nth)
        ref = attn64(q, kv.K_host, kv.V_host, nh, nkv, hd, [(0, p + 1) for p in pos], 1.0 / np.sqrt(hd))
        np.testing.assert_allclose(pre, ref, rtol=1e-5, atol=ATOL)
        outs = [pre]
        # Skipped cells 153..254 were never written: zero in the region and in K_host alike.
        for n_past in (150, 151, 152, 255, 256):  # 256 starts a fresh KV block
            q1, k1, v1 = _qkv(rng, 1, nh, nkv, hd, peak=3.0)
            y = kv.forward(q1, k1, v1, cells=[n_past], pos=[n_past], n_threads=nth)
            ref = attn64(q1, kv.K_host, kv.V_host, nh, nkv, hd, [(0, n_past + 1)], 1.0 / np.sqrt(hd))
            np.testing.assert_allclose(y, ref, rtol=1e-5, atol=ATOL)
            outs.append(y)
        by_threads[nth] = outs
    for a, b in zip(by_threads[1], by_threads[2]):
        np.testing.assert_array_equal(a, b)


def test_attention_explicit_span(kernel_path, kv_type):
    """Two packed sequences, a sliding window and an empty span, all in one batch."""
    nh, nkv, hd, n_ctx = 14, 2, 64, 200
    rng = np.random.default_rng(77)
    # Tokens 0..69 are sequence A at cells 0..69; tokens 70..99 are sequence B at cells 100..129.
    nt = 100
    cells = np.concatenate([np.arange(70), np.arange(100, 130)]).astype(np.int32)
    pos = np.concatenate([np.arange(70), np.arange(30)]).astype(np.int32)
    spans = [(0, t + 1) for t in range(70)] + [(100, 100 + i + 1) for i in range(30)]
    spans[5] = (2, 6)        # sliding window of 4 ending at the token itself
    spans[69] = (66, 66)     # empty: output defined as zeros
    spans[99] = (64, 130)    # crosses a KV block boundary and both sequences
    q, k, v = _qkv(rng, nt, nh, nkv, hd, peak=2.0)
    outs = []
    for nth in (1, 2, 5):
        kv = KvRig(nh, nkv, hd, n_ctx, q_extra=64, kv_type=kv_type)
        outs.append(kv.forward(q, k, v, cells=cells, pos=pos, span=spans, n_threads=nth))
    ref = attn64(q, kv.K_host, kv.V_host, nh, nkv, hd, spans, 1.0 / np.sqrt(hd))
    np.testing.assert_allclose(outs[0], ref, rtol=1e-5, atol=ATOL)
    assert not outs[0][69].any()
    for o in outs[1:]:
        np.testing.assert_array_equal(outs[0], o)


@pytest.mark.parametrize("window", [0, 24, 8])
def test_attention_reads_a_shared_prefix_in_place(kernel_path, kv_type, window):
    """Sequence B borrows the first 40 positions of sequence A (cells 0..39) and keeps
    its own from cell 140 (its cells 100..139 are never written): each of its rows reads
    A's cells, then its own, as one softmax; a window cuts the prefix first (24 cuts
    into it for the early rows, 8 cuts it all). Rows without a prefix beside them."""
    nh, nkv, hd, n_ctx = 8, 2, 64, 200
    rng = np.random.default_rng(78)
    qa, ka, va = _qkv(rng, 70, nh, nkv, hd, peak=2.0)
    nb = 30
    q, k, v = _qkv(rng, nb + 2, nh, nkv, hd, peak=2.0)
    cells = np.concatenate([140 + np.arange(nb), [180, 190]]).astype(np.int32)
    pos = np.concatenate([40 + np.arange(nb), [0, 5]]).astype(np.int32)
    spans = [(140, 140 + i + 1, 0, 40) for i in range(nb)] + [(180, 181, 0, 0), (185, 191, 0, 0)]
    spans[3] = (140, 140, 0, 40)   # the prefix alone (its own cells still to come)
    outs = []
    for nth in (1, 3):
        rig = KvRig(nh, nkv, hd, n_ctx, q_extra=64, kv_type=kv_type)
        rig.forward(qa, ka, va, cells=np.arange(70), pos=np.arange(70), span=[(0, t + 1) for t in range(70)])
        outs.append(_attn_windowed(rig, q, k, v, cells, pos, spans, window, nth))
    ref = attn64(q, rig.K_host, rig.V_host, nh, nkv, hd, spans, 1.0 / np.sqrt(hd), window=window)
    np.testing.assert_allclose(outs[0], ref, rtol=1e-5, atol=ATOL)
    np.testing.assert_array_equal(outs[0], outs[1])


@pytest.mark.parametrize("window", [0, 40])
def test_attention_bits_do_not_depend_on_where_the_cells_lie(kernel_path, kv_type, window):
    """One sequence's 150 positions held three ways: from cell 0, from an unaligned cell
    (37), and with its first 90 read in place from another sequence's cells (300..389)
    after its own from cell 1090: a decode row and a 50-row prefill block give the same
    bits all three ways, at 1 and 3 threads (blocks count positions, not cells)."""
    nh, nkv, hd, n_ctx, n = 8, 2, 64, 1400, 150
    rng = np.random.default_rng(79)
    _, k, v = _qkv(rng, n, nh, nkv, hd)
    q, _, _ = _qkv(rng, 51, nh, nkv, hd, peak=2.0)
    pos = np.concatenate([np.arange(99, 149), [149]]).astype(np.int32)
    layouts = {
        "from 0": (np.arange(n), lambda p: (0, p + 1, 0, 0)),
        "unaligned": (37 + np.arange(n), lambda p: (37, 37 + p + 1, 0, 0)),
        "borrowed": (np.concatenate([300 + np.arange(90), 1000 + np.arange(90, n)]),
                     lambda p: (1090, 1000 + p + 1, 300, 390)),
    }
    outs = {}
    for name, (cells, span_of) in layouts.items():
        for nth in (1, 3):
            rig = KvRig(nh, nkv, hd, n_ctx, q_extra=64, kv_type=kv_type)
            # Write every position's K/V at its cell (rows that read nothing), then attend.
            rig.forward(np.zeros((n, nh * hd), np.float32), k, v, cells=cells, pos=np.arange(n),
                        span=[(int(c), int(c)) for c in cells])
            got = _attn_windowed(rig, q, k[pos], v[pos], cells[pos], pos, [span_of(int(p)) for p in pos], window, nth)
            outs[(name, nth)] = got
    base = outs[("from 0", 1)]
    ref = attn64(q, rig.K_host, rig.V_host, nh, nkv, hd, [span_of(int(p)) for p in pos], 1.0 / np.sqrt(hd),
                 window=window)
    np.testing.assert_allclose(base, ref, rtol=1e-5, atol=ATOL)
    for key, got in outs.items():
        assert got.tobytes() == base.tobytes(), key


def _attn_windowed(rig, q, k, v, cells, pos, spans, window, n_threads):
    """KvRig.forward with a sliding window on the attention step."""
    if not window:
        return rig.forward(q, k, v, cells=cells, pos=pos, span=spans, n_threads=n_threads)
    orig = rig.run

    def run(steps, n):
        op, bufs, ip, fp, w = steps[1]
        ip = list(ip) + [0] * (8 - len(ip))
        ip[7] = window
        return orig([steps[0], (op, bufs, ip, fp, w)], n)

    rig.run = run
    try:
        return rig.forward(q, k, v, cells=cells, pos=pos, span=spans, n_threads=n_threads)
    finally:
        rig.run = orig


def test_attention_rejects_bad_positions_and_spans():
    kv = KvRig(4, 2, 64, n_ctx=16)
    rng = np.random.default_rng(0)
    q, k, v = _qkv(rng, 2, 4, 2, 64)
    with pytest.raises(ValueError, match="position outside"):
        kv.forward(q, k, v, cells=[0, 1], pos=[0, 16])
    with pytest.raises(ValueError, match="span"):
        kv.forward(q, k, v, cells=[0, 1], pos=[0, 1], span=[(0, 1), (3, 2)])
    with pytest.raises(ValueError, match="span"):
        kv.forward(q, k, v, cells=[0, 1], pos=[0, 1], span=[(0, 1), (1, 2, 3, 2)])
    with pytest.raises(ValueError, match="span"):
        kv.forward(q, k, v, cells=[0, 1], pos=[0, 1], span=[(0, 1), (1, 2, 0, 17)])
    with pytest.raises(ValueError, match="KV cell"):
        kv.forward(q, k, v, cells=[0, 16], pos=[0, 1])


def test_f16_kv_differs_from_f32_only_by_rounding():
    """The f16 path must really read f16: its output matches the reference over rounded
    K/V, and differs from the f32 path (which matches the unrounded reference)."""
    nh, nkv, hd, nt = 14, 2, 64, 40
    rng = np.random.default_rng(5)
    q, k, v = _qkv(rng, nt, nh, nkv, hd, peak=3.0)
    pos = np.arange(nt, dtype=np.int32)
    outs = {}
    for t in ("f32", "f16"):
        kv = KvRig(nh, nkv, hd, 64, kv_type=t)
        outs[t] = kv.forward(q, k, v, cells=pos, pos=pos, n_threads=2)
    ref16 = attn64(q, k.astype(np.float16), v.astype(np.float16), nh, nkv, hd, [(0, p + 1) for p in pos],
                    1.0 / np.sqrt(hd))
    ref32 = attn64(q, k, v, nh, nkv, hd, [(0, p + 1) for p in pos], 1.0 / np.sqrt(hd))
    np.testing.assert_allclose(outs["f16"], ref16, rtol=1e-5, atol=ATOL)
    np.testing.assert_allclose(outs["f32"], ref32, rtol=1e-5, atol=ATOL)
    assert np.abs(outs["f16"] - outs["f32"]).max() > 10 * ATOL


def test_kv_regions_sized_by_element_type():
    """Validation sizes the K/V regions by the step's element type, and refuses others."""
    rig = KvRig(4, 2, 64, n_ctx=16, kv_type="f16")
    rng = np.random.default_rng(1)
    q, k, v = _qkv(rng, 1, 4, 2, 64)
    rig.forward(q, k, v, cells=[0], pos=[0])      # f16 regions: 16 * 128 * 2 bytes suffice
    rig.kv_code = 0                               # the same regions read as f32 are too small
    with pytest.raises(ValueError, match="K region buffer .* holds 4096 bytes, needs 8192"):
        rig.forward(q, k, v, cells=[0], pos=[0])
    rig.kv_code = 2
    with pytest.raises(ValueError, match="KV element type 2 is not f32"):
        rig.forward(q, k, v, cells=[0], pos=[0])


@pytest.mark.parametrize("nt,n_threads", [(1, 1), (37, 2), (150, 2)])
def test_f16_kv_is_the_f32_path_on_f16_values(nt, n_threads, kernel_path):
    """Widening f16 K/V is exact, so on K/V that are already f16 values the f16 path must
    equal the f32 path bit for bit (same kernels, same order): any drift would be the
    f16 path computing something else."""
    nh, nkv, hd = 14, 2, 64
    rng = np.random.default_rng(nt)
    q, k, v = _qkv(rng, nt, nh, nkv, hd, peak=3.0)
    k, v = k.astype(np.float16).astype(np.float32), v.astype(np.float16).astype(np.float32)
    pos = np.arange(nt, dtype=np.int32)
    outs = [KvRig(nh, nkv, hd, 160, kv_type=t).forward(q, k, v, cells=pos, pos=pos, n_threads=n_threads)
            for t in ("f32", "f16")]
    assert outs[0].tobytes() == outs[1].tobytes()
