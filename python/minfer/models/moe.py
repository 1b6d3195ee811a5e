"""The mixture-of-experts feed-forward block, shared by every architecture with experts
(qwen2moe, qwen3moe, and llama with experts: Mixtral).

A layer's router (`ffn_gate_inp`, [n_embd, n_expert]) scores every expert per token;
each token's `n_used` best go on with their routing weights; each picked expert's
SwiGLU FFN runs on the token (the 3-D weights `ffn_gate_exps` / `ffn_up_exps`
[n_embd, n_ff, n_expert] and `ffn_down_exps` [n_ff, n_embd, n_expert], quantized per
expert row, multiplied by MatMulId, which groups a batch's tokens by expert); their
outputs are weighted and summed. Qwen2-MoE adds a shared expert: a plain SwiGLU FFN
(`ffn_*_shexp`) on every token whose output is scaled by sigmoid(`ffn_gate_inp_shexp`
. x) and added.

The graph is llama.cpp's build_moe_ffn for these architectures: softmax over all the
router's logits, the top n_used of them, their probabilities renormalised to sum to 1
where the model says so, scaled by expert_weights_scale if that is set. The metadata
keys expert_gating_func and expert_weights_norm, when a file has them, override the
architecture's defaults (llama.cpp itself hard-codes these three architectures).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from minfer.errors import UnsupportedModelError
from minfer.graph.ir import Gating, MoeRouteMeta

if TYPE_CHECKING:
    from minfer.graph.builder import GraphBuilder
    from minfer.models.base import ModelDef
    from minfer.models.blocks import AttnSpec, DecoderGraph

_MAX_EXPERTS = 1 << 12  # far above any released model (DeepSeek: 256), checked on read


@dataclass(frozen=True)
class MoeSpec:
    """One model's expert layout and routing rule, read from its metadata."""

    n_expert: int          # expert_count
    n_used: int            # expert_used_count: experts per token
    n_ff: int              # each expert's hidden width (expert_feed_forward_length)
    gating: Gating = Gating.Softmax
    norm: bool = False     # the picked weights renormalised to sum to 1
    scale: float = 0.0     # then multiplied by this (0 or 1: not)
    n_ff_shared: int = 0   # the shared expert's hidden width (qwen2moe); 0: none

    def route(self) -> MoeRouteMeta:
        return MoeRouteMeta(self.n_expert, self.n_used, self.gating, self.norm, self.scale)


