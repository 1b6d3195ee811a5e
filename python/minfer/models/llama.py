"""Llama (GGUF general.architecture "llama"): Llama 2, Llama 3 / 3.1 / 3.2, Mistral 7B,
SmolLM / SmolLM2, TinyLlama, CodeLlama and the many fine-tunes that keep the layout.

The pre-norm block of blocks.DecoderGraph with llama.cpp's LLAMA rope type: the
converter permutes q and k so that RoPE rotates interleaved pairs (RopeStyle.Normal).
What the file says is read and checked:

- head dims: attention.key_length (Mistral Nemo: 128 with n_embd / n_head = 160) and
  rope.dimension_count, which llama.cpp requires to equal the head dim;
- RoPE scaling: rope.scaling.type none or linear (rope.scaling.factor, or the older
  rope.scale_linear), and Llama 3.1 / 3.2's `llama3` scaling, which the converter writes
  as the per-frequency factors tensor rope_freqs.weight (computed from the HF config's
  factor, low/high_freq_factor and original context as llama.cpp's convert_hf_to_gguf.py
  does); anything else is refused by name;
- optional biases on the q/k/v/output projections and the FFN (llama.cpp loads them
  when present);
- tied embeddings: no output.weight means token_embd.weight is the lm head.
"""

from __future__ import annotations

from functools import cached_property

from minfer.errors import UnsupportedModelError
from minfer.graph.ir import ComputeGraph, RopeStyle
from minfer.graph.params import GraphParams
from minfer.models.base import ModelDef
from minfer.models.moe import MoeSpec, moe_layer, moe_tensors, moe_weight_bytes_per_token, read_moe_spec  # MoE
from minfer.models.blocks import (AttnSpec, DecoderGraph, RopeSpec, attn_tensors, default_scale, ffn_tensors,
                                  full_rotary, head_tensors, rope_scaling)


class LlamaModel(ModelDef):
    arch = "llama"

    def _read_hparams(self, g):
        hp = super()._read_hparams(g)
        md = self.meta
        full_rotary(self, hp.head_dim)
        n_vocab = md.count("vocab_size", hp.n_vocab)
        if n_vocab != hp.n_vocab:
            raise UnsupportedModelError(f"{g.path}: {self.arch}.vocab_size {n_vocab} disagrees with token_embd.weight's "
                                        f"{hp.n_vocab} rows")
        self.freq_scale = rope_scaling(self)
        factors = g.tensors.get("rope_freqs.weight")
        if factors is not None and tuple(int(d) for d in factors.shape) not in ((hp.head_dim // 2,), (hp.head_dim // 2, 1)):
            raise UnsupportedModelError(f"{g.path}: rope_freqs.weight has shape {list(factors.shape)}, expected "
                                        f"[{hp.head_dim // 2}]")
        self.rope_factors = "rope_freqs.weight" if factors is not None else None
        return hp

    # ---- MoE: llama with experts (Mixtral), models/moe.py --------------------------------
    @cached_property
    def moe(self) -> MoeSpec | None:
        """The experts' layout when the file has expert_count (their width is
        feed_forward_length, weights renormalised: llama.cpp's llama), else None."""
        if not self.meta.count("expert_count", 0, lo=0):
            return None
        return read_moe_spec(self, norm=True, n_ff=self.hp.n_ff)

    def weight_bytes_per_token(self) -> int:
        return moe_weight_bytes_per_token(self, self.moe) if self.moe else super().weight_bytes_per_token()
    # ---- end MoE --------------------------------------------------------------------------

    def expected_tensors(self) -> dict[str, tuple[int, ...]]:
        hp = self.hp
        t = head_tensors(self)
        if self.rope_factors:
            t[self.rope_factors] = (hp.head_dim // 2,)
        for il in range(hp.n_layer):
            p = f"blk.{il}."
            t.update(attn_tensors(self, p, bias="optional", o_bias=True))
            if self.moe:  # MoE (Mixtral)
                t[p + "ffn_norm.weight"] = (hp.n_embd,)
                t.update(moe_tensors(self, p, self.moe))
            else:
                t.update(ffn_tensors(self, p, bias=True))
        return t

    def attn_spec(self, il: int) -> AttnSpec:
        hp = self.hp
        rope = RopeSpec(hp.rope_base, hp.head_dim, RopeStyle.Normal, freq_scale=self.freq_scale,
                        factors=self.rope_factors)
        return AttnSpec(rope, default_scale(hp.head_dim))

    def build_graph(self, params: GraphParams) -> ComputeGraph:
        g = DecoderGraph(self, params)
        h = g.embed()
        for il in range(self.hp.n_layer):
            if self.moe:  # MoE (Mixtral): the experts in place of the FFN
                h = moe_layer(g, il, h, self.attn_spec(il), self.moe, qkv_bias="optional", o_bias=True)
                continue
            h = g.pre_norm_layer(il, h, self.attn_spec(il), qkv_bias="optional", o_bias=True, ffn_bias=True)
        return g.head(h)
