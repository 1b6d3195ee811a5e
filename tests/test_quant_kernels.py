"""Quantized matmul kernels (csrc/cpu/quants*.cpp) through minfer._core: one-step MATMUL
plans and _core.testing.dequantize_row, checked against the gguf package's (de)quantizers and
NumPy float64, on both kernel paths.

Two tolerances, both derived rather than tuned:
- tight: the kernel must equal  y @ W.T  where W is gguf's dequantization of the weight
  and y is the activation after the same Q8 quantization (done here independently, with
  gguf's Q8_0 quantizer or a NumPy port of ggml's Q8_K), up to f32 rounding, bounded by
  c * n * 2^-24 * sum|w||y| (a recursive-summation bound with slack for the per-block
  scale products);
- semantic: against the exact  x @ W.T  the only extra error is the activation rounding,
  at most  amax(block) * (1/254 + 2^-11)  per element for Q8_0 (half a step, plus the fp16
  rounding of the step), amax/254 for Q8_K (f32 step); summed against |w| per block.
"""

import numpy as np
import pytest

import gguf  # a declared dependency: failing to import it is a failure, not a skip
from minfer import _core  # noqa: E402

Q = gguf.GGMLQuantizationType
OPS = _core.OPS
U = 2.0**-24

FAMILY32 = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0]
KQUANTS = [Q.Q4_K, Q.Q5_K, Q.Q6_K]
ALL_TYPES = [Q.F32, Q.F16] + FAMILY32 + KQUANTS

# Byte offsets of the fp16 scale fields inside one block (random blocks get finite ones).
F16_FIELDS = {
    Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q8_0: [0],
    Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208],
}


@pytest.fixture(params=["simd", "scalar"])
def kernel_path(request):
    _core.testing.set_kernel_path(request.param)
    yield request.param
    _core.testing.set_kernel_path("simd")


def in_dim_for(qtype):
    # 32-family: 7 blocks (odd, so a two-blocks-at-a-time path has a tail); K: 2 blocks;
    # floats: 45 = 16 + 16 + 8 + 5 exercises every vector tail.
    return {Q.F32: 45, Q.F16: 45}.get(qtype, 512 if qtype in KQUANTS else 224)


