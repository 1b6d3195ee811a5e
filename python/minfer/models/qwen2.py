"""Qwen2 (§4.1–§4.3 of the design of record): pre-norm transformer blocks with q/k/v
biases, NeoX RoPE, GQA attention, SwiGLU FFN, and the G3 tail-row reduction.

Qwen3 (qwen3.py) shares this skeleton and only changes the attention projections: the
layer is blocks.DecoderGraph.pre_norm_layer with the two switches it needs."""

from __future__ import annotations

from minfer.graph.ir import ComputeGraph
from minfer.graph.params import GraphParams
from minfer.models.base import ModelDef
from minfer.models.blocks import (AttnSpec, DecoderGraph, RopeSpec, attn_tensors, default_scale, ffn_tensors,
                                  head_tensors)


class Qwen2Model(ModelDef):
    arch = "qwen2"
    qk_norm = False  # Qwen3: per-head RMSNorm on q and k before RoPE
    qkv_bias = True  # Qwen2: biases on the q/k/v projections

    def expected_tensors(self) -> dict[str, tuple[int, ...]]:
        t = head_tensors(self)
        for il in range(self.hp.n_layer):
            p = f"blk.{il}."
            t.update(attn_tensors(self, p, bias="all" if self.qkv_bias else "none", qk_norm=self.qk_norm))
            t.update(ffn_tensors(self, p))
        return t

    def build_graph(self, params: GraphParams) -> ComputeGraph:
        hp = self.hp
        g = DecoderGraph(self, params)
        h = g.embed()
        spec = AttnSpec(RopeSpec(hp.rope_base, hp.head_dim), default_scale(hp.head_dim))
        for il in range(hp.n_layer):
            h = g.pre_norm_layer(il, h, spec, qkv_bias="all" if self.qkv_bias else "none", qk_norm=self.qk_norm)
        return g.head(h)
