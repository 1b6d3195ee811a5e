"""The host-side weight store every backend registers into: `_core.WeightStore` entries
by reference into the GGUF mmap (a device backend makes its device copy from them on
first use), refused by type when the backend has no kernel for it; derived row
concatenations are the only copies, built once."""

from __future__ import annotations

import numpy as np

from minfer import _core
from minfer.errors import UnsupportedModelError
from minfer.graph.ir import GraphError
from minfer.io.gguf_file import ggml_type_name


class HostWeights:
    def __init__(self, backend: str, types: frozenset) -> None:
        self.core = _core.WeightStore()
        self.backend, self.types = backend, types

    def _check(self, name: str, ggml_type: int) -> None:
        if int(ggml_type) not in self.types:
            raise UnsupportedModelError(f"tensor {name} has type {ggml_type_name(int(ggml_type))}, which backend "
                                        f"{self.backend} does not run")

    def add(self, name: str, data: np.ndarray, ggml_type: int, ne0: int, ne1: int) -> int:
        self._check(name, ggml_type)
        return self.core.add(name, data, int(ggml_type), int(ne0), int(ne1))

    def add_concat_rows(self, name: str, parts: list) -> int:
        """parts: (data, ggml_type, ne0, ne1) of one type and row width, stacked in order."""
        t, ne0 = int(parts[0][1]), int(parts[0][2])
        if any((int(p[1]), int(p[2])) != (t, ne0) for p in parts):
            raise GraphError(f"derived weight {name!r}: parts differ in type or row width")
        self._check(name, t)
        data = np.concatenate([p[0] for p in parts])   # rows are contiguous in GGUF layout [out][in]
        return self.core.add(name, data, t, ne0, sum(int(p[3]) for p in parts))
