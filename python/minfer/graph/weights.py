"""A model's weights by name, device-free.

`WeightRegistry` records where each weight's bytes are on the host (a view into the
GGUF mmap, never a copy), with its GGUF type and shape, plus derived weights
(row concatenations such as q|k|v or gate|up, for fused ops). It never touches a
device: each backend gets its own `BoundWeights` from `registry.on(entry)`, whose
store the backend created (`entry.open_weights()`: zero-copy references on the CPU,
an upload on a device). A weight is registered on a backend the first time a plan
for that backend names it, and a derived weight is built there once, on first use.

A backend store has: add(name, data, ggml_type, ne0, ne1) -> handle and
add_concat_rows(name, parts) -> handle, where parts are (data, ggml_type, ne0, ne1)
in row order; both raise MinferError naming the tensor for a type it cannot run.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from minfer.errors import UnsupportedModelError
from minfer.graph.ir import GraphError
from minfer.io.gguf_file import ggml_type_name

GGML_F32 = 0


class WeightRegistry:
    def __init__(self) -> None:
        self._src: dict = {}       # name -> (uint8 data, ggml_type, ne0, ne1)
        self._derived: dict = {}   # name -> part names, rows stacked in this order
        self._bound: dict = {}     # (backend id, name) -> BoundWeights

    def add(self, name: str, data: np.ndarray, ggml_type: int, ne0: int, ne1: int) -> None:
        """Record raw GGUF bytes (C-contiguous) of metadata shape [ne0, ne1]. Re-adding a
        name with the same type and shape is a no-op: rebuilds must not pay for weights again."""
        key = (int(ggml_type), int(ne0), int(ne1))
        if name in self._src or name in self._derived:
            if self.info(name) != key:
                raise GraphError(f"weight {name!r} re-registered with a different type or shape")
            return
        self._src[name] = (np.ascontiguousarray(data).view(np.uint8).reshape(-1),) + key

    def add_f32(self, name: str, arr: np.ndarray) -> None:
        """An f32 tensor in memory order [ne1][ne0] (a weight [out][in], or a 1-D norm/bias)."""
        a = np.ascontiguousarray(arr, dtype=np.float32)
        ne0 = a.shape[-1] if a.ndim else 1
        self.add(name, a.view(np.uint8).reshape(-1), GGML_F32, ne0, a.size // ne0)

    def add_concat_rows(self, name: str, parts: list) -> None:
        """A derived weight whose rows are those of `parts` stacked in order (all of one type
        and one row width). Recorded here; each backend builds it once, when first used."""
        missing = [p for p in parts if p not in self._src]
        if missing:
            raise GraphError(f"derived weight {name!r}: parts {missing} are not registered weights")
        infos = [self.info(p) for p in parts]
        if not parts or any(i[:2] != infos[0][:2] for i in infos):
            raise GraphError(f"derived weight {name!r}: parts {parts} must share one type and row width")
        if name in self._src or name in self._derived:
            if self._derived.get(name) != list(parts):
                raise GraphError(f"weight {name!r} re-registered with different parts")
            return
        self._derived[name] = list(parts)

    def info(self, name: str) -> tuple:
        """(ggml_type, ne0, ne1) of a weight."""
        if name in self._src:
            return self._src[name][1:]
        if name in self._derived:
            infos = [self.info(p) for p in self._derived[name]]
            return infos[0][0], infos[0][1], sum(i[2] for i in infos)
        raise GraphError(f"weight {name!r} is not registered")

    def __contains__(self, name: str) -> bool:
        return name in self._src or name in self._derived

    def __len__(self) -> int:
        return len(self._src) + len(self._derived)

    def check_types(self, entries: list) -> None:
        """Refuse, up front, a weight whose type no participating backend executes."""
        for name, (_, t, _, _) in self._src.items():
            if not any(t in e.weight_types for e in entries):
                sup = sorted({ggml_type_name(x) for e in entries for x in e.weight_types})
                raise UnsupportedModelError(
                    f"tensor {name} has type {ggml_type_name(t)}, which no selected backend "
                    f"({', '.join(e.name for e in entries)}) supports (supported: {', '.join(sup)})")

    def on(self, entry) -> "BoundWeights":
        """This registry's weights on one backend (created once per backend)."""
        key = (entry.id, entry.name)
        b = self._bound.get(key)
        if b is None:
            if entry.open_weights is None:
                raise GraphError(f"backend {entry.name!r} cannot hold weights in this build")
            b = self._bound[key] = BoundWeights(self, entry, entry.open_weights())
        return b


class BoundWeights:
    """One backend's weights: its store and the name -> handle map the lowering resolves."""

    def __init__(self, registry: WeightRegistry, entry, store) -> None:
        self.registry, self.entry, self.store = registry, entry, store
        self._handles: dict = {}

    def handle(self, name: Optional[str], node_name: str = "?") -> int:
        if name is None:
            return -1
        h = self._handles.get(name)
        if h is None:
            reg = self.registry
            if name in reg._src:
                h = self.store.add(name, *reg._src[name])
            elif name in reg._derived:
                h = self.store.add_concat_rows(name, [reg._src[p] for p in reg._derived[name]])
            else:
                raise GraphError(f"node {node_name!r} references weight {name!r}, which is not registered")
            self._handles[name] = h
        return h

    def __contains__(self, name: str) -> bool:
        return name in self._handles

    def __len__(self) -> int:
        return len(self._handles)
