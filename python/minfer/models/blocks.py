"""The pieces dense decoder graphs are composed of: the graph's inputs, embedding,
norms, the attention block (projections, per-head norms, RoPE, KV store, attention,
output projection), the gated FFN, the G3 tail rows and the lm head.

Each architecture (qwen2.py, qwen3.py, llama.py, gemma.py, phi3.py) is a short builder
that calls these in its own order with its own switches, so a shared piece is written
once. Node names and build order are part of the contract (traces diff by name, the
graph cache compares params only and the same params must build the same graph), so a
piece always names its nodes the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from minfer.errors import UnsupportedModelError
from minfer.graph.builder import GraphBuilder
from minfer.graph.ir import SPAN_INTS, AttnMeta, ComputeGraph, DType, RoPEMeta, RopeStyle

if TYPE_CHECKING:
    from minfer.graph.params import GraphParams
    from minfer.models.base import ModelDef


@dataclass(frozen=True)
class RopeSpec:
    """One layer's rotary embedding: which dims rotate, how, and how it is scaled."""

    base: float
    n_rot: int
    style: RopeStyle = RopeStyle.Neox
    freq_scale: float = 1.0      # linear scaling: positions times this (1 / factor)
    attn_factor: float = 1.0     # cos and sin times this (LongRoPE's mscale)
    factors: Optional[str] = None  # per-frequency divisors: an f32[n_rot / 2] weight

    def meta(self, hd: int, nh: int) -> RoPEMeta:
        return RoPEMeta(n_rot=self.n_rot, freq_base=self.base, hd=hd, nh=nh, style=self.style,
                        freq_scale=self.freq_scale, attn_factor=self.attn_factor, factors=self.factors)


@dataclass(frozen=True)
class AttnSpec:
    """One layer's attention: its RoPE, the score scale, sliding window and soft-cap."""

    rope: RopeSpec
    scale: float
    window: int = 0        # 0: full causal attention
    softcap: float = 0.0   # 0: none


