"""The repacked K-quant matmul (csrc/cpu/repack_k.cpp: Q4_K / Q5_K / Q6_K weights interleaved in
16-row groups, VNNI int8 dots against Q8_K activations) through one-step MATMUL plans.

References are independent of the kernel: gguf's dequantization of the weight in float64,
times the activation after ggml's Q8_K quantization (a NumPy port, test_quant_kernels.
q8_K_roundtrip), and the exact product; the tolerances are test_quant_kernels'
check_against_references ("tight": K-quant recursive-summation bound 8 * n * 2^-24 *
sum|w||y|; "semantic": plus the Q8_K activation rounding amax/254 per element).

Shapes cover row counts that are not a multiple of the 16-row group (1, 17, 40), token
counts around the kernel's tile of 8 tokens, and thread counts
whose row split cuts groups unevenly (3, 5, 16 threads on 17-40 rows).
"""

import numpy as np
import pytest

import gguf
from minfer import _core
from test_quant_kernels import check_against_references, make_weight, run_matmul

Q = gguf.GGMLQuantizationType
KTYPES = [Q.Q4_K, Q.Q5_K, Q.Q6_K]
IN_DIM = 768  # three super-blocks


@pytest.fixture(autouse=True)
def simd_path():
    _core.testing.set_kernel_path("simd")
    yield


def test_k_quants_are_packed_on_x86_simd_builds():
    """The tests below pin the repacked kernel wherever the build has AVX2 or wider."""
    f = _core.testing.cpu_features()
    for qtype in KTYPES:
        assert _core.testing.repack_packable(int(qtype)) == (f["simd_path"] in ("avx2", "avx512"))


@pytest.mark.parametrize("qtype", KTYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("out_dim", [1, 17, 40])
@pytest.mark.parametrize("nt", [1, 8, 9, 37])
def test_packed_k_matches_reference(qtype, out_dim, nt):
    rng = np.random.default_rng(17 * int(qtype) + 3 * out_dim + nt)
    raw, deq = make_weight(qtype, out_dim, IN_DIM, rng)
    x = rng.standard_normal((nt, IN_DIM)).astype(np.float32)
    for n_threads in (1, 3, 16):
        got = run_matmul(raw, qtype, IN_DIM, out_dim, x, n_threads=n_threads)
        check_against_references(got, x, deq, qtype)


@pytest.mark.parametrize("qtype", KTYPES, ids=lambda t: t.name)
def test_packed_k_bitwise_across_threads_and_batches(qtype):
    """A (row, token) result does not depend on the thread split or on which tokens share
    its tile: decode (one token) and prefill agree bit for bit."""
    rng = np.random.default_rng(int(qtype))
    out_dim, nt = 40, 19
    raw, _ = make_weight(qtype, out_dim, IN_DIM, rng)
    x = rng.standard_normal((nt, IN_DIM)).astype(np.float32)
    ref = run_matmul(raw, qtype, IN_DIM, out_dim, x, n_threads=1)
    for n_threads in (2, 3, 5, 16):
        got = run_matmul(raw, qtype, IN_DIM, out_dim, x, n_threads=n_threads)
        assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), n_threads
    for t in (0, 8, 18):
        alone = run_matmul(raw, qtype, IN_DIM, out_dim, x[t:t + 1], n_threads=2)
        assert np.array_equal(alone[0].view(np.uint32), ref[t].view(np.uint32)), t
    tail = run_matmul(raw, qtype, IN_DIM, out_dim, x[5:], n_threads=3)
    assert np.array_equal(tail.view(np.uint32), ref[5:].view(np.uint32))


