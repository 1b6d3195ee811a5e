"""Phi-3 / Phi-3.5 / Phi-4-mini, GGUF architecture "phi3".

The pre-norm block of blocks.DecoderGraph with the fused tensors used as they are: one
attn_qkv matmul whose rows are q | k | v and one ffn_up matmul whose rows are gate | up,
each sliced apart after the matmul (nothing is split at load). NeoX RoPE over
rope.dimension_count dims (Phi-4-mini rotates 3/4 of each head).

LongRoPE (Phi-3 128k, Phi-3.5, Phi-4-mini): when the file has rope_factors_long /
rope_factors_short, llama.cpp divides each frequency by the long factors when the context
exceeds rope.scaling.original_context_length and by the short ones otherwise, and scales
cos and sin by rope.scaling.attn_factor; so does this graph, deciding on the context the
graph is built for (the whole KV arena when several sequences share it). transformers
instead switches per forward on the longest position seen, so the two agree on short
prompts with a short context and on long ones with a long context.

Sliding window: attention.sliding_window > 0 (Phi-3-mini: 2047) limits every layer's
attention to that many positions, as transformers does. llama.cpp currently ignores the
key for phi3 (full attention, "Phi SWA is currently disabled"), so past the window the two
differ; Phi-4-mini's converter writes 0 (none).
"""

from __future__ import annotations

from minfer.errors import UnsupportedModelError
from minfer.graph.ir import ComputeGraph
from minfer.graph.params import GraphParams
from minfer.models.base import ModelDef
from minfer.models.blocks import AttnSpec, DecoderGraph, RopeSpec, attn_tensors, default_scale, ffn_tensors, head_tensors


class Phi3Model(ModelDef):
    arch = "phi3"

    def _read_hparams(self, g):
        hp = super()._read_hparams(g)
        md = self.meta
        self.n_rot = md.count("rope.dimension_count", hp.head_dim)
        if self.n_rot > hp.head_dim or self.n_rot % 2:
            raise UnsupportedModelError(f"{self.arch}: rope.dimension_count {self.n_rot} must be even and at most "
                                        f"the head dim {hp.head_dim}")
        kind = md.string("rope.scaling.type", None)
        if kind not in (None, "none", "longrope"):
            raise UnsupportedModelError(f"{self.arch}: rope scaling type {kind!r} is not supported "
                                        f"(supported: none, longrope)")
        self.window = md.count("attention.sliding_window", 0, lo=0)
        self.n_ctx_orig = md.count("rope.scaling.original_context_length", hp.n_ctx_train)
        self.attn_factor = md.real("rope.scaling.attn_factor", 1.0, lambda v: v > 0, "a finite number > 0")
        have = [n for n in ("rope_factors_long.weight", "rope_factors_short.weight") if n in g.tensors]
        if len(have) == 1:
            raise UnsupportedModelError(f"{g.path}: {have[0]} without its long/short counterpart")
        self.longrope = bool(have)
        return hp

    def expected_tensors(self) -> dict[str, tuple[int, ...]]:
        hp = self.hp
        t = head_tensors(self)
        if self.longrope:
            t["rope_factors_long.weight"] = (self.n_rot // 2,)
            t["rope_factors_short.weight"] = (self.n_rot // 2,)
        for il in range(hp.n_layer):
            p = f"blk.{il}."
            t.update(attn_tensors(self, p, fused=True, bias="optional", o_bias=True))
            t.update(ffn_tensors(self, p, fused=True))
        return t

    def attn_spec(self, n_ctx: int) -> AttnSpec:
        hp = self.hp
        factors = None
        if self.longrope:
            factors = "rope_factors_long.weight" if n_ctx > self.n_ctx_orig else "rope_factors_short.weight"
        rope = RopeSpec(hp.rope_base, self.n_rot, attn_factor=self.attn_factor, factors=factors)
        return AttnSpec(rope, default_scale(hp.head_dim), window=self.window)

    def build_graph(self, params: GraphParams) -> ComputeGraph:
        g = DecoderGraph(self, params)
        h = g.embed()
        # Per sequence, as llama.cpp's n_ctx_per_seq: a context of many sequences is not one long one.
        spec = self.attn_spec(params.cparams.seq_ctx or params.cparams.n_ctx)
        for il in range(self.hp.n_layer):
            h = g.pre_norm_layer(il, h, spec, qkv_bias="optional", fused_qkv=True, o_bias=True, fused_up=True)
        return g.head(h)
