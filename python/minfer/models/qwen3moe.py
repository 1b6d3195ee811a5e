"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head RMSNorm on q
and k, no biases, head dim from attention.key_length) with the mixture-of-experts FFN:
softmax routing, expert_used_count of expert_count experts per token, their weights
renormalised to sum to 1 (llama.cpp's default for the architecture), no shared expert."""

from __future__ import annotations

from minfer.models.qwen2moe import Qwen2MoeModel


class Qwen3MoeModel(Qwen2MoeModel):
    arch = "qwen3moe"
    qk_norm = True
    qkv_bias = False
    shared_expert = False
    norm_w = True
