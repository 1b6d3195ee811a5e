"""Backends: the CPU (and, when compiled, CUDA/Metal) entries the graph runs on."""

from __future__ import annotations

import os


def default_threads() -> int:
    """Physical cores available to this process (SMT siblings count once): the one
    answer to "how many CPU threads" for the engine, the tools and the benchmarks."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    cores = set()
    for c in cpus:
        try:
            with open(f"/sys/devices/system/cpu/cpu{c}/topology/core_id") as f:
                core = f.read().strip()
            with open(f"/sys/devices/system/cpu/cpu{c}/topology/physical_package_id") as f:
                pkg = f.read().strip()
            cores.add((pkg, core))
        except OSError:
            cores.add(("?", str(c)))
    return max(1, len(cores))
