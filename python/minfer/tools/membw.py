"""STREAM-style memory-bandwidth probe, used by `minfer bench` to say how close decode
gets to the memory wall.

Decode of a small quantized model is bandwidth-bound: every token streams all weights
once. So the useful yardstick for a tok/s number is "bytes of weights per token x tok/s
/ bytes/s the machine can move", and that denominator has to be measured on the same
machine, in the same run, because it moves with whatever else is using the memory bus.

The probe is plain NumPy. One thread cannot saturate the memory controllers on most
CPUs, so the arrays are split into per-thread slices and each thread runs the kernel on
its own slice; NumPy releases the GIL inside copies and simple ufunc loops, so the
threads really run in parallel. Byte counts follow STREAM's convention (copy moves 2
arrays' worth, triad 3, read 1; write-allocate traffic is not counted).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import numpy as np

from minfer.backends import default_threads

# Big enough that the working set is far outside any L3 we are likely to meet
# (32 MiB here); small enough that the probe stays well under a second per pass.
_MIN_ARRAY_BYTES = 64 << 20
# Triad is done in cache-sized chunks so the scaled temporary never goes to memory.
_CHUNK_ELEMS = 32 << 10


@dataclass(frozen=True)
class BandwidthReport:
    copy_bytes_per_s: float
    triad_bytes_per_s: float
    read_bytes_per_s: float
    n_threads: int
    array_bytes: int

    @property
    def best(self) -> float:
        return max(self.copy_bytes_per_s, self.triad_bytes_per_s, self.read_bytes_per_s)


def _l3_bytes() -> int:
    # sysfs is the cheap, dependency-free source on Linux; elsewhere assume a big L3.
    base = "/sys/devices/system/cpu/cpu0/cache"
    best = 0
    try:
        for entry in os.listdir(base):
            if not entry.startswith("index"):
                continue
            with open(os.path.join(base, entry, "size")) as f:
                text = f.read().strip()
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
            digits = text[:-1] if text[-1:].isalpha() else text
            best = max(best, int(digits) * mult)
    except (OSError, ValueError):
        pass
    return best or (64 << 20)




def _run_parallel(fn, n_threads: int) -> float:
    """Runs fn(i) on n_threads threads released together; returns wall seconds."""
    barrier = threading.Barrier(n_threads + 1)
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        barrier.wait()
        try:
            fn(i)
        except BaseException as e:  # surfaced below: a probe must not fail silently
            errors.append(e)
        barrier.wait()

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(n_threads)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    barrier.wait()
    dt = time.perf_counter() - t0
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return dt


def measure(n_threads: int | None = None, array_bytes: int | None = None,
            repeats: int = 5) -> BandwidthReport:
    """Best-of-`repeats` copy and triad bandwidth in bytes/s."""
    n_threads = max(1, int(n_threads or default_threads()))
    if array_bytes is None:
        array_bytes = max(_MIN_ARRAY_BYTES, 4 * _l3_bytes())
    n = max(array_bytes // 8, n_threads * _CHUNK_ELEMS)
    n -= n % n_threads
    a = np.ones(n, dtype=np.float64)
    b = np.full(n, 2.0)
    c = np.zeros(n)  # touched now, so page faults are not timed
    per = n // n_threads
    slices = [slice(i * per, (i + 1) * per) for i in range(n_threads)]
    scratch = [np.empty(_CHUNK_ELEMS) for _ in range(n_threads)]

    def copy(i: int) -> None:
        np.copyto(c[slices[i]], a[slices[i]])

    def triad(i: int) -> None:
        s = slices[i]
        tmp = scratch[i]
        for lo in range(s.start, s.stop, _CHUNK_ELEMS):
            hi = min(lo + _CHUNK_ELEMS, s.stop)
            t = tmp[: hi - lo]
            np.multiply(c[lo:hi], 3.0, out=t)
            np.add(b[lo:hi], t, out=a[lo:hi])

    def read(i: int) -> None:
        # Decode only reads weights, and read-only streams usually go faster than
        # copy. A max reads the slice once with vectorized code on this thread alone:
        # np.dot, used before, hands a large vector to BLAS threads, so a "1-thread"
        # probe read with every core (61.8 GB/s on a 16-core Xeon).
        np.maximum.reduce(b[slices[i]])

    nbytes = n * 8
    best_copy = best_triad = best_read = 0.0
    for _ in range(max(1, repeats)):
        best_copy = max(best_copy, 2 * nbytes / _run_parallel(copy, n_threads))
        best_triad = max(best_triad, 3 * nbytes / _run_parallel(triad, n_threads))
        best_read = max(best_read, nbytes / _run_parallel(read, n_threads))
    return BandwidthReport(best_copy, best_triad, best_read, n_threads, nbytes)


def measure_bandwidth(n_threads: int | None = None, repeats: int = 5) -> float:
    """The machine's sustainable memory bandwidth in bytes/s (best of copy, triad, read)."""
    return measure(n_threads=n_threads, repeats=repeats).best
