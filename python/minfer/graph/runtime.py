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


def preview(graph: ComputeGraph, cache) -> int:
    """Assignment and fusion only: what --dump-graph shows. Returns the rewrite count."""
    cache.scheduler.assign_backends(graph)
    return FusionPass().run(graph, cache.scheduler.by_id)


def prepare(graph: ComputeGraph, cache) -> tuple:
    """assign_backends -> FusionPass -> alloc_graph -> split -> lower (once per build)."""
    preview(graph, cache)
    cache.alloc.alloc_graph(graph)
    splits = cache.scheduler.split_graph(graph)
    lowered: Lowered = lower_graph(graph, splits, cache.alloc, cache.weights, cache.registry)
    return splits, lowered


def install(cache, graph: ComputeGraph, params) -> ComputeGraph:
    """Make `graph` the cache's current graph. The old graph's buffers go back to the
    pools (the KV stays); a failure leaves the cache empty rather than half-built."""
    cache.invalidate()
    splits, lowered = prepare(graph, cache)
    cache.replace_graph(graph, params, lowered, splits)
    return graph
