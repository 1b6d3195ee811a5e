"""Small random-weight Qwen2 / Qwen3 / Llama GGUF models for tests (and, with fast=True,
benchmark-shaped ones).

The files use the real llama.cpp tensor names and metadata keys, so every loader and
graph path that runs the real model also runs these; only the sizes are tiny. Weights
are scaled like an initialised network (std ~ 1/sqrt(fan_in), norms ~ 1) so a forward
pass stays in a sane numeric range and differences between kernels show up clearly.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import gguf
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT, GGUFValueType
from gguf.gguf_writer import GGUFValue

ROLES = (
    "token_embd", "output", "attn_q", "attn_k", "attn_v",
    "attn_output", "ffn_gate", "ffn_up", "ffn_down",
)
SUPPORTED_TYPES = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K",
)
DEFAULT_TYPES: dict[str, str] = {r: "F32" for r in ROLES}
# The per-role mix of the real Qwen2.5-Coder-0.5B Q4_K_M file (ffn_down alternates
# Q4_K/Q6_K there; Q6_K is used for all layers here). Needs n_ff a multiple of 256.
QWEN2_Q4_K_M_TYPES: dict[str, str] = {
    "token_embd": "Q5_0", "output": "Q8_0", "attn_q": "Q5_0", "attn_k": "Q5_0",
    "attn_v": "Q8_0", "attn_output": "Q5_0", "ffn_gate": "Q5_0", "ffn_up": "Q5_0",
    "ffn_down": "Q6_K",
}

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# A handful of merges so BPE actually merges something; each result becomes a token.
MERGES = (
    ("Ġ", "t"), ("h", "e"), ("i", "n"), ("Ġt", "he"), ("e", "r"), ("Ġ", "a"),
    ("o", "n"), ("r", "e"), ("Ġ", "s"), ("a", "t"), ("e", "n"), ("o", "r"),
    ("Ġ", "w"), ("Ġ", "c"), ("i", "s"), ("Ġ", "Ġ"), ("l", "l"), ("Ġ", "f"),
    ("e", "s"), ("Ġ", "b"),
)
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TOKEN_TYPE_NORMAL, TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNUSED = 1, 3, 5
ARCHS = ("qwen2", "qwen3", "llama")
# Llama 3.1's rope scaling (its config.json's rope_scaling, rope_type llama3).
LLAMA31_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_context_length": 8192}


def llama3_rope_factors(n_rot: int, base: float, factor: float, low_freq_factor: float, high_freq_factor: float,
                        original_context_length: int) -> np.ndarray:
    """rope_freqs.weight as llama.cpp's convert_hf_to_gguf.py computes it for rope_type
    llama3 (in float32, as its torch tensors are): per rotated pair, 1 for short
    wavelengths, `factor` for long ones, and a smooth blend between."""
    f32 = np.float32
    # torch's float32 pow rounds as the double power rounded to float32 does (NumPy's
    # float32 pow is an ulp off in places).
    expo = np.arange(0, n_rot, 2, dtype=f32) / f32(n_rot)
    freqs = f32(1.0) / (float(base) ** expo.astype(np.float64)).astype(f32)
    low_wavelen = original_context_length / low_freq_factor
    high_wavelen = original_context_length / high_freq_factor
    out = []
    for freq in freqs:
        wavelen = f32(2 * math.pi) / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (f32(original_context_length) / wavelen - f32(low_freq_factor)) / f32(high_freq_factor -
                                                                                          low_freq_factor)
            out.append(f32(1) / ((f32(1) - smooth) / f32(factor) + smooth))
    return np.asarray(out, f32)


@dataclass(frozen=True)
class SynthConfig:
    path: Path
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int
    ctx: int
    rope_base: float
    eps: float
    types: dict[str, str] = field(hash=False)
    seed: int
    tie_embeddings: bool
    with_tokenizer: bool
    bos_id: int | None = None
    eos_id: int | None = None
    eot_ids: tuple[int, ...] = ()

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim


def bytes_to_unicode() -> list[tuple[int, str]]:
    """GPT-2's byte -> printable char table, in GPT-2 vocabulary order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [(b, chr(c)) for b, c in zip(bs, cs)]


