"""The standalone kernel harness (tests/kernels/kernel_check.cpp) built three ways:
natively (AVX2 here), cross-compiled for aarch64 and run under qemu-user (NEON, with and
without the dot-product extension), and compile-only for AVX-512 (no such CPU here).
Test vectors come from the gguf package and NumPy float64 (see test_quant_kernels.py).

The aarch64 tools are Debian's g++-aarch64-linux-gnu and qemu-user (`bash .ci/run`
installs them). Without them the NEON tests fail, naming the packages: never a skip.
"""

import hashlib
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest

import gguf
from test_quant_kernels import (  # noqa: E402  (tests/ is on sys.path under pytest)
    ALL_TYPES, FAMILY32, KQUANTS, U, act_quant, in_dim_for, make_weight)

Q = gguf.GGMLQuantizationType
ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT / "tests" / "kernels" / "kernel_check.cpp"
CROSS = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64"
FLAGS = ["-std=c++17", "-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", f"-I{ROOT / 'csrc'}"]


def quant_sources():
    return sorted(str(p) for p in (ROOT / "csrc" / "cpu").glob("quants*.cpp"))


def write_vectors(path):
    """One case per weight type: nw = 13 rows, na = 5 activation rows (a group of 4
    plus a single), tolerances as in test_quant_kernels (tight, vs quantized x)."""
    rng = np.random.default_rng(2024)
    cases = []
    for qtype in ALL_TYPES:
        for random_codes in (False, True) if qtype not in KQUANTS + [Q.F32, Q.F16] else (False,):
            n, nw, na = in_dim_for(qtype), 13, 5
            raw, deq = make_weight(qtype, nw, n, rng, random_codes=random_codes)
            x = (rng.standard_normal((na, n)) * 3).astype(np.float32)
            if qtype in FAMILY32:
                # Row 0: every block has amax 127, so the Q8_0 step is exactly 1 and all the
                # k + 0.5 values are rounding ties (ggml rounds them away from zero).
                ties = np.arange(n, dtype=np.float32) % 64 - 31.5
                ties[::32] = 127.0
                x[0] = ties * np.where(np.arange(n) % 3 == 0, -1, 1)
            roundtrip, _, _ = act_quant(qtype)
            y64, w64 = roundtrip(x).astype(np.float64), deq.astype(np.float64)
            ref = y64 @ w64.T
            c = 8.0 if qtype in KQUANTS else 2.0
            tol = c * n * U * (np.abs(y64) @ np.abs(w64).T) + 1e-30
            # The activation bytes gguf's Q8_0 quantizer gives (ggml's reference rounding).
            act = (np.ascontiguousarray(gguf.quants.quantize(x, Q.Q8_0)).view(np.uint8).reshape(-1)
                   if qtype in FAMILY32 else np.zeros(0, np.uint8))
            cases.append((int(qtype), nw, na, n, raw, x, deq, ref, tol, act))
    with open(path, "wb") as f:
        f.write(b"MQKVEC1\0" + struct.pack("<I", len(cases)))
        for qt, nw, na, n, raw, x, deq, ref, tol, act in cases:
            raw = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
            f.write(struct.pack("<iiiiqQ", qt, nw, na, 0, n, raw.size))
            f.write(raw.tobytes())
            for arr, dt in ((x, "<f4"), (deq, "<f4"), (ref, "<f8"), (tol, "<f8")):
                f.write(np.ascontiguousarray(arr, dtype=dt).tobytes())
            f.write(struct.pack("<Q", act.size) + act.tobytes())
    return len(cases)


@pytest.fixture(scope="module")
def vectors(tmp_path_factory):
    path = tmp_path_factory.mktemp("kvec") / "vectors.bin"
    return path, write_vectors(path)


def need_tools(*tools):
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        pytest.fail(f"missing {', '.join(missing)}: apt-get install g++-aarch64-linux-gnu qemu-user "
                    f"(or run the suite with `bash .ci/run`, which does)")


def build(compiler, flags, out_dir, name, srcs=None):
    """Compiles each source (default: this harness and the quant kernels) in its own
    process (two cores build in half the time) and links; binaries are cached by a hash
    of sources, headers, compiler and flags."""
    srcs = [str(s) for s in srcs] if srcs else [str(HARNESS), *quant_sources()]
    key = hashlib.sha256(repr((compiler, flags, FLAGS)).encode())
    for p in srcs + sorted(str(h) for h in (ROOT / "csrc").rglob("*.h")):
        key.update(Path(p).read_bytes())
    exe = out_dir / f"{name}-{key.hexdigest()[:16]}"
    if exe.exists():
        return exe
    objs = [out_dir / f"{name}-{Path(s).stem}.o" for s in srcs]
    procs = [(s, subprocess.Popen([compiler, *FLAGS, *flags, "-c", s, "-o", str(o)], stderr=subprocess.PIPE, text=True))
             for s, o in zip(srcs, objs)]
    for s, p in procs:
        err = p.communicate()[1]
        assert p.returncode == 0, f"{compiler} {' '.join(flags)} failed on {s}:\n{err[-4000:]}"
    r = subprocess.run([compiler, *flags, *map(str, objs), "-o", str(exe)], capture_output=True, text=True)
    assert r.returncode == 0, f"link failed:\n{r.stderr[-4000:]}"
    return exe


@pytest.fixture(scope="module")
def build_dir(request):
    return Path(request.config.cache.mkdir("kernel_check"))


def run_harness(cmd, vectors, expect_path):
    path, ncases = vectors
    r = subprocess.run([*cmd, str(path)], capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert f"simd path: {expect_path}" in out, out[-2000:]
    assert f"cases: {ncases} " in out and "failures: 0" in out, out[-2000:]


def test_native_harness(build_dir, vectors):
    need_tools("g++")
    exe = build("g++", ["-march=native"], build_dir, "native")
    from minfer import _core

    run_harness([str(exe)], vectors, _core.testing.cpu_features()["simd_path"])


@pytest.mark.parametrize("march,name", [("armv8.2-a+dotprod", "dotprod"), ("armv8-a", "no-dotprod")])
def test_neon_harness_under_qemu(build_dir, vectors, march, name):
    need_tools(CROSS, QEMU)
    exe = build(CROSS, [f"-march={march}"], build_dir, f"aarch64-{name}")
    run_harness([QEMU, "-L", "/usr/aarch64-linux-gnu", str(exe)], vectors, "neon")


def test_avx512_path_compiles(tmp_path):
    """No AVX-512 CPU here: compile the quant sources for it and check that the AVX-512
    K-quant kernels (VNNI dpwssd included) were really emitted, not silently compiled
    out. (The 32-element family runs its AVX2 rows on AVX-512 builds: measured faster.)"""
    need_tools("g++", "objdump")
    flags = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma", "-mf16c"]
    obj = tmp_path / "quants_k_avx512.o"
    src = str(ROOT / "csrc" / "cpu" / "quants_k.cpp")
    # -O1: the intrinsics are emitted at any level and this is only a compile check.
    r = subprocess.run(["g++", *FLAGS, "-O1", *flags, "-c", src, "-o", str(obj)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    dis = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(obj)], capture_output=True, text=True).stdout
    assert "vpdpwssd" in dis and "zmm" in dis
    for src in quant_sources():  # the whole quant family must at least build for it
        r = subprocess.run(["g++", *FLAGS, *flags, "-fsyntax-only", src], capture_output=True, text=True)
        assert r.returncode == 0, f"{src}:\n{r.stderr[-4000:]}"
