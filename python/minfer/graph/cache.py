"""GraphCache: the current graph, the params it was built from, its lowered plans,
and the allocator, which outlives rebuilds because it holds the KV regions.

Reuse compares GraphParams only (never the nodes). A graph is replaced with a
fresh process-wide uid; a reused graph keeps its uid and its plans.

Besides the current graph, the cache keeps up to KEEP small graphs (at most
KEEP_MAX_TOKENS rows: a server's bucketed steps, session.Context.PAD_STEP) built and
allocated, keyed by their params: speculative decoding alternates single steps with
verification blocks of a few sizes, a server's batch moves with its load, and each
switch would otherwise rebuild and re-lower the whole model. Big prefill graphs are
released when replaced (their activations are large and rarely repeat).
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from typing import Callable, Optional

from minfer.errors import BackendError
from minfer.graph.alloc import GraphAllocator
from minfer.graph.backend import name_of
from minfer.graph.fusion import FusionPass
from minfer.graph.ir import ComputeGraph, GraphError
from minfer.graph.lowering import lower_graph
from minfer.graph.params import GraphParams
from minfer.graph.scheduler import BackendScheduler
from minfer.graph.weights import WeightRegistry

_uid_lock = threading.Lock()
_uids = itertools.count(1)


def next_uid() -> int:
    with _uid_lock:
        return next(_uids)


class GraphCache:
    # A server's bucketed shapes (session.Context.warm_buckets: 43 of them) and the
    # speculative blocks' sizes besides.
    KEEP = 48
    KEEP_MAX_TOKENS = 64

    def __init__(self, entries: list, weights: WeightRegistry, options: Optional[dict] = None) -> None:
        """entries: the participating backends, as the registry selected them (the graph
        never chooses). weights: the model's WeightRegistry. options: run settings each
        backend reads for itself when it opens its device or lowers a plan (the CPU reads
        "threads"; "fuse": False turns every backend's step merges off, the unfused side of
        the identity tests)."""
        if not entries:
            raise BackendError("no backend is available")
        for e in entries:
            if e.open_device is None:
                raise BackendError(f"backend {e.name!r} cannot execute plans in this build")
        weights.check_types(entries)
        self.scheduler = BackendScheduler(entries)
        opts = dict(options or {})
        self.options = opts
        self.alloc = GraphAllocator(self.scheduler.entries, {e.id: e.open_device(opts) for e in self.scheduler.entries})
        self.weights = weights
        self.graph: Optional[ComputeGraph] = None
        self.params: Optional[GraphParams] = None
        self.lowered = None
        self.splits: list = []
        self._kept: OrderedDict = OrderedDict()  # params -> (graph, lowered, splits, alloc state)

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
        self._set_aside(params)
        self.invalidate()
        self.preview(graph, fuse=params.cparams.fuse_swiglu if params is not None else True)
        self.alloc.alloc_graph(graph)
        splits = self.scheduler.split_graph(graph)
        lowered = lower_graph(graph, splits, self.alloc, self.weights, params, self.options)
        self.replace_graph(graph, params, lowered, splits)
        return graph

    def try_reuse(self, params: GraphParams) -> bool:
        if self.graph is not None and self.lowered is not None and self.params == params:
            return True
        kept = self._kept.pop(params, None)
        if kept is None:
            return False
        self._set_aside(params)
        graph, lowered, splits, state = kept
        self.alloc.attach(state)
        self.graph, self.params, self.lowered, self.splits = graph, params, lowered, splits
        return True

    def _set_aside(self, incoming: Optional[GraphParams]) -> None:
        """Keep the current graph for later if it is small, else free its buffers."""
        cur = self.params
        stale = self._kept.pop(incoming, None) if incoming is not None else None
        if stale is not None:
            self.alloc.release_state(stale[3])
        small = cur is not None and cur.n_tokens <= self.KEEP_MAX_TOKENS
        if self.graph is None or self.lowered is None or cur is None or cur == incoming or not small:
            self.alloc.release()
            return
        self._kept[cur] = (self.graph, self.lowered, self.splits, self.alloc.detach())
        while len(self._kept) > self.KEEP:
            self.alloc.release_state(self._kept.popitem(last=False)[1][3])

    def drop_kept(self) -> None:
        while self._kept:
            self.alloc.release_state(self._kept.popitem()[1][3])

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

    @property
    def entries(self) -> list:
        """The participating backends in priority order."""
        return self.scheduler.entries

    def name_of(self, bid: Optional[int]) -> str:
        return name_of(bid, self.scheduler.by_id)

    def current(self) -> Optional[ComputeGraph]:
        return self.graph

    def execute(self, on_step: Optional[Callable] = None, on_launch: Optional[Callable] = None,
                timed: bool = False) -> None:
        """One forward of the installed graph (BackendScheduler.execute: the hooks and
        timed are tracing's and profiling's)."""
        if self.graph is None or self.lowered is None:
            raise GraphError("no graph is installed (build one and call cache.install first)")
        self.scheduler.execute(self.graph, self.alloc, self.lowered, on_step, on_launch, timed)

    def reset_kv(self) -> None:
        """Forget the KV (and the graphs, whose plans point at the old regions)."""
        self.drop_kept()
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
