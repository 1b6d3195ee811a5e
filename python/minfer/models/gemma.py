"""Gemma 2 and Gemma 3 (text), GGUF architectures "gemma2" and "gemma3".

The sandwich block of blocks.DecoderGraph: RMSNorm before and after attention and
before and after the FFN, a GELU-tanh gated FFN, the embeddings scaled by sqrt(n_embd),
NeoX RoPE. Gemma's norms compute x * (1 + w); llama.cpp's convert_hf_to_gguf.py adds
the 1 to every *norm.weight when converting (conversion/gemma.py), so the file's norms
are plain RMSNorm weights and are used as they are.

Read from the file, with llama.cpp's defaults (src/models/gemma2.cpp, gemma3.cpp):

- sliding windows: attention.sliding_window (Gemma 2: 4096 when absent; Gemma 3: no
  sliding layers when absent or 0) on the layers attention.sliding_window_pattern marks
  (a per-layer array, or n: layer il slides unless il % n == n - 1; default 2 for Gemma 2,
  6 for Gemma 3: 5 local : 1 global);
- RoPE: rope.freq_base on global layers, rope.freq_base_swa on local ones (Gemma 2: the
  global base; Gemma 3: 10000), linear rope.scaling.factor on the global layers only for
  Gemma 3 (its 4B+ use 8), on both for Gemma 2;
- soft-capping: attn_logit_softcapping (Gemma 2: 50 when absent; Gemma 3 has none) and
  final_logit_softcapping (Gemma 2: 30; Gemma 3: none unless given);
- the query pre-attention scale: 1/sqrt(head_dim), except the 27B models (46 layers for
  Gemma 2, 62 for Gemma 3), where it is 1/sqrt(n_embd / n_head), as llama.cpp decides it
  (the HF config's query_pre_attn_scalar is not in the GGUF).
"""

from __future__ import annotations

import math

from minfer.graph.ir import ComputeGraph
from minfer.graph.params import GraphParams
from minfer.models.base import ModelDef
from minfer.models.blocks import (AttnSpec, DecoderGraph, RopeSpec, attn_tensors, ffn_tensors, full_rotary,
                                  head_tensors, rope_scaling)


class Gemma2Model(ModelDef):
    arch = "gemma2"
    qk_norm = False
    default_window = 4096       # used when the file names none
    default_pattern = 2
    layers_27b = 46

    def _read_hparams(self, g):
        hp = super()._read_hparams(g)
        md = self.meta
        full_rotary(self, hp.head_dim)
        self.freq_scale = rope_scaling(self)
        self.window = md.count("attention.sliding_window", self.default_window, lo=0)
        self.swa_layers = self._swa_layers(hp.n_layer) if self.window > 0 else [False] * hp.n_layer
        self.base_swa = md.real("rope.freq_base_swa", self._default_base_swa(hp), lambda v: v > 0,
                                "a finite number > 0")
        self.attn_softcap = self._attn_softcap()
        self.final_softcap = md.real("final_logit_softcapping", self._default_final_softcap(), lambda v: v >= 0,
                                     "a finite number >= 0")
        big = hp.n_layer == self.layers_27b
        self.scale = 1.0 / math.sqrt(hp.n_embd // hp.n_head if big else hp.head_dim)
        return hp

    def _swa_layers(self, n_layer: int) -> list:
        md = self.meta
        flags = None
        if md.has("attention.sliding_window_pattern") and not isinstance(
                md.md[md.key("attention.sliding_window_pattern")], (int, float)):
            flags = md.flags("attention.sliding_window_pattern", n_layer)
        if flags is not None:
            return flags
        n = md.count("attention.sliding_window_pattern", self.default_pattern, lo=0)
        return [n == 0 or il % n < n - 1 for il in range(n_layer)]

    def _default_base_swa(self, hp) -> float:
        return hp.rope_base

    def _attn_softcap(self) -> float:
        return self.meta.real("attn_logit_softcapping", 50.0, lambda v: v > 0, "a finite number > 0")

    def _default_final_softcap(self) -> float:
        return 30.0

    def _swa_freq_scale(self) -> float:
        return self.freq_scale

    def expected_tensors(self) -> dict[str, tuple[int, ...]]:
        hp = self.hp
        t = head_tensors(self)
        for il in range(hp.n_layer):
            p = f"blk.{il}."
            t.update(attn_tensors(self, p, qk_norm=self.qk_norm))
            t[p + "post_attention_norm.weight"] = (hp.n_embd,)
            t.update(ffn_tensors(self, p))
            t[p + "post_ffw_norm.weight"] = (hp.n_embd,)
        return t

    def attn_spec(self, il: int) -> AttnSpec:
        hp = self.hp
        if self.swa_layers[il]:
            rope = RopeSpec(self.base_swa, hp.head_dim, freq_scale=self._swa_freq_scale())
            return AttnSpec(rope, self.scale, window=self.window, softcap=self.attn_softcap)
        rope = RopeSpec(hp.rope_base, hp.head_dim, freq_scale=self.freq_scale)
        return AttnSpec(rope, self.scale, softcap=self.attn_softcap)

    def build_graph(self, params: GraphParams) -> ComputeGraph:
        hp = self.hp
        g = DecoderGraph(self, params)
        h = g.b.scale(g.embed(), math.sqrt(hp.n_embd), name="token_embd_scaled")
        for il in range(hp.n_layer):
            h = g.sandwich_layer(il, h, self.attn_spec(il), qk_norm=self.qk_norm)
        return g.head(h, self.final_softcap)


class Gemma3Model(Gemma2Model):
    arch = "gemma3"
    qk_norm = True
    default_window = 0          # no sliding_window key: every layer is global
    default_pattern = 6
    layers_27b = 62

    def _default_base_swa(self, hp) -> float:
        return 10000.0

    def _attn_softcap(self) -> float:
        return 0.0

    def _default_final_softcap(self) -> float:
        return 0.0

    def _swa_freq_scale(self) -> float:
        return 1.0
