"""The dense families beyond Qwen (llama, gemma2, gemma3, phi3) on CUDA (GPU suite, marker
`cuda`; CI deselects it, `pytest -m cuda` runs it).

Op level: each op and variant these families add (scale, soft-cap, GELU, GeGLU, the column
slice, RoPE in both styles with frequency factors, linear scaling, an attention factor and
partial rotary dims, attention with sliding windows and soft-capped scores at head dims
64, 96, 128 and 256) against float64 references and the CPU backend's same step, odd sizes
included; the decode step merges that rope (q|k|v + rope + KV store in one launch, and
rope + rope + KV store) bitwise against the steps launched apart.

Model level: every dense variant of tests/gpu_models.py, Q8_0 and Q4_K_M, CUDA against the
CPU backend: the logits of a prefill and a dozen decode steps, greedy continuations,
batched decode of two sequences past the sliding window, and the step merges' identity.
The models come from GPU_SUITE_MODELS (built on a machine with transformers and
llama.cpp's converter: python tests/gpu_models.py DIR).

Without a CUDA build or a visible device every test here fails, naming what is missing.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from minfer import _core
from minfer.backends import cuda as cuda_backend

sys.path.insert(0, str(Path(__file__).parent))
import gpu_models  # noqa: E402
from test_cpu_ops import attn64  # noqa: E402  (the float64 attention reference, soft-cap included)

pytestmark = pytest.mark.cuda

OPS = _core.OPS
F32, Q4_K, Q5_0, Q8_0 = 0, 12, 6, 8  # GGUF type ids
F16_KV = 1


@pytest.fixture(scope="module", autouse=True)
def cuda_required():
    e = cuda_backend.ENTRY
    assert e.compiled and e.usable, f"pytest -m cuda needs the CUDA backend here: {e.unusable_reason}"


# ---- one plan on both backends ---------------------------------------------------------

class Pair:
    """The same steps on the CPU (host pool, 2 threads) and on CUDA (device pool), over
    the same inputs and weights. Buffers are named by index; outputs start as NaN on both,
    so an unwritten element cannot pass."""

    def __init__(self):
        self.cpu, self.gpu = _core.Pool("cpu-test"), _core.CudaPool("cuda-test")
        self.wc, self.wg = _core.WeightStore(), _core.WeightStore()
        self.ids: list[tuple[int, int]] = []

    def buf(self, arr) -> int:
        arr = np.ascontiguousarray(arr)
        pair = []
        for pool in (self.cpu, self.gpu):
            bid = pool.alloc(max(arr.nbytes, 4))
            pool.write(bid, arr)
            pair.append(bid)
        self.ids.append(tuple(pair))
        return len(self.ids) - 1

    def out(self, n: int, itemsize: int = 4) -> int:
        return self.buf(np.full(max(1, n * itemsize // 4), np.nan, np.float32))

    def weight(self, name: str, arr, wtype: int, ne0: int, ne1: int) -> int:
        raw = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
        hc = self.wc.add(name, raw, wtype, ne0, ne1)
        hg = self.wg.add(name, raw, wtype, ne0, ne1)
        assert hc == hg
        return hc

    def plan(self, steps, side: int, flags: int = 0):
        plan = _core.Plan("t")
        for i, (op, bufs, ip, fp, w) in enumerate(steps):
            plan.add(OPS[op], i, [self.ids[b][side] if b >= 0 else -1 for b in bufs], list(ip), list(fp), list(w))
        plan.flags = flags
        return plan

    def run_cpu(self, steps):
        _core.run(self.plan(steps, 0), self.cpu, self.wc, 2)

    def gpu_plan(self, steps, flags: int = 0):
        plan = self.plan(steps, 1, flags)
        _core.cuda_validate(plan, self.gpu, self.wg)
        return plan

    def run_gpu(self, plan):
        _core.cuda_run(plan, self.gpu, self.wg, 0, -1)
        _core.cuda_sync()

    def read(self, b: int, n: int, dtype: str = "float32"):
        """(CPU, CUDA) contents of buffer b."""
        return self.cpu.read(self.ids[b][0], dtype, n), self.gpu.read(self.ids[b][1], dtype, n)

    def read_gpu(self, b: int, n: int, dtype: str = "float32"):
        return self.gpu.read(self.ids[b][1], dtype, n)

    def write(self, b: int, arr) -> None:
        arr = np.ascontiguousarray(arr)
        self.cpu.write(self.ids[b][0], arr)
        self.gpu.write(self.ids[b][1], arr)


SIZES = [1, 7, 33, 1000, 4099]


def _gelu64(x):
    x = x.astype(np.float64)
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


@pytest.mark.parametrize("n", SIZES)
def test_scale_softcap_gelu_geglu_vs_cpu_and_float64(n):
    """SCALE is exact; SOFTCAP and GELU (tanh approximation, the CPU's constant form) are
    within a few float32 ulps of float64 on both backends (the CPU's vector tanh is its
    own approximation, so the two agree to rounding, not bitwise); GEGLU is bitwise GELU
    then MUL on CUDA."""
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * 4).astype(np.float32)
    x[: min(n, 5)] = np.array([0.0, -30.0, 30.0, 1e-3, -7.5], np.float32)[: min(n, 5)]
    u = rng.standard_normal(n).astype(np.float32)
    cap, v = 5.0, 0.37
    r = Pair()
    xi, ui = r.buf(x), r.buf(u)
    ys, yc, yg, ygg, ym = (r.out(n) for _ in range(5))
    steps = [("scale", [ys, xi], [n], [v], []), ("softcap", [yc, xi], [n], [cap], []), ("gelu", [yg, xi], [n], [], []),
             ("geglu", [ygg, xi, ui], [n], [], []), ("mul", [ym, yg, ui], [n], [], [])]
    r.run_cpu(steps)
    r.run_gpu(r.gpu_plan(steps))
    cs, gs = r.read(ys, n)
    assert np.array_equal(gs, x * np.float32(v)) and np.array_equal(gs, cs)
    ref = cap * np.tanh(x.astype(np.float64) / cap)
    for got in r.read(yc, n):  # tanh's error times the cap, x / cap's rounding times its slope
        assert np.all(np.abs(got - ref) <= 1e-6 * (cap + np.abs(x))), np.max(np.abs(got - ref))
    ref = _gelu64(x)
    tol = 2e-6 * (1 + np.abs(x))
    for got in r.read(yg, n):
        assert np.all(np.abs(got - ref) <= tol), np.max(np.abs(got - ref) / tol)
    for got in r.read(ygg, n):
        assert np.all(np.abs(got - ref * u) <= tol * (1 + np.abs(u))), np.max(np.abs(got - ref * u))
    g_gelu, g_geglu, g_mul = r.read_gpu(yg, n), r.read_gpu(ygg, n), r.read_gpu(ym, n)
    assert np.array_equal(g_geglu, g_gelu * u) and np.array_equal(g_geglu, g_mul)


@pytest.mark.parametrize("nt,src_width,offset,width", [(1, 7, 0, 7), (5, 37, 11, 13), (3, 4096 + 2 * 1024, 4096, 1024),
                                                       (17, 97, 96, 1)])
def test_slice_columns_exact(nt, src_width, offset, width):
    rng = np.random.default_rng(src_width + nt)
    x = rng.standard_normal((nt, src_width)).astype(np.float32)
    r = Pair()
    xi, yi = r.buf(x), r.out(nt * width)
    steps = [("slice", [yi, xi], [width, nt, src_width, offset], [], [])]
    r.run_cpu(steps)
    r.run_gpu(r.gpu_plan(steps))
    c, g = r.read(yi, nt * width)
    assert np.array_equal(g, x[:, offset:offset + width].reshape(-1)) and np.array_equal(g, c)


# ---- RoPE --------------------------------------------------------------------------------

def _rope64(x, pos, nh, hd, n_rot, base, style, factors=None, freq_scale=1.0, attn=1.0):
    """plan.h's ROPE in float64 (the angles exactly; the backends round cos and sin)."""
    x = x.astype(np.float64).reshape(len(pos), nh, hd).copy()
    half = n_rot // 2
    inv = base ** (-2.0 * np.arange(half) / n_rot) * freq_scale
    if factors is not None:
        inv = inv / factors.astype(np.float64)
    th = np.asarray(pos, np.float64)[:, None] * inv[None, :]
    c, s = np.cos(th)[:, None, :] * attn, np.sin(th)[:, None, :] * attn
    if style == 0:
        i0, i1 = np.arange(half), np.arange(half) + half
    else:
        i0, i1 = 2 * np.arange(half), 2 * np.arange(half) + 1
    x0, x1 = x[..., i0].copy(), x[..., i1].copy()
    x[..., i0] = x0 * c - x1 * s
    x[..., i1] = x0 * s + x1 * c
    return x.reshape(len(pos), -1)


# (freq_scale, attn_factor, with factors) as plan.h's fp[1], fp[2] (0 means 1) and w[0]
ROPE_EXT = {"plain": (0.0, 0.0, False), "factors": (0.0, 0.0, True), "scaled": (0.25, 1.3, True),
            "linear": (0.125, 0.0, False)}


@pytest.mark.parametrize("ext", sorted(ROPE_EXT))
@pytest.mark.parametrize("hd,n_rot", [(64, 64), (64, 48), (64, 38), (96, 96), (128, 64), (256, 256)])
@pytest.mark.parametrize("style", [0, 1], ids=["neox", "normal"])
def test_rope_both_styles_and_scalings_vs_cpu_and_float64(style, hd, n_rot, ext):
    """RoPE of either style with frequency factors, linear scaling and an attention factor,
    n_rot below the head dim (the rest passed through exactly), at positions up to 30000:
    CUDA and CPU both within a few float32 ulps of max |x| of float64 (the angles are
    worked out in double by both; cos and sin rounded once, then times the attention
    factor)."""
    fs, af, with_f = ROPE_EXT[ext]
    rng = np.random.default_rng(hd * 10 + n_rot + style)
    nh, base = 3, 10000.0
    pos = np.array([0, 1, 77, 4095, 30000], np.int32)
    x = rng.standard_normal((len(pos), nh * hd)).astype(np.float32)
    factors = rng.uniform(1.0, 8.0, n_rot // 2).astype(np.float32) if with_f else None
    r = Pair()
    wf = r.weight("rope_freqs", factors, F32, n_rot // 2, 1) if with_f else -1
    xi, pi, yi = r.buf(x), r.buf(pos), r.out(x.size)
    steps = [("rope", [yi, xi, pi], [len(pos), nh, hd, n_rot, style], [base, fs, af], [wf])]
    r.run_cpu(steps)
    r.run_gpu(r.gpu_plan(steps))
    want = _rope64(x, pos, nh, hd, n_rot, base, style, factors, fs or 1.0, af or 1.0)
    for got in r.read(yi, x.size):
        got = got.reshape(len(pos), nh, hd)
        np.testing.assert_allclose(got.reshape(len(pos), -1), want, rtol=0, atol=5e-7 * np.abs(x).max() * (af or 1))
        assert np.array_equal(got[..., n_rot:], x.reshape(len(pos), nh, hd)[..., n_rot:])


def _k_raw(rows, cols, rng):
    """Random Q4_K rows (what a Q4_K_M q projection holds) with sane scales."""
    raw = rng.integers(0, 256, size=(rows, cols // 256, 144), dtype=np.uint8)
    for off in (0, 2):
        raw[:, :, off:off + 2] = (rng.standard_normal((rows, cols // 256)) * 0.0005).astype(np.float16) \
            .view(np.uint8).reshape(rows, cols // 256, 2)
    return raw.reshape(rows, -1)


def _legacy_raw(qtype, rows, cols, rng):
    size = {Q5_0: 22, Q8_0: 34}[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // 32, size), dtype=np.uint8)
    raw[:, :, 0:2] = (rng.standard_normal((rows, cols // 32)) * 0.02).astype(np.float16) \
        .view(np.uint8).reshape(rows, cols // 32, 2)
    return raw.reshape(rows, -1)


def _qkv_rope_plan(r, hd, n_rot, nh, nkv, n_ctx, pos, cell, style, q_ext, k_ext, rng):
    """q, k, v matvecs (Q4_K, Q5_0, Q8_0 with biases), rope q, rope k, KV store: a llama
    decode layer's attention inputs. Returns (steps, buffers)."""
    d = 256
    qd, kd = nh * hd, nkv * hd
    raws = [_k_raw(qd, d, rng), _legacy_raw(Q5_0, kd, d, rng), _legacy_raw(Q8_0, kd, d, rng)]
    ws = [r.weight(n, raw, t, d, rows) for n, raw, t, rows in zip("qkv", raws, (Q4_K, Q5_0, Q8_0), (qd, kd, kd))]
    bs = [r.weight("b" + n, rng.standard_normal(m).astype(np.float32), F32, m, 1) for n, m in zip("qkv", (qd, kd, kd))]

    def ext(e, name):
        fs, af, factors = e
        wf = r.weight(name, factors, F32, n_rot // 2, 1) if factors is not None else -1
        return [10000.0, fs, af], [wf]

    qfp, qw = ext(q_ext, "q_factors")
    kfp, kw = (qfp, qw) if k_ext is q_ext else ext(k_ext, "k_factors")  # one weight: the merges compare handles
    b = dict(x=r.buf(rng.standard_normal(d).astype(np.float32)), pos=r.buf(np.array([pos], np.int32)),
             cell=r.buf(np.array([cell], np.int32)), yq=r.out(qd), yk=r.out(kd), yv=r.out(kd), rq=r.out(qd),
             rk=r.out(kd), kc=r.out(n_ctx * kd, 2), vc=r.out(n_ctx * kd, 2))
    steps = [("matmul", [b["yq"], b["x"]], [d, qd, 1], [], [ws[0], bs[0]]),
             ("matmul", [b["yk"], b["x"]], [d, kd, 1], [], [ws[1], bs[1]]),
             ("matmul", [b["yv"], b["x"]], [d, kd, 1], [], [ws[2], bs[2]]),
             ("rope", [b["rq"], b["yq"], b["pos"]], [1, nh, hd, n_rot, style], qfp, qw),
             ("rope", [b["rk"], b["yk"], b["pos"]], [1, nkv, hd, n_rot, style], kfp, kw),
             ("kv_store", [b["kc"], b["rk"], b["yv"], b["cell"], b["vc"]], [1, kd, n_ctx, F16_KV], [], [])]
    return steps, b


@pytest.mark.parametrize("pos", [13, 37])
@pytest.mark.parametrize("style,hd,n_rot", [(1, 64, 64), (1, 128, 128), (1, 128, 64), (1, 64, 40), (1, 64, 38),
                                            (0, 64, 48), (1, 96, 96), (0, 256, 256), (1, 256, 256)])
def test_qkv_rope_store_tail_general_rope_bitwise(style, hd, n_rot, pos):
    """The decode merges that rope (FUSE_QKV: q|k|v in one matvec launch, then rope q +
    rope k + KV store in one; with FUSE_ROPE the matvec launch also ropes and stores) with
    interleaved pairs, llama3 frequency factors, linear scaling and an attention factor:
    bitwise the steps launched apart, direct and replayed, whether each block ropes whole
    pairs of its own rows (n_rot and hd - n_rot multiples of 4) or the last block of a head
    does the head (n_rot 38), and whether the step's angles come from the table by
    position (13 < n_ctx) or are worked out (37). The unfused rope is float64's rope of
    the unfused matvec outputs; the cache holds the roped k and v in f16."""
    rng = np.random.default_rng(hd * 7 + n_rot + style)
    nh, nkv, n_ctx, cell = 4, 2, 16, 5
    qd, kd = nh * hd, nkv * hd
    e = (0.5, 1.1, rng.uniform(1.0, 8.0, n_rot // 2).astype(np.float32))
    outs = {}
    for flags in (0, 1, 1 | 32):
        r = Pair()
        steps, b = _qkv_rope_plan(r, hd, n_rot, nh, nkv, n_ctx, pos, cell, style, e, e, np.random.default_rng(3))
        plan = r.gpu_plan(steps, flags)
        assert _core.testing.cuda_plan_info(plan)["launches"] == {0: 6, 1: 2, 33: 1}[flags]
        for _ in range(3):
            r.run_gpu(plan)
            got = [r.read_gpu(b["rq"], qd).tobytes(), r.read_gpu(b["rk"], kd).tobytes(),
                   r.read_gpu(b["kc"], n_ctx * kd, "float16").tobytes(), r.read_gpu(b["vc"], n_ctx * kd, "float16").tobytes()]
            assert outs.setdefault(flags, got) == got
        if flags == 0:
            yq, yk, yv = r.read_gpu(b["yq"], qd), r.read_gpu(b["yk"], kd), r.read_gpu(b["yv"], kd)
    for key, got in outs.items():
        assert got == outs[0], f"flags {key}"
    for y, got, n in ((yq, outs[0][0], nh), (yk, outs[0][1], nkv)):
        want = _rope64(y[None], [pos], n, hd, n_rot, 10000.0, style, e[2], e[0], e[1])
        np.testing.assert_allclose(np.frombuffer(got, np.float32)[None], want, rtol=0, atol=6e-7 * np.abs(y).max())
    kc = np.frombuffer(outs[0][2], np.float16).reshape(n_ctx, kd)
    vc = np.frombuffer(outs[0][3], np.float16).reshape(n_ctx, kd)
    assert np.array_equal(kc[cell], np.frombuffer(outs[0][1], np.float32).astype(np.float16))
    assert np.array_equal(vc[cell], yv.astype(np.float16))


@pytest.mark.parametrize("in_place", [False, True], ids=["apart", "in-place"])
@pytest.mark.parametrize("nt", [1, 3])
@pytest.mark.parametrize("style,hd,n_rot", [(0, 128, 128), (1, 64, 64), (0, 64, 48), (1, 256, 256), (0, 96, 96)])
def test_qk_norm_rope_store_merge_bitwise(style, hd, n_rot, nt, in_place):
    """Qwen3's and Gemma 3's attention inputs: qk_norm q, qk_norm k, rope q, rope k and the
    KV store run as one launch (FUSE_QKV; one warp a head finds the norm's scale) and give
    the bits of the five steps apart, direct and replayed, whether or not FUSE_ROPE is
    also set (the q|k|v tail does not take the norms), and whether each rope writes a
    buffer of its own or over its norm's output (as the allocator lays a model out). The
    unfused result is float64's rope of float64's RMSNorm of the same inputs, within a
    few float32 ulps."""
    rng = np.random.default_rng(hd + n_rot + style + nt)
    nh, nkv, n_ctx, eps = 4, 2, 16, 1e-6
    qd, kd = nh * hd, nkv * hd
    xq = (rng.standard_normal((nt, qd)) * 3).astype(np.float32)
    xk = (rng.standard_normal((nt, kd)) * 3).astype(np.float32)
    xv = rng.standard_normal((nt, kd)).astype(np.float32)
    wq, wk = (rng.uniform(0.5, 1.5, hd).astype(np.float32) for _ in range(2))
    pos, cells = [5 + 3 * t for t in range(nt)], [2 + t for t in range(nt)]
    outs = {}
    for flags in (0, 1, 1 | 32):
        r = Pair()
        hq, hk = r.weight("q_norm", wq, F32, hd, 1), r.weight("k_norm", wk, F32, hd, 1)
        b = dict(xq=r.buf(xq), xk=r.buf(xk), xv=r.buf(xv), pos=r.buf(np.array(pos, np.int32)),
                 cell=r.buf(np.array(cells, np.int32)), nq=r.out(nt * qd), nk=r.out(nt * kd), rq=r.out(nt * qd),
                 rk=r.out(nt * kd), kc=r.out(n_ctx * kd, 2), vc=r.out(n_ctx * kd, 2))
        if in_place:
            b["rq"], b["rk"] = b["nq"], b["nk"]
        steps = [("qk_norm", [b["nq"], b["xq"]], [hd, nt * nh], [eps], [hq]),
                 ("qk_norm", [b["nk"], b["xk"]], [hd, nt * nkv], [eps], [hk]),
                 ("rope", [b["rq"], b["nq"], b["pos"]], [nt, nh, hd, n_rot, style], [10000.0, 0.0, 0.0], [-1]),
                 ("rope", [b["rk"], b["nk"], b["pos"]], [nt, nkv, hd, n_rot, style], [10000.0, 0.0, 0.0], [-1]),
                 ("kv_store", [b["kc"], b["rk"], b["xv"], b["cell"], b["vc"]], [nt, kd, n_ctx, F16_KV], [], [])]
        plan = r.gpu_plan(steps, flags)
        assert _core.testing.cuda_plan_info(plan)["launches"] == {0: 5, 1: 1, 33: 1}[flags]
        for _ in range(3):
            r.run_gpu(plan)
            got = [r.read_gpu(b["rq"], nt * qd).tobytes(), r.read_gpu(b["rk"], nt * kd).tobytes(),
                   r.read_gpu(b["kc"], n_ctx * kd, "float16").tobytes(),
                   r.read_gpu(b["vc"], n_ctx * kd, "float16").tobytes()]
            assert outs.setdefault(flags, got) == got
    for key, got in outs.items():
        assert got == outs[0], f"flags {key}"

    def norm64(x, w, n):
        x = x.astype(np.float64).reshape(nt, n, hd)
        return (x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * w.astype(np.float64)).reshape(nt, -1)

    for x, w, n, got in ((xq, wq, nh, outs[0][0]), (xk, wk, nkv, outs[0][1])):
        want = _rope64(norm64(x, w, n), pos, n, hd, n_rot, 10000.0, style)
        np.testing.assert_allclose(np.frombuffer(got, np.float32).reshape(nt, -1), want, rtol=0,
                                   atol=2e-6 * np.abs(want).max())
    kc = np.frombuffer(outs[0][2], np.float16).reshape(n_ctx, kd)
    vc = np.frombuffer(outs[0][3], np.float16).reshape(n_ctx, kd)
    assert np.array_equal(kc[cells], np.frombuffer(outs[0][1], np.float32).reshape(nt, kd).astype(np.float16))
    assert np.array_equal(vc[cells], xv.astype(np.float16))


def test_rope_merges_take_only_ropes_that_agree():
    """q and k roped with different angles (q with frequency factors, k without) are not
    merged into one rope launch (nor into the q|k|v tail): the ropes and the store run as
    their own steps, and each matches float64 with its own configuration."""
    rng = np.random.default_rng(11)
    hd, n_rot, nh, nkv, n_ctx, pos = 64, 64, 4, 2, 16, 9
    eq = (0.0, 0.0, rng.uniform(1.0, 8.0, n_rot // 2).astype(np.float32))
    ek = (0.0, 0.0, None)
    outs = {}
    for flags in (0, 1 | 32):
        r = Pair()
        steps, b = _qkv_rope_plan(r, hd, n_rot, nh, nkv, n_ctx, pos, 2, 1, eq, ek, np.random.default_rng(4))
        plan = r.gpu_plan(steps, flags)
        assert _core.testing.cuda_plan_info(plan)["launches"] == {0: 6, 33: 4}[flags]
        r.run_gpu(plan)
        outs[flags] = [r.read_gpu(b["rq"], nh * hd), r.read_gpu(b["rk"], nkv * hd)]
        yq, yk = r.read_gpu(b["yq"], nh * hd), r.read_gpu(b["yk"], nkv * hd)
        np.testing.assert_allclose(outs[flags][0][None], _rope64(yq[None], [pos], nh, hd, n_rot, 1e4, 1, eq[2]),
                                   rtol=0, atol=6e-7 * np.abs(yq).max())
        np.testing.assert_allclose(outs[flags][1][None], _rope64(yk[None], [pos], nkv, hd, n_rot, 1e4, 1),
                                   rtol=0, atol=6e-7 * np.abs(yk).max())
    assert all(np.array_equal(a, b) for a, b in zip(outs[0], outs[33]))


# ---- attention: sliding windows and soft-caps --------------------------------------------

def _tensor_cores(nt, hd):
    """Blocks k_attn_prefill.cu takes (Q and P rounded to f16 there)."""
    return nt > _core.CUDA_ROW_EXACT_MAX_TOKENS and hd in (32, 64, 96, 128)


# Decode and row-exact blocks: f32 arithmetic on f16 K/V (|V| ~ 1); tensor-core prefill
# additionally rounds q (the reference gets the rounded q) and P to f16.
ATTN_ATOL, TC_ATTN_ATOL = 2e-5, 2e-3


def _attn_case(nt, start, nh, nkv, hd, n_ctx, rng):
    kv_dim = nkv * hd
    K = rng.standard_normal((n_ctx, kv_dim)).astype(np.float16)
    V = rng.standard_normal((n_ctx, kv_dim)).astype(np.float16)
    q = (rng.standard_normal((nt, nh * hd)) * 1.5).astype(np.float32)
    pos = np.arange(start, start + nt, dtype=np.int32)
    return K, V, q, pos


@pytest.mark.parametrize("nt,start,nh,nkv,hd,n_ctx,window,softcap", [
    (1, 600, 8, 2, 64, 640, 100, 0.0),      # decode over 3 splits, the window starts in the second
    (1, 1500, 8, 2, 128, 2048, 300, 2.0),   # split-K decode, window and soft-cap, splits before it hold no cell
    (1, 5, 4, 2, 128, 2048, 300, 0.0),      # a window longer than the row: no cut
    (1, 40, 4, 2, 256, 64, 8, 2.0),         # Gemma's head dim
    (1, 40, 4, 2, 96, 64, 8, 0.0),          # Phi-3's head dim
    (1, 40, 4, 2, 96, 64, 0, 1.5),
    (3, 20, 4, 1, 64, 64, 5, 1.5),          # a row-exact block
    (16, 30, 4, 2, 128, 128, 7, 0.0),
    (37, 0, 8, 2, 64, 64, 8, 2.0),          # a row-exact block of 37 rows
    (70, 100, 4, 2, 96, 256, 33, 0.0),      # tensor-core prefill
    (130, 0, 4, 2, 128, 130, 64, 1.0),      # several 64-row blocks and KV tiles
    (200, 300, 8, 2, 128, 1024, 300, 0.0),
    (40, 5, 4, 2, 256, 64, 9, 3.0),         # prefill at head dim 256 (the decode kernel, one split)
    (33, 7, 4, 2, 32, 64, 4, 0.0),
])
def test_attention_window_and_softcap_vs_float64_and_cpu(nt, start, nh, nkv, hd, n_ctx, window, softcap):
    """ATTN with a sliding window (a row sees the last `window` cells) and soft-capped
    scores, in every CUDA attention path (decode split over the context, row-exact blocks,
    tensor-core prefill, head dim 256's prefill on the decode kernel), against float64 and
    against the CPU's same step (both over the same f16 K/V)."""
    rng = np.random.default_rng(nt * 1000 + start + hd)
    r = Pair()
    K, V, q, pos = _attn_case(nt, start, nh, nkv, hd, n_ctx, rng)
    Ki, Vi, qi, pi, yi = r.buf(K), r.buf(V), r.buf(q), r.buf(pos), r.out(nt * nh * hd)
    scale = hd ** -0.5
    steps = [("attn", [yi, qi, Ki, Vi, pi, -1], [nt, nh, nkv, hd, n_ctx, nh * hd, F16_KV, window], [scale, softcap], [])]
    r.run_cpu(steps)
    plan = r.gpu_plan(steps)
    r.run_gpu(plan)
    cpu, gpu = (a.reshape(nt, -1) for a in r.read(yi, nt * nh * hd))
    lo_hi = [(max(0, p + 1 - window) if window > 0 else 0, p + 1) for p in pos]
    Kf, Vf = K.astype(np.float32), V.astype(np.float32)
    want = attn64(q, Kf, Vf, nh, nkv, hd, lo_hi, scale, softcap)
    np.testing.assert_allclose(cpu, want, rtol=0, atol=ATTN_ATOL)
    if _tensor_cores(nt, hd):
        want_tc = attn64(q.astype(np.float16), Kf, Vf, nh, nkv, hd, lo_hi, scale, softcap)
        np.testing.assert_allclose(gpu, want_tc, rtol=0, atol=TC_ATTN_ATOL)
        np.testing.assert_allclose(gpu, cpu, rtol=0, atol=2 * TC_ATTN_ATOL)
    else:
        np.testing.assert_allclose(gpu, want, rtol=0, atol=ATTN_ATOL)
        np.testing.assert_allclose(gpu, cpu, rtol=0, atol=2 * ATTN_ATOL)
    if softcap > 0 or (window > 0 and pos[-1] + 1 > window):  # the variant really changes the result
        plain = attn64(q, Kf, Vf, nh, nkv, hd, [(0, p + 1) for p in pos], scale)
        assert np.abs(plain - want).max() > 1e-2
    r.run_gpu(plan)
    assert r.read_gpu(yi, nt * nh * hd).tobytes() == gpu.tobytes()


@pytest.mark.parametrize("nt,hd", [(3, 64), (70, 64), (20, 96), (5, 256), (80, 128)])
def test_attention_window_over_explicit_spans(nt, hd):
    """Several sequences in one block (explicit per-row spans: empty, one cell, ragged)
    with a sliding window of 6 and a soft-cap: the window cuts each row's cells, a
    shared prefix's first."""
    rng = np.random.default_rng(17 + nt + hd)
    nh, nkv, n_ctx, window, softcap = 4, 2, 160, 6, 2.5
    r = Pair()
    K, V, q, pos = _attn_case(nt, 10, nh, nkv, hd, n_ctx, rng)
    lo = rng.integers(0, n_ctx, nt)
    hi = np.minimum(n_ctx, lo + rng.integers(0, 40, nt))
    plo = rng.integers(0, n_ctx, nt)   # every third row after a shared prefix, which the window may cut
    phi = np.where(np.arange(nt) % 3 == 1, np.minimum(n_ctx, plo + rng.integers(1, 12, nt)), plo)
    span = np.stack([lo, hi, plo, phi], 1).astype(np.int32)
    span[0] = [0, 11, 0, 0]
    span[1 % nt] = [12, 13, 20, 30]
    if nt > 2:
        span[2] = [7, 7, 0, 0]
    Ki, Vi, qi, pi, si, yi = r.buf(K), r.buf(V), r.buf(q), r.buf(pos), r.buf(span), r.out(nt * nh * hd)
    scale = hd ** -0.5
    steps = [("attn", [yi, qi, Ki, Vi, pi, si], [nt, nh, nkv, hd, n_ctx, nh * hd, F16_KV, window],
              [scale, softcap], [])]
    r.run_cpu(steps)
    r.run_gpu(r.gpu_plan(steps))
    cpu, gpu = (a.reshape(nt, -1) for a in r.read(yi, nt * nh * hd))
    tc = _tensor_cores(nt, hd)
    want = attn64(q.astype(np.float16) if tc else q, K.astype(np.float32), V.astype(np.float32), nh, nkv, hd,
                  [tuple(int(x) for x in row) for row in span], scale, softcap, window=window)
    np.testing.assert_allclose(gpu, want, rtol=0, atol=TC_ATTN_ATOL if tc else ATTN_ATOL)
    np.testing.assert_allclose(gpu, cpu, rtol=0, atol=2 * (TC_ATTN_ATOL if tc else ATTN_ATOL))
    ok = (span[:, 1] > span[:, 0]) | (span[:, 3] > span[:, 2])
    assert not gpu[~ok].any()


@pytest.mark.parametrize("hd,softcap", [(64, 0.0), (128, 2.0), (256, 1.5)])
def test_windowed_split_attention_replays_at_every_position(hd, softcap):
    """Decode attention split over a 2048-cell context with a window of 300: the splits
    holding cells move with the position (those before the window draw no ticket); the
    plan runs direct, is captured and replays with fresh q and positions and the output
    poisoned in between, each run matching float64 (a ticket left nonzero would leave the
    poison), a replay at the first run's inputs giving its bits."""
    n_ctx, nh, nkv, window = 2048, 8, 2, 300
    rng = np.random.default_rng(hd)
    r = Pair()
    K = rng.standard_normal((n_ctx, nkv * hd)).astype(np.float16)
    V = rng.standard_normal((n_ctx, nkv * hd)).astype(np.float16)
    Ki, Vi = r.buf(K), r.buf(V)
    qi, pi, yi = r.buf(np.zeros(nh * hd, np.float32)), r.buf(np.zeros(1, np.int32)), r.out(nh * hd)
    scale = hd ** -0.5
    plan = r.gpu_plan([("attn", [yi, qi, Ki, Vi, pi, -1], [1, nh, nkv, hd, n_ctx, nh * hd, F16_KV, window],
                        [scale, softcap], [])])
    Kf, Vf = K.astype(np.float32), V.astype(np.float32)
    qs = [rng.standard_normal((1, nh * hd)).astype(np.float32) for _ in range(5)]
    outs = []
    for k, (p, q) in enumerate(zip((1000, 5, 2047, 299, 300), qs)):
        r.write(qi, q)
        r.write(pi, np.array([p], np.int32))
        r.write(yi, np.full(nh * hd, np.nan, np.float32))
        r.run_gpu(plan)
        got = r.read_gpu(yi, nh * hd)[None]
        want = attn64(q, Kf, Vf, nh, nkv, hd, [(max(0, p + 1 - window), p + 1)], scale, softcap)
        np.testing.assert_allclose(got, want, rtol=0, atol=ATTN_ATOL, err_msg=f"run {k} at position {p}")
        outs.append(got.tobytes())
    r.write(qi, qs[0])
    r.write(pi, np.array([1000], np.int32))
    r.run_gpu(plan)
    assert r.read_gpu(yi, nh * hd).tobytes() == outs[0]
    assert _core.testing.cuda_plan_info(plan)["captured"]


# ---- the families' models: CUDA against the CPU ---------------------------------------------

CASES = [(n, q) for n in gpu_models.DENSE for q in gpu_models.QTYPES]
N_PROMPT, N_STEPS, N_CTX = 40, 12, 128  # 40 tokens: past every variant's window (8) and the GEMM/prefill paths
# CUDA against CPU, over every row of the prefill and the decode steps: max |diff| and the
# root mean square of the differences, over the std of the CPU's logits. Both backends
# are within rel 0.13 / rms 0.03 of transformers on the files' own dequantized weights
# (measured on the CPU: test_families' quantized check; CUDA's prefill computes in f16
# on dequantized weights, its decode with int8 activations like the CPU's), so their
# distance stays below the sum, and an O(1) bug (a wrong angle, window or cap) is far above.
REL_TOL, RMS_TOL = 0.3, 0.06
# Greedy picks may part only at a step where the CPU's best two logits are closer than
# this (times the row's std): 4x the rms distance above, twice it for two logits.
GREEDY_MARGIN = 0.25


def _prompt(path, n: int, seed: int) -> list[int]:
    from minfer.model import Model

    n_vocab = Model.open(path, backends=["cpu"]).hp.n_vocab
    return [int(t) for t in np.random.default_rng(seed).integers(3, n_vocab, size=n)]


def _sessions(path, **kw):
    from minfer.session import Session

    gpu = Session.open(path, n_ctx=N_CTX, backends=["cuda"], **kw)
    cpu = Session.open(path, n_ctx=N_CTX, backends=["cpu"], n_threads=2, **kw)
    assert gpu.backend_names == ["CUDA"] and gpu.kv_type == cpu.kv_type == "f16"
    return gpu, cpu


def _on_cuda_alone(sess) -> None:
    """The graph just run is one CUDA split: no node was left to the CPU."""
    splits = sess.context.cache.splits
    assert len(splits) == 1 and splits[0].backend == cuda_backend.ENTRY.id, splits


def _dist(g, c) -> tuple[float, float]:
    g, c = np.asarray(g, np.float64), np.asarray(c, np.float64)
    d = np.abs(g - c)
    return float(d.max() / c.std()), float(np.sqrt((d ** 2).mean()) / c.std())


@pytest.mark.parametrize("name,qtype", CASES)
def test_family_logits_cuda_vs_cpu(name, qtype):
    """A 40-token prefill (every row's logits) and 12 decode steps on the CPU's greedy
    tokens (teacher-forced, so both backends see the same sequence), on CUDA and on the
    CPU: within REL_TOL / RMS_TOL of each other, every node of both graphs on the GPU."""
    path = gpu_models.family_gguf(name, qtype)
    prompt = _prompt(path, N_PROMPT, sum(map(ord, name)))
    gpu, cpu = _sessions(path)
    g = [np.asarray(gpu.forward(prompt, n_out=len(prompt)))]
    _on_cuda_alone(gpu)
    c = [np.asarray(cpu.forward(prompt, n_out=len(prompt)))]
    for _ in range(N_STEPS):
        t = int(np.argmax(c[-1][-1]))
        g.append(np.asarray(gpu.forward([t])).reshape(1, -1))
        c.append(np.asarray(cpu.forward([t])).reshape(1, -1))
    _on_cuda_alone(gpu)
    G, C = np.concatenate(g), np.concatenate(c)
    assert np.isfinite(G).all()
    rel, rms = _dist(G, C)
    pre, _ = _dist(G[:N_PROMPT], C[:N_PROMPT])
    dec, _ = _dist(G[N_PROMPT:], C[N_PROMPT:])
    print(f"\n{name} {qtype}: CUDA vs CPU rel {rel:.4f} (prefill {pre:.4f}, decode {dec:.4f}) rms {rms:.4f}")
    assert rel <= REL_TOL and rms <= RMS_TOL, f"{name} {qtype}: rel {rel:.4f} rms {rms:.4f}"


@pytest.mark.parametrize("name,qtype", CASES)
def test_family_greedy_continuation_cuda_vs_cpu(name, qtype):
    """16 greedy tokens after two prompts (40 and 23 tokens) from CUDA's generation loop
    (device argmax, the one-call decode step) equal the CPU's, except after a step where
    the CPU's best two logits lie within GREEDY_MARGIN x the row's std (a near-tie either
    backend may break its own way)."""
    from minfer.session import Session

    path = gpu_models.family_gguf(name, qtype)
    n = 16
    for k, length in enumerate((N_PROMPT, 23)):
        prompt = _prompt(path, length, sum(map(ord, name)) + k)
        got = Session.open(path, n_ctx=N_CTX, backends=["cuda"]).generate_ids(prompt, n)
        cpu = Session.open(path, n_ctx=N_CTX, backends=["cpu"], n_threads=2)
        row = np.asarray(cpu.forward(prompt)).reshape(-1)
        want, close = [], []
        for _ in range(n):
            top2 = np.sort(row)[-2:]
            close.append(top2[1] - top2[0] < GREEDY_MARGIN * row.std())
            want.append(int(np.argmax(row)))
            row = np.asarray(cpu.forward([want[-1]])).reshape(-1)
        first = next((j for j in range(n) if got[j] != want[j]), n)
        assert first == n or close[first], (f"{name} {qtype}: CUDA left the CPU's greedy path at step {first} "
                                            f"(CUDA {got}, CPU {want}) without a near-tie there")


@pytest.mark.parametrize("qtype", gpu_models.QTYPES)
@pytest.mark.parametrize("name", ["llama3", "gemma3", "gemma2", "phi3"])
def test_batched_decode_of_two_sequences_past_the_window(name, qtype):
    """Two sequences (prompts of 40 and 23 tokens, past the sliding window of 8 where the
    variant has one) decoded together, one row each per step (explicit spans: the window
    cuts each sequence's own cells): each step's rows within 1e-4 x std of the same
    sequence decoded alone on CUDA (only attention's summation order may differ), and
    within the CPU tolerance of the CPU's batched rows."""
    from minfer.model import Model
    from minfer.session import Context, Session

    path = gpu_models.family_gguf(name, qtype)
    a = _prompt(path, N_PROMPT, 5)
    b = _prompt(path, 23, 6)
    rows = {}
    for backend in ("cuda", "cpu"):
        ctx = Context(Model.open(path, backends=[backend], n_threads=2), n_ctx=64, n_seq=2)
        sa, sb = ctx.session(0), ctx.session(1)
        sa.forward(a[:-1], n_out=1)
        sb.forward(b[:-1], n_out=1)
        ta, tb, out = a[-1], b[-1], []
        for _ in range(8):
            r = np.asarray(ctx.decode_batch([(sa, [ta]), (sb, [tb])]))
            out.append(r)
            if backend == "cuda":
                _on_cuda_alone(sa)
            ta, tb = int(np.argmax(r[0])), int(np.argmax(r[1]))
        rows[backend] = np.stack(out)  # [step, seq, vocab]
    g, c = rows["cuda"], rows["cpu"]
    rel, rms = _dist(g, c)
    assert rel <= REL_TOL and rms <= RMS_TOL, f"{name} {qtype} batched: rel {rel:.4f} rms {rms:.4f}"
    # The same sequences alone on CUDA, fed the batched run's tokens.
    for k, p in enumerate((a, b)):
        s = Session.open(path, n_ctx=64, backends=["cuda"])
        s.forward(p[:-1], n_out=1)
        t = p[-1]
        for step in range(8):
            alone = np.asarray(s.forward([t])).reshape(-1)
            got = g[step, k]
            assert np.abs(alone - got).max() <= 1e-4 * alone.std(), f"{name} seq {k} step {step}"
            t = int(np.argmax(got))


@pytest.mark.parametrize("name", ["llama3", "mistral", "gemma2", "gemma3", "phi3", "phi4mini"])
def test_step_merges_keep_the_bits_on_the_families(name, monkeypatch):
    """Whatever decode step merges a family's graph allows (llama: the q|k|v launch ropes
    interleaved pairs with its frequency factors and stores K/V; Gemma 2: the same in NeoX
    style; Gemma 3: q/k norms between matvec and rope; Phi-3: its fused projections sliced
    apart, partial rotary), a prefill and decode steps give the unfused logits bit for bit,
    through graph replays and direct launches alike."""
    from minfer.session import Session

    path = gpu_models.family_gguf(name, "Q4_K_M")
    prompt = _prompt(path, 20, 9)

    def run():
        s = Session.open(path, n_ctx=64, backends=["cuda"])
        out = [np.asarray(s.forward(prompt, n_out=len(prompt)))]
        t = int(np.argmax(out[0][-1]))
        for _ in range(6):
            out.append(np.asarray(s.forward([t])).reshape(1, -1))
            t = int(np.argmax(out[-1][-1]))
        return np.concatenate(out).tobytes()

    monkeypatch.setenv("MINFER_CUDA_FUSE", "none")
    base = run()
    monkeypatch.setenv("MINFER_CUDA_FUSE", "all")
    assert run() == base, "fused vs unfused"
    monkeypatch.setenv("MINFER_NO_CUDA_GRAPH", "1")
    assert run() == base, "direct launches vs unfused"


def test_llama_decode_keeps_the_fused_rope_tail(monkeypatch):
    """Llama's decode layer (interleaved RoPE with rope_freqs factors) takes the q|k|v
    launch with the rope + KV-store tail: one launch a layer fewer than without the rope
    fusion, as Qwen2's does (the fast path Llama-3.1-8B's decode speed rests on)."""
    from minfer.session import Session

    path = gpu_models.family_gguf("llama3", "Q4_K_M")
    counts = {}
    no_rope = ",".join(f for f in cuda_backend.FUSIONS if f != "rope")
    for fz in ("all", no_rope):
        monkeypatch.setenv("MINFER_CUDA_FUSE", fz)
        s = Session.open(path, n_ctx=64, backends=["cuda"])
        s.forward([5, 6, 7])
        s.forward([8])
        s.forward([9])
        counts[fz] = _core.testing.cuda_plan_info(s.context.cache.lowered.splits[0].plan)["launches"]
    assert counts["all"] == counts[no_rope] - s.hp.n_layer, counts
