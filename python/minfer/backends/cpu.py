"""The CPU backend as the graph sees it: its capability matrix and the lowering of
one node to `_core.Plan` steps (op code, buffer ids, int/float params, weights).

Step field meanings are the contract in csrc/common/plan.h. `make_entry` lets tests
register a second CPU-backed backend (own pool, restricted matrix) to exercise the
multi-backend machinery without a GPU.
"""

from __future__ import annotations

from typing import Callable, Optional

from minfer.graph.ir import AttnMode, DType, EmbedMeta, GraphError, Op, RopeStyle
from minfer.graph.registry import CPU_ID, BackendEntry

_ELEMENTWISE = {Op.Add, Op.Mul, Op.Silu, Op.SwiGLU}


def _weight_type_ok(wtype: int) -> bool:
    from minfer import _core
    return bool(_core.weight_type_supported(int(wtype)))


def supports_op(node) -> bool:
    op = node.op
    if op is Op.Input:
        return node.out_dtype in (DType.F32, DType.I32)
    if node.out_dtype is not DType.F32:
        return False
    if op in _ELEMENTWISE or op in (Op.RmsNorm, Op.QkNorm, Op.KvcacheStore, Op.KvcacheLoad):
        return True
    if op is Op.MatMul:
        return not node.meta.transpose_b and _weight_type_ok(node.meta.wtype)
    if op is Op.GetRows:
        return not isinstance(node.meta, EmbedMeta) or _weight_type_ok(node.meta.wtype)
    if op is Op.RoPE:
        return node.meta.style is RopeStyle.Neox
    if op is Op.Attn:
        return node.meta.mode in (AttnMode.Gqa, AttnMode.Flash) and (not node.meta.explicit_span or supports_attn_span())
    # Scale/Softmax/layout ops are vocabulary only; the fused decode ops are GPU kernels.
    return False


def supports_fused(fused: str) -> bool:
    return fused == "swiglu"


def supports_attn_span() -> bool:
    return True


_OPS: dict = {}
# The plan's kv_type field is the GGML type id of the K/V elements.
_KV_CODE = {DType.F32: 0, DType.F16: 1}
KV_TYPES = ("f16", "f32")


def _code(name: str) -> int:
    if not _OPS:
        from minfer import _core
        _OPS.update(_core.OPS)
    return _OPS[name]


def lower_node(node, graph, ctx) -> list:
    """Steps for one live node: a list of (op, bufs, ip, fp, w). Leaves (inputs, KV
    views) need no step. `ctx` resolves buffers, KV regions and weight handles."""
    op = node.op
    if op in (Op.Input, Op.KvcacheLoad):
        return []
    y = ctx.out(node)
    n = node.n_elements
    nt = node.n_rows
    src = node.src
    if op in (Op.Add, Op.Mul, Op.SwiGLU):
        name = {Op.Add: "add", Op.Mul: "mul", Op.SwiGLU: "swiglu"}[op]
        return [(_code(name), [y, ctx.src(node, 0), ctx.src(node, 1)], [n], [], [])]
    if op is Op.Silu:
        return [(_code("silu"), [y, ctx.src(node, 0)], [n], [], [])]
    if op is Op.RmsNorm:
        m = node.meta
        return [(_code("rms_norm"), [y, ctx.src(node, 0)], [node.out_shape[0], nt], [m.eps],
                 [ctx.weight(m.weight_name, node)])]
    if op is Op.QkNorm:
        m = node.meta
        return [(_code("qk_norm"), [y, ctx.src(node, 0)], [m.hd, nt * m.nh], [m.eps],
                 [ctx.weight(m.weight_name, node)])]
    if op is Op.MatMul:
        m = node.meta
        x = graph.nodes[src[0]]
        if x.out_shape[0] != m.in_dim:
            raise GraphError(f"node {node.id} ({node.name}): input width {x.out_shape[0]} != in_dim {m.in_dim}")
        return [(_code("matmul"), [y, ctx.src(node, 0)], [m.in_dim, m.out_dim, x.n_rows], [],
                 [ctx.weight(m.weight_name, node), ctx.weight(m.bias_name, node)])]
    if op is Op.GetRows:
        if isinstance(node.meta, EmbedMeta):
            m = node.meta
            return [(_code("get_rows_w"), [y, ctx.src(node, 0)], [node.out_shape[0], nt, m.n_vocab], [],
                     [ctx.weight(m.weight_name, node)])]
        x = graph.nodes[src[0]]
        return [(_code("get_rows"), [y, ctx.src(node, 0), ctx.src(node, 1)], [node.out_shape[0], nt, x.n_rows],
                 [], [])]
    if op is Op.RoPE:
        m = node.meta
        return [(_code("rope"), [y, ctx.src(node, 0), ctx.src(node, 1)], [nt, m.nh, m.hd, m.n_rot],
                 [m.freq_base], [])]
    if op is Op.KvcacheStore:
        m = node.meta
        k_id, v_id = ctx.kv(node, m.layer)
        k = graph.nodes[src[0]]
        return [(_code("kv_store"), [k_id, ctx.src(node, 0), ctx.src(node, 1), ctx.src(node, 2), v_id],
                 [k.n_rows, m.kv_dim, m.n_ctx, _KV_CODE[m.kv_type]], [], [])]
    if op is Op.Attn:
        m = node.meta
        q = graph.nodes[src[0]]
        kv_node = graph.nodes[src[1]]
        k_id, v_id = ctx.kv(node, m.layer)
        if ctx.src(node, 1) != k_id:
            raise GraphError(f"node {node.id} ({node.name}): kv source {kv_node.name!r} is not layer {m.layer}'s K region")
        span = ctx.src(node, 3) if len(src) > 3 else -1
        return [(_code("attn"), [y, ctx.src(node, 0), k_id, v_id, ctx.src(node, 2), span],
                 [nt, m.n_head, m.n_head_kv, m.hd, m.n_ctx, q.out_shape[0], _KV_CODE[m.kv_type]], [m.scale], [])]
    raise GraphError(f"node {node.id} ({node.name}): op {op} has no CPU lowering")


def run_plan(plan, pool, store, n_threads: int, begin: int = 0, end: int = -1) -> None:
    from minfer import _core
    _core.run(plan, pool, store, n_threads, begin, end)


def copy_cross(src_pool, src_id: int, dst_pool, dst_id: int, nbytes: int):
    """A host memcpy: complete when it returns, so the ticket needs no wait."""
    from minfer import _core
    _core.copy_buffer(src_pool, src_id, dst_pool, dst_id, nbytes)
    return None


def await_cross(ticket) -> None:
    """No-op for a CPU source: the copy already finished. Still called once per copy
    so the boundary protocol is the same for every backend."""
    return None


def make_entry(name: str = "cpu", id: int = CPU_ID, priority: int = 100,
               supports_op_fn: Optional[Callable] = None, supports_fused_fn: Optional[Callable] = None,
               supports_attn_span_fn: Optional[Callable] = None) -> BackendEntry:
    def make_pool():
        from minfer import _core
        return _core.Pool(name)

    return BackendEntry(
        name=name, id=id, priority=priority, compiled=True, usable=True, unusable_reason="",
        supports_op=supports_op_fn or supports_op,
        supports_fused=supports_fused_fn or supports_fused,
        supports_attn_span=supports_attn_span_fn or supports_attn_span,
        make_pool=make_pool, lower_node=lower_node, run_plan=run_plan,
        copy_cross=copy_cross, await_cross=await_cross, kv_types=KV_TYPES,
    )


ENTRY = make_entry()
