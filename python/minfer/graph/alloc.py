"""GraphAllocator: the single owner of every buffer.

One device per participating backend (its pool of buffers; see graph/backend.py). A
graph build plans its
buffers here: liveness in build order (the order the scheduler executes), inputs
and outputs pinned, in-place aliasing where it is safe, persistent per-layer K/V
regions that survive rebuilds, and fresh staging buffers for split boundaries.

KV sizing rule: a layer's regions are created once, by the first graph that uses
the layer, on that graph's backend for the layer. A later graph asking for the
same layer with a different kv_dim, n_ctx or element type is an error (the KV
holds the conversation; silently resizing would drop it). Call `reset_kv()` to
start over. A graph's new regions are sized and allocated together, before any
work: if they cannot all be had, the error names the bytes the KV needs.
"""

from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass
from typing import Iterable, Optional

import numpy as np

from minfer.graph.backend import copy_route
from minfer.graph.ir import KV_BOUND, KV_WRITERS, ComputeGraph, DType, GraphError, Op

# Ops that may write their output over their first input (same shape, elementwise
# per position), saving a buffer and keeping kernel-order execution correct.
ALIASING = frozenset({Op.Silu, Op.RoPE})

_INF = 1 << 62


@dataclass(frozen=True)
class BufRef:
    backend: int
    id: int


@dataclass
class KvRegion:
    layer: int
    backend: int
    k: int
    v: int
    kv_dim: int
    n_ctx: int
    kv_type: DType = DType.F32

    @property
    def row_bytes(self) -> int:
        return self.kv_type.nbytes(self.kv_dim)


# Host fills take these element types (numpy dtype objects: comparing them is cheap).
_FILL_DTYPES = {DType.I32: np.dtype(np.int32), DType.F32: np.dtype(np.float32)}


def _kv_type(meta) -> DType:
    # The fused decode writers carry no element type yet: their regions are f32.
    return getattr(meta, "kv_type", DType.F32)


class _Cross:
    """One split-boundary staging buffer: a node's value copied to another backend, by
    the route chosen for that (source, destination) pair when the buffer was staged."""
    __slots__ = ("node", "src", "dst", "nbytes", "state", "ticket", "route", "src_dev", "dst_dev")

    def __init__(self, node: int, src: BufRef, dst: BufRef, nbytes: int, route, src_dev, dst_dev) -> None:
        self.node, self.src, self.dst, self.nbytes = node, src, dst, nbytes
        self.route, self.src_dev, self.dst_dev = route, src_dev, dst_dev
        self.state = "idle"      # idle -> enqueued -> ready, once per execute
        self.ticket = None


def liveness(graph: ComputeGraph, order: Iterable[int]) -> dict:
    """last_use[node] as a position in `order`: the last position any live consumer
    reads it. Inputs and outputs are pinned for the whole graph."""
    order = list(order)
    pos = {nid: i for i, nid in enumerate(order)}
    last = {}
    for nid in order:
        if nid in graph.dead:
            continue
        last[nid] = max(last.get(nid, pos[nid]), pos[nid])
        for s in graph.nodes[nid].src:
            last[s] = max(last.get(s, pos[s]), pos[nid])
    for nid in list(graph.outputs) + pinned_inputs(graph):
        last[nid] = _INF
    return last


def pinned_inputs(graph: ComputeGraph) -> list:
    ids = set(graph.inputs) | {n.id for n in graph.nodes if n.op is Op.Input}
    return sorted(i for i in ids if i not in graph.dead)


