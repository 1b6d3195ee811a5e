"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): the Qwen2 layer (q/k/v biases, NeoX
RoPE, GQA) with the mixture-of-experts FFN of models/moe.py in place of the dense one:
softmax routing over expert_count experts, expert_used_count of them per token, their
weights not renormalised, plus the shared expert gated by a sigmoid.

Qwen3-MoE (qwen3moe.py) is the same layer with Qwen3's attention (per-head q/k norms, no
biases), no shared expert and renormalised weights."""

from __future__ import annotations

from functools import cached_property

from minfer.graph.ir import ComputeGraph
from minfer.graph.params import GraphParams
from minfer.models.base import ModelDef
from minfer.models.blocks import AttnSpec, DecoderGraph, RopeSpec, attn_tensors, default_scale, head_tensors
from minfer.models.moe import MoeSpec, moe_layer, moe_tensors, moe_weight_bytes_per_token, read_moe_spec


class Qwen2MoeModel(ModelDef):
    arch = "qwen2moe"
    qk_norm = False       # Qwen3-MoE: per-head RMSNorm on q and k before RoPE
    qkv_bias = True       # biases on the q/k/v projections
    shared_expert = True  # the sigmoid-gated shared expert
    norm_w = False        # llama.cpp's default for the architecture (expert_weights_norm overrides)

    @cached_property
    def moe(self) -> MoeSpec:
        return read_moe_spec(self, norm=self.norm_w, shared=self.shared_expert)

    def expected_tensors(self) -> dict[str, tuple[int, ...]]:
        t = head_tensors(self)
        for il in range(self.hp.n_layer):
            p = f"blk.{il}."
            t.update(attn_tensors(self, p, bias="all" if self.qkv_bias else "none", qk_norm=self.qk_norm))
            t[p + "ffn_norm.weight"] = (self.hp.n_embd,)
            t.update(moe_tensors(self, p, self.moe))
        return t

    def weight_bytes_per_token(self) -> int:
        return moe_weight_bytes_per_token(self, self.moe)

    def build_graph(self, params: GraphParams) -> ComputeGraph:
        hp = self.hp
        g = DecoderGraph(self, params)
        h = g.embed()
        spec = AttnSpec(RopeSpec(hp.rope_base, hp.head_dim), default_scale(hp.head_dim))
        for il in range(hp.n_layer):
            h = moe_layer(g, il, h, spec, self.moe, qkv_bias="all" if self.qkv_bias else "none", qk_norm=self.qk_norm)
        return g.head(h)
