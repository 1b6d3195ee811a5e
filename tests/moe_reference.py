"""Float64 NumPy reference forward for the mixture-of-experts GGUFs (qwen2moe, qwen3moe,
llama with experts), on the `gguf` package's dequantization of the file's own weights.

It extends tests/reference_forward.py (same helpers, same attention and act_quant
rounding; no minfer code): the dense FFN becomes llama.cpp's build_moe_ffn for these
architectures (softmax over the router's logits, the top n_used, weights renormalised
for qwen3moe and llama, the shared expert gated by a sigmoid for qwen2moe), and llama's
RoPE is the normal (interleaved-pair) style. Routing is computed in float64 here, so a
token whose k-th and (k+1)-th router logits nearly tie may pick a different expert than
an engine in float32; `router_margins` reports how close each token came.
"""

from __future__ import annotations

from types import SimpleNamespace

import gguf
import numpy as np

from reference_forward import (KVCache, ReferenceModel, _dequant, _fake_q8_0, _fake_q8_k, _field, _rms_norm, _silu,
                               _Weight, _Q8_0_FAMILY, _Q8_K_FAMILY)


class _Experts:
    """A 3-D expert tensor [n_expert][out][in], dequantized, with its input rounding."""

    def __init__(self, t, act_quant: bool):
        ne0, ne1, ne2 = (int(s) for s in t.shape[:3])
        self.w = _dequant(t).reshape(ne2, ne1, ne0)
        name = t.tensor_type.name
        self.fake = None
        if act_quant and name in _Q8_0_FAMILY:
            self.fake = _fake_q8_0
        elif act_quant and name in _Q8_K_FAMILY:
            self.fake = _fake_q8_k

    def apply(self, e: int, x: np.ndarray) -> np.ndarray:
        if self.fake is not None:
            x = self.fake(x)
        return x @ self.w[e].T


class MoeReference(ReferenceModel):
    def __init__(self, path: str, act_quant: bool = False, kv_f16: bool = False):
        self.kv_f16 = kv_f16
        reader = gguf.GGUFReader(path)
        arch = _field(reader, "general.architecture")
        if arch not in ("qwen2moe", "qwen3moe", "llama"):
            raise ValueError(f"MoE reference supports qwen2moe/qwen3moe/llama, got {arch!r}")
        self.arch = arch
        f = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
        self.n_layer = int(f("block_count"))
        self.n_embd = int(f("embedding_length"))
        self.n_head = int(f("attention.head_count"))
        self.n_head_kv = int(f("attention.head_count_kv", self.n_head))
        self.head_dim = int(f("attention.key_length", self.n_embd // self.n_head))
        self.eps = float(f("attention.layer_norm_rms_epsilon", 1e-6))
        self.rope_base = float(f("rope.freq_base", 10000.0))
        self.n_expert = int(f("expert_count"))
        self.n_used = int(f("expert_used_count"))
        self.norm_w = bool(f("expert_weights_norm", arch != "qwen2moe"))
        tensors = {t.name: t for t in reader.tensors}
        self._tensors, self._reader = tensors, reader

        get = lambda n: _dequant(tensors[n])  # noqa: E731
        mat = lambda n: _Weight(tensors[n], act_quant)  # noqa: E731
        opt_vec = lambda n: get(n).reshape(-1) if n in tensors else None  # noqa: E731
        self.layers = []
        for i in range(self.n_layer):
            p = f"blk.{i}."
            L = SimpleNamespace(
                attn_norm=get(p + "attn_norm.weight").reshape(-1),
                wq=mat(p + "attn_q.weight"), wk=mat(p + "attn_k.weight"), wv=mat(p + "attn_v.weight"),
                wo=mat(p + "attn_output.weight"),
                bq=opt_vec(p + "attn_q.bias"), bk=opt_vec(p + "attn_k.bias"), bv=opt_vec(p + "attn_v.bias"),
                q_norm=opt_vec(p + "attn_q_norm.weight"), k_norm=opt_vec(p + "attn_k_norm.weight"),
                ffn_norm=get(p + "ffn_norm.weight").reshape(-1),
                router=mat(p + "ffn_gate_inp.weight"),
                gate=_Experts(tensors[p + "ffn_gate_exps.weight"], act_quant),
                up=_Experts(tensors[p + "ffn_up_exps.weight"], act_quant),
                down=_Experts(tensors[p + "ffn_down_exps.weight"], act_quant),
                shexp=None,
            )
            if p + "ffn_gate_shexp.weight" in tensors:
                L.shexp = SimpleNamespace(inp=mat(p + "ffn_gate_inp_shexp.weight"), gate=mat(p + "ffn_gate_shexp.weight"),
                                          up=mat(p + "ffn_up_shexp.weight"), down=mat(p + "ffn_down_shexp.weight"))
            self.layers.append(L)
        self.output_norm = get("output_norm.weight").reshape(-1)
        self._embd = tensors["token_embd.weight"]
        self.n_vocab = int(self._embd.shape[1])
        self.lm_head = mat("output.weight") if "output.weight" in tensors else mat("token_embd.weight")
        self.w_out = self.lm_head.w
        hd = self.head_dim
        self._inv_freq = self.rope_base ** (-np.arange(0, hd // 2, dtype=np.float64) * 2.0 / hd)
        self.margins: list[float] = []   # per routed token: logit k - logit k+1 (smallest gap)

    def _rope(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        if self.arch != "llama":
            return super()._rope(x, pos)
        # Normal style: pairs (2i, 2i + 1).
        ang = pos[:, None].astype(np.float64) * self._inv_freq[None, :]
        cos, sin = np.cos(ang), np.sin(ang)
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = x0 * cos - x1 * sin
        out[..., 1::2] = x0 * sin + x1 * cos
        return out

    def _moe(self, L, h: np.ndarray) -> np.ndarray:
        logits = h @ L.router                                  # [n_tok, n_expert]
        z = logits - logits.max(axis=1, keepdims=True)
        probs = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
        order = np.argsort(-logits, axis=1, kind="stable")
        ids = order[:, :self.n_used]
        srt = np.take_along_axis(logits, order, axis=1)
        if self.n_used < self.n_expert:
            self.margins.extend((srt[:, self.n_used - 1] - srt[:, self.n_used]).tolist())
        w = np.take_along_axis(probs, ids, axis=1)
        if self.norm_w:
            w = w / np.maximum(w.sum(axis=1, keepdims=True), 6.103515625e-5)
        out = np.zeros_like(h)
        for t in range(h.shape[0]):
            x = h[t:t + 1]
            for j, e in enumerate(ids[t]):
                a = _silu(L.gate.apply(e, x)) * L.up.apply(e, x)
                out[t] += w[t, j] * L.down.apply(e, a)[0]
        if L.shexp is not None:
            s = L.shexp
            g = 1.0 / (1.0 + np.exp(-(h @ s.inp)))              # [n_tok, 1]
            out = out + g * ((_silu(h @ s.gate) * (h @ s.up)) @ s.down)
        return out

    def _hidden(self, tokens, cache: KVCache) -> np.ndarray:
        x = self.embed(tokens)
        for li, L in enumerate(self.layers):
            x = x + self._attention(L, li, _rms_norm(x, L.attn_norm, self.eps), cache)
            x = x + self._moe(L, _rms_norm(x, L.ffn_norm, self.eps))
        cache.n_past += len(tokens)
        return _rms_norm(x, self.output_norm, self.eps)

    def _hidden_batch(self, seqs: list, caches: list[KVCache]) -> list[np.ndarray]:
        return [self._hidden(s, c) for s, c in zip(seqs, caches)]
