"""Lowering of one graph node to plan steps (op code, buffer ids, int/float params,
weight handles): the step format of csrc/common/plan.h, which every backend that runs
`_core.Plan`s executes (the CPU on host pools, CUDA on device pools)."""

from __future__ import annotations

from minfer import _core
from minfer.graph.ir import DType, EmbedMeta, GraphError, Op, RopeStyle

_OPS: dict = dict(_core.OPS)
# The plan's kv_type field is the GGML type id of the K/V elements.
_KV_CODE = {DType.F32: 0, DType.F16: 1}


def _code(name: str) -> int:
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
        style = 0 if m.style is RopeStyle.Neox else 1
        return [(_code("rope"), [y, ctx.src(node, 0), ctx.src(node, 1)], [nt, m.nh, m.hd, m.n_rot, style],
                 [m.freq_base, m.freq_scale, m.attn_factor], [ctx.weight(m.factors, node)])]
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
                 [nt, m.n_head, m.n_head_kv, m.hd, m.n_ctx, q.out_shape[0], _KV_CODE[m.kv_type], m.window,
                  m.seq_ctx],
                 [m.scale, m.softcap], [])]
    if op is Op.Sigmoid:
        return [(_code("sigmoid"), [y, ctx.src(node, 0)], [n], [], [])]
    if op is Op.MoeTopK:
        m = node.meta
        return [(_code("moe_topk"), [y, ctx.src(node, 0)], [m.n_expert, m.k, nt], [], [])]
    if op is Op.MoeWeights:
        m = node.meta
        return [(_code("moe_weights"), [y, ctx.src(node, 0)], [m.n_expert, m.k, nt, m.gating.value, int(m.norm)],
                 [m.scale], [])]
    if op is Op.MatMulId:
        m = node.meta
        x, ids = graph.nodes[src[0]], graph.nodes[src[1]]
        return [(_code("matmul_id"), [y, ctx.src(node, 0), ctx.src(node, 1)],
                 [m.in_dim, m.out_dim, x.n_rows, m.n_expert, ids.out_shape[0], ids.n_rows], [],
                 [ctx.weight(m.weight_name, node)])]
    if op is Op.MoeSum:
        w = graph.nodes[src[1]]
        return [(_code("moe_sum"), [y, ctx.src(node, 0), ctx.src(node, 1)], [node.out_shape[0], w.out_shape[0], nt],
                 [], [])]
    if op in (Op.Scale, Op.Softcap):
        return [(_code("scale" if op is Op.Scale else "softcap"), [y, ctx.src(node, 0)], [n], [node.meta.value], [])]
    if op is Op.Gelu:
        return [(_code("gelu"), [y, ctx.src(node, 0)], [n], [], [])]
    if op is Op.GeGLU:
        return [(_code("geglu"), [y, ctx.src(node, 0), ctx.src(node, 1)], [n], [], [])]
    if op is Op.Slice:
        x = graph.nodes[src[0]]
        return [(_code("slice"), [y, ctx.src(node, 0)], [node.out_shape[0], nt, x.out_shape[0], node.meta.offset],
                 [], [])]
    raise GraphError(f"node {node.id} ({node.name}): op {op} has no plan-step lowering")
