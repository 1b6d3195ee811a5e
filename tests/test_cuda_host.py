"""CUDA backend pieces that need no GPU: the build decision (MINFER_CUDA=AUTO/ON/OFF),
the registry entry's refusal, the fusion switches."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from pathlib import Path

import pytest

from minfer import _core
from minfer.backends import cuda
from minfer.errors import BackendError
from minfer.graph.params import CParams
from minfer.backends import default_registry

ROOT = Path(__file__).resolve().parent.parent


def _decide(mode: str, nvcc: bool, cublas: bool) -> tuple[str, str]:
    cmake = shutil.which("cmake")
    assert cmake, "cmake is a build requirement"
    out = subprocess.run([cmake, f"-DMODE={mode}", f"-DNVCC={int(nvcc)}", f"-DCUBLAS={int(cublas)}", "-P",
                          str(ROOT / "cmake" / "MinferCudaDecide.cmake")], capture_output=True, text=True, check=True)
    line = (out.stdout + out.stderr).strip().splitlines()[-1]
    build, reason = line.removeprefix("build=").split(";", 1)
    return build, reason


@pytest.mark.parametrize("nvcc,cublas,build", [(True, True, "ON"), (True, False, "OFF"), (False, True, "OFF"),
                                               (False, False, "OFF")])
def test_cmake_auto_builds_cuda_only_with_compiler_and_cublas(nvcc, cublas, build):
    got, reason = _decide("AUTO", nvcc, cublas)
    assert got == build
    if not nvcc:
        assert "nvcc" in reason
    if not cublas:
        assert "cuBLAS" in reason


def test_cmake_on_fails_naming_what_is_missing_and_off_never_builds():
    assert _decide("ON", True, True)[0] == "ON"
    b, r = _decide("ON", True, False)
    assert b == "ERROR" and "cuBLAS" in r
    assert _decide("OFF", True, True)[0] == "OFF"
    assert _decide("maybe", True, True)[0] == "ERROR"


def test_entry_matches_the_build_and_the_machine():
    e = cuda.ENTRY
    assert (e.id, e.priority, e.name) == (2, 200, "cuda")
    assert e.compiled == bool(_core.HAS_CUDA)
    if not e.compiled:
        assert not e.usable and "not compiled into this build" in e.unusable_reason
    elif not e.usable:
        n, why = _core.cuda_device_count()
        assert n == 0 and e.unusable_reason == why and why.startswith("no CUDA device visible")
    if not e.usable:
        with pytest.raises(BackendError, match="backend 'cuda' is not"):
            default_registry().select_backends(["cuda"])


def test_fusion_switches(monkeypatch):
    """MINFER_CUDA_FUSE (a diagnostic, docs/configuration.md): unset, 1 or all = every
    decode step merge; none or 0 = none; else a comma list, validated."""
    every = {"qkv", "ffn", "residual", "quant", "rope"}
    monkeypatch.delenv(cuda.ENV_FUSE, raising=False)
    assert cuda.fusions_from_env() == every
    for v in ("all", "1", " ALL "):
        monkeypatch.setenv(cuda.ENV_FUSE, v)
        assert cuda.fusions_from_env() == every
    monkeypatch.setenv(cuda.ENV_FUSE, "residual,quant")
    assert cuda.fusions_from_env() == {"residual", "quant"}
    monkeypatch.setenv(cuda.ENV_FUSE, "0")
    assert cuda.fusions_from_env() == frozenset()
    monkeypatch.setenv(cuda.ENV_FUSE, "none")
    assert cuda.fusions_from_env() == frozenset()
    monkeypatch.setenv(cuda.ENV_FUSE, "ffn, qkv")
    assert cuda.fusions_from_env() == {"ffn", "qkv"}
    for bad in ("qkv,bogus", "norm"):  # norm: the deleted norm fusion
        monkeypatch.setenv(cuda.ENV_FUSE, bad)
        with pytest.raises(BackendError, match="unknown fusion"):
            cuda.fusions_from_env()
    # The step merges are the CUDA backend's plan flags, read at lowering from the
    # cache's options and the variable: not graph parameters.
    monkeypatch.setenv(cuda.ENV_FUSE, "qkv,residual")
    assert cuda.plan_flags({}) == 1 | 4 and cuda.plan_flags({"fuse": True}) == 1 | 4
    monkeypatch.setenv(cuda.ENV_FUSE, "quant")
    assert cuda.plan_flags({}) == 8
    monkeypatch.setenv(cuda.ENV_FUSE, "rope")
    assert cuda.plan_flags({}) == 32
    monkeypatch.delenv(cuda.ENV_FUSE)
    assert cuda.plan_flags({}) == 1 | 2 | 4 | 8 | 32
    assert cuda.plan_flags({"fuse": False}) == 0
    assert not any(f.name.startswith("fuse_") and f.name != "fuse_swiglu" for f in dataclasses.fields(CParams))


def test_fusion_bits_match_the_executor_header():
    """Every FUSE_* bit in cuda/executor.h is the one plan_flags sets for that fusion."""
    import re
    text = (ROOT / "csrc" / "cuda" / "executor.h").read_text()
    bits = {k.lower(): int(v) for k, v in re.findall(r"FUSE_(\w+) = (\d+)", text)}
    assert bits == cuda._FLAG_BITS
