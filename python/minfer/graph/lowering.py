"""Lowering: each split becomes one plan on its backend's device, once per graph build.

Buffer ids are resolved here through the allocator (node buffers, KV regions,
staging buffers for cross-backend inputs) and weight names through the model's
weights bound to that backend, so a reused graph re-runs its plans with no Python
per node. The plan itself (creation, validation, execution) belongs to the backend.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from minfer.errors import BackendError
from minfer.graph.backend import name_of
from minfer.graph.ir import KV_BOUND, ComputeGraph, GraphError


@dataclass
class LoweredSplit:
    split: object
    entry: object
    device: object
    plan: object
    run: object                                     # run(begin=0, end=-1): the plan, bound to its device
    step_nodes: list
    prepare: object = None                          # prepare(): the device readies the plan's weights now
    staged: list = field(default_factory=list)      # (node, backend) keys, in first-read order
    first_read: dict = field(default_factory=dict)  # step index -> staged keys first read there
    step: object = None                             # step(*input buffer ids, *values): fill one-int inputs + run, one call
    # launches(after=None, timed=False) -> [(kernel, steps, ms)]: a device's whole run
    # launched one launch at a time (tracing and profiling see the kernels a normal run
    # runs, step merges included); after(k, kernel, steps) follows launch k. None where
    # the backend runs the plan's steps as they are (the CPU).
    launches: object = None

    @property
    def n_steps(self) -> int:
        return len(self.step_nodes)


@dataclass
class Lowered:
    splits: list


class LowerCtx:
    """What a backend's lower_node may ask: buffer ids on its own backend."""

    def __init__(self, graph: ComputeGraph, alloc, weights, backend: int, names) -> None:
        """weights: the model's weights bound to this backend (BoundWeights)."""
        self.graph, self.alloc, self.weights, self.backend, self._names = graph, alloc, weights, backend, names
        self.staged: list = []
        self.first_read: dict = {}
        self.step = 0

    def _mismatch(self, node, what: str, other: int) -> BackendError:
        return BackendError(f"node {node.id} ({node.name}) runs in a {self._names(self.backend)} split but {what} "
                            f"lives on backend {self._names(other)}")

    def out(self, node) -> int:
        ref = self.alloc.buffer(node.id)
        if ref.backend != self.backend:
            raise self._mismatch(node, "its buffer", ref.backend)
        return ref.id

    def src(self, node, i: int) -> int:
        s = node.src[i]
        if s in self.graph.dead:
            raise GraphError(f"node {node.id} ({node.name}) reads node {s}, which was fused away")
        ref = self.alloc.buffer(s)
        if ref.backend == self.backend:
            return ref.id
        prod = self.graph.nodes[s]
        if prod.op in KV_BOUND:
            raise self._mismatch(node, f"its KV source {prod.name!r}", ref.backend)
        key = (s, self.backend)
        dst = self.alloc.stage(s, self.backend)
        if key not in self.staged:
            self.staged.append(key)
            self.first_read.setdefault(self.step, []).append(key)
        return dst.id

    def kv(self, node, layer: int) -> tuple:
        r = self.alloc.kv_pair(layer)
        if r.backend != self.backend:
            raise self._mismatch(node, f"layer {layer}'s KV", r.backend)
        return r.k, r.v

    def weight(self, name, node) -> int:
        return self.weights.handle(name, node.name)


def lower_graph(graph: ComputeGraph, splits: list, alloc, weights, params=None, options=None) -> Lowered:
    """weights: the model's WeightRegistry; each split resolves names on its own backend.
    options: the cache's run settings, which a backend's plan_flags reads."""
    out = []
    names = lambda bid: name_of(bid, alloc.entries)  # noqa: E731
    for k, sp in enumerate(splits):
        entry = alloc.entries[sp.backend]
        if entry.lower_node is None:
            raise BackendError(f"backend {entry.name!r} cannot execute plans in this build")
        device = alloc.devices[sp.backend]
        bound = weights.on(entry)
        ctx = LowerCtx(graph, alloc, bound, sp.backend, names)
        plan = device.new_plan(f"split{k}:{entry.name}")
        step_nodes = []
        for i in range(*sp.node_range):
            node = graph.nodes[i]
            if i in graph.dead:
                continue
            if node.backend != sp.backend:
                raise BackendError(f"node {i} ({node.name}) is on backend {names(node.backend)} inside a "
                                   f"{entry.name} split")
            ref = alloc.node_to_buf.get(i)
            if ref is not None and ref.backend != sp.backend:
                raise ctx._mismatch(node, "its buffer", ref.backend)
            for op, bufs, ip, fp, w in entry.lower_node(node, graph, ctx):
                plan.add(op, i, bufs, ip, fp, w)
                step_nodes.append(i)
                ctx.step = len(step_nodes)
            if node.op not in KV_BOUND and node.id not in alloc.node_to_buf:
                raise GraphError(f"node {i} ({node.name}) was not allocated")
        # Step merges (fused decode ops) only when no other split reads this one's buffers.
        if entry.plan_flags is not None and params is not None and len(splits) == 1:
            plan.flags = int(entry.plan_flags(options or {}))
        try:
            device.validate(plan, bound.store)
        except (ValueError, IndexError) as e:
            raise GraphError(f"split {k} ({entry.name}) does not lower to a valid plan: {e}") from e
        prepare = getattr(device, "prepare", None)
        bind_step = getattr(device, "bind_step", None)
        bind_launches = getattr(device, "bind_launches", None)
        out.append(LoweredSplit(sp, entry, device, plan, device.bind(plan, bound.store), step_nodes,
                                functools.partial(prepare, plan, bound.store) if prepare else None,
                                ctx.staged, ctx.first_read,
                                bind_step(plan, bound.store) if bind_step else None,
                                bind_launches(plan, bound.store) if bind_launches else None))
    return Lowered(out)
