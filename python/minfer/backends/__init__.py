"""The backend registry: the composition root that knows every backend.

The graph layer never imports this package; whoever builds a GraphCache asks the
registry for the participating entries (`select_backends`) and passes them in.
Ids are a file-format contract (cpu=0, metal=1, cuda=2; later ones are appended,
never renumbered). Priority decides assignment (Metal 300 > CUDA 200 > CPU 100).
Every ordering here is by (priority desc, id) so nothing depends on dict order.
"""

from __future__ import annotations

import os
from typing import Optional

from minfer.errors import BackendError
from minfer.graph.backend import CPU_ID, CUDA_ID, METAL_ID, BackendEntry

__all__ = ["CPU_ID", "CUDA_ID", "METAL_ID", "ENV_BACKENDS", "BackendEntry", "Registry", "default_registry",
           "default_threads", "parse_backend_list", "select_backends"]

ENV_BACKENDS = "MINFER_BACKENDS"


class Registry:
    def __init__(self) -> None:
        self._by_id: dict = {}

    def register(self, entry: BackendEntry) -> None:
        if entry.id in self._by_id:
            raise BackendError(f"backend id {entry.id} is already registered ({self._by_id[entry.id].name})")
        if any(e.name == entry.name for e in self._by_id.values()):
            raise BackendError(f"backend name {entry.name!r} is already registered")
        self._by_id[entry.id] = entry

    def copy(self) -> "Registry":
        r = Registry()
        r._by_id = dict(self._by_id)
        return r

    def entries(self) -> list:
        """All entries in priority order (ties broken by id)."""
        return sorted(self._by_id.values(), key=lambda e: e.order_key)

    def by_name(self, name: str) -> BackendEntry:
        for e in self._by_id.values():
            if e.name == name:
                return e
        known = ", ".join(sorted(e.name for e in self._by_id.values()))
        raise BackendError(f"unknown backend {name!r} (known backends: {known})")

    def select_backends(self, names: Optional[list] = None) -> list:
        """The participating backends, in priority order.

        names None means: the MINFER_BACKENDS environment list if set, else every
        compiled, usable backend. Naming a backend that cannot run is a loud refusal
        that says which of the three reasons applies, never a silent skip."""
        if names is None:
            env = os.environ.get(ENV_BACKENDS, "").strip()
            names = parse_backend_list(env) if env else None
        if names is None:
            chosen = [e for e in self._by_id.values() if e.compiled and e.usable]
        else:
            chosen = []
            for n in names:
                e = self.by_name(n)
                if not e.compiled:
                    raise BackendError(f"backend {n!r} is not compiled into this build")
                if not e.usable:
                    raise BackendError(f"backend {n!r} is not usable on this machine: {e.unusable_reason}")
                if e not in chosen:
                    chosen.append(e)
        if not chosen:
            raise BackendError("no backend is available")
        return sorted(chosen, key=lambda e: e.order_key)


def parse_backend_list(text: str) -> list:
    """'cpu, cuda' -> ['cpu', 'cuda'] (the --backend / MINFER_BACKENDS syntax)."""
    names = [p.strip().lower() for p in text.split(",") if p.strip()]
    if not names:
        raise BackendError(f"empty backend list {text!r}")
    return names


_DEFAULT: Optional[Registry] = None


def default_registry() -> Registry:
    """The process registry with the built-in backends. Tests that add a backend
    should register into `default_registry().copy()` so nothing leaks across tests."""
    global _DEFAULT
    if _DEFAULT is None:
        from minfer.backends import cpu, cuda, metal
        r = Registry()
        for entry in (cpu.ENTRY, metal.ENTRY, cuda.ENTRY):
            r.register(entry)
        _DEFAULT = r
    return _DEFAULT


def select_backends(names: Optional[list] = None, registry: Optional[Registry] = None) -> list:
    return (registry or default_registry()).select_backends(names)


def default_threads() -> int:
    """Physical cores available to this process (SMT siblings count once): the one
    answer to "how many CPU threads" for the CPU backend's device, the tools and the
    benchmarks (the compiled core has no default of its own)."""
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
