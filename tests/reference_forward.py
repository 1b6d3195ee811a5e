"""Independent float64 NumPy forward pass for Qwen2/Qwen3 GGUF models.

Built only from the ``gguf`` package (GGUFReader + gguf.quants.dequantize) and NumPy so
that it shares no code with minfer: a bug in our loaders, kernels or graph cannot hide
by being mirrored here. Weights are dequantized once and held as float64 (the real
0.5B model is ~4 GB that way); mixed float32-weight/float64-activation matmuls were
measured ~6x slower per decode step, which would blow the test-time budget.

Activations and accumulation are float64 throughout, so the only approximation left is
the weight quantization itself, which the engine sees identically.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np


def _field(reader: gguf.GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _dequant(t) -> np.ndarray:
    """Tensor -> float64 array shaped (rows, ne0), i.e. ggml's row-major view."""
    ne0 = int(t.shape[0])
    rows = int(np.prod([int(s) for s in t.shape[1:]])) if len(t.shape) > 1 else 1
    data = np.asarray(t.data)
    if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return data.astype(np.float64).reshape(rows, ne0)
    data = data.reshape(rows, -1)
    out = np.empty((rows, ne0), dtype=np.float64)
    # Row chunks bound the float32 temporaries gguf's dequantizer makes; whole-tensor
    # dequantization of the 150k-row lm head pushed peak RSS well past the 6 GB budget.
    step = 8192
    for r0 in range(0, rows, step):
        out[r0:r0 + step] = gguf.quants.dequantize(data[r0:r0 + step], t.tensor_type).reshape(-1, ne0)
    return out


def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _round_away(x: np.ndarray) -> np.ndarray:
    return np.sign(x) * np.floor(np.abs(x) + 0.5)  # C roundf


def _fake_q8_0(x: np.ndarray) -> np.ndarray:
    """x rounded as ggml's quantize_row_q8_0 would, then dequantized (fp16 block scale)."""
    b = x.reshape(-1, 32)
    d = np.abs(b).max(axis=1, keepdims=True) / 127.0
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(d == 0, 0.0, _round_away(b / d))
    return (q * d.astype(np.float16).astype(np.float64)).reshape(x.shape)


def _fake_q8_k(x: np.ndarray) -> np.ndarray:
    """x rounded as ggml's quantize_row_q8_K would (signed max -> -127), then dequantized."""
    b = x.reshape(-1, 256)
    idx = np.abs(b).argmax(axis=1)
    mx = b[np.arange(b.shape[0]), idx][:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = np.where(mx == 0, 0.0, -127.0 / mx)
        q = np.minimum(127.0, np.rint(iscale * b))
        d = np.where(mx == 0, 0.0, (1.0 / iscale).astype(np.float32).astype(np.float64))
    return (q * d).reshape(x.shape)


_Q8_0_FAMILY = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"}
_Q8_K_FAMILY = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}


class _Weight:
    """A dequantized matrix plus how its input is rounded in act_quant mode."""

    __array_ufunc__ = None  # makes ndarray @ _Weight defer to __rmatmul__

    def __init__(self, t, act_quant: bool):
        self.w = _dequant(t)
        name = t.tensor_type.name
        self.fake = None
        if act_quant and name in _Q8_0_FAMILY:
            self.fake = _fake_q8_0
        elif act_quant and name in _Q8_K_FAMILY:
            self.fake = _fake_q8_k

    def __rmatmul__(self, x: np.ndarray) -> np.ndarray:
        if self.fake is not None:
            x = self.fake(x)
        return x @ self.w.T


@dataclass
class _Layer:
    attn_norm: np.ndarray
    wq: _Weight
    wk: _Weight
    wv: _Weight
    wo: _Weight
    bq: np.ndarray | None
    bk: np.ndarray | None
    bv: np.ndarray | None
    q_norm: np.ndarray | None
    k_norm: np.ndarray | None
    ffn_norm: np.ndarray
    w_gate: _Weight
    w_up: _Weight
    w_down: _Weight


class KVCache:
    """Per-sequence cache: one (K, V) pair per layer, each [n_head_kv, n_past, head_dim]."""

    def __init__(self, n_layer: int):
        self.k: list[np.ndarray | None] = [None] * n_layer
        self.v: list[np.ndarray | None] = [None] * n_layer
        self.n_past = 0


