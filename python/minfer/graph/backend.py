"""What the graph knows about a backend, and nothing device-specific.

The graph never imports a backend or the compiled core. It is handed the selected
`BackendEntry`s by whoever builds a GraphCache (the registry in `minfer.backends` is
the composition root), and reaches memory, plans, weights and copies only through
the hooks below. A backend is two objects:

- the entry (one per backend, process-wide): name, fixed id, priority, capability
  matrix, and factories for its per-use state;
- a device (one per GraphCache, from `entry.open_device(options)`): its buffer pool
  plus its own run settings (CPU threads live there, not in a generic run call).
  The methods a device must have are listed in `Device`.

Ids are a file-format contract (cpu=0, metal=1, cuda=2; later ones are appended,
never renumbered). Every ordering is by (priority desc, id), never dict order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Protocol

from minfer.errors import BackendError

CPU_ID, METAL_ID, CUDA_ID = 0, 1, 2
BUILTIN_NAMES = {CPU_ID: "cpu", METAL_ID: "metal", CUDA_ID: "cuda"}


class Device(Protocol):
    """One backend's per-cache state: a pool of byte buffers addressed by int ids, plus
    plan creation and execution with the backend's own run settings."""

    def alloc(self, nbytes: int) -> int: ...          # may recycle a freed id of exactly this size
    def alloc_fresh(self, nbytes: int) -> int: ...    # never recycles (KV, staging)
    def free(self, buf: int) -> None: ...
    def count(self) -> int: ...
    def write(self, buf: int, data) -> None: ...      # host -> buffer, C-contiguous array
    def read(self, buf: int, dtype: str, count: int): ...   # buffer -> new host array
    def view(self, buf: int, dtype: str, count: int): ...   # read-only host view, or None
    def argmax(self, buf: int, n: int) -> int: ...    # greedy pick over n f32 values
    def new_plan(self, label: str) -> Any: ...        # has .add(op, node, bufs, ip, fp, w)
    def validate(self, plan, weights) -> None: ...    # raises ValueError/IndexError
    def bind(self, plan, weights) -> Callable: ...    # run(begin=0, end=-1): one call per split
    # Optional: prepare(plan, weights) readies the plan's weights apart from a run (the
    # CPU repacks them; Context.warming() overlaps it with start-up work);
    # argmax_checks_finite = True when argmax answers -1 for a row holding NaN
    # or Inf (else the generation loop checks the row on the host first);
    # argmax_rows(buf, n, rows) -> list of picks, -1 for a non-finite row
    # (Context.argmax_rows reads the rows back without it);
    # alloc_group(sizes) -> ids (a graph's inputs in one block) and
    # write_many(ids, arrays) (whole-buffer writes, adjacent group members in one copy);
    # the allocator uses them when present (graph/alloc.py fill_inputs).
    # bind_launches(plan, weights) -> launches(after=None, timed=False): the whole run
    # one launch at a time, for tracing and profiling (graph/lowering.py LoweredSplit).


@dataclass(frozen=True)
class CopyRoute:
    """How bytes move from a buffer on one backend to a buffer on another.

    start(src_device, src_buf, dst_device, dst_buf, nbytes) -> ticket begins the copy;
    wait(ticket) is called exactly once per started copy, before anything reads the
    destination (a host memcpy is done when start returns, so its wait is a no-op; a
    device copy records an event in start and synchronises on it in wait)."""

    name: str
    start: Callable
    wait: Callable


def _no_route(_other: "BackendEntry") -> Optional[CopyRoute]:
    return None


@dataclass(frozen=True)
class BackendEntry:
    """One backend as the graph sees it. The capability functions are the only place
    that says what a backend can run; the scheduler and fusion pass ask them."""

    name: str
    id: int
    priority: int
    compiled: bool
    usable: bool
    unusable_reason: str
    supports_op: Callable[[Any], bool]          # (CNode) -> bool
    supports_fused: Callable[[str], bool]       # ("swiglu") -> bool
    supports_attn_span: Callable[[], bool]
    weight_types: frozenset = frozenset()       # GGUF type ids its kernels execute
    kv_types: tuple = ()                        # KV element types it holds ("f16", "f32"), default first
    open_device: Optional[Callable[[Mapping], Device]] = None   # (options) -> Device
    open_weights: Optional[Callable[[], Any]] = None            # () -> a WeightStore (see graph/weights.py)
    lower_node: Optional[Callable] = None       # (node, graph, LowerCtx) -> list of (op, bufs, ip, fp, w)
    # Copy dispatch is on the (source, destination) pair: the source's copy_to(dst)
    # is asked first, then the destination's copy_from(src); None means "not me".
    copy_to: Callable[["BackendEntry"], Optional[CopyRoute]] = _no_route
    copy_from: Callable[["BackendEntry"], Optional[CopyRoute]] = _no_route
    memory: str = "host"                        # where its buffers live ("host": CPU-addressable)
    # (cache options) -> int: execution switches for the plan of a single-split graph
    # (CUDA: which step merges, i.e. fused decode ops, its executor may apply). A
    # backend's own business: they change no node of the graph, so they are not in
    # the graph's reuse identity.
    plan_flags: Optional[Callable[[Any], int]] = None

    @property
    def order_key(self) -> tuple:
        return (-self.priority, self.id)


def unavailable_entry(name: str, bid: int, priority: int, reason: str = "not compiled into this build") -> BackendEntry:
    """A backend known by fixed id and priority whose code cannot run here: naming it is
    a clear refusal, and no node is ever assigned to it."""

    def never(*_args, **_kw) -> bool:
        return False

    return BackendEntry(name=name, id=bid, priority=priority, compiled=False, usable=False,
                        unusable_reason=reason, supports_op=never, supports_fused=never,
                        supports_attn_span=never)


def copy_route(src: BackendEntry, dst: BackendEntry) -> CopyRoute:
    """The route for copies from `src` to `dst` (resolved once per staged buffer, at build time)."""
    route = src.copy_to(dst) or dst.copy_from(src)
    if route is None:
        raise BackendError(f"no copy route from backend {src.name!r} to backend {dst.name!r}")
    return route


def name_of(bid: Optional[int], entries: Optional[Mapping] = None) -> str:
    """A backend id as a name: from the given entries (id -> entry), else the built-in
    id space, else 'backend#N'."""
    if bid is None:
        return "unassigned"
    e = entries.get(bid) if entries else None
    if e is not None:
        return e.name
    return BUILTIN_NAMES.get(bid, f"backend#{bid}")
