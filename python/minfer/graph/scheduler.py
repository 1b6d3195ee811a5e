"""BackendScheduler: capability-driven assignment, contiguous splits, and the
execute loop over lowered splits (one backend call per split).

Execution follows build order. At a split boundary the copies of the split's
cross-backend inputs are enqueued (phase 1) and each is awaited once at its
consumer's first read (phase 2); the allocator refuses an un-awaited staged read.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional

from minfer.errors import BackendError
from minfer.graph.ir import KV_BOUND, ComputeGraph


class Launch(NamedTuple):
    """One launch of a device split as it runs (tracing and profiling): the kernel's name
    (a step merge is one launch over several nodes), the live nodes it computes in build
    order, and its device time in ms (timed runs; else None)."""

    kernel: str
    nodes: tuple
    ms: Optional[float]


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

    def execute(self, graph: ComputeGraph, alloc, lowered, on_step: Optional[Callable] = None,
                on_launch: Optional[Callable] = None, timed: bool = False) -> None:
        """Run every split's plan once, or, for tracing and profiling, step by step:
        on_step(node, split) after each plan step. With on_launch, a split whose device
        runs its own launch program (ls.launches: CUDA's kernels, step merges included)
        runs that instead, launch by launch, and on_launch(Launch, split) follows each;
        timed=True times those launches on the device, and on_launch then comes once per
        launch after the split's run, with ms."""
        alloc.begin_execute()
        stepwise = on_step is not None or on_launch is not None
        for ls in lowered.splits:
            for key in ls.staged:
                alloc.enqueue_cross(key)
            if not stepwise or (on_launch is not None and ls.launches is not None):
                # The whole plan is one call, so its first read of every staged input is now.
                for key in ls.staged:
                    alloc.await_cross(key)
                    alloc.cross_input(key)
                if not ls.n_steps:
                    continue
                if not stepwise:
                    ls.run()
                    continue
                nodes = functools.partial(self._launch_nodes, graph, ls)
                if timed:
                    for kernel, steps, ms in ls.launches(timed=True):
                        on_launch(Launch(kernel, nodes(steps), ms), ls)
                else:
                    ls.launches(lambda k, kernel, steps, ls=ls, nodes=nodes:
                                on_launch(Launch(kernel, nodes(steps), None), ls))
            else:
                for j, nid in enumerate(ls.step_nodes):
                    for key in ls.first_read.get(j, ()):
                        alloc.await_cross(key)
                        alloc.cross_input(key)
                    ls.run(j, j + 1)
                    if on_step is not None:
                        on_step(graph.nodes[nid], ls)
        alloc.finish_execute()

    @staticmethod
    def _launch_nodes(graph: ComputeGraph, ls, steps) -> tuple:
        """The nodes of a launch's plan steps, each once (a node may lower to several steps)."""
        ids = sorted({ls.step_nodes[j] for j in steps})
        return tuple(graph.nodes[i] for i in ids)