class DecoderGraph:
    """One graph build: the builder, the standard inputs and the model it reads.

    Inputs are declared at the head, in this order (token_ids, positions, cells, kv_span
    when several sequences share the graph, tail_ids when only some rows need logits),
    not beside their consumers: an input mid-graph would cut a GPU run into extra splits.
    positions is a token's index in its sequence (RoPE, and the causal bound of one
    sequence); cells its KV row in the arena; kv_span gives each token the cells it may
    attend to (SPAN_INTS a token: its own [lo, hi) after a shared prefix's)."""

    def __init__(self, model: ModelDef, params: GraphParams):
        self.model, self.hp, self.params = model, model.hp, params
        nt, n_out = params.n_tokens, params.n_out
        self.n_ctx = params.cparams.n_ctx
        self.span_on = params.cparams.explicit_span
        self.kvt = DType(params.cparams.kv_type)
        b = self.b = GraphBuilder()
        self.tokens = b.input("token_ids", (nt,), DType.I32)
        self.pos = b.input("positions", (nt,), DType.I32)
        self.cells = b.input("cells", (nt,), DType.I32)
        self.span = b.input("kv_span", (SPAN_INTS * nt,), DType.I32) if self.span_on else None
        self.tail = b.input("tail_ids", (n_out,), DType.I32) if n_out < nt else None

    # -- leaves -------------------------------------------------------------------------
    def mm(self, x: int, name: str, bias: Optional[str] = None, node: Optional[str] = None) -> int:
        """x times the weight `name` (GGUF shape [in, out]); the node is named after it."""
        t = self.model.tensors[name]
        return self.b.matmul(x, name, t.type, int(t.shape[0]), int(t.shape[1]), bias_name=bias,
                             name=node or name[:-len(".weight")])

    def opt_bias(self, name: str) -> Optional[str]:
        """A bias the file may or may not have (llama's optional projection biases)."""
        return name if self.model.has(name) else None

    def norm(self, x: int, weight: str, name: str) -> int:
        return self.b.rms_norm(x, weight, self.hp.eps, name=name)

    def embed(self) -> int:
        emb = self.model.tensors["token_embd.weight"]
        return self.b.embedding(self.tokens, "token_embd.weight", emb.type, self.hp.n_embd, self.hp.n_vocab,
                                name="token_embd")

    # -- attention ----------------------------------------------------------------------
    def qkv(self, p: str, x: int, bias: str = "none", fused: bool = False) -> tuple[int, int, int]:
        """q, k, v of layer prefix p. bias: 'none', 'all' (Qwen2: q/k/v biases required)
        or 'optional' (used where the file has them). fused: one attn_qkv weight whose
        output rows are q | k | v, sliced apart (Phi-3)."""
        hp = self.hp
        if fused:
            qkv = self.mm(x, p + "attn_qkv.weight", self.opt_bias(p + "attn_qkv.bias"))
            q = self.b.slice(qkv, 0, hp.q_dim, name=p + "q")
            k = self.b.slice(qkv, hp.q_dim, hp.kv_dim, name=p + "k")
            v = self.b.slice(qkv, hp.q_dim + hp.kv_dim, hp.kv_dim, name=p + "v")
            return q, k, v
        pick = {"none": lambda n: None, "all": lambda n: p + n, "optional": lambda n: self.opt_bias(p + n)}[bias]
        q = self.mm(x, p + "attn_q.weight", pick("attn_q.bias"))
        k = self.mm(x, p + "attn_k.weight", pick("attn_k.bias"))
        v = self.mm(x, p + "attn_v.weight", pick("attn_v.bias"))
        return q, k, v

    def attention(self, il: int, q: int, k: int, v: int, spec: AttnSpec, qk_norm: bool = False) -> int:
        """Per-head q/k norms (optional), RoPE, the KV store and attention of layer il;
        returns the heads' output [q_dim, nt], before the output projection."""
        hp, b, p = self.hp, self.b, f"blk.{il}."
        if qk_norm:
            q = b.qk_norm(q, p + "attn_q_norm.weight", hp.head_dim, hp.n_head, hp.eps, name=p + "q_norm")
            k = b.qk_norm(k, p + "attn_k_norm.weight", hp.head_dim, hp.n_head_kv, hp.eps, name=p + "k_norm")
        q = b.rope(q, self.pos, spec.rope.meta(hp.head_dim, hp.n_head), name=p + "q_rope")
        k = b.rope(k, self.pos, spec.rope.meta(hp.head_dim, hp.n_head_kv), name=p + "k_rope")
        b.kvcache_store(il, k, v, self.cells, hp.kv_dim, self.n_ctx, name=p + "kv_store", kv_type=self.kvt)
        kv = b.kvcache_load(il, hp.kv_dim, self.n_ctx, name=p + "kv_load", kv_type=self.kvt)
        meta = AttnMeta(layer=il, n_head=hp.n_head, n_head_kv=hp.n_head_kv, hd=hp.head_dim, scale=spec.scale,
                        n_ctx=self.n_ctx, explicit_span=self.span_on, kv_type=self.kvt, window=spec.window,
                        softcap=spec.softcap, seq_ctx=self.params.cparams.seq_ctx)
        return b.attn(q, kv, self.pos, meta, span=self.span, name=p + "attn")

    def tail_rows(self, il: int, out: int, residual: int) -> tuple[int, int]:
        """G3: in the last layer, once attention has read every row's K/V, only the rows
        that need logits go on (the attention output and the residual it joins)."""
        if self.tail is None or il != self.hp.n_layer - 1:
            return out, residual
        b, p, shape = self.b, f"blk.{il}.", (self.hp.n_embd, self.params.n_out)
        out = b.get_rows(out, self.tail, shape, name=p + "attn_out_tail")
        residual = b.get_rows(residual, self.tail, shape, name=p + "residual_tail")
        return out, residual

    # -- feed-forward -------------------------------------------------------------------
    def gated_ffn(self, p: str, x: int, act: str = "silu", fused: bool = False, bias: bool = False) -> int:
        """down(act(gate(x)) * up(x)). act: 'silu' (SwiGLU; FusionPass folds it) or 'gelu'
        (GELU-tanh, GeGLU). fused: one ffn_up weight whose output rows are gate | up
        (Phi-3), sliced apart. bias: optional ffn biases where the file has them."""
        b, ff = self.b, self.hp.n_ff
        ob = self.opt_bias if bias else (lambda n: None)
        if fused:
            gu = self.mm(x, p + "ffn_up.weight", ob(p + "ffn_up.bias"))
            gate = b.slice(gu, 0, ff, name=p + "ffn_gate")
            up = b.slice(gu, ff, ff, name=p + "ffn_up_half")
        else:
            gate = self.mm(x, p + "ffn_gate.weight", ob(p + "ffn_gate.bias"))
            up = self.mm(x, p + "ffn_up.weight", ob(p + "ffn_up.bias"))
        # Left as act * mul: FusionPass folds it into SwiGLU / GeGLU where the backend can.
        if act == "silu":
            a = b.silu(gate, name=p + "ffn_silu")
        elif act == "gelu":
            a = b.gelu(gate, name=p + "ffn_gelu")
        else:
            raise ValueError(f"unknown FFN activation {act!r}")
        h = b.mul(a, up, name=p + "ffn_act")
        return self.mm(h, p + "ffn_down.weight", ob(p + "ffn_down.bias"))

    # -- the pre-norm block and the head ------------------------------------------------
    def pre_norm_layer(self, il: int, h: int, spec: AttnSpec, *, qkv_bias: str = "none", fused_qkv: bool = False,
                       qk_norm: bool = False, o_bias: bool = False, fused_up: bool = False,
                       ffn_bias: bool = False) -> int:
        """x + attn(norm(x)), then x + ffn(norm(x)): the Qwen2 / Qwen3 / Llama / Phi-3 layer."""
        b, p = self.b, f"blk.{il}."
        residual = h
        x = self.norm(h, p + "attn_norm.weight", p + "attn_norm")
        q, k, v = self.qkv(p, x, qkv_bias, fused_qkv)
        a = self.attention(il, q, k, v, spec, qk_norm)
        wo = self.mm(a, p + "attn_output.weight", self.opt_bias(p + "attn_output.bias") if o_bias else None)
        wo, residual = self.tail_rows(il, wo, residual)
        h = b.add(residual, wo, name=p + "attn_residual")
        residual = h
        x = self.norm(h, p + "ffn_norm.weight", p + "ffn_norm")
        down = self.gated_ffn(p, x, "silu", fused_up, ffn_bias)
        return b.add(residual, down, name=p + "ffn_residual")

    def sandwich_layer(self, il: int, h: int, spec: AttnSpec, *, qk_norm: bool = False, act: str = "gelu") -> int:
        """Gemma 2 / 3: norms before and after attention and the FFN,
        x + post_norm(attn(norm(x))), then x + post_norm(ffn(norm(x)))."""
        b, p = self.b, f"blk.{il}."
        residual = h
        x = self.norm(h, p + "attn_norm.weight", p + "attn_norm")
        q, k, v = self.qkv(p, x)
        a = self.attention(il, q, k, v, spec, qk_norm)
        wo = self.mm(a, p + "attn_output.weight")
        wo, residual = self.tail_rows(il, wo, residual)
        wo = self.norm(wo, p + "post_attention_norm.weight", p + "post_attention_norm")
        h = b.add(residual, wo, name=p + "attn_residual")
        residual = h
        x = self.norm(h, p + "ffn_norm.weight", p + "ffn_norm")
        down = self.gated_ffn(p, x, act)
        down = self.norm(down, p + "post_ffw_norm.weight", p + "post_ffw_norm")
        return b.add(residual, down, name=p + "ffn_residual")

    def head(self, h: int, final_softcap: float = 0.0) -> ComputeGraph:
        """Final norm and lm head (the embedding table when the file ties them); with
        params.hidden the normed hidden states are the output instead (embeddings)."""
        hp, b = self.hp, self.b
        x = self.norm(h, "output_norm.weight", "output_norm")
        if self.params.hidden:
            b.output(x)
            return b.build()
        name = self.model.output_weight
        out = self.model.tensors[name]
        logits = b.matmul(x, name, out.type, hp.n_embd, hp.n_vocab, name="logits")
        if final_softcap > 0:
            logits = b.softcap(logits, final_softcap, name="logits_softcap")
        b.output(logits)
        return b.build()