def tokenizer_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) before padding: bytes, merge results, specials."""
    tokens = [c for _, c in bytes_to_unicode()]
    merges = [f"{a} {b}" for a, b in MERGES]
    for a, b in MERGES:
        tokens.append(a + b)
    types = [TOKEN_TYPE_NORMAL] * len(tokens)
    tokens += SPECIAL_TOKENS
    types += [TOKEN_TYPE_CONTROL] * len(SPECIAL_TOKENS)
    return tokens, types, merges


# ---- weight encoding ---------------------------------------------------------------


def _encode_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Pack 8 six-bit scales and 8 six-bit mins per block into Q4_K/Q5_K's 12 bytes."""
    out = np.zeros((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (m[:, 0:4] & 63) | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    return out


def _random_k_blocks(qtype: QT, n_rows: int, n_cols: int, std: float, rng) -> np.ndarray:
    """Random K-quant blocks (gguf cannot quantize these) whose dequantized values are
    roughly zero-mean with the requested std. The quant bits are uniform random; the
    scales are chosen so the per-sub-block min cancels the quant midpoint."""
    n_blocks = n_rows * n_cols // 256
    block_bytes = GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    if qtype == QT.Q6_K:
        # layout: ql[128] qh[64] scales[16] (int8) d (f16); w = d * scale * (q - 32)
        scales = rng.integers(16, 64, size=(n_blocks, 16), dtype=np.int8)
        raw[:, 192:208] = scales.view(np.uint8)
        d = std / (40.0 * 18.5)  # mean |scale| ~40, std of uniform(0..63)-32 ~18.5
        raw[:, 208:210] = np.full(n_blocks, d, np.float16).view(np.uint8).reshape(-1, 2)
    else:
        # layout: d, dmin (f16), scales[12], [qh[32] for Q5_K], qs[128];
        # w = d * sc * q - dmin * m, q uniform in 0..15 (Q4_K) or 0..31 (Q5_K)
        q_mid, q_std = (7.5, 4.6) if qtype == QT.Q4_K else (15.5, 9.2)
        sc = rng.integers(16, 64, size=(n_blocks, 8)).astype(np.uint8)
        d = std / (40.0 * q_std)
        dmin = d * (q_mid + 1.0)
        m = np.clip(np.rint(sc * q_mid * d / dmin), 0, 63).astype(np.uint8)
        raw[:, 0:2] = np.full(n_blocks, d, np.float16).view(np.uint8).reshape(-1, 2)
        raw[:, 2:4] = np.full(n_blocks, dmin, np.float16).view(np.uint8).reshape(-1, 2)
        raw[:, 4:16] = _encode_k_scales(sc, m)
    return raw.reshape(n_rows, -1)


# Legacy blocks drawn directly (for benchmark-sized models gguf's NumPy quantizer is far
# too slow): (std of the codes, has a min) with w = d * (q - mid), or d * q + m.
_LEGACY = {QT.Q4_0: (4.6, False), QT.Q5_0: (9.2, False), QT.Q8_0: (74.0, False), QT.Q4_1: (4.6, True),
           QT.Q5_1: (9.2, True)}


def _random_legacy_blocks(qtype: QT, n_rows: int, n_cols: int, std: float, rng) -> np.ndarray:
    """Random 32-element blocks with uniform codes and one scale per block so the
    dequantized values have roughly the requested std (and, with a min, zero mean)."""
    n_blocks = n_rows * n_cols // 32
    raw = rng.integers(0, 256, size=(n_blocks, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
    q_std, has_min = _LEGACY[qtype]
    d = std / q_std
    raw[:, 0:2] = np.full(n_blocks, d, np.float16).view(np.uint8).reshape(-1, 2)
    if has_min:
        mid = 7.5 if qtype == QT.Q4_1 else 15.5
        raw[:, 2:4] = np.full(n_blocks, -mid * d, np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(n_rows, -1)


class _Writer:
    def __init__(self, w: gguf.GGUFWriter, rng: np.random.Generator, fast: bool = False) -> None:
        self.w = w
        self.rng = rng
        self.fast = fast

    def f32(self, name: str, arr: np.ndarray) -> None:
        self.w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))

    def matrix(self, name: str, n_out: int, n_in: int, type_name: str) -> None:
        """A weight with GGUF shape [n_in, n_out] (memory: n_out rows of n_in)."""
        qtype = QT[type_name]
        block = GGML_QUANT_SIZES[qtype][0]
        if n_in % block:
            raise ValueError(
                f"{name}: row length {n_in} is not a multiple of the {type_name} block size "
                f"{block}; pick dimensions that are"
            )
        std = 1.0 / np.sqrt(n_in)
        if qtype in (QT.Q4_K, QT.Q5_K, QT.Q6_K):
            self.w.add_tensor(name, _random_k_blocks(qtype, n_out, n_in, std, self.rng), raw_dtype=qtype)
            return
        if self.fast and qtype in _LEGACY:
            self.w.add_tensor(name, _random_legacy_blocks(qtype, n_out, n_in, std, self.rng), raw_dtype=qtype)
            return
        x = (self.rng.standard_normal((n_out, n_in)) * std).astype(np.float32)
        if qtype == QT.F32:
            self.w.add_tensor(name, x)
        elif qtype == QT.F16:
            self.w.add_tensor(name, x.astype(np.float16))
        else:
            self.w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)

    def norm(self, name: str, n: int) -> None:
        self.f32(name, 1.0 + 0.1 * self.rng.standard_normal(n))

    def bias(self, name: str, n: int) -> None:
        self.f32(name, 0.02 * self.rng.standard_normal(n))


def write_model(
    path: str | Path,
    arch: str = "qwen2",
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    head_dim: int | None = None,
    n_ff: int = 128,
    n_vocab: int | None = None,
    ctx: int = 256,
    rope_base: float = 1e6,
    eps: float = 1e-6,
    types: dict[str, str] | None = None,
    seed: int = 0,
    tie_embeddings: bool = False,
    with_tokenizer: bool = True,
    with_eog: bool = True,
    metadata: dict[str, Any] | None = None,
    fill: dict[str, float] | None = None,
    extra_tensors: dict[str, tuple[int, ...]] | None = None,
    layer_types: Callable[[int], dict[str, str]] | None = None,
    fast: bool = False,
    llama3_rope: dict[str, float] | None = None,
) -> SynthConfig:
    """Write a random-weight model; `types` overrides DEFAULT_TYPES (all F32) per role.

    Knobs for files that lie (loader and run-time checks are tested with them):
    `metadata` sets keys after the honest ones are written (a value of None deletes
    the key; Python int/float/str/bool become UINT32/FLOAT32/STRING/BOOL, a
    GGUFValue keeps its own type); `fill` overwrites every element of the named
    F32 tensors with one value (e.g. NaN); `extra_tensors` adds F32 tensors of the
    given GGUF shapes that no architecture reads; `with_eog=False` writes a tokenizer
    with no end-of-generation token (no eos id, special tokens typed normal), so a
    generation runs until -n or the context is used up. `layer_types(i)` overrides the
    role types again for layer i (mixes like llama.cpp's Q4_K_M); fast=True draws
    32-element quant blocks directly instead of quantizing Gaussians (benchmark-sized
    models).

    arch "llama" writes what llama.cpp's converter writes for a Llama 2 / 3 checkpoint:
    no q/k/v biases or q/k norms, the llama keys (rope.dimension_count, vocab_size, the
    head dims when they are not n_embd / n_head), the llama-bpe pre-tokenizer, and with
    `llama3_rope` (Llama 3.1's scaling, e.g. LLAMA31_ROPE) the rope_freqs.weight factors;
    the graph ropes interleaved pairs (RopeStyle.Normal), as for the real files."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {', '.join(ARCHS)}, got {arch!r}")
    if llama3_rope is not None and arch != "llama":
        raise ValueError("llama3_rope is Llama's rope scaling: arch must be 'llama'")
    if n_head % n_head_kv:
        raise ValueError(f"n_head {n_head} must be a multiple of n_head_kv {n_head_kv}")
    if head_dim is None:
        if n_embd % n_head:
            raise ValueError(f"n_embd {n_embd} is not divisible by n_head {n_head}")
        head_dim = n_embd // n_head
    if arch == "qwen2" and head_dim * n_head != n_embd:
        raise ValueError("qwen2 ties head_dim to n_embd / n_head; only qwen3 and llama may decouple it")
    if head_dim % 2:
        raise ValueError(f"head_dim {head_dim} must be even for RoPE")
    role_types = dict(DEFAULT_TYPES)
    for role, t in (types or {}).items():
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; roles are {', '.join(ROLES)}")
        if t not in SUPPORTED_TYPES:
            raise ValueError(f"unsupported type {t!r} for {role}; use one of {SUPPORTED_TYPES}")
        role_types[role] = t

    tokens, tok_types, merges = tokenizer_vocab()
    if n_vocab is None:
        n_vocab = len(tokens) + 16 if with_tokenizer else 256
    if with_tokenizer and n_vocab < len(tokens):
        raise ValueError(f"n_vocab {n_vocab} is smaller than the tokenizer's {len(tokens)} tokens")

    path = Path(path)
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"synthetic-{arch}")
    w.add_block_count(n_layer)
    w.add_context_length(ctx)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    if arch == "qwen3" or (arch == "llama" and head_dim * n_head != n_embd):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_rope_freq_base(rope_base)
    w.add_layer_norm_rms_eps(eps)
    if any(t not in ("F32", "F16", "BF16") for t in role_types.values()):
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if arch == "llama":
        w.add_vocab_size(n_vocab)
        w.add_rope_dimension_count(head_dim)

    bos = eos = None
    eot: tuple[int, ...] = ()
    if with_tokenizer:
        n_pad = n_vocab - len(tokens)
        all_tokens = tokens + [f"[PAD{i}]" for i in range(n_pad)]
        all_types = tok_types + [TOKEN_TYPE_UNUSED] * n_pad
        if not with_eog:
            all_types = [TOKEN_TYPE_NORMAL if ty == TOKEN_TYPE_CONTROL else ty for ty in all_types]
        bos = tokens.index("<|endoftext|>")
        eos = tokens.index("<|im_end|>")
        eot = (eos, bos) if with_eog else ()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("llama-bpe" if arch == "llama" else "qwen2")
        w.add_token_list(all_tokens)
        w.add_token_types(all_types)
        w.add_token_merges(merges)
        if with_eog:
            w.add_eos_token_id(eos)
        else:
            eos = None
        w.add_pad_token_id(bos)
        w.add_bos_token_id(bos)
        w.add_add_bos_token(False)
        w.add_chat_template(CHATML_TEMPLATE)

    for key, value in (metadata or {}).items():
        _override(w, key, value)

    t = _Writer(w, rng, fast)
    q_dim, kv_dim = n_head * head_dim, n_head_kv * head_dim
    if llama3_rope is not None:
        t.f32("rope_freqs.weight", llama3_rope_factors(head_dim, rope_base, **llama3_rope))
    t.matrix("token_embd.weight", n_vocab, n_embd, role_types["token_embd"])
    t.norm("output_norm.weight", n_embd)
    if not tie_embeddings:
        t.matrix("output.weight", n_vocab, n_embd, role_types["output"])
    base_types = role_types
    for i in range(n_layer):
        p = f"blk.{i}."
        role_types = {**base_types, **(layer_types(i) if layer_types else {})}
        t.norm(p + "attn_norm.weight", n_embd)
        t.matrix(p + "attn_q.weight", q_dim, n_embd, role_types["attn_q"])
        t.matrix(p + "attn_k.weight", kv_dim, n_embd, role_types["attn_k"])
        t.matrix(p + "attn_v.weight", kv_dim, n_embd, role_types["attn_v"])
        if arch == "qwen2":
            t.bias(p + "attn_q.bias", q_dim)
            t.bias(p + "attn_k.bias", kv_dim)
            t.bias(p + "attn_v.bias", kv_dim)
        elif arch == "qwen3":
            t.norm(p + "attn_q_norm.weight", head_dim)
            t.norm(p + "attn_k_norm.weight", head_dim)
        t.matrix(p + "attn_output.weight", n_embd, q_dim, role_types["attn_output"])
        t.norm(p + "ffn_norm.weight", n_embd)
        t.matrix(p + "ffn_gate.weight", n_ff, n_embd, role_types["ffn_gate"])
        t.matrix(p + "ffn_up.weight", n_ff, n_embd, role_types["ffn_up"])
        t.matrix(p + "ffn_down.weight", n_embd, n_ff, role_types["ffn_down"])
    for name, shape in (extra_tensors or {}).items():
        t.f32(name, 0.02 * rng.standard_normal(tuple(reversed(shape))))
    for name, value in (fill or {}).items():
        _fill(w, name, value)

    role_types = base_types
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return SynthConfig(
        path=path, arch=arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head,
        n_head_kv=n_head_kv, head_dim=head_dim, n_ff=n_ff, n_vocab=n_vocab, ctx=ctx,
        rope_base=rope_base, eps=eps, types=role_types, seed=seed,
        tie_embeddings=tie_embeddings, with_tokenizer=with_tokenizer,
        bos_id=bos, eos_id=eos, eot_ids=eot,
    )


def _override(w: gguf.GGUFWriter, key: str, value: Any) -> None:
    kv = w.kv_data[0]
    if value is None:
        kv.pop(key, None)
        return
    if isinstance(value, GGUFValue):
        kv[key] = value
        return
    if isinstance(value, bool):
        vtype = GGUFValueType.BOOL
    elif isinstance(value, int):
        vtype = GGUFValueType.UINT32 if value >= 0 else GGUFValueType.INT32
    elif isinstance(value, float):
        vtype = GGUFValueType.FLOAT32
    elif isinstance(value, str):
        vtype = GGUFValueType.STRING
    else:
        raise ValueError(f"metadata override {key!r}: pass a GGUFValue for a {type(value).__name__}")
    kv[key] = GGUFValue(value=value, type=vtype)


def _fill(w: gguf.GGUFWriter, name: str, value: float) -> None:
    info = w.tensors[0].get(name)
    if info is None:
        raise ValueError(f"fill: no tensor {name!r} in this model")
    if info.dtype != QT.F32 or info.tensor is None:
        raise ValueError(f"fill: {name!r} is {info.dtype.name}; only F32 tensors can be filled")
    info.tensor[...] = value


def patch_tensor_offset(path: str | Path, name: str, rel_offset: int) -> None:
    """Rewrite the data offset (relative to the data section) of tensor `name` in a
    written file, in place: how a file with overlapping tensor data is made."""
    path = Path(path)
    data = bytearray(path.read_bytes())
    enc = name.encode()
    key = struct.pack("<Q", len(enc)) + enc
    at = data.find(key)
    if at < 0:
        raise ValueError(f"no tensor info for {name!r} in {path}")
    at += len(key)
    (n_dims,) = struct.unpack_from("<I", data, at)
    at += 4 + 8 * n_dims + 4  # dims, then the type; the offset follows
    struct.pack_into("<Q", data, at, rel_offset)
    path.write_bytes(bytes(data))