def random_blocks(qtype, rows, cols, rng):
    """Random codes with finite random fp16 scales: covers every code value, incl. -128."""
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // bs, ts), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        d = (rng.standard_normal((rows, cols // bs)) * 0.02).astype(np.float16)
        raw[:, :, off:off + 2] = d.view(np.uint8).reshape(rows, cols // bs, 2)
    return raw.reshape(rows, -1)


def make_weight(qtype, rows, cols, rng, random_codes=False):
    """(raw bytes [rows, row_bytes], dequantized f32 [rows, cols]) with gguf as reference."""
    if qtype in KQUANTS or random_codes:
        raw = random_blocks(qtype, rows, cols, rng)
    else:
        w = (rng.standard_normal((rows, cols)) * 0.1).astype(np.float32)
        raw = np.ascontiguousarray(gguf.quants.quantize(w, qtype)).view(np.uint8).reshape(rows, -1)
    deq = gguf.quants.dequantize(raw, qtype).reshape(rows, cols).astype(np.float32)
    return raw, deq


def q8_0_roundtrip(x):
    return gguf.quants.dequantize(gguf.quants.quantize(x, Q.Q8_0), Q.Q8_0).reshape(x.shape)


def q8_K_roundtrip(x):
    """ggml's quantize_row_q8_K_ref: the signed max maps to -127; d = 1/iscale in f32."""
    b = x.reshape(-1, 256).astype(np.float32)
    idx = np.argmax(np.abs(b), axis=1)
    mx = b[np.arange(len(b)), idx]
    out = np.zeros_like(b)
    nz = mx != 0
    iscale = (np.float32(-127.0) / mx[nz]).astype(np.float32)
    q = np.minimum(np.rint((iscale[:, None] * b[nz]).astype(np.float32)), 127)
    out[nz] = (np.float32(1.0) / iscale)[:, None] * q
    return out.reshape(x.shape)


def act_quant(qtype):
    """(activation round trip, block size, per-element error coefficient of amax)."""
    if qtype in FAMILY32:
        return q8_0_roundtrip, 32, 1 / 254 + 2.0**-11
    if qtype in KQUANTS:
        return q8_K_roundtrip, 256, 1 / 254
    return (lambda x: x), None, 0.0


def run_matmul(raw, qtype, in_dim, out_dim, x, bias=None, n_threads=2):
    nt = x.shape[0]
    pool = _core.Pool("qk-test")
    ws = _core.WeightStore()
    y_id = pool.alloc(out_dim * nt * 4)
    x_id = pool.alloc(in_dim * nt * 4)
    pool.write(x_id, np.ascontiguousarray(x, dtype=np.float32))
    wh = ws.add("w", np.ascontiguousarray(raw).view(np.uint8).reshape(-1), int(qtype), in_dim, out_dim)
    bh = ws.add("b", bias.view(np.uint8), int(Q.F32), out_dim, 1) if bias is not None else -1
    plan = _core.Plan("mm")
    plan.add(OPS["matmul"], 0, [y_id, x_id], [in_dim, out_dim, nt], [], [wh, bh])
    _core.run(plan, pool, ws, n_threads)
    return pool.read(y_id, "float32", out_dim * nt).reshape(nt, out_dim)


def check_against_references(got, x, deq, qtype):
    roundtrip, blk, coef = act_quant(qtype)
    n = x.shape[1]
    x64, w64 = x.astype(np.float64), deq.astype(np.float64)
    y64 = roundtrip(x).astype(np.float64)
    abs_wy = np.abs(y64) @ np.abs(w64).T
    # K-quant kernels combine d*sc and dmin*m terms that can partly cancel: more slack.
    c = 8.0 if qtype in KQUANTS else 2.0
    tight = y64 @ w64.T
    tight_tol = c * n * U * abs_wy + 1e-30
    err = np.abs(got - tight)
    assert np.all(err <= tight_tol), (
        f"{qtype.name}: max err/tol vs quantized-activation reference {np.max(err / tight_tol):.3g}")

    exact = x64 @ w64.T
    slop = c * n * U * (np.abs(x64) @ np.abs(w64).T)
    if blk:
        nb = n // blk
        amax = np.abs(x64).reshape(x.shape[0], nb, blk).max(axis=2)
        wsum = np.abs(w64).reshape(deq.shape[0], nb, blk).sum(axis=2)
        bound = coef * 1.001 * (amax @ wsum.T) + slop
    else:
        bound = slop + 1e-30
    err = np.abs(got - exact)
    assert np.all(err <= bound), f"{qtype.name}: max err/bound vs exact {np.max(err / bound):.3g}"


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("nt", [1, 3, 7, 33])
def test_matmul_matches_reference(qtype, nt, kernel_path):
    rng = np.random.default_rng(1000 * int(qtype) + nt)
    in_dim, out_dim = in_dim_for(qtype), 37
    raw, deq = make_weight(qtype, out_dim, in_dim, rng)
    x = rng.standard_normal((nt, in_dim)).astype(np.float32)
    got = run_matmul(raw, qtype, in_dim, out_dim, x)
    check_against_references(got, x, deq, qtype)


@pytest.mark.parametrize("qtype", FAMILY32, ids=lambda t: t.name)
def test_matmul_random_codes(qtype, kernel_path):
    """Every code value (Q8_0's -128 too, the extreme for maddubs) and large inputs."""
    rng = np.random.default_rng(7 + int(qtype))
    in_dim, out_dim = 256, 19
    raw, deq = make_weight(qtype, out_dim, in_dim, rng, random_codes=True)
    x = (rng.standard_normal((5, in_dim)) * 30).astype(np.float32)
    x[1] = 0.0  # all-zero activation blocks: scale 0, no division by zero
    got = run_matmul(raw, qtype, in_dim, out_dim, x)
    check_against_references(got, x, deq, qtype)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_rows_do_not_depend_on_batch_or_threads(qtype, kernel_path):
    """A token's output is bitwise the same whether it ran alone, in a tile of 4, or with
    another thread split: prefill and decode agree, and split runs match unsplit ones."""
    rng = np.random.default_rng(55 + int(qtype))
    in_dim, out_dim = in_dim_for(qtype), 37
    raw, _ = make_weight(qtype, out_dim, in_dim, rng)
    x = rng.standard_normal((7, in_dim)).astype(np.float32)
    full = run_matmul(raw, qtype, in_dim, out_dim, x, n_threads=2)
    one_thread = run_matmul(raw, qtype, in_dim, out_dim, x, n_threads=1)
    assert np.array_equal(full.view(np.uint32), one_thread.view(np.uint32))
    for t in (0, 5, 6):
        alone = run_matmul(raw, qtype, in_dim, out_dim, x[t:t + 1])
        assert np.array_equal(alone[0].view(np.uint32), full[t].view(np.uint32)), f"token {t}"


def test_matmul_with_bias(kernel_path):
    rng = np.random.default_rng(3)
    in_dim, out_dim = 224, 37
    raw, deq = make_weight(Q.Q8_0, out_dim, in_dim, rng)
    x = rng.standard_normal((3, in_dim)).astype(np.float32)
    bias = rng.standard_normal(out_dim).astype(np.float32)
    got = run_matmul(raw, Q.Q8_0, in_dim, out_dim, x, bias=bias)
    plain = run_matmul(raw, Q.Q8_0, in_dim, out_dim, x)
    assert np.array_equal(got, plain + bias)  # the executor adds the bias in f32
    check_against_references(got - bias, x, deq, Q.Q8_0)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_row_is_bitwise_gguf(qtype):
    rng = np.random.default_rng(99 + int(qtype))
    cols = in_dim_for(qtype)
    for random_codes in (False, True) if qtype in FAMILY32 else (False,):
        raw, deq = make_weight(qtype, 5, cols, rng, random_codes=random_codes)
        got = _core.testing.dequantize_row(int(qtype), raw.reshape(-1), 5 * cols)
        assert np.array_equal(got.view(np.uint32), deq.reshape(-1).view(np.uint32))


def test_dequantize_q8_K():
    """Q8_K (an activation format; gguf has no codec for it): d * q with an f32 d."""
    rng = np.random.default_rng(5)
    nb = 3
    d = rng.standard_normal(nb).astype(np.float32)
    qs = rng.integers(-128, 128, size=(nb, 256), dtype=np.int8)
    bsums = qs.reshape(nb, 16, 16).sum(axis=2).astype(np.int16)
    raw = np.concatenate([d.view(np.uint8).reshape(nb, 4), qs.view(np.uint8),
                          bsums.view(np.uint8).reshape(nb, 32)], axis=1)
    got = _core.testing.dequantize_row(int(Q.Q8_K), raw.reshape(-1), nb * 256)
    assert np.array_equal(got, (d[:, None] * qs.astype(np.float32)).reshape(-1))


@pytest.mark.parametrize("bad", [int(Q.Q2_K), int(Q.Q3_K), int(Q.Q8_1), 99, -1])
def test_unsupported_types_raise(bad):
    assert not _core.weight_type_supported(bad)
    ws = _core.WeightStore()
    with pytest.raises(ValueError, match="unsupported"):
        ws.add("w", np.zeros(1024, np.uint8), bad, 256, 1)
    with pytest.raises(ValueError):
        _core.testing.dequantize_row(bad, np.zeros(1024, np.uint8), 256)


def test_kernel_path_switch():
    assert _core.testing.kernel_path() == "simd"
    _core.testing.set_kernel_path("scalar")
    try:
        assert _core.testing.kernel_path() == "scalar"
    finally:
        _core.testing.set_kernel_path("simd")
    with pytest.raises(ValueError):
        _core.testing.set_kernel_path("avx9")
    f = _core.testing.cpu_features()
    expect = ("avx512" if f["avx512f"] else "avx2") if (f["avx2"] and f["fma"] and f["f16c"]) else (
        "neon" if f["neon"] else "scalar")
    assert f["simd_path"] == expect


@pytest.fixture(scope="module")
def real_tensor_slices(real_model_path):
    """45 rows of the first 2-D tensor of each quantized type in the default model."""
    from minfer.io.gguf_file import GGUFFile

    out = {}
    with GGUFFile.open(real_model_path) as f:
        for info in f.tensors.values():
            qtype = Q(info.type)
            if qtype == Q.F32 or qtype in out or len(info.shape) != 2:
                continue
            rows = f.tensor_data(info.name).reshape(info.shape[1], info.row_nbytes)
            out[qtype] = (info.name, info.shape[0], np.array(rows[:45]))
    return out


def test_real_model_tensors(real_tensor_slices, kernel_path):
    """Real weights (real scale distributions, every tensor type of the default model),
    dequantized and multiplied."""
    assert {Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q6_K} <= set(real_tensor_slices)
    rng = np.random.default_rng(11)
    for qtype, (name, in_dim, raw) in real_tensor_slices.items():
        deq = gguf.quants.dequantize(raw, qtype).reshape(45, in_dim).astype(np.float32)
        got = _core.testing.dequantize_row(int(qtype), raw.reshape(-1), 45 * in_dim)
        assert np.array_equal(got.view(np.uint32), deq.reshape(-1).view(np.uint32)), name
        x = rng.standard_normal((5, in_dim)).astype(np.float32)
        check_against_references(run_matmul(raw, qtype, in_dim, 45, x), x, deq, qtype)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q5_0, Q.Q4_K, Q.Q6_K])