def plan_buffers(graph: ComputeGraph, order: Iterable[int]):
    """Decide which nodes share a buffer, walking `order` (the allocator always
    passes build order; the parameter exists so tests can show why).

    Returns (slot_of: node -> slot index, slots: list of (backend, nbytes)) for every
    live node that needs a pooled buffer. KV-bound nodes are absent (they use the
    persistent regions). Sharing is by exact byte size, matching the pool."""
    order = list(order)
    last = liveness(graph, order)
    cons = graph.consumers()
    outputs = set(graph.outputs)
    inputs = pinned_inputs(graph)
    pinned = set(inputs) | outputs
    slots: list = []
    slot_of: dict = {}
    expiry: dict = {}            # slot -> last position read
    free: dict = {}              # (backend, nbytes) -> free slots (LIFO)
    heap: list = []              # (expiry, slot) of live, non-pinned slots

    def backend_of(node) -> int:
        if node.backend is None:
            raise GraphError(f"node {node.id} ({node.name}) has no backend; run assign_backends first")
        return node.backend

    def new_slot(node, exp: int) -> int:
        key = (backend_of(node), node.nbytes)
        lst = free.get(key)
        s = lst.pop() if lst else None
        if s is None:
            s = len(slots)
            slots.append(key)
        expiry[s] = exp
        if exp < _INF:
            heapq.heappush(heap, (exp, s))
        return s

    # Inputs are host-filled before anything runs, so they are live from the start
    # and never share a buffer with each other or with anything else.
    for nid in inputs:
        slot_of[nid] = new_slot(graph.nodes[nid], _INF)

    for i, nid in enumerate(order):
        node = graph.nodes[nid]
        if nid in graph.dead or nid in slot_of or node.op in KV_BOUND:
            continue
        while heap and heap[0][0] < i:
            exp, s = heapq.heappop(heap)
            if expiry[s] != exp:
                continue        # stale: an alias extended this slot (and re-pushed it)
            free.setdefault(slots[s], []).append(s)
        if node.op in ALIASING and node.src:
            x = node.src[0]
            xn = graph.nodes[x]
            if (x in slot_of and x not in pinned and cons[x] == [nid] and xn.backend == backend_of(node)
                    and xn.nbytes == node.nbytes):
                s = slot_of[x]
                slot_of[nid] = s
                if last[nid] > expiry[s]:
                    expiry[s] = last[nid]
                    if last[nid] < _INF:
                        heapq.heappush(heap, (last[nid], s))
                continue
        slot_of[nid] = new_slot(node, last[nid])
    return slot_of, slots


