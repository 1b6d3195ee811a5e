"""The backend registry: names, fixed ids, priorities, capability matrices, pool hooks.

Ids are a file-format contract (cpu=0, metal=1, cuda=2; later ones are appended,
never renumbered). Priority decides assignment (Metal 300 > CUDA 200 > CPU 100).
Every ordering here is by (priority desc, id) so nothing depends on dict order.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

from minfer.errors import BackendError

CPU_ID, METAL_ID, CUDA_ID = 0, 1, 2
BUILTIN_IDS = (CPU_ID, METAL_ID, CUDA_ID)
ENV_BACKENDS = "MINFER_BACKENDS"


@dataclass(frozen=True)
class BackendEntry:
    """One backend as the graph sees it. The capability functions are the only
    place that says what a backend can run; the scheduler and fusion pass ask them."""

    name: str
    id: int
    priority: int
    compiled: bool
    usable: bool
    unusable_reason: str
    supports_op: Callable[[Any], bool]          # (CNode) -> bool
    supports_fused: Callable[[str], bool]       # ("swiglu") -> bool
    supports_attn_span: Callable[[], bool]
    make_pool: Callable[[], Any]                # () -> a pool with the _core.Pool surface
    lower_node: Optional[Callable] = None       # (node, graph, LowerCtx) -> list of step tuples
    run_plan: Optional[Callable] = None         # (plan, pool, store, n_threads, begin, end) -> None
    copy_cross: Optional[Callable] = None       # (src_pool, src_id, dst_pool, dst_id, nbytes) -> ticket
    await_cross: Optional[Callable] = None      # (ticket) -> None; one call per copy
    kv_types: tuple = ()                        # KV element types it can hold ("f16", "f32"), default first

    @property
    def order_key(self) -> tuple:
        return (-self.priority, self.id)


def uncompiled_entry(name: str, bid: int, priority: int) -> BackendEntry:
    """A backend known to the registry (fixed id and priority) whose code is not in this
    build: naming it is a clear refusal, and no node is ever assigned to it."""

    def never(*_args, **_kw) -> bool:
        return False

    def no_pool():
        raise BackendError(f"backend {name!r} is not compiled into this build")

    return BackendEntry(name=name, id=bid, priority=priority, compiled=False, usable=False,
                        unusable_reason="not compiled into this build", supports_op=never,
                        supports_fused=never, supports_attn_span=never, make_pool=no_pool)


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

    def by_id(self, bid: int) -> BackendEntry:
        try:
            return self._by_id[bid]
        except KeyError:
            raise BackendError(f"no backend with id {bid}") from None

    def name_of(self, bid: Optional[int]) -> str:
        if bid is None:
            return "unassigned"
        e = self._by_id.get(bid)
        return e.name if e else f"backend#{bid}"

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
