"""The repacked matmul (csrc/cpu/repack*.cpp) built for the x86 targets that a native build
of this machine does not compile: AVX2 alone (maddubs, 8-lane halves, 4-token tiles),
AVX-512 without VNNI (maddubs on 16 lanes) and AVX-VNNI (vpdpbusd on 8 lanes). A CI
machine of one kind would otherwise never run the others' kernels.

tests/repack_builds/check.cpp links the repack and quant sources for each target and runs
every weight type the target packs over 40 rows (a partial group; the rows cut at 16 as
two threads would) and 13 tokens (tiles of 4 and 8 with a tail), as one prefill call and
token by token as decode does. Each result is checked against the float64 references of
test_quant_kernels (gguf's dequantization times the quantized activations), the
K-quants' extreme codes and scales included, and, where this machine's own build packs
the type too, bitwise against it: the repacked kernels' rounding (csrc/cpu/repack.h) is the
same sequence of float operations at every vector width. Targets this CPU cannot run are
compiled only.
"""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest

import gguf
from minfer import _core
from test_kernels_qemu import ROOT, build, need_tools, quant_sources
from test_quant_kernels import FAMILY32, KQUANTS, check_against_references, make_weight, run_matmul
from test_repack_k import cpu_flags, extreme_blocks

Q = gguf.GGMLQuantizationType
CHECK = ROOT / "tests" / "repack_builds" / "check.cpp"
REPACK = [ROOT / "csrc" / "cpu" / f for f in ("repack.cpp", "repack_k.cpp", "repack_k_amx.cpp")]
SOURCES = [CHECK, *quant_sources(), *REPACK]
IN_DIM, ROWS, NT = 768, 40, 13
V3 = {"avx2", "fma", "f16c"}
# name: (compiler flags, CPU flags it needs, its SIMD path, whether it packs Q8_0: only
# where vpdpbusd exists, since maddubs would saturate on code + 128)
TARGETS = {
    "avx2": (["-march=haswell"], V3, "avx2", False),
    "avx512-maddubs": (["-march=skylake-avx512"], V3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}, "avx512",
                       False),
    "avx-vnni": (["-march=haswell", "-mavxvnni"], V3 | {"avx_vnni"}, "avx2", True),
}


def cases():
    """(qtype, raw, deq, x): every repackable type, and the K-quants' extreme blocks."""
    rng = np.random.default_rng(606)
    out = []
    for qtype in FAMILY32 + KQUANTS:
        raw, deq = make_weight(qtype, ROWS, IN_DIM, rng)
        out.append((qtype, raw, deq, rng.standard_normal((NT, IN_DIM)).astype(np.float32)))
    for qtype in KQUANTS:
        raw, deq = extreme_blocks(qtype, ROWS, rng)
        x = (rng.standard_normal((NT, IN_DIM)) * 30).astype(np.float32)
        x[4] = 5.0
        out.append((qtype, raw, deq, x))
    return out


def run_check(exe: Path, tmp: Path, cs) -> tuple[str, list]:
    src, dst = tmp / "in.bin", tmp / "out.bin"
    with open(src, "wb") as f:
        f.write(b"MRPVEC1\0" + struct.pack("<I", len(cs)))
        for qtype, raw, _, x in cs:
            w = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
            f.write(struct.pack("<iiiiqQ", int(qtype), ROWS, NT, 0, IN_DIM, w.size) + w.tobytes())
            f.write(np.ascontiguousarray(x, dtype="<f4").tobytes())
    r = subprocess.run([str(exe), str(src), str(dst)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    data, at, got = dst.read_bytes(), 0, []
    for _ in cs:
        packed = data[at] == 1
        at += 1
        if not packed:
            got.append(None)
            continue
        n = NT * ROWS * 4
        pre = np.frombuffer(data[at:at + n], "<f4").reshape(NT, ROWS)
        dec = np.frombuffer(data[at + n:at + 2 * n], "<f4").reshape(NT, ROWS)
        at += 2 * n
        got.append((pre, dec))
    assert at == len(data)
    return r.stdout, got


@pytest.fixture(scope="module")
def build_dir(request):
    return Path(request.config.cache.mkdir("repack_builds"))


@pytest.mark.parametrize("target", list(TARGETS))
def test_repacked_kernels_of_other_x86_targets(target, build_dir, tmp_path):
    need_tools("g++")
    flags, needs, path, packs_q8_0 = TARGETS[target]
    exe = build("g++", [*flags, "-fopenmp"], build_dir, f"repack-{target}", SOURCES)
    if not needs <= cpu_flags():
        return  # compiled for that target above; none of its kernels can run on this CPU
    _core.testing.set_kernel_path("simd")
    cs = cases()
    out, got = run_check(exe, tmp_path, cs)
    assert f"simd path: {path}" in out, out
    for (qtype, raw, deq, x), res in zip(cs, got):
        assert (res is not None) == (qtype != Q.Q8_0 or packs_q8_0), (target, qtype.name)
        if res is None:
            continue
        pre, dec = res
        check_against_references(pre, x, deq, qtype)
        # Prefill and decode give the same bits (the rounding contract), at this width too.
        assert np.array_equal(pre.view(np.uint32), dec.view(np.uint32)), (target, qtype.name)
        if _core.testing.repack_packable(int(qtype)):
            native = run_matmul(raw, qtype, IN_DIM, ROWS, x, n_threads=1)
            assert np.array_equal(pre.view(np.uint32), native.view(np.uint32)), (target, qtype.name)
