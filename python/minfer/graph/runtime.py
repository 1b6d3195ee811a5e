"""The glue the engine calls: build-time pipeline and the per-step calls.

    if not cache.try_reuse(params):
        runtime.install(cache, model.build_graph(params), params)
    cache.alloc.fill_input(cache.graph, "token_ids", ids)   # one pool.write each
    cache.execute()                                          # one _core.run per split
    logits = cache.alloc.copy_to_host(cache.graph.outputs[0])
"""

from __future__ import annotations

from minfer.graph.fusion import FusionPass
from minfer.graph.ir import ComputeGraph
from minfer.graph.lowering import Lowered, lower_graph


def preview(graph: ComputeGraph, cache, fuse: bool = True) -> int:
    """Assignment and fusion only: what --dump-graph shows. Returns the rewrite count.
    fuse=False skips the peephole pass (the unfused side of the identity tests)."""
    cache.scheduler.assign_backends(graph)
    return FusionPass().run(graph, cache.scheduler.by_id) if fuse else 0


def prepare(graph: ComputeGraph, cache, fuse: bool = True) -> tuple:
    """assign_backends -> FusionPass -> alloc_graph -> split -> lower (once per build)."""
    preview(graph, cache, fuse)
    cache.alloc.alloc_graph(graph)
    splits = cache.scheduler.split_graph(graph)
    lowered: Lowered = lower_graph(graph, splits, cache.alloc, cache.weights, cache.registry)
    return splits, lowered


def install(cache, graph: ComputeGraph, params, fuse: bool = True) -> ComputeGraph:
    """Make `graph` the cache's current graph. The old graph's buffers go back to the
    pools (the KV stays); a failure leaves the cache empty rather than half-built."""
    cache.invalidate()
    splits, lowered = prepare(graph, cache, fuse)
    cache.replace_graph(graph, params, lowered, splits)
    return graph