def test_weights_from_a_file_mapping_survive_repack_page_release(qtype, tmp_path):
    """A weight registered from a read-only file mmap (as the GGUF is) may have its pages
    dropped once the SIMD matmul has repacked it; a later reader of the original bytes
    (the scalar path) must still see them: same results as a heap copy of the weight."""
    import mmap

    rng = np.random.default_rng(int(qtype))
    in_dim, out_dim = 512, 160  # 160 rows of 288 (Q6_K: 420) bytes: whole pages inside the tensor
    raw, deq = make_weight(qtype, out_dim, in_dim, rng)
    path = tmp_path / "w.bin"
    path.write_bytes(b"\0" * 100 + raw.tobytes())  # an unaligned start, as in a GGUF
    x = rng.standard_normal((3, in_dim)).astype(np.float32)
    before = _core.testing.kernel_path()
    try:
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        view = np.frombuffer(mm, np.uint8)[100:]
        pool, ws = _core.Pool("filemap"), _core.WeightStore()
        x_id, y_id = pool.alloc(x.nbytes), pool.alloc(3 * out_dim * 4)
        pool.write(x_id, x)
        wh = ws.add("w", view, int(qtype), in_dim, out_dim)
        plan = _core.Plan("mm")
        plan.add(OPS["matmul"], 0, [y_id, x_id], [in_dim, out_dim, 3], [], [wh, -1])
        got = {}
        for path_name in ("simd", "scalar", "simd"):
            _core.testing.set_kernel_path(path_name)
            _core.run(plan, pool, ws, 2)
            got.setdefault(path_name, []).append(pool.read(y_id, "float32", 3 * out_dim).reshape(3, out_dim))
        assert view.tobytes() == raw.tobytes()  # the mapping still reads the file's bytes
    finally:
        _core.testing.set_kernel_path(before)
    _core.testing.set_kernel_path("scalar")
    try:
        ref_scalar = run_matmul(raw.copy(), qtype, in_dim, out_dim, x)
    finally:
        _core.testing.set_kernel_path(before)
    assert got["scalar"][0].tobytes() == ref_scalar.tobytes()
    assert got["simd"][0].tobytes() == got["simd"][1].tobytes()
    check_against_references(got["scalar"][0], x, deq, qtype)
