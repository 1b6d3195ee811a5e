"""GraphBuilder: an append-only factory for ComputeGraph.

It assigns ids in build order, checks and records shapes, and wires sources. It
never computes and never allocates. Because every source is built before its
consumer, node-id order is an executable order (the one the scheduler and the
allocator both use).
"""

from __future__ import annotations

from typing import Optional, Sequence

from minfer.graph.ir import (
    SPAN_INTS, AttnMeta, CNode, ComputeGraph, DType, EmbedMeta, GraphError, KvcacheMeta, MatMulMeta, NormMeta, Op,
    RoPEMeta, ScalarMeta, SliceMeta,
)
from minfer.graph.ir import MatMulIdMeta, MoeRouteMeta  # mixture of experts


_KV_DTYPES = (DType.F32, DType.F16)


def _kv_meta(layer: int, kv_dim: int, n_ctx: int, kv_type: DType) -> KvcacheMeta:
    if kv_type not in _KV_DTYPES:
        raise GraphError(f"layer {layer}: KV element type {kv_type} is not f32 or f16")
    return KvcacheMeta(layer, kv_dim, n_ctx, kv_type)


def shape4(shape: Sequence[int]) -> tuple:
    shape = tuple(int(d) for d in shape)
    if not 1 <= len(shape) <= 4 or any(d <= 0 for d in shape):
        raise GraphError(f"bad shape {shape}: 1 to 4 positive dims")
    return shape + (1,) * (4 - len(shape))


def _n(shape: tuple) -> int:
    return shape[0] * shape[1] * shape[2] * shape[3]


