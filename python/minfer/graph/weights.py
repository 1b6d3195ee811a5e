"""A model's weights by name: one `_core.WeightStore` plus the name -> handle map the
lowering resolves. Weights are registered by reference (the GGUF mmap), never copied."""

from __future__ import annotations

from typing import Optional

import numpy as np

from minfer.graph.ir import GraphError

GGML_F32 = 0


class WeightRegistry:
    def __init__(self, store=None) -> None:
        if store is None:
            from minfer import _core
            store = _core.WeightStore()
        self.store = store
        self._handles: dict = {}
        self._shapes: dict = {}

    def add(self, name: str, data: np.ndarray, ggml_type: int, ne0: int, ne1: int) -> int:
        """Register raw GGUF bytes (uint8, C-contiguous) of metadata shape [ne0, ne1].
        Re-registering a name is a no-op: rebuilds must not pay for weights again."""
        if name in self._handles:
            if self._shapes[name] != (int(ggml_type), int(ne0), int(ne1)):
                raise GraphError(f"weight {name!r} re-registered with a different type or shape")
            return self._handles[name]
        h = self.store.add(name, np.ascontiguousarray(data).view(np.uint8).reshape(-1), int(ggml_type),
                           int(ne0), int(ne1))
        self._handles[name] = h
        self._shapes[name] = (int(ggml_type), int(ne0), int(ne1))
        return h

    def add_f32(self, name: str, arr: np.ndarray) -> int:
        """An f32 tensor in memory order [ne1][ne0] (a weight [out][in], or a 1-D norm/bias)."""
        a = np.ascontiguousarray(arr, dtype=np.float32)
        ne0 = a.shape[-1] if a.ndim else 1
        return self.add(name, a.view(np.uint8).reshape(-1), GGML_F32, ne0, a.size // ne0)

    def handle(self, name: Optional[str], node_name: str = "?") -> int:
        if name is None:
            return -1
        try:
            return self._handles[name]
        except KeyError:
            raise GraphError(f"node {node_name!r} references weight {name!r}, which is not registered") from None

    def info(self, name: str) -> tuple:
        """(ggml_type, ne0, ne1) of a registered weight."""
        return self._shapes[name]

    def __contains__(self, name: str) -> bool:
        return name in self._handles

    def __len__(self) -> int:
        return len(self._handles)