def extreme_blocks(qtype, rows, rng):
    """Random blocks whose first rows hold the extreme codes and scales: the integer sums
    that come closest to int32 (and the maddubs int16 pairs on AVX2) are exercised."""
    raw, _ = make_weight(qtype, rows, IN_DIM, rng)
    blocks = raw.reshape(rows, IN_DIM // 256, -1)
    if qtype in (Q.Q4_K, Q.Q5_K):  # (Q5_K: its qh bytes too, so codes 31 and 0)
        blocks[0, :, 4:] = 0xFF  # scales = mins = 63, codes 15
        blocks[1, :, 4:16] = 0xFF  # scales = mins = 63, codes 0
        blocks[1, :, 16:] = 0
    else:
        blocks[0, :, :192] = 0xFF  # codes 63 (+31 signed)
        blocks[0, :, 192:208] = np.uint8(0x7F)  # scales 127
        blocks[1, :, :192] = 0  # codes 0 (-32 signed)
        blocks[1, :, 192:208] = np.uint8(0x80)  # scales -128
    raw = blocks.reshape(rows, -1)
    deq = gguf.quants.dequantize(raw, qtype).reshape(rows, IN_DIM).astype(np.float32)
    return raw, deq


@pytest.mark.parametrize("qtype", KTYPES, ids=lambda t: t.name)
def test_packed_k_extreme_codes(qtype):
    rng = np.random.default_rng(100 + int(qtype))
    raw, deq = extreme_blocks(qtype, 18, rng)
    x = (rng.standard_normal((6, IN_DIM)) * 30).astype(np.float32)
    x[1] = 0.0  # all-zero activation: d = 0, no division by zero
    x[2] = 5.0  # every activation code 127
    x[3] = -5.0  # every activation code -127
    got = run_matmul(raw, qtype, IN_DIM, 18, x, n_threads=2)
    check_against_references(got, x, deq, qtype)
    assert np.all(got[1] == 0.0)


def test_q8_K_quantizer_simd_is_bytewise_scalar():
    """The SIMD Q8_K activation quantizer writes the scalar one's bytes: the max's sign
    from its first occurrence (ties of +m and -m both ways), rounding ties, zero blocks,
    and blocks with inf or NaN (which take the scalar loop)."""
    rng = np.random.default_rng(8)
    blocks = [rng.standard_normal(256) * s for s in (1e-30, 1e-3, 1.0, 1e4, 1e30)]
    b = rng.standard_normal(256)
    b[[10, 200]] = [-4.0, 4.0]  # -max first
    blocks.append(b)
    b = rng.standard_normal(256)
    b[[3, 7]] = [5.0, -5.0]  # +max first
    blocks.append(b)
    blocks.append(np.zeros(256))
    blocks.append(np.round(rng.standard_normal(256) * 127) / 127 * 2.0 + 0.5 / 127 * 2.0)  # halfway codes
    b = rng.standard_normal(256)
    b[17] = np.inf
    blocks.append(b)
    b = rng.standard_normal(256)
    b[99] = np.nan
    blocks.append(b)
    x = np.concatenate(blocks).astype(np.float32)
    simd = _core.testing.quantize_q8_K(x, True)
    scalar = _core.testing.quantize_q8_K(x, False)
    assert simd.tobytes() == scalar.tobytes()
    # and the scalar one is ggml's (test_quant_kernels.q8_K_roundtrip) on the finite blocks
    from test_quant_kernels import q8_K_roundtrip
    fin = np.concatenate(blocks[:-2]).astype(np.float32)
    got = _core.testing.dequantize_row(int(Q.Q8_K), _core.testing.quantize_q8_K(fin, True), fin.size)
    assert np.array_equal(got, q8_K_roundtrip(fin).reshape(-1))


def run_shared_input(weights, in_dim, x, n_threads):
    """Several MATMUL steps of one plan reading the same input: the executor quantizes it
    once and every step reads the same activation bytes and per-block summaries."""
    nt = x.shape[0]
    pool, ws = _core.Pool("shared"), _core.WeightStore()
    x_id = pool.alloc(in_dim * nt * 4)
    pool.write(x_id, np.ascontiguousarray(x, dtype=np.float32))
    plan, ys = _core.Plan("mm"), []
    for i, (raw, qtype, out_dim) in enumerate(weights):
        y = pool.alloc(out_dim * nt * 4)
        h = ws.add(f"w{i}", np.ascontiguousarray(raw).view(np.uint8).reshape(-1), int(qtype), in_dim, out_dim)
        plan.add(_core.OPS["matmul"], i, [y, x_id], [in_dim, out_dim, nt], [], [h, -1])
        ys.append((y, out_dim))
    _core.run(plan, pool, ws, n_threads)
    return [pool.read(y, "float32", o * nt).reshape(nt, o) for y, o in ys]


@pytest.mark.parametrize("types", [(Q.Q4_K, Q.Q6_K, Q.Q4_K), (Q.Q6_K, Q.Q4_K),
                                   (Q.Q5_0, Q.Q8_0, Q.Q4_0), (Q.Q8_0, Q.Q5_0)], ids=lambda ts: "-".join(t.name for t in ts))
@pytest.mark.parametrize("nt", [1, 13])
def test_matmuls_sharing_an_input_equal_each_alone(types, nt):
    """Whichever type quantized the shared input, each matmul's result is bit for bit
    its result alone (which the tests above check against references)."""
    rng = np.random.default_rng(len(types) * 10 + nt)
    weights = []
    for i, qtype in enumerate(types):
        raw, _ = make_weight(qtype, 24 + 16 * i, IN_DIM, rng)
        weights.append((raw, qtype, 24 + 16 * i))
    x = rng.standard_normal((nt, IN_DIM)).astype(np.float32)
    for n_threads in (1, 3):
        shared = run_shared_input(weights, IN_DIM, x, n_threads)
        for (raw, qtype, out_dim), got in zip(weights, shared):
            alone = run_matmul(raw, qtype, IN_DIM, out_dim, x, n_threads=n_threads)
            assert np.array_equal(got.view(np.uint32), alone.view(np.uint32)), (qtype.name, n_threads)


def cpu_flags() -> set[str]:
    """This CPU's feature flags, as /proc/cpuinfo names them."""
    with open("/proc/cpuinfo") as f:
        return set(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))