def read_moe_spec(model: ModelDef, *, norm: bool, n_ff: int | None = None, shared: bool = False) -> MoeSpec:
    """The MoE hyper-parameters of `model`'s GGUF, each type- and range-checked naming its
    key. norm: the architecture's default for expert_weights_norm. n_ff: the expert width
    when the file has no expert_feed_forward_length (None: feed_forward_length / n_used,
    llama.cpp's rule for the Qwen MoEs; llama passes feed_forward_length). shared: read
    the shared expert's width (expert_shared_feed_forward_length, default
    feed_forward_length)."""
    g, arch = model.gguf, model.arch
    md = g.metadata

    def key(k: str) -> str:
        return f"{arch}.{k}"

    def bad(k: str, v, why: str) -> UnsupportedModelError:
        return UnsupportedModelError(f"{g.path}: metadata {key(k)} = {v!r} {why}")

    def integer(k: str, default: int | None, lo: int, hi: int) -> int:
        if key(k) not in md:
            if default is None:
                raise UnsupportedModelError(f"{g.path}: missing metadata key {key(k)} (a mixture-of-experts "
                                            f"{arch} model needs it)")
            return default
        v = md[key(k)]
        if isinstance(v, (list, tuple, np.ndarray)):
            # llama.cpp accepts a per-layer array; minfer runs one value for every layer.
            vals = {int(x) for x in v} if all(isinstance(x, (int, np.integer)) and not isinstance(x, bool)
                                              for x in v) else None
            if not vals or len(vals) != 1:
                raise bad(k, v, "is not one integer (per-layer values that differ are not supported)")
            v = vals.pop()
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise bad(k, v, "is not an integer")
        if not lo <= int(v) <= hi:
            raise bad(k, int(v), f"is out of range (must be in [{lo}, {hi}])")
        return int(v)

    n_expert = integer("expert_count", None, 1, _MAX_EXPERTS)
    n_used = integer("expert_used_count", None, 1, n_expert)
    # No expert_feed_forward_length: llama.cpp's qwen rule (feed_forward_length / n_used)
    # unless the architecture names its own (llama: feed_forward_length itself).
    n_ff = integer("expert_feed_forward_length", n_ff if n_ff is not None else max(1, model.hp.n_ff // n_used),
                   1, 1 << 24)
    gating_code = integer("expert_gating_func", Gating.Softmax.value, 0, 1 << 8)
    if gating_code == 0:   # LLAMA_EXPERT_GATING_FUNC_TYPE_NONE: the architecture's own (softmax)
        gating_code = Gating.Softmax.value
    try:
        gating = Gating(gating_code)
    except ValueError:
        raise bad("expert_gating_func", gating_code, "is not a supported gating function "
                  "(1 softmax, 2 sigmoid, 3 softmax of the picked logits)") from None
    if key("expert_weights_norm") in md:
        v = md[key("expert_weights_norm")]
        if not isinstance(v, (bool, np.bool_)):
            raise bad("expert_weights_norm", v, "is not a boolean")
        norm = bool(v)
    scale = md.get(key("expert_weights_scale"), 0.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.integer, np.floating)) \
            or not math.isfinite(float(scale)) or float(scale) < 0:
        raise bad("expert_weights_scale", scale, "is not a finite number >= 0")
    n_shared = integer("expert_shared_feed_forward_length", model.hp.n_ff, 1, 1 << 24) if shared else 0
    return MoeSpec(n_expert, n_used, n_ff, gating, norm, float(scale), n_shared)


def moe_tensors(model: ModelDef, p: str, spec: MoeSpec) -> dict:
    """The block's tensors of layer prefix p (name -> GGUF shape, ne0 first); ffn_norm
    is the caller's, as in the dense tables."""
    d, ff, ne = model.hp.n_embd, spec.n_ff, spec.n_expert
    t = {
        p + "ffn_gate_inp.weight": (d, ne),
        p + "ffn_gate_exps.weight": (d, ff, ne),
        p + "ffn_up_exps.weight": (d, ff, ne),
        p + "ffn_down_exps.weight": (ff, d, ne),
    }
    if spec.n_ff_shared:
        fs = spec.n_ff_shared
        t.update({
            p + "ffn_gate_inp_shexp.weight": (d,),
            p + "ffn_gate_shexp.weight": (d, fs),
            p + "ffn_up_shexp.weight": (d, fs),
            p + "ffn_down_shexp.weight": (fs, d),
        })
    return t


def moe_weight_bytes_per_token(model: ModelDef, spec: MoeSpec) -> int:
    """Bytes of weights a decode step reads: the expert tensors count n_used / n_expert of
    their bytes (each token reads only its picked experts' rows); everything else as the
    dense count does (every matmul weight once, one embedding row)."""
    total = 0
    for name in model.expected_tensors():
        t = model.tensors[name]
        if name.endswith("_exps.weight"):
            total += t.nbytes * spec.n_used // spec.n_expert
        elif name == "token_embd.weight" and model.output_weight != name:
            total += t.row_nbytes
        else:
            total += t.nbytes
    return total


def _mm(b: GraphBuilder, model: ModelDef, x: int, name: str) -> int:
    t = model.tensors[name]
    out = int(t.shape[1]) if len(t.shape) > 1 else 1   # ffn_gate_inp_shexp is a vector: one output
    return b.matmul(x, name, t.type, int(t.shape[0]), out, name=name[:-len(".weight")])


