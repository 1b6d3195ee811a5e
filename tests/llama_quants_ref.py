"""llama.cpp's own quantizers, as a reference for `minfer quantize` (tests/test_quantize.py,
bench/quantize_bench.py).

On first use this fetches the `llama-cpp-python` source distribution from the package
registry with pip (it vendors llama.cpp under vendor/llama.cpp), unpacks only ggml's
headers and ggml/src/ggml-quants.c, and compiles that one C file with gcc, plus a tiny
shim for the four ggml.c helpers it calls (ggml_abort, ggml_row_size, ggml_type_size,
ggml_type_name), into a shared library that ctypes loads. Everything is cached under
$MINFER_CACHE (default ~/.cache/minfer)/llama-ref/<version>/, so later runs reuse it.

The library is compiled as llama.cpp's ggml-base is (-O3, no -march) and with
-ffp-contract=off, so no FMA contraction changes a rounding on any host.

    python tests/llama_quants_ref.py          # fetch + build now, print the library path
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np

VERSION = "0.3.36"  # llama-cpp-python release whose vendored llama.cpp is the reference
PACKAGE = "llama-cpp-python"

# name -> (ggml type id, elements per block, bytes per block)
TYPES = {
    "Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22), "Q5_1": (7, 32, 24),
    "Q8_0": (8, 32, 34), "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176), "Q6_K": (14, 256, 210),
}

_SHIM = r"""
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include "ggml.h"

