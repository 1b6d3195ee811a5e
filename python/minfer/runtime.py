"""What the engine holds between forward passes: the model's weights registered with
the compiled core (by reference into the GGUF mmap), and the graph cache.

A forward pass is §11.1's reuse kernel: params -> reuse or build+install -> fill the
inputs -> run the plans -> read the logits. A reused decode step is a handful of
Python->C++ calls: three input writes, one run per split, one read.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from minfer import _core
from minfer.graph import runtime as graph_runtime
from minfer.graph.cache import GraphCache
from minfer.graph.export import write_dot
from minfer.graph.params import CParams, GraphParams, GraphType
from minfer.graph.trace import trace_enabled, trace_summary
from minfer.graph.weights import WeightRegistry


def register_weights(model, gguf, weights: WeightRegistry) -> None:
    for name in model.expected_tensors():
        t = model.tensors[name]
        ne0 = int(t.shape[0])
        ne1 = int(np.prod(t.shape[1:])) if len(t.shape) > 1 else 1
        weights.add(name, gguf.tensor_data(name), t.type, ne0, ne1)


class Runtime:
    def __init__(self, model, gguf, n_threads: int, backends: list[str] | None):
        self.model = model
        self.weights = WeightRegistry()
        register_weights(model, gguf, self.weights)
        self.cache = GraphCache(self.weights, backends=backends, n_threads=n_threads)
        self.builds = 0  # graph builds so far (reuse is observable in tests)
        self._key = None
        self._graph = None
        self._argmax_args = None
        self._tail_cache: dict[tuple[int, int], np.ndarray] = {}
        self.tracer = None  # a minfer.tools.trace.Tracer (or profiler) replaces execute() when set

    @property
    def backend_names(self) -> list[str]:
        return [self.cache.registry.name_of(e.id).upper() for e in self.cache.scheduler.entries]

    def params(self, n_tokens: int, n_out: int, n_ctx: int) -> GraphParams:
        gtype = GraphType.Decode if n_tokens == 1 else GraphType.Prefill
        # The CPU builds no decode-fused QKV/FFN nodes (it has no such kernels); a GPU
        # backend joining would flip gpu and the fusion flags, and so rebuild.
        return GraphParams(n_tokens=n_tokens, n_out=n_out, gtype=gtype, cparams=CParams(n_ctx=n_ctx))

    def forward(self, ids: np.ndarray, n_past: int, n_out: int, n_ctx: int, reuse: bool = True,
                fuse: bool = True, copy: bool = True) -> np.ndarray:
        """Logits [n_out, n_vocab]; copy=False returns a read-only view that the next
        forward overwrites (the generation loop samples before it steps again)."""
        nt = int(ids.size)
        cache = self.cache
        key = (nt, n_out, n_ctx, fuse)
        # Params are a pure function of this key: a decode step that matches the graph
        # installed last skips building them (the cheapest possible reuse check).
        if not (reuse and key == self._key and cache.graph is self._graph):
            params = self.params(nt, n_out, n_ctx)
            if not (reuse and cache.try_reuse(params)):
                graph = self.model.build_graph(params)
                graph_runtime.install(cache, graph, params, fuse=fuse)
                self.builds += 1
                if trace_enabled():
                    sys.stderr.write(trace_summary(graph, cache.splits, cache.registry) + "\n")
            self._key, self._graph = key, cache.graph
            out = cache.graph.nodes[cache.graph.outputs[0]]
            ref = cache.alloc.buffer(out.id)
            self._argmax_args = (cache.alloc.pools[ref.backend], ref.id, out.out_shape[0], out.n_rows)
        g = cache.graph
        alloc = cache.alloc
        alloc.fill_input(g, "token_ids", ids)
        alloc.fill_input(g, "positions", np.arange(n_past, n_past + nt, dtype=np.int32))
        if n_out < nt:
            alloc.fill_input(g, "tail_ids", np.arange(nt - n_out, nt, dtype=np.int32))
        if self.tracer is None:
            cache.execute()
        else:
            self.tracer.execute(cache)   # MINFER_TRACE / viz: step by step, reading each node
        return alloc.copy_to_host(g.outputs[0]) if copy else alloc.host_view(g.outputs[0])

    def argmax_last(self) -> int:
        """Greedy pick from the last logits row, scanned in C++ by the threads that wrote it."""
        pool, buf, n, rows = self._argmax_args
        if rows != 1 or not hasattr(pool, "view"):
            return int(np.argmax(self.cache.alloc.copy_to_host(self._graph.outputs[0])[-1]))
        return int(_core.argmax(pool, buf, n, self.cache.n_threads))

    def preview_graph(self, n_tokens: int, n_ctx: int, decode: bool, fuse: bool = True):
        """The graph a forward of this shape would run, assigned and fused, not installed.
        Built through self.params and graph_runtime.preview, the very calls forward uses,
        so an export shows the live fusion and backend assignment (tests pin it)."""
        nt = 1 if decode else n_tokens
        graph = self.model.build_graph(self.params(nt, 1, n_ctx))
        graph_runtime.preview(graph, self.cache, fuse=fuse)
        return graph

    def dump_graph(self, path: str | Path, n_tokens: int, n_ctx: int, decode: bool, fuse: bool = True) -> None:
        write_dot(self.preview_graph(n_tokens, n_ctx, decode, fuse), str(path), self.cache.registry)