class GraphAllocator:
    def __init__(self, entries: list, devices: dict) -> None:
        """entries: the participating backends; devices: backend id -> its opened device."""
        self.entries = {e.id: e for e in entries}
        self.devices = devices
        self.node_to_buf: dict = {}
        self.cross: dict = {}            # (node, dst backend) -> _Cross
        self.kv: dict = {}               # layer -> KvRegion
        self.stats = {"copies": 0, "waits": 0}
        self._graph: Optional[ComputeGraph] = None
        self._inputs: dict = {}          # name -> (node, device, buffer id)

    # ---- build time ----

    def release(self) -> None:
        """Return the current graph's buffers (not the KV) to their pools."""
        self.release_state(self.detach())

    def detach(self) -> tuple:
        """Set the current graph's buffers aside, still allocated (GraphCache keeps a
        few small graphs ready this way); attach() makes them current again."""
        state = (self.node_to_buf, self.cross, self._inputs, self._graph)
        self.node_to_buf, self.cross, self._inputs, self._graph = {}, {}, {}, None
        return state

    def attach(self, state: tuple) -> None:
        if self._graph is not None or self.node_to_buf:
            raise GraphError("attach: the current graph's buffers must be detached or released first")
        self.node_to_buf, self.cross, self._inputs, self._graph = state

    def release_state(self, state: tuple) -> None:
        """Free a detached graph's buffers (never the KV regions it points into)."""
        node_to_buf, cross, _, _ = state
        kv_ids = {(r.backend, r.k) for r in self.kv.values()}
        seen = set()
        for ref in node_to_buf.values():
            key = (ref.backend, ref.id)
            if key in kv_ids or key in seen:
                continue
            seen.add(key)
            self.devices[ref.backend].free(ref.id)
        for c in cross.values():
            self.devices[c.dst.backend].free(c.dst.id)

    def alloc_graph(self, graph: ComputeGraph) -> None:
        self.release()
        graph.topo_order()          # acyclicity; the order itself is not used
        graph.check_build_order()
        for node in graph.nodes:
            if node.id not in graph.dead and node.backend not in self.devices:
                raise GraphError(f"node {node.id} ({node.name}) is assigned to backend {node.backend}, "
                                 f"which has no pool here (participating: {sorted(self.devices)})")
        slot_of, slots = plan_buffers(graph, range(len(graph.nodes)))
        slot_ids = self._alloc_slots(slots, [slot_of[nid] for nid in pinned_inputs(graph)])
        for nid, s in slot_of.items():
            self.node_to_buf[nid] = BufRef(slots[s][0], slot_ids[s])
        kv_nodes = [n for n in graph.nodes if n.id not in graph.dead and (n.op in KV_BOUND or n.op in KV_WRITERS)]
        self._reserve_kv(kv_nodes)
        for node in kv_nodes:
            m = node.meta
            r = self.ensure_kv(m.layer, node.backend, m.kv_dim, m.n_ctx, _kv_type(m))
            if node.op in KV_BOUND:
                self.node_to_buf[node.id] = BufRef(r.backend, r.k)
        for nid in pinned_inputs(graph):
            node = graph.nodes[nid]
            ref = self.node_to_buf[nid]
            self._inputs[node.name] = (node, self.devices[ref.backend], ref.id)
        self._graph = graph

    def _alloc_slots(self, slots: list, input_slots: list) -> list:
        """Buffer ids for the planned slots, in slot order. A device that offers
        alloc_group gets its input slots (never shared, see plan_buffers) as one group,
        so fill_inputs can move a step's inputs in one copy; the rest one by one."""
        ids: list = [None] * len(slots)
        by_backend: dict = {}
        for s in input_slots:
            by_backend.setdefault(slots[s][0], []).append(s)
        for b, ss in sorted(by_backend.items()):
            group = getattr(self.devices[b], "alloc_group", None)
            if group is not None and len(ss) > 1:
                for s, bid in zip(ss, group([slots[s][1] for s in ss])):
                    ids[s] = bid
        for s, (b, nbytes) in enumerate(slots):
            if ids[s] is None:
                ids[s] = self.devices[b].alloc(nbytes)
        return ids

    def _reserve_kv(self, kv_nodes: list) -> None:
        """Check and allocate every layer the graph adds at once, so an impossible KV is
        one error naming the total bytes, raised before any region or work."""
        new: dict = {}
        for node in kv_nodes:
            m = node.meta
            if m.layer not in self.kv:
                new.setdefault(m.layer, (node.backend, m.kv_dim, m.n_ctx, _kv_type(m)))
        for layer, (backend, _, _, kv_type) in new.items():
            entry = self.entries[backend]
            if kv_type.value not in entry.kv_types:
                supported = ", ".join(entry.kv_types) or "none"
                raise GraphError(f"backend {entry.name!r} cannot hold {kv_type.value} KV (supports: {supported})")
        total = sum(2 * kv_type.nbytes(kv_dim * n_ctx) for _, kv_dim, n_ctx, kv_type in new.values())
        done = []
        try:
            for layer, (backend, kv_dim, n_ctx, kv_type) in new.items():
                done.append(self.ensure_kv(layer, backend, kv_dim, n_ctx, kv_type))
        except (MemoryError, RuntimeError) as e:
            for r in done:
                self._drop_kv(r)
            raise GraphError(f"cannot allocate the KV cache: {len(new)} layers need {total} bytes "
                             f"({total / 2**20:.0f} MiB) ({e})") from None

    def ensure_kv(self, layer: int, backend: int, kv_dim: int, n_ctx: int, kv_type: DType = DType.F32) -> KvRegion:
        r = self.kv.get(layer)
        if r is not None:
            if (r.kv_dim, r.n_ctx, r.kv_type) != (kv_dim, n_ctx, kv_type):
                raise GraphError(f"layer {layer} KV was created as [{r.kv_dim}, {r.n_ctx}] {r.kv_type.value} and a "
                                 f"graph now asks for [{kv_dim}, {n_ctx}] {kv_type.value}; size the context once per "
                                 f"conversation or call reset_kv()")
            return r
        nbytes = kv_type.nbytes(kv_dim * n_ctx)
        dev = self.devices[backend]
        k = dev.alloc_fresh(nbytes)
        try:
            v = dev.alloc_fresh(nbytes)
        except BaseException:
            dev.free(k)
            raise
        r = KvRegion(layer, backend, k, v, kv_dim, n_ctx, kv_type)
        self.kv[layer] = r
        return r

    def kv_pair(self, layer: int) -> KvRegion:
        r = self.kv.get(layer)
        if r is None:
            raise GraphError(f"layer {layer} has no KV regions (no KV store/load node for it was allocated)")
        return r

    def _drop_kv(self, r: KvRegion) -> None:
        self.devices[r.backend].free(r.k)
        self.devices[r.backend].free(r.v)
        del self.kv[r.layer]

    def reset_kv(self) -> None:
        """Drop every layer's K/V (a new conversation with a different context size)."""
        for r in list(self.kv.values()):
            self._drop_kv(r)

    def buffer(self, node_id: int) -> BufRef:
        try:
            return self.node_to_buf[node_id]
        except KeyError:
            raise GraphError(f"node {node_id} has no buffer (fused away, or the graph was not allocated)") from None

    # ---- split-boundary staging ----

    def stage(self, node_id: int, dst_backend: int) -> BufRef:
        """The staging buffer for node_id's value on dst_backend: created once per
        graph (fresh, so it cannot collide with a recycled buffer in this graph)."""
        key = (node_id, dst_backend)
        c = self.cross.get(key)
        if c is None:
            src = self.buffer(node_id)
            nbytes = self._graph.nodes[node_id].nbytes
            route = copy_route(self.entries[src.backend], self.entries[dst_backend])
            dst_dev = self.devices[dst_backend]
            c = _Cross(node_id, src, BufRef(dst_backend, dst_dev.alloc_fresh(nbytes)), nbytes, route,
                       self.devices[src.backend], dst_dev)
            self.cross[key] = c
        return c.dst

    def begin_execute(self) -> None:
        for c in self.cross.values():
            c.state = "idle"
            c.ticket = None

    def enqueue_cross(self, key: tuple) -> None:
        """Phase 1, at the split boundary: start the copy. A second enqueue of an
        entry already in flight is the same transfer, so it is a no-op."""
        c = self.cross[key]
        if c.state == "enqueued":
            return
        c.ticket = c.route.start(c.src_dev, c.src.id, c.dst_dev, c.dst.id, c.nbytes)
        c.state = "enqueued"
        self.stats["copies"] += 1

    def await_cross(self, key: tuple) -> None:
        """Phase 2, at the consumer's first read: exactly one wait per copy."""
        c = self.cross[key]
        if c.state == "ready":
            return
        if c.state != "enqueued":
            raise GraphError(f"staged copy of node {c.node} to backend {c.dst.backend} was never enqueued")
        c.route.wait(c.ticket)
        c.state = "ready"
        c.ticket = None
        self.stats["waits"] += 1

    def cross_input(self, key: tuple) -> BufRef:
        """The staged buffer, refused unless its copy has been awaited this execute."""
        c = self.cross[key]
        if c.state != "ready":
            raise GraphError(f"staged copy of node {c.node} to backend {c.dst.backend} read before it was awaited "
                             f"(state {c.state})")
        return c.dst

    def finish_execute(self) -> None:
        """Drain copies nothing read (one wait each), so no transfer outlives the step."""
        for key, c in self.cross.items():
            if c.state == "enqueued":
                self.await_cross(key)

    # ---- host access ----

    def fill_input(self, graph: ComputeGraph, name: str, data) -> None:
        _, dev, bid, arr = self._input_array(graph, name, data)
        dev.write(bid, arr)

    def fill_inputs(self, graph: ComputeGraph, values: dict) -> None:
        """Several inputs at once ({name: data}, each checked as fill_input does): one
        write_many per device that has it (a device then copies adjacent inputs in one
        transfer), else one write each."""
        items = [self._input_array(graph, name, data) for name, data in values.items()]
        per_dev: dict = {}
        for _, dev, bid, arr in items:
            group = per_dev.get(id(dev))
            if group is None:
                group = per_dev[id(dev)] = (dev, [], [])
            group[1].append(bid)
            group[2].append(arr)
        for dev, bids, arrs in per_dev.values():
            many = getattr(dev, "write_many", None)
            if many is not None and len(bids) > 1:
                many(bids, arrs)
            else:
                for bid, arr in zip(bids, arrs):
                    dev.write(bid, arr)

    def input_buffers(self) -> dict:
        """{input name: (node, device, buffer id)} of the allocated graph."""
        return dict(self._inputs)

    def _input_array(self, graph: ComputeGraph, name: str, data) -> tuple:
        """(node, device, buffer id, C-contiguous 1-D array of the node's dtype) for a fill."""
        if graph is not self._graph:
            raise GraphError("fill_input: this graph is not the one currently allocated")
        try:
            node, dev, bid = self._inputs[name]
        except KeyError:
            raise GraphError(f"graph has no input named {name!r} (inputs: {', '.join(self._inputs)})") from None
        if (type(data) is np.ndarray and data.ndim == 1 and data.dtype == _FILL_DTYPES.get(node.out_dtype)
                and data.flags.c_contiguous):
            # What the engine passes: nothing to convert, only the size to check.
            if data.size != node.n_elements:
                raise GraphError(f"input {name!r} takes exactly {node.n_elements} values, got {data.size}")
            return node, dev, bid, data
        arr = np.asarray(data)
        if node.out_dtype is DType.I32:
            if arr.dtype.kind not in "iu" and arr.size:
                raise GraphError(f"input {name!r} is i32 and needs integer data, got {arr.dtype}")
            if arr.dtype != np.int32:
                if arr.size and (arr.min() < -(1 << 31) or arr.max() >= (1 << 31)):
                    raise GraphError(f"input {name!r}: values outside int32")
                arr = arr.astype(np.int32)
        elif node.out_dtype is DType.F32:
            arr = arr.astype(np.float32, copy=False)
        else:
            raise GraphError(f"input {name!r} has dtype {node.out_dtype.value}; host fill supports f32 and i32")
        if arr.size != node.n_elements:
            raise GraphError(f"input {name!r} takes exactly {node.n_elements} values, got {arr.size}")
        return node, dev, bid, np.ascontiguousarray(arr).reshape(-1)

    def copy_to_host(self, node_id: int, rows: int | None = None) -> np.ndarray:
        """A node's value as a token-major array [rows, d] (its first `rows` rows only
        when given: a bucketed step's logits, whose rows past the wanted ones are never
        read)."""
        g = self._graph
        if g is None or not 0 <= node_id < len(g.nodes):
            raise GraphError(f"copy_to_host: no node {node_id} in the allocated graph")
        node = g.nodes[node_id]
        ref = self.buffer(node_id)
        if node.out_dtype not in (DType.F32, DType.I32):
            raise GraphError(f"copy_to_host: node {node.name!r} is {node.out_dtype.value}")
        n_rows = node.n_rows if rows is None else min(int(rows), node.n_rows)
        out = self.devices[ref.backend].read(ref.id, node.out_dtype.numpy, n_rows * node.out_shape[0])
        return out.reshape(n_rows, node.out_shape[0])

    def host_view(self, node_id: int, rows: int | None = None) -> np.ndarray:
        """Like copy_to_host, but a read-only view of the buffer where the backend's memory
        is host-addressable (else a copy): valid until the next execute. The decode loop
        samples from it without a copy. rows: the first `rows` rows only (a device view
        is a D2H of what it covers, so it covers only those)."""
        node = self._graph.nodes[node_id]
        ref = self.buffer(node_id)
        n_rows = node.n_rows if rows is None else min(int(rows), node.n_rows)
        out = self.devices[ref.backend].view(ref.id, node.out_dtype.numpy, n_rows * node.out_shape[0])
        if out is None:
            return self.copy_to_host(node_id, rows=rows)
        return out.reshape(n_rows, node.out_shape[0])

    def viewer(self, node_id: int):
        """host_view(node_id) of the allocated graph as a call of no arguments, the
        lookups done once (the decode step's logits)."""
        node = self._graph.nodes[node_id]
        ref = self.buffer(node_id)
        view = functools.partial(self.devices[ref.backend].view, ref.id, node.out_dtype.numpy, node.n_elements)
        shape = (node.n_rows, node.out_shape[0])

        def get() -> np.ndarray:
            out = view()
            return self.copy_to_host(node_id) if out is None else out.reshape(shape)
        return get

    def copy_kv_to_host(self, layer: int) -> tuple:
        """(K, V) of a layer, each [n_ctx, kv_dim] float32 whatever the stored type."""
        r = self.kv_pair(layer)
        dev = self.devices[r.backend]
        n = r.kv_dim * r.n_ctx
        return tuple(dev.read(b, r.kv_type.numpy, n).astype(np.float32, copy=False).reshape(r.n_ctx, r.kv_dim)
                     for b in (r.k, r.v))

    def _kv_range(self, r: KvRegion, start: int, n: int) -> tuple:
        if start < 0 or n < 0 or start + n > r.n_ctx:
            raise GraphError(f"KV rows [{start}, {start + n}) are outside layer {r.layer}'s {r.n_ctx} cells")
        return start * r.row_bytes, n * r.row_bytes

    def read_kv_rows(self, layer: int, start: int, n: int) -> tuple:
        """Raw bytes (uint8 arrays) of K and V cells [start, start+n) of a layer, in their
        stored element type, through the device surface (host and device memory alike)."""
        r = self.kv_pair(layer)
        off, nb = self._kv_range(r, start, n)
        dev = self.devices[r.backend]
        return dev.read(r.k, "uint8", nb, off), dev.read(r.v, "uint8", nb, off)

    def copy_kv_rows(self, layer: int, src: int, dst: int, n: int) -> None:
        """KV cells [src, src+n) of a layer copied to [dst, dst+n) where they live (a
        device copies on the device, ordered with its runs)."""
        r = self.kv_pair(layer)
        s_off, nb = self._kv_range(r, src, n)
        d_off, _ = self._kv_range(r, dst, n)
        if nb == 0 or src == dst:
            return
        dev = self.devices[r.backend]
        for rid in (r.k, r.v):
            dev.copy_within(rid, s_off, d_off, nb)

    def write_kv_rows(self, layer: int, start: int, n: int, k, v) -> None:
        """The write direction of read_kv_rows: restore cells [start, start+n)."""
        r = self.kv_pair(layer)
        off, nb = self._kv_range(r, start, n)
        dev = self.devices[r.backend]
        for rid, data in ((r.k, k), (r.v, v)):
            arr = np.frombuffer(data, dtype=np.uint8)
            if arr.size != nb:
                raise GraphError(f"layer {layer}: {arr.size} bytes for {n} KV rows of {r.row_bytes} bytes")
            dev.write(rid, arr, off)
