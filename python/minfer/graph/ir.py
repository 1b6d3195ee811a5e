"""The graph IR: ops, dtypes, node metadata, nodes and the graph itself.

Pure data. Nothing here computes or allocates; the builder creates it, the
scheduler assigns backends, the fusion pass rewrites it, the allocator and the
lowering read it.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Union

from minfer.errors import MinferError


class GraphError(MinferError):
    """A graph is malformed (cycle, bad shape, unknown input) or cannot be executed as built."""


class Op(enum.Enum):
    """The whole operator vocabulary. Payloads live in the node's meta, so an op
    compared together with its meta covers the payload (see verify_structural)."""

    Input = "Input"
    Add = "Add"
    Mul = "Mul"
    Silu = "Silu"
    RmsNorm = "RmsNorm"
    QkNorm = "QkNorm"
    MatMul = "MatMul"
    GetRows = "GetRows"
    RoPE = "RoPE"
    Attn = "Attn"
    KvcacheStore = "KvcacheStore"
    KvcacheLoad = "KvcacheLoad"
    SwiGLU = "SwiGLU"
    # Dense families beyond Qwen (llama, gemma2/3, phi3):
    Scale = "Scale"        # x * value (ScalarMeta): Gemma's embedding scale
    Gelu = "Gelu"          # GELU, tanh approximation
    GeGLU = "GeGLU"        # gelu(gate) * up, fused (FusionPass folds Mul(Gelu(g), u))
    Softcap = "Softcap"    # value * tanh(x / value) (ScalarMeta): Gemma 2's final logits
    Slice = "Slice"        # columns [offset, offset + width) of every row (SliceMeta): fused q|k|v, gate|up
    # Mixture of experts (models/moe.py): the router's picks and weights, the grouped
    # expert matmul (llama.cpp's mul_mat_id) and the weighted sum of the experts' rows.
    Sigmoid = "Sigmoid"
    MoeTopK = "MoeTopK"        # i32 [k, nt]: the picked experts (MoeRouteMeta)
    MoeWeights = "MoeWeights"  # f32 [k, nt]: their routing weights (MoeRouteMeta)
    MatMulId = "MatMulId"      # [out, k, nt]: each slot's expert times its input row (MatMulIdMeta)
    MoeSum = "MoeSum"          # [d, nt]: the k slots' rows weighted and summed

    def __str__(self) -> str:
        return self.value


class DType(enum.Enum):
    F32 = "f32"
    F16 = "f16"
    I32 = "i32"
    Q8_0 = "q8_0"

    def nbytes(self, n_elements: int) -> int:
        if self is DType.Q8_0:
            if n_elements % 32:
                raise GraphError(f"q8_0 tensor of {n_elements} elements is not a whole number of 32-element blocks")
            return n_elements // 32 * 34
        return n_elements * (2 if self is DType.F16 else 4)

    @property
    def numpy(self) -> str:
        return {DType.F32: "float32", DType.F16: "float16", DType.I32: "int32"}.get(self, "uint8")


class RopeStyle(enum.Enum):
    Neox = "neox"        # non-interleaved halves (Qwen2/Qwen3)
    Normal = "normal"    # interleaved pairs (llama); vocabulary only today


class AttnMode(enum.Enum):
    Gqa = "gqa"
    Flash = "flash"
    Mha = "mha"          # vocabulary only


# ---- node metadata: frozen so equality and hashing cover every payload field ----

@dataclass(frozen=True)
class MatMulMeta:
    weight_name: str
    in_dim: int
    out_dim: int
    bias_name: Optional[str] = None
    wtype: int = 0          # GGUF tensor type id of the weight
    transpose_b: bool = False


@dataclass(frozen=True)
class NormMeta:
    eps: float
    weight_name: Optional[str] = None
    hd: int = 0             # QkNorm only: per-head width and head count
    nh: int = 0


@dataclass(frozen=True)
class RoPEMeta:
    n_rot: int
    freq_base: float
    hd: int
    nh: int
    style: RopeStyle = RopeStyle.Neox
    # Scaling as llama.cpp's rope_ext applies it with ext_factor 0: angle = position *
    # freq_scale * freq_base^(-2i/n_rot) / factors[i], then cos and sin times attn_factor.
    # factors: the name of an f32[n_rot/2] weight (llama3's rope_freqs, Phi-3's LongRoPE
    # short/long factors), or None.
    freq_scale: float = 1.0
    attn_factor: float = 1.0
    factors: Optional[str] = None


# Ints per token row of an attention span input (csrc/common/attn_span.h): its own cells
# [lo, hi), then [lo, hi) of a prefix shared with another sequence, read before them.
SPAN_INTS = 4


@dataclass(frozen=True)
class AttnMeta:
    layer: int
    n_head: int
    n_head_kv: int
    hd: int
    scale: float
    n_ctx: int
    explicit_span: bool = False
    mode: AttnMode = AttnMode.Gqa
    kv_type: DType = DType.F32   # element type of the K/V regions it reads
    # window > 0: a token at position p sees only cells of positions (p - window, p]
    # (sliding-window layers; llama.cpp's LLAMA_SWA_TYPE_STANDARD). softcap > 0: every
    # score s (after scale) becomes softcap * tanh(s / softcap) before the softmax (Gemma 2).
    window: int = 0
    softcap: float = 0.0
    # The most cells one query's span holds: its sequence's context where the arena holds
    # several (0: n_ctx). Backends may cut their work by it (CUDA's decode splits), so a
    # row's result does not depend on how many sequences share the arena.
    seq_ctx: int = 0


@dataclass(frozen=True)
class KvcacheMeta:
    layer: int
    kv_dim: int
    n_ctx: int
    kv_type: DType = DType.F32   # element type of the regions (F32 or F16)


@dataclass(frozen=True)
class EmbedMeta:
    weight_name: str
    n_vocab: int
    wtype: int = 0


@dataclass(frozen=True)
class ScalarMeta:
    value: float


@dataclass(frozen=True)
class SliceMeta:
    offset: int             # first column taken; the width is the node's out_shape[0]


class Gating(enum.Enum):
    """How a MoE router turns its logits into the picked experts' weights (the plan's
    gating codes, llama.cpp's expert_gating_func values)."""
    Softmax = 1        # softmax over every expert, then the picked probabilities
    Sigmoid = 2        # sigmoid of each picked logit
    SoftmaxTopK = 3    # softmax over the picked logits only