class ReferenceModel:
    def __init__(self, path: str, act_quant: bool = False, kv_f16: bool = False):
        """act_quant: round each matmul input the way a ggml-style engine does (8-bit
        Q8_0 blocks for the 32-element quant family, Q8_K for K-quants, none for F32/F16)
        before the float64 matmul. Off, the reference is the ideal float64 network; on,
        it isolates everything except accumulation order, so comparisons can be tight.
        kv_f16: round K (after RoPE) and V to float16 as they enter the cache, as an
        engine with an f16 KV cache stores them.
        """
        self.kv_f16 = kv_f16
        reader = gguf.GGUFReader(path)
        arch = _field(reader, "general.architecture")
        if arch not in ("qwen2", "qwen3"):
            raise ValueError(f"reference supports qwen2/qwen3, got {arch!r}")
        self.arch = arch
        self.n_layer = int(_field(reader, f"{arch}.block_count"))
        self.n_embd = int(_field(reader, f"{arch}.embedding_length"))
        self.n_head = int(_field(reader, f"{arch}.attention.head_count"))
        self.n_head_kv = int(_field(reader, f"{arch}.attention.head_count_kv", self.n_head))
        self.head_dim = int(_field(reader, f"{arch}.attention.key_length", self.n_embd // self.n_head))
        self.eps = float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6))
        self.rope_base = float(_field(reader, f"{arch}.rope.freq_base", 10000.0))

        tensors = {t.name: t for t in reader.tensors}
        self._tensors = tensors
        self._reader = reader  # keeps the memmap behind token_embd alive for lazy rows

        def get(name):
            return _dequant(tensors[name])

        def mat(name):
            return _Weight(tensors[name], act_quant)

        def opt_vec(name):
            return get(name).reshape(-1) if name in tensors else None

        self.layers: list[_Layer] = []
        for i in range(self.n_layer):
            p = f"blk.{i}."
            self.layers.append(
                _Layer(
                    attn_norm=get(p + "attn_norm.weight").reshape(-1),
                    wq=mat(p + "attn_q.weight"),
                    wk=mat(p + "attn_k.weight"),
                    wv=mat(p + "attn_v.weight"),
                    wo=mat(p + "attn_output.weight"),
                    bq=opt_vec(p + "attn_q.bias"),
                    bk=opt_vec(p + "attn_k.bias"),
                    bv=opt_vec(p + "attn_v.bias"),
                    q_norm=opt_vec(p + "attn_q_norm.weight"),
                    k_norm=opt_vec(p + "attn_k_norm.weight"),
                    ffn_norm=get(p + "ffn_norm.weight").reshape(-1),
                    w_gate=mat(p + "ffn_gate.weight"),
                    w_up=mat(p + "ffn_up.weight"),
                    w_down=mat(p + "ffn_down.weight"),
                )
            )
        if arch == "qwen3" and self.layers and self.layers[0].q_norm is None:
            raise ValueError("qwen3 model without attn_q_norm weights")
        self.output_norm = get("output_norm.weight").reshape(-1)
        self._embd = tensors["token_embd.weight"]
        self.n_vocab = int(self._embd.shape[1])
        # Tied embeddings: the lm head is token_embd itself.
        self.lm_head = mat("output.weight") if "output.weight" in tensors else mat("token_embd.weight")
        self.w_out = self.lm_head.w

        hd = self.head_dim
        self._inv_freq = self.rope_base ** (-np.arange(0, hd // 2, dtype=np.float64) * 2.0 / hd)

    # ---- building blocks -------------------------------------------------------------

    def embed(self, tokens) -> np.ndarray:
        tokens = np.asarray(tokens, dtype=np.int64)
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.n_vocab):
            raise ValueError("token id out of range")
        t = self._embd
        rows = np.asarray(t.data)[tokens]
        if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            return rows.astype(np.float64).reshape(len(tokens), self.n_embd)
        return gguf.quants.dequantize(rows, t.tensor_type).astype(np.float64).reshape(len(tokens), self.n_embd)

    def _rope(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """NeoX rotation: pairs (i, i + hd/2). x: [n_heads, n_tok, hd]."""
        half = self.head_dim // 2
        ang = pos[:, None].astype(np.float64) * self._inv_freq[None, :]  # [n_tok, half]
        cos, sin = np.cos(ang), np.sin(ang)
        x0, x1 = x[..., :half], x[..., half:]
        return np.concatenate([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1)

    def _attention(self, L: _Layer, li: int, h: np.ndarray, cache: KVCache) -> np.ndarray:
        n_tok = h.shape[0]
        hd, nh, nkv = self.head_dim, self.n_head, self.n_head_kv
        q = h @ L.wq
        k = h @ L.wk
        v = h @ L.wv
        if L.bq is not None:
            q = q + L.bq
        if L.bk is not None:
            k = k + L.bk
        if L.bv is not None:
            v = v + L.bv
        q = q.reshape(n_tok, nh, hd).transpose(1, 0, 2)
        k = k.reshape(n_tok, nkv, hd).transpose(1, 0, 2)
        v = v.reshape(n_tok, nkv, hd).transpose(1, 0, 2)
        if L.q_norm is not None:
            q = _rms_norm(q, L.q_norm, self.eps)
        if L.k_norm is not None:
            k = _rms_norm(k, L.k_norm, self.eps)
        pos = np.arange(cache.n_past, cache.n_past + n_tok)
        q = self._rope(q, pos)
        k = self._rope(k, pos)
        if self.kv_f16:
            k = k.astype(np.float16).astype(np.float64)
            v = v.astype(np.float16).astype(np.float64)
        if cache.k[li] is not None:
            k = np.concatenate([cache.k[li], k], axis=1)
            v = np.concatenate([cache.v[li], v], axis=1)
        cache.k[li], cache.v[li] = k, v
        n_kv = k.shape[1]
        group = nh // nkv
        k_full = np.repeat(k, group, axis=0)  # head j uses kv head j // group
        v_full = np.repeat(v, group, axis=0)
        scores = q @ k_full.transpose(0, 2, 1) / np.sqrt(hd)  # [nh, n_tok, n_kv]
        # Query i sits at absolute position n_past + i and may see keys 0..n_past + i.
        mask = np.arange(n_kv)[None, :] > (pos[:, None])
        scores = np.where(mask[None], -np.inf, scores)
        scores = scores - scores.max(axis=-1, keepdims=True)
        p = np.exp(scores)
        p /= p.sum(axis=-1, keepdims=True)
        out = (p @ v_full).transpose(1, 0, 2).reshape(n_tok, nh * hd)
        return out @ L.wo

    def _hidden(self, tokens, cache: KVCache) -> np.ndarray:
        """Run tokens through the stack, appending to cache; returns final-normed states."""
        x = self.embed(tokens)
        for li, L in enumerate(self.layers):
            x = x + self._attention(L, li, _rms_norm(x, L.attn_norm, self.eps), cache)
            h = _rms_norm(x, L.ffn_norm, self.eps)
            x = x + (_silu(h @ L.w_gate) * (h @ L.w_up)) @ L.w_down
        cache.n_past += len(tokens)
        return _rms_norm(x, self.output_norm, self.eps)

    def _hidden_batch(self, seqs: list, caches: list[KVCache]) -> list[np.ndarray]:
        """Like _hidden for several independent sequences, sharing each weight matmul.

        Stacking the tokens of all sequences turns B small matmuls into one, which is
        what makes the many-prompt tests affordable; attention stays per sequence.
        """
        lens = [len(s) for s in seqs]
        bounds = np.cumsum([0] + lens)
        x = np.concatenate([self.embed(s) for s in seqs], axis=0)
        for li, L in enumerate(self.layers):
            hn = _rms_norm(x, L.attn_norm, self.eps)
            att = np.concatenate(
                [self._attention(L, li, hn[bounds[b]:bounds[b + 1]], caches[b]) for b in range(len(seqs))],
                axis=0,
            )
            x = x + att
            h = _rms_norm(x, L.ffn_norm, self.eps)
            x = x + (_silu(h @ L.w_gate) * (h @ L.w_up)) @ L.w_down
        for c, n in zip(caches, lens):
            c.n_past += n
        x = _rms_norm(x, self.output_norm, self.eps)
        return [x[bounds[b]:bounds[b + 1]] for b in range(len(seqs))]

    # ---- public API ------------------------------------------------------------------

    def new_cache(self) -> KVCache:
        return KVCache(self.n_layer)

    def logits(self, tokens) -> np.ndarray:
        """[n_tokens, n_vocab] float64 logits for a whole sequence from position 0."""
        return self._hidden(list(tokens), self.new_cache()) @ self.lm_head

    def forward(self, tokens, cache: KVCache) -> np.ndarray:
        """Append tokens to an existing cache; logits for every appended token."""
        return self._hidden(list(tokens), cache) @ self.lm_head

    def logits_batch(self, seqs, first) -> list[np.ndarray]:
        """Logits of rows first[b]: of each of B independent sequences (from position 0).

        The lm head is applied only to the requested rows: at 150k vocab it would
        otherwise dominate long prompts.
        """
        caches = [self.new_cache() for _ in seqs]
        hs = self._hidden_batch([list(s) for s in seqs], caches)
        return [h[f:] @ self.lm_head for h, f in zip(hs, first)]

    def last_logits_batch(self, seqs) -> np.ndarray:
        """[B, n_vocab] last-position logits of B independent sequences."""
        return np.concatenate(self.logits_batch(seqs, [len(s) - 1 for s in seqs]))

    def greedy(self, tokens, n: int) -> tuple[list[int], list[float]]:
        ids, margins = self.greedy_batch([tokens], n)[0]
        return ids, margins

    def greedy_batch(self, seqs, n: int) -> list[tuple[list[int], list[float]]]:
        """Greedy continuations of B prompts decoded in lockstep (one matmul per step).

        Returns, per prompt, the n next ids and the top1 - top2 logit margin at each step
        (a small margin means a tie the engine may legitimately break the other way).
        """
        seqs = [list(s) for s in seqs]
        caches = [self.new_cache() for _ in seqs]
        hs = self._hidden_batch(seqs, caches)
        last = np.stack([h[-1] for h in hs])
        out = [([], []) for _ in seqs]
        for step in range(n):
            lg = last @ self.lm_head
            top2 = np.argpartition(-lg, 1, axis=1)[:, :2]
            nxt = []
            for b in range(len(seqs)):
                i = int(np.argmax(lg[b]))
                vals = lg[b, top2[b]]
                out[b][0].append(i)
                out[b][1].append(float(vals.max() - vals.min()))
                nxt.append([i])
            if step + 1 < n:
                hs = self._hidden_batch(nxt, caches)
                last = np.stack([h[-1] for h in hs])
        return out
