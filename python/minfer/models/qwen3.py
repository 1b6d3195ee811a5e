"""Qwen3 (§4.4): the Qwen2 skeleton with per-head RMSNorm on q and k, no attention
biases, and a head dim decoupled from n_embd / n_head (attention.key_length)."""

from __future__ import annotations

from minfer.models.qwen2 import Qwen2Model


class Qwen3Model(Qwen2Model):
    arch = "qwen3"
    qk_norm = True
    qkv_bias = False