class GraphBuilder:
    def __init__(self) -> None:
        self._nodes: list = []
        self._inputs: list = []
        self._outputs: list = []
        self._names: set = set()
        self._built = False

    # ---- the generic constructor ----

    def node(self, name: str, op: Op, src: Sequence[int], out_shape: Sequence[int],
             out_dtype: DType = DType.F32, meta=None, backend: Optional[int] = None) -> int:
        if self._built:
            raise GraphError("GraphBuilder.build() was already called; a builder is single-use")
        if name in self._names:
            raise GraphError(f"duplicate node name {name!r}")
        nid = len(self._nodes)
        for s in src:
            if not isinstance(s, int) or not 0 <= s < nid:
                raise GraphError(f"node {name!r}: source {s!r} is not an earlier node")
        self._nodes.append(CNode(nid, name, op, list(src), shape4(out_shape), out_dtype, backend, meta))
        self._names.add(name)
        return nid

    def _shape(self, nid: int) -> tuple:
        return self._nodes[nid].out_shape

    def _rows(self, nid: int) -> int:
        return self._nodes[nid].n_rows

    def _auto(self, stem: str) -> str:
        return f"{stem}.{len(self._nodes)}"

    def _check_f32(self, what: str, *ids: int) -> None:
        for i in ids:
            if self._nodes[i].out_dtype is not DType.F32:
                raise GraphError(f"{what}: input {self._nodes[i].name!r} is {self._nodes[i].out_dtype.value}, needs f32")

    def _check_i32(self, what: str, nid: int, n: Optional[int] = None) -> None:
        node = self._nodes[nid]
        if node.out_dtype is not DType.I32:
            raise GraphError(f"{what}: index input {node.name!r} must be i32")
        if n is not None and node.n_elements != n:
            raise GraphError(f"{what}: index input {node.name!r} has {node.n_elements} entries, needs {n}")

    # ---- leaves and markers ----

    def input(self, name: str, shape: Sequence[int], dtype: DType = DType.F32) -> int:
        nid = self.node(name, Op.Input, [], shape, dtype)
        self._inputs.append(nid)
        return nid

    def output(self, nid: int) -> None:
        if not 0 <= nid < len(self._nodes):
            raise GraphError(f"output {nid} is not a node")
        if nid not in self._outputs:
            self._outputs.append(nid)

    def build(self) -> ComputeGraph:
        if not self._outputs:
            raise GraphError("graph has no outputs")
        self._built = True
        return ComputeGraph(self._nodes, self._inputs, self._outputs)

    # ---- element-wise ----

    def _same(self, what: str, a: int, b: int) -> tuple:
        self._check_f32(what, a, b)
        sa, sb = self._shape(a), self._shape(b)
        if sa != sb:
            raise GraphError(f"{what}: shapes {sa} and {sb} differ")
        return sa

    def add(self, a: int, b: int, name: Optional[str] = None) -> int:
        return self.node(name or self._auto("add"), Op.Add, [a, b], self._same("add", a, b))

    def mul(self, a: int, b: int, name: Optional[str] = None) -> int:
        return self.node(name or self._auto("mul"), Op.Mul, [a, b], self._same("mul", a, b))

    def swiglu(self, gate: int, up: int, name: Optional[str] = None) -> int:
        return self.node(name or self._auto("swiglu"), Op.SwiGLU, [gate, up], self._same("swiglu", gate, up))

    def silu(self, x: int, name: Optional[str] = None) -> int:
        self._check_f32("silu", x)
        return self.node(name or self._auto("silu"), Op.Silu, [x], self._shape(x))

    # ---- normalization ----

    def rms_norm(self, x: int, weight_name: Optional[str], eps: float, name: Optional[str] = None) -> int:
        self._check_f32("rms_norm", x)
        return self.node(name or self._auto("rms_norm"), Op.RmsNorm, [x], self._shape(x),
                         meta=NormMeta(float(eps), weight_name))

    def qk_norm(self, x: int, weight_name: Optional[str], hd: int, nh: int, eps: float,
                name: Optional[str] = None) -> int:
        self._check_f32("qk_norm", x)
        if self._shape(x)[0] != hd * nh:
            raise GraphError(f"qk_norm: input width {self._shape(x)[0]} != {nh} heads x {hd}")
        return self.node(name or self._auto("qk_norm"), Op.QkNorm, [x], self._shape(x),
                         meta=NormMeta(float(eps), weight_name, hd, nh))

    # ---- linear algebra and lookups ----

    def matmul(self, x: int, weight_name: str, wtype: int, in_dim: int, out_dim: int,
               bias_name: Optional[str] = None, name: Optional[str] = None) -> int:
        """x [in_dim, nt] times a GGUF weight of metadata shape [in_dim, out_dim] -> [out_dim, nt]."""
        self._check_f32("matmul", x)
        if self._shape(x)[0] != in_dim:
            raise GraphError(f"matmul {weight_name}: input width {self._shape(x)[0]} != in_dim {in_dim}")
        return self.node(name or self._auto(weight_name), Op.MatMul, [x], (out_dim, self._rows(x)),
                         meta=MatMulMeta(weight_name, in_dim, out_dim, bias_name, wtype))

    def embedding(self, ids: int, weight_name: str, wtype: int, n_embd: int, n_vocab: int,
                  name: Optional[str] = None) -> int:
        self._check_i32("embedding", ids)
        return self.node(name or self._auto("embd"), Op.GetRows, [ids], (n_embd, self._nodes[ids].n_elements),
                         meta=EmbedMeta(weight_name, n_vocab, wtype))

    def get_rows(self, x: int, ids: int, out_shape: Sequence[int], name: Optional[str] = None) -> int:
        """Select token rows of x (e.g. the tail rows that need logits)."""
        self._check_f32("get_rows", x)
        out = shape4(out_shape)
        self._check_i32("get_rows", ids, _n(out) // out[0])
        if out[0] != self._shape(x)[0]:
            raise GraphError(f"get_rows: row width {out[0]} != source width {self._shape(x)[0]}")
        return self.node(name or self._auto("get_rows"), Op.GetRows, [x, ids], out)

    # ---- positional encoding and attention ----

    def rope(self, x: int, pos: int, meta: RoPEMeta, name: Optional[str] = None) -> int:
        self._check_f32("rope", x)
        self._check_i32("rope", pos, self._rows(x))
        if self._shape(x)[0] != meta.hd * meta.nh:
            raise GraphError(f"rope: input width {self._shape(x)[0]} != {meta.nh} heads x {meta.hd}")
        if meta.n_rot > meta.hd or meta.n_rot % 2:
            raise GraphError(f"rope: n_rot {meta.n_rot} must be even and <= head dim {meta.hd}")
        return self.node(name or self._auto("rope"), Op.RoPE, [x, pos], self._shape(x), meta=meta)

    def attn(self, q: int, kv_k: int, pos: int, meta: AttnMeta, span: Optional[int] = None,
             name: Optional[str] = None) -> int:
        """Output width comes from the meta (n_head * hd), not from q: a fused QKV
        node hands attention its whole q|k|v concat buffer."""
        self._check_f32("attn", q)
        nt = self._rows(q)
        self._check_i32("attn", pos, nt)
        if self._shape(q)[0] < meta.n_head * meta.hd:
            raise GraphError(f"attn: q width {self._shape(q)[0]} < {meta.n_head} heads x {meta.hd}")
        if meta.n_head_kv <= 0 or meta.n_head % meta.n_head_kv:
            raise GraphError(f"attn: {meta.n_head} heads is not a multiple of {meta.n_head_kv} KV heads")
        if self._nodes[kv_k].op not in (Op.KvcacheLoad, Op.KvcacheStore):
            raise GraphError("attn: the kv source must be a kvcache_load (or kvcache_store) node")
        kvm = self._nodes[kv_k].meta
        if (kvm.layer != meta.layer or kvm.kv_dim != meta.n_head_kv * meta.hd or kvm.n_ctx != meta.n_ctx
                or kvm.kv_type != meta.kv_type):
            raise GraphError(f"attn layer {meta.layer}: KV node {self._nodes[kv_k].name!r} does not match its meta")
        src = [q, kv_k, pos]
        if span is not None:
            self._check_i32("attn span", span, SPAN_INTS * nt)
            src.append(span)
        elif meta.explicit_span:
            raise GraphError("attn: explicit_span needs a span input")
        return self.node(name or self._auto(f"attn.{meta.layer}"), Op.Attn, src, (meta.n_head * meta.hd, nt),
                         meta=meta)

    def kvcache_store(self, layer: int, k: int, v: int, cells: int, kv_dim: int, n_ctx: int,
                      name: Optional[str] = None, kv_type: DType = DType.F32) -> int:
        """Write k/v rows into the layer's persistent regions at the rows given by `cells` (data, not topology)."""
        self._check_f32("kvcache_store", k, v)
        nt = self._rows(k)
        for t in (k, v):
            if self._shape(t)[0] != kv_dim or self._rows(t) != nt:
                raise GraphError(f"kvcache_store layer {layer}: {self._nodes[t].name!r} is not [{kv_dim}, {nt}]")
        self._check_i32("kvcache_store", cells, nt)
        return self.node(name or self._auto(f"kv_store.{layer}"), Op.KvcacheStore, [k, v, cells], (kv_dim, n_ctx),
                         meta=_kv_meta(layer, kv_dim, n_ctx, kv_type))

    def kvcache_load(self, layer: int, kv_dim: int, n_ctx: int, name: Optional[str] = None,
                     kv_type: DType = DType.F32) -> int:
        return self.node(name or self._auto(f"kv_load.{layer}"), Op.KvcacheLoad, [], (kv_dim, n_ctx),
                         meta=_kv_meta(layer, kv_dim, n_ctx, kv_type))

    # ---- ops of the dense families beyond Qwen (llama, gemma2/3, phi3) ----

    def scale(self, x: int, value: float, name: Optional[str] = None) -> int:
        """x * value."""
        self._check_f32("scale", x)
        return self.node(name or self._auto("scale"), Op.Scale, [x], self._shape(x), meta=ScalarMeta(float(value)))

    def gelu(self, x: int, name: Optional[str] = None) -> int:
        """GELU with the tanh approximation (gelu_pytorch_tanh, ggml_gelu)."""
        self._check_f32("gelu", x)
        return self.node(name or self._auto("gelu"), Op.Gelu, [x], self._shape(x))

    def geglu(self, gate: int, up: int, name: Optional[str] = None) -> int:
        return self.node(name or self._auto("geglu"), Op.GeGLU, [gate, up], self._same("geglu", gate, up))

    def softcap(self, x: int, cap: float, name: Optional[str] = None) -> int:
        """cap * tanh(x / cap)."""
        self._check_f32("softcap", x)
        if not cap > 0:
            raise GraphError(f"softcap: cap {cap} must be > 0")
        return self.node(name or self._auto("softcap"), Op.Softcap, [x], self._shape(x), meta=ScalarMeta(float(cap)))

    def slice(self, x: int, offset: int, width: int, name: Optional[str] = None) -> int:
        """Columns [offset, offset + width) of every row of x (a fused projection's part)."""
        self._check_f32("slice", x)
        d = self._shape(x)[0]
        if offset < 0 or width <= 0 or offset + width > d:
            raise GraphError(f"slice: columns [{offset}, {offset + width}) outside a row of {d}")
        return self.node(name or self._auto("slice"), Op.Slice, [x], (width, self._rows(x)), meta=SliceMeta(int(offset)))

    # ---- mixture of experts (models/moe.py) ----

    def sigmoid(self, x: int, name: Optional[str] = None) -> int:
        self._check_f32("sigmoid", x)
        return self.node(name or self._auto("sigmoid"), Op.Sigmoid, [x], self._shape(x))

    def _route(self, what: str, logits: int, meta: MoeRouteMeta) -> int:
        self._check_f32(what, logits)
        if self._shape(logits)[0] != meta.n_expert:
            raise GraphError(f"{what}: router logits are {self._shape(logits)[0]} wide, not n_expert {meta.n_expert}")
        if not 1 <= meta.k <= meta.n_expert:
            raise GraphError(f"{what}: k {meta.k} is not in [1, n_expert {meta.n_expert}]")
        return self._rows(logits)

    def moe_topk(self, logits: int, meta: MoeRouteMeta, name: Optional[str] = None) -> int:
        """logits [n_expert, nt] -> the ids of the k largest per token, i32 [k, nt] (best first)."""
        nt = self._route("moe_topk", logits, meta)
        return self.node(name or self._auto("moe_topk"), Op.MoeTopK, [logits], (meta.k, nt), DType.I32, meta=meta)

    def moe_weights(self, logits: int, meta: MoeRouteMeta, name: Optional[str] = None) -> int:
        """logits [n_expert, nt] -> the routing weights of the same picks, f32 [k, nt]."""
        nt = self._route("moe_weights", logits, meta)
        return self.node(name or self._auto("moe_weights"), Op.MoeWeights, [logits], (meta.k, nt), meta=meta)

    def matmul_id(self, x: int, ids: int, weight_name: str, wtype: int, in_dim: int, out_dim: int, n_expert: int,
                  name: Optional[str] = None) -> int:
        """Each token's k picked experts: x [in_dim, nt] (shared by a token's k slots) or
        [in_dim, k, nt] (one row per slot) times expert ids[j, t] of a weight of GGUF shape
        [in_dim, out_dim, n_expert] -> [out_dim, k, nt]."""
        self._check_f32("matmul_id", x)
        idn = self._nodes[ids]
        if idn.out_dtype is not DType.I32 or idn.out_shape[2:] != (1, 1):
            raise GraphError(f"matmul_id {weight_name}: ids {idn.name!r} must be i32 [k, nt]")
        k, nt = idn.out_shape[0], idn.out_shape[1]
        if self._shape(x)[0] != in_dim:
            raise GraphError(f"matmul_id {weight_name}: input width {self._shape(x)[0]} != in_dim {in_dim}")
        if self._rows(x) not in (nt, nt * k):
            raise GraphError(f"matmul_id {weight_name}: input has {self._rows(x)} rows, needs {nt} or {nt * k}")
        if not 1 <= k <= n_expert:
            raise GraphError(f"matmul_id {weight_name}: k {k} is not in [1, n_expert {n_expert}]")
        return self.node(name or self._auto(weight_name), Op.MatMulId, [x, ids], (out_dim, k, nt),
                         meta=MatMulIdMeta(weight_name, in_dim, out_dim, n_expert, wtype))

    def moe_sum(self, x: int, w: int, name: Optional[str] = None) -> int:
        """x [d, k, nt] (k * nt rows of d, slot-minor) weighted by w [k, nt] and summed over
        the k slots, in order -> [d, nt]. With k = 1 it scales each token's row (a [d, nt]
        x and a [1, nt] w: the shared expert's gate)."""
        self._check_f32("moe_sum", x, w)
        ws = self._shape(w)
        k, nt = ws[0], ws[1]
        if ws[2:] != (1, 1) or self._rows(x) != k * nt:
            raise GraphError(f"moe_sum: input {self._shape(x)} and weights {ws} are not [d, k, nt] and [k, nt]")
        return self.node(name or self._auto("moe_sum"), Op.MoeSum, [x, w], (self._shape(x)[0], nt))
