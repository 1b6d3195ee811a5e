"""The CUDA backend's registry entry (id 2, priority 200).

It runs the same plan steps as the CPU (backends/plan_steps.py) on device pools
(`_core.CudaPool`), with weights mirrored on the device once per handle, K/V kept in
f16, and each whole plan replayed as one CUDA graph once warm. When `_core` was built
without CUDA, or no device is visible, the entry is a refusal that says which.
"""

from __future__ import annotations

import functools
from typing import Callable, Mapping, Optional

from minfer.backends.host_weights import HostWeights
from minfer.backends.plan_steps import lower_node
from minfer.graph.backend import CUDA_ID, BackendEntry, CopyRoute, unavailable_entry
from minfer.graph.ir import AttnMode, DType, EmbedMeta, Op, RopeStyle

NAME = "cuda"
PRIORITY = 200

# GGUF type ids with a CUDA matvec / dequantization kernel (csrc/cuda/quant.cuh).
WEIGHT_TYPES = frozenset({0, 1, 2, 3, 6, 7, 8, 12, 13, 14})
HEAD_DIMS = frozenset({32, 64, 96, 128, 256})
KV_TYPES = ("f16",)  # K/V regions hold f16 (the attention kernels read f16 rows)
# With the dense families' scale, soft-cap, GELU (tanh), GeGLU and column slice.
_ELEMENTWISE = {Op.Add, Op.Mul, Op.Silu, Op.SwiGLU, Op.Scale, Op.Softcap, Op.Gelu, Op.GeGLU, Op.Slice}


# The mixture-of-experts steps (csrc/cuda/k_moe.cu; MatMulId below, by weight type).
_MOE = {Op.Sigmoid, Op.MoeWeights, Op.MoeSum}


def supports_op(node) -> bool:
    op = node.op
    if op is Op.Input:
        return node.out_dtype in (DType.F32, DType.I32)
    if op is Op.MoeTopK:  # the picked experts' ids: i32
        return node.out_dtype is DType.I32
    if node.out_dtype is not DType.F32:
        return False
    if op in _ELEMENTWISE or op in _MOE or op in (Op.RmsNorm, Op.QkNorm, Op.KvcacheStore, Op.KvcacheLoad):
        return True
    if op is Op.MatMulId:
        m = node.meta
        return int(m.wtype) in WEIGHT_TYPES and m.in_dim % 32 == 0
    if op is Op.MatMul:
        m = node.meta
        return not m.transpose_b and int(m.wtype) in WEIGHT_TYPES and m.in_dim % 32 == 0
    if op is Op.GetRows:
        return not isinstance(node.meta, EmbedMeta) or int(node.meta.wtype) in WEIGHT_TYPES
    if op is Op.RoPE:  # both styles, frequency factors, linear scaling, attention factor, partial rotary
        return node.meta.style in (RopeStyle.Neox, RopeStyle.Normal)
    if op is Op.Attn:  # sliding windows and soft-capping included
        return node.meta.mode in (AttnMode.Gqa, AttnMode.Flash) and node.meta.hd in HEAD_DIMS
    return False


def supports_fused(fused: str) -> bool:
    return fused in ("swiglu", "geglu")


def supports_attn_span() -> bool:
    return True


# A diagnostic: the decode step merges to apply (each is bitwise its unfused steps; this
# narrows a numerics difference down to one of them). Unset or 'all': every one.
ENV_FUSE = "MINFER_CUDA_FUSE"
FUSIONS = ("qkv", "ffn", "residual", "quant", "rope")
_FLAG_BITS = {"qkv": 1, "ffn": 2, "residual": 4, "quant": 8, "rope": 32}  # cuda/executor.h PlanFlags


def fusions_from_env() -> frozenset:
    """The decode fusions to use: MINFER_CUDA_FUSE unset, '1' or 'all' = every one, '0' or
    'none' = none, else a comma list of qkv, ffn, residual, quant, rope."""
    import os
    v = os.environ.get(ENV_FUSE, "").strip().lower()
    if v in ("", "1", "all"):
        return frozenset(FUSIONS)
    if v in ("0", "none"):
        return frozenset()
    names = {p.strip() for p in v.split(",") if p.strip()}
    bad = names - set(FUSIONS)
    if bad:
        from minfer.errors import BackendError
        raise BackendError(f"{ENV_FUSE}: unknown fusion(s) {', '.join(sorted(bad))} (known: {', '.join(FUSIONS)})")
    return frozenset(names)


def plan_flags(options) -> int:
    """The executor's step merges for a decode plan: every fusion MINFER_CUDA_FUSE leaves
    on (read at each lowering), none where the cache's options say fuse=False."""
    fz = fusions_from_env() if options.get("fuse", True) else frozenset()
    out = 0
    for name in fz:
        out |= _FLAG_BITS[name]
    return out