def _amx_cpu() -> bool:
    return {"amx_int8", "amx_tile"} <= cpu_flags()


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda q: q.name)
def test_k_quant_prefill_on_amx_tiles_is_bitwise_the_vector_kernel(qtype):
    """Where the build targets AMX (-march=native on an AMX machine) and the OS grants
    the tile state, K-quant blocks of 16 tokens run on the tiles: the scale-folded
    weights give the same integer super-block sums and the same float epilogue as the
    vector kernel, so every output is bitwise its result (the switch off), across thread
    splits and partial groups, with 32-token pairs, a lone 16-token tile and a tail past
    the last whole tile, more tokens than one block of activations on two threads, extreme
    codes and scales included, and within the float64 references. Elsewhere the tiles
    never run and the switch changes nothing."""
    avail = _core.testing.cpu_amx_available()
    if not _amx_cpu():
        assert not avail
    rng = np.random.default_rng(404)
    raw, deq = make_weight(qtype, 40, 2048, rng)
    x = rng.standard_normal((70, 2048)).astype(np.float32)
    ext, ext_deq = extreme_blocks(qtype, 18, rng)
    xe = (rng.standard_normal((33, IN_DIM)) * 30).astype(np.float32)
    xe[4] = 5.0
    xl = rng.standard_normal((600, 2048)).astype(np.float32)
    outs, ran = {}, {}
    try:
        for on in (True, False):
            _core.testing.cpu_set_amx(on)
            c0 = _core.testing.cpu_amx_calls()
            outs[on] = [run_matmul(raw, qtype, 2048, 40, x, n_threads=n) for n in (1, 3)]
            outs[on].append(run_matmul(ext, qtype, IN_DIM, 18, xe, n_threads=2))
            outs[on].append(run_matmul(raw, qtype, 2048, 40, x[:16], n_threads=1))
            # More tokens than the tiles' block of activations (448 tokens of 2,048-wide
            # rows), cut into the split's eighths on two threads.
            outs[on].append(run_matmul(raw, qtype, 2048, 40, xl, n_threads=2))
            ran[on] = _core.testing.cpu_amx_calls() - c0
    finally:
        _core.testing.cpu_set_amx(True)
    assert ran[False] == 0 and (ran[True] > 0) == avail, (ran, avail)
    for a, b in zip(outs[True], outs[False]):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    check_against_references(outs[True][0], x, deq, qtype)
    check_against_references(outs[True][2], xe, ext_deq, qtype)