# ---- the tensor tables (name -> GGUF shape, ne0 first) of the same pieces -----------------

def head_tensors(m: ModelDef) -> dict:
    """token_embd, output_norm and output (only when the file has it: else tied)."""
    hp = m.hp
    t = {"token_embd.weight": (hp.n_embd, hp.n_vocab), "output_norm.weight": (hp.n_embd,)}
    if m.has("output.weight"):
        t["output.weight"] = (hp.n_embd, hp.n_vocab)
    return t


def attn_tensors(m: ModelDef, p: str, *, bias: str = "none", fused: bool = False, qk_norm: bool = False,
                 o_bias: bool = False) -> dict:
    hp = m.hp
    d, qd, kvd = hp.n_embd, hp.q_dim, hp.kv_dim
    t = {p + "attn_norm.weight": (d,)}
    if fused:
        t[p + "attn_qkv.weight"] = (d, qd + 2 * kvd)
    else:
        t[p + "attn_q.weight"] = (d, qd)
        t[p + "attn_k.weight"] = (d, kvd)
        t[p + "attn_v.weight"] = (d, kvd)
    t[p + "attn_output.weight"] = (qd, d)
    biases = {"attn_q.bias": (qd,), "attn_k.bias": (kvd,), "attn_v.bias": (kvd,)} if not fused else \
        {"attn_qkv.bias": (qd + 2 * kvd,)}
    for n, shape in biases.items():
        if bias == "all" or (bias == "optional" and m.has(p + n)):
            t[p + n] = shape
    if o_bias and m.has(p + "attn_output.bias"):
        t[p + "attn_output.bias"] = (d,)
    if qk_norm:
        t[p + "attn_q_norm.weight"] = (hp.head_dim,)
        t[p + "attn_k_norm.weight"] = (hp.head_dim,)
    return t


