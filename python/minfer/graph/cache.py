"""GraphCache: the current graph, the params it was built from, its lowered plans,
and the allocator, which outlives rebuilds because it holds the KV regions.

Reuse compares GraphParams only (never the nodes). A graph is replaced with a
fresh process-wide uid; a reused graph keeps its uid and its plans.
"""

from __future__ import annotations

import itertools
import threading
from typing import Callable, Optional

from minfer.graph.alloc import GraphAllocator
from minfer.graph.fusion import FusionPass
from minfer.graph.ir import ComputeGraph, GraphError
from minfer.graph.lowering import lower_graph
from minfer.graph.params import GraphParams
from minfer.graph.registry import Registry, default_registry
from minfer.graph.scheduler import BackendScheduler

_uid_lock = threading.Lock()
_uids = itertools.count(1)


def next_uid() -> int:
    with _uid_lock:
        return next(_uids)


class GraphCache:
    def __init__(self, weights, backends: Optional[list] = None, registry: Optional[Registry] = None,
                 n_threads: Optional[int] = None) -> None:
        """weights: the model's WeightRegistry. backends: names to fence to (None:
        MINFER_BACKENDS, else every usable backend)."""
        self.registry = registry or default_registry()
        entries = self.registry.select_backends(backends)
        self.scheduler = BackendScheduler(entries)
        self.alloc = GraphAllocator(entries)
        self.weights = weights
        if n_threads is None:
            from minfer import _core
            n_threads = _core.default_threads()
        self.n_threads = max(1, int(n_threads))
        self.graph: Optional[ComputeGraph] = None
        self.params: Optional[GraphParams] = None
        self.lowered = None
        self.splits: list = []

    # -- build time: assign -> fuse -> allocate -> split -> lower, once per build --------
    def preview(self, graph: ComputeGraph, fuse: bool = True) -> int:
        """Assignment and fusion only: what the exporters show. Returns the rewrite count.
        fuse=False skips the peephole pass (the unfused side of the identity tests)."""
        self.scheduler.assign_backends(graph)
        return FusionPass().run(graph, self.scheduler.by_id) if fuse else 0

    def install(self, graph: ComputeGraph, params: GraphParams) -> ComputeGraph:
        """Make `graph` (built from `params`) the current graph. The old graph's buffers
        go back to the pools (the KV stays); a failure leaves the cache empty rather
        than half-built. Fusion follows params.cparams.fuse_swiglu, so the switch is
        part of the reuse identity."""
        self.invalidate()
        self.preview(graph, fuse=params.cparams.fuse_swiglu if params is not None else True)
        self.alloc.alloc_graph(graph)
        splits = self.scheduler.split_graph(graph)
        lowered = lower_graph(graph, splits, self.alloc, self.weights, self.registry)
        self.replace_graph(graph, params, lowered, splits)
        return graph

    def try_reuse(self, params: GraphParams) -> bool:
        if self.graph is not None and self.lowered is not None and self.params == params:
            return True
        return False

    def invalidate(self) -> None:
        self.graph = None
        self.params = None
        self.lowered = None
        self.splits = []

    def replace_graph(self, graph: ComputeGraph, params: GraphParams, lowered=None, splits=None) -> None:
        graph.uid = next_uid()
        self.graph = graph
        self.params = params
        self.lowered = lowered
        self.splits = list(splits or [])

    def current(self) -> Optional[ComputeGraph]:
        return self.graph

    def execute(self, on_step: Optional[Callable] = None) -> None:
        if self.graph is None or self.lowered is None:
            raise GraphError("no graph is installed (build one and call cache.install first)")
        self.scheduler.execute(self.graph, self.alloc, self.lowered, self.weights, self.n_threads, on_step)

    def reset_kv(self) -> None:
        """Forget the KV (and the graph, whose plans point at the old regions)."""
        self.invalidate()
        self.alloc.release()
        self.alloc.reset_kv()


def verify_structural(a: ComputeGraph, b: ComputeGraph) -> bool:
    """Debug check that two graphs built from equal params are the same topology:
    op with its payload (meta), shape, dtype and sources, node by node."""
    if len(a.nodes) != len(b.nodes) or a.inputs != b.inputs or a.outputs != b.outputs:
        return False
    for x, y in zip(a.nodes, b.nodes):
        if (x.op, x.meta, x.out_shape, x.out_dtype, x.src, x.name) != (y.op, y.meta, y.out_shape, y.out_dtype,
                                                                      y.src, y.name):
            return False
    return a.dead == b.dead
