"""Qwen2 (§4.1–§4.3 of the design of record): pre-norm transformer blocks with q/k/v
biases, NeoX RoPE, GQA attention, SwiGLU FFN, and the G3 tail-row reduction.

Qwen3 (qwen3.py) shares this skeleton and only changes the attention projections, so
the block is written once here with the two switches it needs."""

from __future__ import annotations

import math

from minfer.graph.builder import GraphBuilder
from minfer.graph.ir import AttnMeta, ComputeGraph, DType, RoPEMeta
from minfer.graph.params import GraphParams
from minfer.models.base import ModelDef


class Qwen2Model(ModelDef):
    arch = "qwen2"
    qk_norm = False  # Qwen3: per-head RMSNorm on q and k before RoPE
    qkv_bias = True  # Qwen2: biases on the q/k/v projections

    def expected_tensors(self) -> dict[str, tuple[int, ...]]:
        hp = self.hp
        d, qd, kvd, ff = hp.n_embd, hp.q_dim, hp.kv_dim, hp.n_ff
        t = {"token_embd.weight": (d, hp.n_vocab), "output_norm.weight": (d,)}
        if self.has("output.weight"):
            t["output.weight"] = (d, hp.n_vocab)
        for il in range(hp.n_layer):
            p = f"blk.{il}."
            t[p + "attn_norm.weight"] = (d,)
            t[p + "attn_q.weight"] = (d, qd)
            t[p + "attn_k.weight"] = (d, kvd)
            t[p + "attn_v.weight"] = (d, kvd)
            t[p + "attn_output.weight"] = (qd, d)
            if self.qkv_bias:
                t[p + "attn_q.bias"] = (qd,)
                t[p + "attn_k.bias"] = (kvd,)
                t[p + "attn_v.bias"] = (kvd,)
            if self.qk_norm:
                t[p + "attn_q_norm.weight"] = (hp.head_dim,)
                t[p + "attn_k_norm.weight"] = (hp.head_dim,)
            t[p + "ffn_norm.weight"] = (d,)
            t[p + "ffn_gate.weight"] = (d, ff)
            t[p + "ffn_up.weight"] = (d, ff)
            t[p + "ffn_down.weight"] = (ff, d)
        return t

    def _mm(self, b: GraphBuilder, x: int, name: str, bias: str | None = None) -> int:
        t = self.tensors[name]
        return b.matmul(x, name, t.type, int(t.shape[0]), int(t.shape[1]), bias_name=bias, name=name[:-len(".weight")])

    def build_graph(self, params: GraphParams) -> ComputeGraph:
        hp = self.hp
        nt, n_out, n_ctx = params.n_tokens, params.n_out, params.cparams.n_ctx
        b = GraphBuilder()
        span_on = params.cparams.explicit_span
        kvt = DType(params.cparams.kv_type)
        tokens = b.input("token_ids", (nt,), DType.I32)
        # positions: a token's index in its sequence (RoPE, and the causal bound of one
        # sequence); cells: its KV row in the arena. Apart, so one graph can hold several
        # sequences; then kv_span gives each token the [lo, hi) cells it may attend to.
        pos = b.input("positions", (nt,), DType.I32)
        cells = b.input("cells", (nt,), DType.I32)
        span = b.input("kv_span", (2 * nt,), DType.I32) if span_on else None
        # Declared at the head, not beside its consumer: an input mid-graph would cut a
        # GPU run into extra splits (R3-A1).
        tail = b.input("tail_ids", (n_out,), DType.I32) if n_out < nt else None

        emb = self.tensors["token_embd.weight"]
        h = b.embedding(tokens, "token_embd.weight", emb.type, hp.n_embd, hp.n_vocab, name="token_embd")
        rope = lambda nh: RoPEMeta(n_rot=hp.head_dim, freq_base=hp.rope_base, hd=hp.head_dim, nh=nh)  # noqa: E731
        scale = 1.0 / math.sqrt(hp.head_dim)

        for il in range(hp.n_layer):
            p = f"blk.{il}."
            residual = h
            x = b.rms_norm(h, p + "attn_norm.weight", hp.eps, name=p + "attn_norm")
            bias = (lambda n: p + n) if self.qkv_bias else (lambda n: None)
            q = self._mm(b, x, p + "attn_q.weight", bias("attn_q.bias"))
            k = self._mm(b, x, p + "attn_k.weight", bias("attn_k.bias"))
            v = self._mm(b, x, p + "attn_v.weight", bias("attn_v.bias"))
            if self.qk_norm:
                q = b.qk_norm(q, p + "attn_q_norm.weight", hp.head_dim, hp.n_head, hp.eps, name=p + "q_norm")
                k = b.qk_norm(k, p + "attn_k_norm.weight", hp.head_dim, hp.n_head_kv, hp.eps, name=p + "k_norm")
            q = b.rope(q, pos, rope(hp.n_head), name=p + "q_rope")
            k = b.rope(k, pos, rope(hp.n_head_kv), name=p + "k_rope")
            b.kvcache_store(il, k, v, cells, hp.kv_dim, n_ctx, name=p + "kv_store", kv_type=kvt)
            kv = b.kvcache_load(il, hp.kv_dim, n_ctx, name=p + "kv_load", kv_type=kvt)
            a = b.attn(q, kv, pos, AttnMeta(layer=il, n_head=hp.n_head, n_head_kv=hp.n_head_kv, hd=hp.head_dim,
                                            scale=scale, n_ctx=n_ctx, explicit_span=span_on, kv_type=kvt), span=span,
                       name=p + "attn")
            wo = self._mm(b, a, p + "attn_output.weight")
            if tail is not None and il == hp.n_layer - 1:
                # G3: from here on only the rows that need logits are computed.
                wo = b.get_rows(wo, tail, (hp.n_embd, n_out), name=p + "attn_out_tail")
                residual = b.get_rows(residual, tail, (hp.n_embd, n_out), name=p + "residual_tail")
            h = b.add(residual, wo, name=p + "attn_residual")

            residual = h
            x = b.rms_norm(h, p + "ffn_norm.weight", hp.eps, name=p + "ffn_norm")
            gate = self._mm(b, x, p + "ffn_gate.weight")
            up = self._mm(b, x, p + "ffn_up.weight")
            # Left as silu * mul: FusionPass folds it into SwiGLU where the backend can.
            act = b.mul(b.silu(gate, name=p + "ffn_silu"), up, name=p + "ffn_act")
            down = self._mm(b, act, p + "ffn_down.weight")
            h = b.add(residual, down, name=p + "ffn_residual")

        x = b.rms_norm(h, "output_norm.weight", hp.eps, name="output_norm")
        if params.hidden:       # embeddings: the normed hidden states, no lm head
            b.output(x)
            return b.build()
        out = self.tensors[self.output_weight]
        logits = b.matmul(x, self.output_weight, out.type, hp.n_embd, hp.n_vocab, name="logits")
        b.output(logits)
        return b.build()
