"""BackendScheduler: capability-driven assignment, contiguous splits, and the
execute loop over lowered splits (one backend call per split).

Execution follows build order. At a split boundary the copies of the split's
cross-backend inputs are enqueued (phase 1) and each is awaited once at its
consumer's first read (phase 2); the allocator refuses an un-awaited staged read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from minfer.errors import BackendError
from minfer.graph.ir import KV_BOUND, ComputeGraph


@dataclass
class Split:
    backend: int
    node_range: tuple                              # [start, end) in graph.nodes
    inputs: list = field(default_factory=list)     # nodes produced on another backend, staged in
    outputs: list = field(default_factory=list)    # nodes read by a split on another backend


class BackendScheduler:
    def __init__(self, entries: list) -> None:
        self.entries = sorted(entries, key=lambda e: e.order_key)
        self.by_id = {e.id: e for e in self.entries}

    def assign_backends(self, graph: ComputeGraph) -> None:
        """Each unassigned node goes to the first participating backend (priority
        order) whose matrix accepts it. No taker is an error, never a fallback."""
        for node in graph.nodes:
            if node.backend is not None:
                if node.backend not in self.by_id:
                    raise BackendError(f"node {node.id} ({node.name}) is pinned to backend {node.backend}, "
                                       f"which is not participating ({self._names()})")
                continue
            for e in self.entries:
                if e.supports_op(node):
                    node.backend = e.id
                    break
            else:
                raise BackendError(f"no participating backend ({self._names()}) supports node {node.id} "
                                   f"({node.name}): op {node.op} {node.out_dtype.value}")

    def _names(self) -> str:
        return ", ".join(e.name for e in self.entries)

    def split_graph(self, graph: ComputeGraph) -> list:
        """Cut wherever the (live) backend changes. Dead nodes never cut a split."""
        splits: list = []
        start = 0
        cur: Optional[int] = None
        for node in graph.nodes:
            if node.id in graph.dead:
                continue
            if cur is None:
                cur = node.backend
            elif node.backend != cur:
                splits.append(Split(cur, (start, node.id)))
                start, cur = node.id, node.backend
        if cur is not None:
            splits.append(Split(cur, (start, len(graph.nodes))))
        split_of = {}
        for k, sp in enumerate(splits):
            for i in range(*sp.node_range):
                split_of[i] = k
        for k, sp in enumerate(splits):
            ins = set()
            for i in range(*sp.node_range):
                if i in graph.dead:
                    continue
                for s in graph.nodes[i].src:
                    prod = graph.nodes[s]
                    # KV-bound values are never staged: attention must share its KV's backend.
                    if prod.backend != sp.backend and prod.op not in KV_BOUND:
                        ins.add(s)
            sp.inputs = sorted(ins)
            for s in sp.inputs:
                out = splits[split_of[s]].outputs
                if s not in out:
                    out.append(s)
        for sp in splits:
            sp.outputs.sort()
        return splits

    def execute(self, graph: ComputeGraph, alloc, lowered, on_step: Optional[Callable] = None) -> None:
        """Run every split's plan once (or step by step with on_step(node, split) for tracing)."""
        alloc.begin_execute()
        for ls in lowered.splits:
            for key in ls.staged:
                alloc.enqueue_cross(key)
            if on_step is None:
                # The whole plan is one call, so its first read of every staged input is now.
                for key in ls.staged:
                    alloc.await_cross(key)
                    alloc.cross_input(key)
                if ls.n_steps:
                    ls.run()
            else:
                for j, nid in enumerate(ls.step_nodes):
                    for key in ls.first_read.get(j, ()):
                        alloc.await_cross(key)
                        alloc.cross_input(key)
                    ls.run(j, j + 1)
                    on_step(graph.nodes[nid], ls)
        alloc.finish_execute()