def moe_ffn(b: GraphBuilder, model: ModelDef, p: str, x: int, spec: MoeSpec) -> int:
    """The block on x [n_embd, nt] (already ffn-normed) of layer prefix p ('blk.N.');
    returns its output [n_embd, nt], to be added to the residual by the caller.

    Node names follow llama.cpp's callbacks (ffn_moe_logits, ffn_moe_topk, ...) under the
    layer prefix, so traces line up with a llama.cpp eval-callback dump."""
    hp = model.hp
    route = spec.route()
    logits = _mm(b, model, x, p + "ffn_gate_inp.weight")                         # [n_expert, nt]
    ids = b.moe_topk(logits, route, name=p + "ffn_moe_topk")                      # i32 [k, nt]
    weights = b.moe_weights(logits, route, name=p + "ffn_moe_weights")           # [k, nt]

    def exps(inp: int, which: str, out_dim: int, in_dim: int) -> int:
        name = f"{p}ffn_{which}_exps.weight"
        return b.matmul_id(inp, ids, name, model.tensors[name].type, in_dim, out_dim, spec.n_expert,
                           name=f"{p}ffn_moe_{which}")

    gate = exps(x, "gate", spec.n_ff, hp.n_embd)                                 # [n_ff, k, nt]
    up = exps(x, "up", spec.n_ff, hp.n_embd)
    # Left as silu * mul: FusionPass folds it into SwiGLU where the backend can.
    act = b.mul(b.silu(gate, name=p + "ffn_moe_silu"), up, name=p + "ffn_moe_swiglu")
    down = exps(act, "down", hp.n_embd, spec.n_ff)                               # [n_embd, k, nt]
    out = b.moe_sum(down, weights, name=p + "ffn_moe_out")                       # [n_embd, nt]
    if not spec.n_ff_shared:
        return out
    # The shared expert, gated per token by sigmoid(w . x): a weighted sum of one slot.
    sg = _mm(b, model, x, p + "ffn_gate_inp_shexp.weight")                       # [1, nt]
    sg = b.sigmoid(sg, name=p + "ffn_shexp_gate")
    s_gate = _mm(b, model, x, p + "ffn_gate_shexp.weight")
    s_up = _mm(b, model, x, p + "ffn_up_shexp.weight")
    s_act = b.mul(b.silu(s_gate, name=p + "ffn_shexp_silu"), s_up, name=p + "ffn_shexp_act")
    shexp = _mm(b, model, s_act, p + "ffn_down_shexp.weight")                    # [n_embd, nt]
    shexp = b.moe_sum(shexp, sg, name=p + "ffn_shexp_out")                       # times the gate: k = 1
    return b.add(out, shexp, name=p + "ffn_out")


def moe_layer(g: DecoderGraph, il: int, h: int, spec: AttnSpec, moe: MoeSpec, *, qkv_bias: str = "none",
              qk_norm: bool = False, o_bias: bool = False) -> int:
    """blocks.DecoderGraph.pre_norm_layer with the MoE block as its FFN: x + attn(norm(x)),
    then x + moe_ffn(norm(x)) (Qwen2-MoE, Qwen3-MoE, Mixtral)."""
    b, p = g.b, f"blk.{il}."
    residual = h
    x = g.norm(h, p + "attn_norm.weight", p + "attn_norm")
    q, k, v = g.qkv(p, x, qkv_bias)
    a = g.attention(il, q, k, v, spec, qk_norm)
    wo = g.mm(a, p + "attn_output.weight", g.opt_bias(p + "attn_output.bias") if o_bias else None)
    wo, residual = g.tail_rows(il, wo, residual)
    h = b.add(residual, wo, name=p + "attn_residual")
    x = g.norm(h, p + "ffn_norm.weight", p + "ffn_norm")
    return b.add(h, moe_ffn(b, g.model, p, x, moe), name=p + "ffn_residual")