void ggml_abort(const char * file, int line, const char * fmt, ...) {
    va_list ap; va_start(ap, fmt);
    fprintf(stderr, "ggml_abort %s:%d: ", file, line); vfprintf(stderr, fmt, ap); fputc('\n', stderr);
    va_end(ap); abort();
}
static void sizes(enum ggml_type t, size_t * bs, size_t * ts) {
    switch ((int) t) {
        case GGML_TYPE_F32:  *bs = 1;   *ts = 4;   return;
        case GGML_TYPE_F16:  *bs = 1;   *ts = 2;   return;
        case GGML_TYPE_BF16: *bs = 1;   *ts = 2;   return;
        case GGML_TYPE_Q4_0: *bs = 32;  *ts = 18;  return;
        case GGML_TYPE_Q4_1: *bs = 32;  *ts = 20;  return;
        case GGML_TYPE_Q5_0: *bs = 32;  *ts = 22;  return;
        case GGML_TYPE_Q5_1: *bs = 32;  *ts = 24;  return;
        case GGML_TYPE_Q8_0: *bs = 32;  *ts = 34;  return;
        case GGML_TYPE_Q8_1: *bs = 32;  *ts = 36;  return;
        case GGML_TYPE_Q2_K: *bs = 256; *ts = 84;  return;
        case GGML_TYPE_Q3_K: *bs = 256; *ts = 110; return;
        case GGML_TYPE_Q4_K: *bs = 256; *ts = 144; return;
        case GGML_TYPE_Q5_K: *bs = 256; *ts = 176; return;
        case GGML_TYPE_Q6_K: *bs = 256; *ts = 210; return;
        case GGML_TYPE_Q8_K: *bs = 256; *ts = 292; return;
        default: fprintf(stderr, "llama_quants_ref shim: type %d not sized\n", (int) t); abort();
    }
}
size_t ggml_type_size(enum ggml_type t) { size_t bs, ts; sizes(t, &bs, &ts); return ts; }
size_t ggml_row_size(enum ggml_type t, int64_t ne) { size_t bs, ts; sizes(t, &bs, &ts); return ts * ne / bs; }
const char * ggml_type_name(enum ggml_type t) { (void) t; return "?"; }
"""

_CFLAGS = ["-O3", "-DNDEBUG", "-fPIC", "-std=gnu11", "-ffp-contract=off", "-w"]


def cache_dir() -> Path:
    root = os.environ.get("MINFER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "minfer")
    return Path(root) / "llama-ref" / VERSION


def _log(msg: str) -> None:
    sys.stderr.write(f"llama_quants_ref: {msg}\n")


def sdist() -> Path:
    """The llama-cpp-python source distribution, fetched through pip once."""
    d = cache_dir()
    found = sorted(d.glob("llama_cpp_python-*.tar.gz"))
    if found:
        return found[0]
    d.mkdir(parents=True, exist_ok=True)
    _log(f"pip download {PACKAGE}=={VERSION} (source distribution) into {d}")
    with tempfile.TemporaryDirectory(dir=d) as tmp:
        # --no-binary for this package only: its build backend's own dependencies may come
        # as wheels (forcing those to source too would build CMake from source).
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", PACKAGE,
                        "-q", "-d", tmp, f"{PACKAGE}=={VERSION}"], check=True)
        got = sorted(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if not got:
            raise RuntimeError(f"pip download of {PACKAGE}=={VERSION} produced no source distribution")
        dest = d / got[0].name
        os.replace(got[0], dest)
    return dest


def llama_cpp_dir() -> Path:
    """vendor/llama.cpp of the sdist, unpacked as far as the reference needs: ggml's
    headers, ggml-quants.c, and (for the benchmark's llama-quantize build) everything when
    full=True is asked through unpack_full()."""
    d = cache_dir() / "src"
    marker = d / "ggml" / "src" / "ggml-quants.c"
    if marker.exists():
        return d
    want = ("ggml/include/", "ggml/src/ggml-quants.c", "ggml/src/ggml-quants.h", "ggml/src/ggml-common.h",
            "ggml/src/ggml-impl.h", "ggml/src/ggml-cpu/ggml-cpu-impl.h")
    _extract(lambda rel: rel.startswith(want), d)
    return d


def unpack_full() -> Path:
    """The whole vendored llama.cpp tree (bench/quantize_bench.py builds llama-quantize)."""
    d = cache_dir() / "llama.cpp"
    if (d / "CMakeLists.txt").exists():
        return d
    _extract(lambda rel: True, d)
    return d


def _extract(keep, dest: Path) -> None:
    prefix = None
    archive = sdist()
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".unpack-"))
    try:
        with tarfile.open(archive) as tf:
            members = []
            for m in tf.getmembers():
                parts = m.name.split("/", 1)
                if len(parts) < 2:
                    continue
                rel = parts[1]
                if not rel.startswith("vendor/llama.cpp/"):
                    continue
                rel = rel[len("vendor/llama.cpp/"):]
                if rel and keep(rel) and (m.isfile() or m.isdir()):
                    prefix = parts[0] + "/vendor/llama.cpp/"
                    members.append(m)
            if prefix is None:
                raise RuntimeError("the sdist has no vendor/llama.cpp")
            kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tf.extractall(tmp, members=members, **kwargs)
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp / prefix, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def library_path() -> Path:
    out = cache_dir() / "libggml_quants_ref.so"
    if out.exists():
        return out
    src = llama_cpp_dir()
    cc = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (gcc or cc) to build llama.cpp's ggml-quants.c")
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        shim = Path(tmp) / "shim.c"
        shim.write_text(_SHIM)
        so = Path(tmp) / out.name
        inc = ["-I", str(src / "ggml" / "include"), "-I", str(src / "ggml" / "src"),
               "-I", str(src / "ggml" / "src" / "ggml-cpu")]
        cmd = [cc, *_CFLAGS, "-shared", *inc, str(src / "ggml" / "src" / "ggml-quants.c"), str(shim),
               "-o", str(so), "-lm"]
        _log("compiling ggml-quants.c: " + " ".join(cmd[:8]) + " ...")
        subprocess.run(cmd, check=True)
        os.replace(so, out)
    return out


_LIB = None


def _c(type_name: str) -> str:
    """ggml's C spelling of a type in function names: q4_0, q4_K."""
    return type_name.lower().replace("_k", "_K")


def library() -> ctypes.CDLL:
    global _LIB
    if _LIB is None:
        lib = ctypes.CDLL(str(library_path()))
        f32p, vp = ctypes.POINTER(ctypes.c_float), ctypes.c_void_p
        for name in TYPES:
            fn = getattr(lib, f"quantize_{_c(name)}")
            fn.argtypes = [f32p, vp, ctypes.c_int64, ctypes.c_int64, f32p]
            fn.restype = ctypes.c_size_t
            deq = getattr(lib, f"dequantize_row_{_c(name)}")
            deq.argtypes = [vp, f32p, ctypes.c_int64]
            deq.restype = None
        _LIB = lib
    return _LIB


def quantize(type_name: str, x: np.ndarray) -> np.ndarray:
    """llama.cpp's quantize_<type>(src, dst, nrow, n_per_row, imatrix=NULL) — what
    llama-quantize runs per chunk without an importance matrix. F16 and BF16 are the
    round-to-nearest-even conversions (numpy's, and ggml's bit formula)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim == 1:
        x = x[None, :]
    rows, n = x.shape
    if type_name == "F16":
        return x.astype(np.float16).view(np.uint8).reshape(rows, -1)
    if type_name == "BF16":
        u = x.view(np.uint32).astype(np.uint64)
        nan = (u & 0x7FFFFFFF) > 0x7F800000
        b = np.where(nan, (u >> 16) | 64, (u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)
        return b.view(np.uint8).reshape(rows, -1)
    _, bs, ts = TYPES[type_name]
    out = np.zeros((rows, n // bs * ts), np.uint8)
    fn = getattr(library(), f"quantize_{_c(type_name)}")
    fn(x.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), out.ctypes.data, rows, n, None)
    return out


def dequantize(type_name: str, raw: np.ndarray, n: int) -> np.ndarray:
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    _, bs, ts = TYPES[type_name]
    rows = raw.size // (n // bs * ts)
    out = np.empty((rows, n), np.float32)
    getattr(library(), f"dequantize_row_{_c(type_name)}")(
        raw.ctypes.data, out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), rows * n)
    return out


if __name__ == "__main__":
    print(library_path())
