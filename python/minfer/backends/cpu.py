"""The CPU backend: its capability matrix, the lowering of one node to plan steps
(op code, buffer ids, int/float params, weights), its device (a `_core.Pool` plus
the thread count it runs with), its weight store (zero-copy references into the
GGUF mmap) and host-memory copies.

Step field meanings are the contract in csrc/common/plan.h. `make_entry` lets tests
register a second CPU-backed backend (own pool, restricted matrix) to exercise the
multi-backend machinery without a GPU.
"""

from __future__ import annotations

import functools
from typing import Callable, Mapping, Optional

from gguf import GGMLQuantizationType

from minfer import _core
from minfer.backends import default_threads
from minfer.backends.host_weights import HostWeights
from minfer.backends.plan_steps import lower_node
from minfer.graph.backend import CPU_ID, BackendEntry, CopyRoute
from minfer.graph.ir import AttnMode, DType, EmbedMeta, Op, RopeStyle

# The GGUF types the compiled kernels execute (the core is the one source of truth).
WEIGHT_TYPES = frozenset(int(t) for t in GGMLQuantizationType if _core.weight_type_supported(int(t)))
KV_TYPES = ("f16", "f32")   # KV element types the kernels store and attend over; default first

_ELEMENTWISE = {Op.Add, Op.Mul, Op.Silu, Op.SwiGLU}
# The dense families beyond Qwen (cpu/ops_dense.cpp).
_DENSE = {Op.Scale, Op.Gelu, Op.GeGLU, Op.Softcap, Op.Slice}


# Mixture of experts (cpu/moe.h); MoeTopK writes i32 ids, the others f32.
_MOE = {Op.Sigmoid, Op.MoeTopK, Op.MoeWeights, Op.MoeSum}


def supports_op(node, weight_types: frozenset = WEIGHT_TYPES) -> bool:
    op = node.op
    if op is Op.Input:
        return node.out_dtype in (DType.F32, DType.I32)
    if op in _MOE:
        return node.out_dtype is (DType.I32 if op is Op.MoeTopK else DType.F32)
    if op is Op.MatMulId:
        return node.out_dtype is DType.F32 and int(node.meta.wtype) in weight_types
    if node.out_dtype is not DType.F32:
        return False
    if op in _ELEMENTWISE or op in (Op.RmsNorm, Op.QkNorm, Op.KvcacheStore, Op.KvcacheLoad):
        return True
    if op is Op.MatMul:
        return not node.meta.transpose_b and int(node.meta.wtype) in weight_types
    if op is Op.GetRows:
        return not isinstance(node.meta, EmbedMeta) or int(node.meta.wtype) in weight_types
    if op is Op.RoPE:
        return node.meta.style in (RopeStyle.Neox, RopeStyle.Normal)
    if op in _DENSE:
        return True
    if op is Op.Attn:
        return node.meta.mode in (AttnMode.Gqa, AttnMode.Flash) and (not node.meta.explicit_span or supports_attn_span())
    return False


def supports_fused(fused: str) -> bool:
    return fused in ("swiglu", "geglu")


def supports_attn_span() -> bool:
    return True


class CpuDevice:
    """One GraphCache's CPU state: a buffer pool and the thread count plans run with.
    The pool's own methods are bound directly, so host I/O adds no Python frame."""

    argmax_checks_finite = True

    def __init__(self, name: str, options: Mapping) -> None:
        self.pool = pool = _core.Pool(name)
        self.n_threads = max(1, int(options.get("threads") or default_threads()))
        self.alloc, self.alloc_fresh, self.free = pool.alloc, pool.alloc_fresh, pool.free
        self.count, self.size = pool.count, pool.size
        self.write, self.read, self.view = pool.write, pool.read, pool.view
        self.copy_within = pool.copy_within
        # argmax(buf, n): the greedy pick over n f32 values, scanned by the threads that
        # wrote them (a partial, not a method: one Python frame less per decode step);
        # -1 when a value is NaN or Inf, found in the same pass (argmax_checks_finite).
        self.argmax = functools.partial(_core.argmax, pool, n_threads=self.n_threads)
        self.argmax_rows = functools.partial(_core.argmax_rows, pool, n_threads=self.n_threads)

    def new_plan(self, label: str):
        return _core.Plan(label)

    def validate(self, plan, weights: HostWeights) -> None:
        _core.validate(plan, self.pool, weights.core)

    def prepare(self, plan, weights: HostWeights) -> None:
        """The plan's weights made ready (repacked) now instead of at its first run."""
        _core.prepare(plan, weights.core, self.n_threads)

    def bind(self, plan, weights: HostWeights) -> Callable:
        """run(begin=0, end=-1): one GIL-free core call, with this device's threads."""
        return functools.partial(_core.run, plan, self.pool, weights.core, self.n_threads)

    def bind_step(self, plan, weights: HostWeights) -> Callable:
        """step(tok_buf, pos_buf, cell_buf, token, position, cell): a decode step's three
        one-int inputs written and the plan run, in one core call."""
        return functools.partial(_core.step, plan, self.pool, weights.core, self.n_threads)


def _host_copy(src_dev: CpuDevice, src_buf: int, dst_dev: CpuDevice, dst_buf: int, nbytes: int):
    """A host memcpy: complete when it returns, so the ticket needs no wait."""
    _core.copy_buffer(src_dev.pool, src_buf, dst_dev.pool, dst_buf, nbytes)


def _host_wait(ticket) -> None:
    """Nothing to wait for: the copy already finished. Still called once per copy so the
    boundary protocol is the same for every route."""


HOST_COPY = CopyRoute("host memcpy", _host_copy, _host_wait)


def _host_route(other: BackendEntry) -> Optional[CopyRoute]:
    # Host to host only: a device backend offers its own routes to and from host memory.
    return HOST_COPY if other.memory == "host" else None


def make_entry(name: str = "cpu", id: int = CPU_ID, priority: int = 100,
               supports_op_fn: Optional[Callable] = None, supports_fused_fn: Optional[Callable] = None,
               supports_attn_span_fn: Optional[Callable] = None, weight_types: frozenset = WEIGHT_TYPES,
               copy_to: Optional[Callable] = None, copy_from: Optional[Callable] = None) -> BackendEntry:
    """A CPU-backed entry. Tests make restricted ones (fewer ops, fewer weight types,
    other copy routes) to exercise the multi-backend machinery without a device."""
    weight_types = frozenset(weight_types)
    return BackendEntry(
        name=name, id=id, priority=priority, compiled=True, usable=True, unusable_reason="",
        supports_op=supports_op_fn or (lambda node: supports_op(node, weight_types)),
        supports_fused=supports_fused_fn or supports_fused,
        supports_attn_span=supports_attn_span_fn or supports_attn_span,
        weight_types=weight_types, kv_types=KV_TYPES,
        open_device=lambda options: CpuDevice(name, options),
        open_weights=lambda: HostWeights(name, weight_types),
        lower_node=lower_node, copy_to=copy_to or _host_route, copy_from=copy_from or _host_route,
        memory="host",
    )


ENTRY = make_entry()
