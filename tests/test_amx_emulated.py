"""The K-quant AMX prefill kernel (csrc/cpu/repack_k_amx.cpp) on machines without AMX.

Its tile instructions are replaced by a plain C++ emulation (tests/amx_emulation/tiles.h,
force-included), and a small program packs random and extreme Q4_K / Q5_K / Q6_K rows and
compares every output of the tiles with the vector kernel's, bitwise, over 32-token
pairs, lone 16-token tiles, token tails and split row ranges. The vector kernel is
checked against the gguf dequantization in test_repack_k.py; on an AMX machine the same
comparison runs on the real tiles there as well.

The program is built for an AVX-512 VNNI target; on a CPU without it (an AVX2-only CI
machine) it is built but not run, since no kernel of that target can execute there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from test_repack_k import cpu_flags

ROOT = Path(__file__).resolve().parents[1]
HERE = ROOT / "tests" / "amx_emulation"
SOURCES = [HERE / "check.cpp"] + [ROOT / "csrc" / "cpu" / f for f in ("repack.cpp", "repack_k.cpp", "repack_k_amx.cpp")]
FLAGS = ["-std=c++20", "-O1", "-march=x86-64-v4", "-mavx512vnni", "-mamx-tile", "-mamx-int8", "-fopenmp"]
TYPES = {12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}


def _cpu_runs_it() -> bool:
    return {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_vnni"} <= cpu_flags()


@pytest.fixture(scope="module")
def program(tmp_path_factory) -> Path:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    assert cxx, "no C++ compiler (the package itself is built with one)"
    exe = tmp_path_factory.mktemp("amx") / "check"
    cmd = [cxx, *FLAGS, "-include", str(HERE / "tiles.h"), "-I", str(ROOT / "csrc"), *map(str, SOURCES), "-o", str(exe)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return exe


def test_amx_kernel_on_emulated_tiles_is_bitwise_the_vector_kernel(program):
    assert program.exists()
    if not _cpu_runs_it():
        return  # built for the AVX-512 target above; nothing of it can run on this CPU
    out = subprocess.run([str(program)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [list(map(int, line.split())) for line in out.stdout.strip().splitlines()]
    assert {r[0] for r in rows} == set(TYPES) and len(rows) == 15
    for qtype, k, n, nt, calls, diff in rows:
        case = f"{TYPES[qtype]} {k}x{n}, {nt} tokens"
        assert calls == 2, f"{case}: the tiles ran in {calls} of 2 calls"
        assert diff == 0, f"{case}: {diff} of {n * nt} outputs differ from the vector kernel"
