"""The CMake build options (docs/configuration.md) do what they say, read from a configure
of this tree (no build) through its compile commands: MINFER_NATIVE adds -march=native to
the CPU kernels (where the compiler takes it), MINFER_CUDA=OFF builds no CUDA, and
MINFER_CUDA_TIMELINE compiles the timeline marks into the CUDA kernels when the CUDA
backend is built (AUTO: wherever a CUDA compiler and cuBLAS are found, as in CI)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def configure(build: Path, *defs: str) -> tuple[str, list, str]:
    """(configure output, compile commands, CMakeCache.txt) of a configure with defs."""
    cmake = shutil.which("cmake")
    assert cmake, "cmake is a build requirement"
    pb = subprocess.run([sys.executable, "-m", "pybind11", "--cmakedir"], capture_output=True, text=True,
                        check=True).stdout.strip()
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    r = subprocess.run([cmake, "-S", str(ROOT), "-B", str(build), *gen, "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON",
                        f"-Dpybind11_DIR={pb}", f"-DPython_EXECUTABLE={sys.executable}", *defs],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout, json.loads((build / "compile_commands.json").read_text()), (build / "CMakeCache.txt").read_text()


def _cmds(cmds: list, part: str) -> list:
    return [c["command"] for c in cmds if part in c["file"]]


def test_native_and_cuda_off(tmp_path):
    out, cmds, _ = configure(tmp_path / "off", "-DMINFER_CUDA=OFF", "-DMINFER_NATIVE=OFF")
    assert "minfer CUDA backend: OFF (MINFER_CUDA=OFF)" in out
    assert _cmds(cmds, "/csrc/cpu/") and not any("-march=native" in c for c in _cmds(cmds, "/csrc/cpu/"))
    assert not any(c["file"].endswith(".cu") for c in cmds)
    out, cmds, cache = configure(tmp_path / "off", "-DMINFER_NATIVE=ON")
    native = "minfer_has_march_native:INTERNAL=1" in cache
    assert all(("-march=native" in c) == native for c in _cmds(cmds, "/csrc/cpu/"))
    assert native or sys.platform != "linux", "g++ / clang on Linux take -march=native"


def test_cuda_timeline_marks_only_when_asked(tmp_path):
    out, cmds, _ = configure(tmp_path / "auto", "-DMINFER_CUDA=AUTO", "-DMINFER_NATIVE=OFF", "-DMINFER_CUDA_TIMELINE=ON")
    built = "minfer CUDA backend: ON" in out
    cu = [c for c in cmds if c["file"].endswith(".cu")]
    assert bool(cu) == built, out
    assert all("MINFER_CUDA_TIMELINE=1" in c["command"] for c in cu)
    _, cmds, _ = configure(tmp_path / "auto", "-DMINFER_CUDA_TIMELINE=OFF")
    assert not any("MINFER_CUDA_TIMELINE" in c["command"] for c in cmds)