@dataclass(frozen=True)
class MoeRouteMeta:
    """MoeTopK / MoeWeights: k of n_expert picked per token by the largest logit."""
    n_expert: int
    k: int
    gating: Gating = Gating.Softmax
    norm: bool = False      # the picked weights divided by their sum
    scale: float = 0.0      # then multiplied by this (0 or 1: not)


@dataclass(frozen=True)
class MatMulIdMeta:
    """MatMulId: a 3-D expert weight of GGUF shape [in_dim, out_dim, n_expert]."""
    weight_name: str
    in_dim: int
    out_dim: int
    n_expert: int
    wtype: int = 0


NodeMeta = Union[None, MatMulMeta, NormMeta, RoPEMeta, AttnMeta, KvcacheMeta, EmbedMeta, ScalarMeta, SliceMeta,
                 MoeRouteMeta, MatMulIdMeta]

# Ops whose kernels write the layer's persistent K/V regions (the allocator ensures them).
KV_WRITERS = frozenset({Op.KvcacheStore})
# Ops whose node buffer *is* the layer's K region rather than a pooled buffer.
KV_BOUND = frozenset({Op.KvcacheStore, Op.KvcacheLoad})


def node_layer(node: "CNode") -> Optional[int]:
    """The KV layer a node touches, if any."""
    m = node.meta
    if isinstance(m, (KvcacheMeta, AttnMeta)):
        return m.layer
    return None


@dataclass
class CNode:
    id: int
    name: str
    op: Op
    src: list
    out_shape: tuple          # 4-tuple, feature-major: (d, nt, 1, 1)
    out_dtype: DType
    backend: Optional[int] = None
    meta: NodeMeta = None

    @property
    def n_elements(self) -> int:
        a, b, c, d = self.out_shape
        return a * b * c * d

    @property
    def nbytes(self) -> int:
        return self.out_dtype.nbytes(self.n_elements)

    @property
    def n_rows(self) -> int:
        """Tokens (everything past the feature dim): the row count of the token-major buffer."""
        return self.out_shape[1] * self.out_shape[2] * self.out_shape[3]


@dataclass
class ComputeGraph:
    nodes: list
    inputs: list
    outputs: list
    uid: int = 0
    # Nodes the fusion pass folded into another; no buffer, never executed.
    dead: set = field(default_factory=set)

    def node_by_name(self, name: str) -> CNode:
        for n in self.nodes:
            if n.name == name:
                return n
        raise GraphError(f"graph has no node named {name!r}")

    def consumers(self) -> list:
        """Live consumers of every node (a node listing a source twice counts twice)."""
        cons = [[] for _ in self.nodes]
        for n in self.nodes:
            if n.id in self.dead:
                continue
            for s in n.src:
                cons[s].append(n.id)
        return cons

    def topo_order(self) -> list:
        """Kahn order, for validation only: execution and liveness use build order."""
        n = len(self.nodes)
        indeg = [0] * n
        users = [[] for _ in range(n)]
        for node in self.nodes:
            for s in node.src:
                if not 0 <= s < n:
                    raise GraphError(f"node {node.id} ({node.name}) reads unknown node {s}")
                indeg[node.id] += 1
                users[s].append(node.id)
        q = deque(i for i in range(n) if indeg[i] == 0)
        order = []
        while q:
            i = q.popleft()
            order.append(i)
            for u in users[i]:
                indeg[u] -= 1
                if indeg[u] == 0:
                    q.append(u)
        if len(order) != n:
            stuck = [self.nodes[i].name for i in range(n) if indeg[i] > 0][:5]
            raise GraphError(f"graph has a cycle through {', '.join(stuck)}")
        return order

    def check_build_order(self) -> None:
        """Every source precedes its consumer; this is what makes build order executable."""
        for node in self.nodes:
            for s in node.src:
                if s >= node.id:
                    raise GraphError(f"node {node.id} ({node.name}) reads node {s}, built after it")

    def capture_nt_hint(self) -> Optional[int]:
        """Row count of the first matmul: distinguishes decode- from prefill-shaped graphs."""
        for node in self.nodes:
            if node.op is Op.MatMul:
                return node.n_rows
        return None