def ffn_tensors(m: ModelDef, p: str, *, fused: bool = False, bias: bool = False) -> dict:
    hp = m.hp
    d, ff = hp.n_embd, hp.n_ff
    t = {p + "ffn_norm.weight": (d,)}
    if fused:
        t[p + "ffn_up.weight"] = (d, 2 * ff)
    else:
        t[p + "ffn_gate.weight"] = (d, ff)
        t[p + "ffn_up.weight"] = (d, ff)
    t[p + "ffn_down.weight"] = (ff, d)
    if bias:
        for n, shape in (("ffn_gate.bias", (ff,)), ("ffn_up.bias", (2 * ff if fused else ff,)), ("ffn_down.bias", (d,))):
            if m.has(p + n):
                t[p + n] = shape
    return t


def full_rotary(m: ModelDef, head_dim: int) -> None:
    """Refuses a rope.dimension_count other than the head dim, for the families whose
    llama.cpp graphs rotate whole heads (it calls any other value an invalid n_rot)."""
    n_rot = m.meta.count("rope.dimension_count", head_dim)
    if n_rot != head_dim:
        raise UnsupportedModelError(f"{m.arch}: rope.dimension_count {n_rot} must equal the head dim {head_dim} "
                                    f"(llama.cpp: invalid n_rot)")


def rope_scaling(m: ModelDef, supported: tuple = ("none", "linear")) -> float:
    """freq_scale (1 / factor) from rope.scaling.type / rope.scaling.factor (or the older
    rope.scale_linear), as llama.cpp reads them: no type means linear, no factor means 1,
    and type none never scales. Any other type is refused by name."""
    md = m.meta
    kind = md.string("rope.scaling.type", "linear")
    if kind not in supported:
        raise UnsupportedModelError(f"{m.arch}: rope scaling type {kind!r} is not supported "
                                    f"(supported: {', '.join(supported)})")
    key = "rope.scaling.factor" if md.has("rope.scaling.factor") else "rope.scale_linear"
    factor = md.real(key, 0.0, lambda v: v == 0 or v >= 1e-3, "0 or a positive number")
    if kind == "none" or factor == 0:
        return 1.0
    return 1.0 / factor


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