class CudaDevice:
    """One GraphCache's CUDA state: a device pool (write = stream-ordered H2D from a
    pinned mirror, read = D2H + wait, view = read-only window on the pinned mirror,
    argmax = device argmax returning one int, -1 when a value is NaN or Inf)."""

    # The greedy loop may skip its host-side NaN/Inf check of the row: argmax makes it.
    argmax_checks_finite = True

    def __init__(self, name: str, options: Mapping) -> None:
        from minfer import _core
        self.core = _core
        self.pool = pool = _core.CudaPool(name)
        self.alloc, self.alloc_fresh, self.free = pool.alloc, pool.alloc_fresh, pool.free
        self.count, self.bytes_total, self.size = pool.count, pool.bytes_total, pool.size
        self.write, self.read, self.view = pool.write, pool.read, pool.view
        # A graph's inputs share one block, so a decode step's fill is one H2D.
        self.alloc_group, self.write_many = pool.alloc_group, pool.write_many
        # pick_target(buf, n): logits a greedy pick reads; the plan writing them last
        # takes the argmax inside its graph, and argmax is then only the 4-byte readback.
        self.pick_target = pool.pick_target
        self.argmax = functools.partial(_core.argmax, pool, n_threads=1)
        # argmax_rows(buf, n, rows): greedy picks of a verified speculative block, one
        # launch and one readback of `rows` ints instead of the rows' logits.
        self.argmax_rows = functools.partial(_core.argmax_rows, pool)
        # top_k_rows(buf, n, rows, k, gather): sampling's candidates selected on the device
        # (the k best ids and values, the values at the gather ids); None for a row
        # holding NaN or Inf. A sampled step reads back those instead of its row.
        self.top_k_rows = functools.partial(_core.top_k_rows, pool)
        self.top_k_max = _core.top_k_max
        # mask_rows(buf, n, rows, which, words): token masks applied to the logits in
        # place, so a masked pick goes through argmax_rows / top_k_rows too.
        self.mask_rows = functools.partial(_core.mask_rows, pool)
        self.copy_within = pool.copy_within

    def new_plan(self, label: str):
        return self.core.Plan(label)

    def validate(self, plan, weights: HostWeights) -> None:
        """Checks the plan and uploads the weights it uses (once per handle)."""
        self.core.cuda_validate(plan, self.pool, weights.core)

    def bind(self, plan, weights: HostWeights) -> Callable:
        """run(begin=0, end=-1): enqueue on the CUDA stream (a graph replay once warm);
        the next host read waits."""
        return functools.partial(self.core.cuda_run, plan, self.pool, weights.core)

    def bind_step(self, plan, weights: HostWeights) -> Callable:
        """step(tok_buf, pos_buf, cell_buf, token, position, cell): a decode step's three
        one-int inputs written (one H2D) and the whole plan enqueued, in one call."""
        return functools.partial(self.core.cuda_step, plan, self.pool, weights.core)

    def bind_launches(self, plan, weights: HostWeights) -> Callable:
        """launches(after=None, timed=False) -> [(kernel, steps, ms)]: the whole plan
        launched directly, one launch at a time, for tracing (after(k, kernel, steps)
        reads launch k's outputs) and profiling (timed: device events)."""
        return functools.partial(self.core.cuda_launches, plan, self.pool, weights.core)


def _copy(src_dev, src_buf: int, dst_dev, dst_buf: int, nbytes: int):
    """Device->device and host->device copies are ordered on the stream every consumer
    runs on; device->host waits inside the copy. Either way the ticket needs no wait."""
    from minfer import _core
    _core.copy_buffer(src_dev.pool, src_buf, dst_dev.pool, dst_buf, nbytes)


def _no_wait(ticket) -> None:
    """Called once per copy, like every route's wait; nothing is left to wait for."""


DEVICE_COPY = CopyRoute("cuda stream copy", _copy, _no_wait)


def _route(other: BackendEntry) -> Optional[CopyRoute]:
    return DEVICE_COPY if other.memory in ("host", "cuda") else None


def probe() -> tuple:
    """(compiled, usable, reason): why CUDA can or cannot run in this process."""
    try:
        from minfer import _core
    except ImportError as e:  # the CPU entry reports a broken core more usefully
        return False, False, f"minfer._core failed to import ({e})"
    if not getattr(_core, "HAS_CUDA", False):
        return False, False, ("not compiled into this build (minfer._core was built without CUDA: no CUDA "
                              "compiler or cuBLAS at build time, or MINFER_CUDA=OFF)")
    n, why = _core.cuda_device_count()
    if n <= 0:
        return True, False, why or "no CUDA device visible"
    return True, True, ""


def make_entry() -> BackendEntry:
    compiled, usable, reason = probe()
    if not compiled:
        return unavailable_entry(NAME, CUDA_ID, PRIORITY, reason)
    return BackendEntry(
        name=NAME, id=CUDA_ID, priority=PRIORITY, compiled=True, usable=usable, unusable_reason=reason,
        supports_op=supports_op, supports_fused=supports_fused, supports_attn_span=supports_attn_span,
        weight_types=WEIGHT_TYPES, kv_types=KV_TYPES,
        open_device=lambda options: CudaDevice(NAME, options), open_weights=lambda: HostWeights(NAME, WEIGHT_TYPES),
        lower_node=lower_node, copy_to=_route, copy_from=_route, memory="cuda", plan_flags=plan_flags,
    )


ENTRY = make_entry()
