"""A random-weight mixture-of-experts GGUF in a chosen shape, written straight to
Q4_K_M (for the MoE rows of docs/performance.md).

    python bench/moe_shape.py OUT.gguf [--preset qwen3moe-2g] [--seed 0] [--threads 2]
                              [--fast] [--vocab VOCAB.gguf]

Every tensor gets llama.cpp's Q4_K_M type for its role (minfer.tools.quantize.make_plan:
llama_tensor_get_type's rules, the n_expert == 8 ones included) and is quantized by the
compiled core's quantizers, which give llama.cpp's bytes (tests/test_quantize.py), from
normal(0, 0.02) weights (norms 1, the router F32 as llama-quantize keeps it); tensors are
streamed to the file one at a time, so memory stays at one tensor. The tokenizer keys come
from the default model (Qwen2.5's 151,936-token vocabulary, as Qwen3-30B-A3B's), so both
`minfer bench` and llama.cpp's llama-bench load the file. Random weights do the same work
per token as trained ones, except where routing is concerned: the picks of a random
router are spread over the experts about evenly, as a trained one's are meant to be.

Presets (GGUF shapes; ~2 GB each at Q4_K_M):
- qwen3moe-2g: Qwen3-30B-A3B's attention (32 query heads of 128, 4 KV heads, q/k norms)
  at n_embd 2048 over 16 layers, with 8 experts of 3072, 2 per token: 3.34 B parameters,
  of which 1.22 B are read per token (lm head included).
- mixtral-2g: llama with 8 experts of 4096, 2 per token (Mixtral's layout), n_embd 2048,
  14 layers, 16 heads of 128, 8 KV heads.
- qwen3-30b-a3b-4l: 4 of Qwen3-30B-A3B's 48 layers as they are (128 experts of 768, 8 per
  token) with its vocabulary: 1.9 GB, for the real model's per-layer shapes.
- qwen3-30b-a3b: the whole of Qwen3-30B-A3B's shape: 48 layers, n_embd 2048, 32 query
  heads of 128, 4 KV heads, q/k norms, 128 experts of 768, 8 per token, a 151,936-token
  vocabulary and an untied output: 30.5 B parameters, ~17 GB at Q4_K_M (use --fast).

--fast skips the quantizers (far too slow for 30 B parameters): every quantized tensor
gets random quants and, per block, scale fields drawn from a table of finite f16 scales
of a realistic magnitude (each block's values about normal(0, 0.02) in spread, as
tests' synthetic models draw them), written with NumPy a tensor at a time by --threads
workers (~17 GB in about a minute on 16 cores, the disk permitting). The bytes differ
from the quantizing mode's; the shapes, types and the work per token do not.

--vocab takes the tokenizer keys from another GGUF (e.g. llama.cpp's vocab-only
ggml-vocab-qwen2.gguf, 151,936 tokens) instead of the default model, which may have to be
fetched: for machines without a network.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

PRESETS = {
    "qwen3moe-2g": dict(arch="qwen3moe", n_layer=16, n_embd=2048, n_head=32, n_head_kv=4, head_dim=128,
                        n_expert=8, n_used=2, n_ff_exp=3072, n_ff=6144, norm_w=True, qk_norm=True,
                        rope_base=1000000.0),
    # Qwen3-30B-A3B's layer exactly (128 experts of 768, 8 per token), 4 of its 48 layers.
    "qwen3-30b-a3b-4l": dict(arch="qwen3moe", n_layer=4, n_embd=2048, n_head=32, n_head_kv=4, head_dim=128,
                             n_expert=128, n_used=8, n_ff_exp=768, n_ff=6144, norm_w=True, qk_norm=True,
                             rope_base=1000000.0),
    # Qwen3-30B-A3B's whole shape (config.json: 48 layers, 6144 dense FFN width recorded).
    "qwen3-30b-a3b": dict(arch="qwen3moe", n_layer=48, n_embd=2048, n_head=32, n_head_kv=4, head_dim=128,
                          n_expert=128, n_used=8, n_ff_exp=768, n_ff=6144, norm_w=True, qk_norm=True,
                          rope_base=1000000.0, n_vocab=151936),
    "mixtral-2g": dict(arch="llama", n_layer=14, n_embd=2048, n_head=16, n_head_kv=8, head_dim=128,
                       n_expert=8, n_used=2, n_ff_exp=4096, n_ff=4096, norm_w=True, qk_norm=False,
                       rope_base=1000000.0),
}


def tensors_of(p: dict, n_vocab: int) -> list:
    """(name, GGUF shape ne0 first) of every tensor, in file order."""
    d, hd, ne, ff = p["n_embd"], p["head_dim"], p["n_expert"], p["n_ff_exp"]
    qd, kvd = p["n_head"] * hd, p["n_head_kv"] * hd
    out = [("token_embd.weight", (d, n_vocab)), ("output_norm.weight", (d,)), ("output.weight", (d, n_vocab))]
    for i in range(p["n_layer"]):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (d,)), (b + "attn_q.weight", (d, qd)), (b + "attn_k.weight", (d, kvd)),
                (b + "attn_v.weight", (d, kvd)), (b + "attn_output.weight", (qd, d))]
        if p["qk_norm"]:
            out += [(b + "attn_q_norm.weight", (hd,)), (b + "attn_k_norm.weight", (hd,))]
        out += [(b + "ffn_norm.weight", (d,)), (b + "ffn_gate_inp.weight", (d, ne)),
                (b + "ffn_gate_exps.weight", (d, ff, ne)), (b + "ffn_up_exps.weight", (d, ff, ne)),
                (b + "ffn_down_exps.weight", (ff, d, ne))]
    return out


def tokenizer_fields(src: Path) -> list:
    import gguf

    from minfer.testing.gguf_io import fields as keys_of

    r = gguf.GGUFReader(str(src))
    fields = [k for k in keys_of(r) if k[0].startswith("tokenizer.")]
    n_vocab = len(r.fields["tokenizer.ggml.tokens"].contents())
    return fields, n_vocab


# ---- --fast: random blocks written directly ----------------------------------------

FAST_STD = 0.02        # the spread of a block's values, as the quantizing mode's weights
FAST_HEADS = 4096      # distinct scale fields a tensor's blocks draw from
FAST_CHUNK = 1 << 16   # blocks a worker fills at a time (a multiple of 8)


def _k_scales(sc, m):
    """8 six-bit scales and 8 six-bit mins per block as Q4_K / Q5_K's 12 bytes."""
    out = np.zeros((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (m[:, 0:4] & 63) | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    return out


def _f16_bytes(v):
    return np.asarray(v, np.float16).view(np.uint8).reshape(len(v), 2)


def scale_fields(t, rng) -> tuple:
    """(byte offset in a block, FAST_HEADS rows of the scale bytes there) for type t: finite
    f16 scales (times 0.5 .. 1.5 across the table), chosen so that a block's values have
    about FAST_STD spread and, with a min, zero mean, whatever its random quants."""
    from gguf import GGMLQuantizationType as QT

    n = FAST_HEADS
    f = FAST_STD * rng.uniform(0.5, 1.5, n)
    if t in (QT.Q4_K, QT.Q5_K):  # d, dmin, scales: w = d * sc * q - dmin * m
        q_mid, q_std = (7.5, 4.6) if t == QT.Q4_K else (15.5, 9.2)
        sc = rng.integers(16, 64, (n, 8)).astype(np.uint8)
        d = f / (40.0 * q_std)
        dmin = d * (q_mid + 1.0)
        m = np.clip(np.rint(sc * q_mid * (d / dmin)[:, None]), 0, 63).astype(np.uint8)
        return 0, np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _k_scales(sc, m)], axis=1)
    if t == QT.Q6_K:  # scales[16] (int8), d at 208: w = d * sc * (q - 32)
        sc = rng.integers(16, 64, (n, 16)).astype(np.int8).view(np.uint8)
        return 192, np.concatenate([sc, _f16_bytes(f / (40.0 * 18.5))], axis=1)
    legacy = {QT.Q4_0: (4.6, None), QT.Q5_0: (9.2, None), QT.Q8_0: (74.0, None), QT.Q4_1: (4.6, 7.5),
              QT.Q5_1: (9.2, 15.5)}
    if t not in legacy:
        raise SystemExit(f"error: --fast has no random blocks for type {t.name}")
    q_std, mid = legacy[t]
    d = f / q_std
    if mid is None:
        return 0, _f16_bytes(d)
    return 0, np.concatenate([_f16_bytes(d), _f16_bytes(-mid * d)], axis=1)


def random_blocks(t, n_blocks: int, seed: tuple, pool) -> np.ndarray:
    """n_blocks random blocks of type t (random quants, scale fields from scale_fields),
    filled in chunks by the pool's workers, each chunk from its own generator (the bytes
    do not depend on the worker count)."""
    import gguf

    ts = gguf.GGML_QUANT_SIZES[t][1]
    off, heads = scale_fields(t, np.random.default_rng(list(seed)))
    out = np.empty((n_blocks, ts), np.uint8)

    def fill(b0: int) -> None:
        b1 = min(n_blocks, b0 + FAST_CHUNK)
        g = np.random.Generator(np.random.SFC64(list(seed) + [b0]))
        part = out[b0:b1]
        words = g.bit_generator.random_raw(((b1 - b0) * ts + 7) // 8)
        part.reshape(-1)[:] = words.view(np.uint8)[:(b1 - b0) * ts]
        part[:, off:off + heads.shape[1]] = heads[g.integers(0, len(heads), b1 - b0)]

    list(pool.map(fill, range(0, n_blocks, FAST_CHUNK)))
    return out.reshape(-1)


def make(out: Path, preset: str, seed: int, n_threads: int, fast: bool = False, vocab: Path | None = None) -> None:
    import gguf
    from gguf import GGMLQuantizationType as QT

    from minfer import _core
    from minfer.io.model_cache import default_model_path
    from minfer.tools.quantize import make_plan

    p = PRESETS[preset]
    arch = p["arch"]
    tok, n_vocab = tokenizer_fields(vocab if vocab is not None else default_model_path(pull=True, progress=False))
    if p.get("n_vocab", n_vocab) != n_vocab:
        raise SystemExit(f"error: preset {preset} has a vocabulary of {p['n_vocab']} tokens, the tokenizer "
                         f"{n_vocab}")
    shapes = tensors_of(p, n_vocab)
    plan = make_plan([(n, s, int(QT.F32)) for n, s in shapes], "Q4_K_M", p["n_layer"], arch=arch,
                     n_expert=p["n_expert"])
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(f"random {preset}")
    w.add_block_count(p["n_layer"])
    w.add_context_length(32768)
    w.add_embedding_length(p["n_embd"])
    w.add_feed_forward_length(p["n_ff"])
    w.add_head_count(p["n_head"])
    w.add_head_count_kv(p["n_head_kv"])
    w.add_key_length(p["head_dim"])
    w.add_value_length(p["head_dim"])
    w.add_rope_dimension_count(p["head_dim"])
    w.add_rope_freq_base(p["rope_base"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(p["n_expert"])
    w.add_expert_used_count(p["n_used"])
    if arch != "llama":
        w.add_expert_feed_forward_length(p["n_ff_exp"])
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q4_K_M))
    for name, value, vt, sub in tok:
        w.add_key_value(name, value, vt, sub_type=sub)
    rng = np.random.default_rng(seed)
    sizes = {}
    for e in plan:
        t = QT(e.dst)
        n0 = int(e.shape[0])
        rows = int(np.prod(e.shape[1:])) if len(e.shape) > 1 else 1
        if t in (QT.F32, QT.F16):
            nbytes = n0 * rows * (4 if t == QT.F32 else 2)
        else:
            bs, ts = gguf.GGML_QUANT_SIZES[t]
            nbytes = n0 // bs * ts * rows
        sizes[e.name] = (t, nbytes)
        byte_shape = list(reversed(e.shape[1:])) + [nbytes // rows]
        w.add_tensor_info(e.name, byte_shape if t not in (QT.F32, QT.F16) else list(reversed(e.shape)),
                          np.uint8 if t not in (QT.F32, QT.F16) else (np.float32 if t == QT.F32 else np.float16),
                          nbytes, raw_dtype=t if t not in (QT.F32, QT.F16) else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    t0, done = time.time(), 0
    pool = ThreadPoolExecutor(max(1, n_threads))
    for i, e in enumerate(plan):
        t, nbytes = sizes[e.name]
        n0 = int(e.shape[0])
        rows = int(np.prod(e.shape[1:])) if len(e.shape) > 1 else 1
        if fast and t not in (QT.F32, QT.F16) and not (len(e.shape) == 1 or e.shape[-1] == 1):
            data = random_blocks(t, n0 * rows // gguf.GGML_QUANT_SIZES[t][0], (seed, i), pool)
        elif len(e.shape) == 1 or e.shape[-1] == 1:
            a = np.ones(n0 * rows, np.float32) if "norm" in e.name else \
                rng.standard_normal(n0 * rows, dtype=np.float32) * 0.02
            data = a.astype(np.float32 if t == QT.F32 else np.float16)
        else:
            parts = []
            step = max(1, (64 << 20) // (4 * n0))   # 64 MiB of f32 at a time
            for r0 in range(0, rows, step):
                x = rng.standard_normal((min(step, rows - r0), n0), dtype=np.float32) * 0.02
                if t == QT.F32:
                    parts.append(x.reshape(-1).view(np.uint8))
                elif t == QT.F16:
                    parts.append(x.astype(np.float16).reshape(-1).view(np.uint8))
                else:
                    parts.append(np.asarray(_core.quantize(int(t), x, n_threads)).reshape(-1))
            data = np.concatenate(parts)
        assert data.nbytes == nbytes, (e.name, data.nbytes, nbytes)
        w.write_tensor_data(data)
        done += nbytes
        sys.stderr.write(f"\r{e.name:32s} {t.name:5s} {done / 2**30:6.2f} GiB  {time.time() - t0:5.0f} s")
    sys.stderr.write("\n")
    pool.shutdown()
    w.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="qwen3moe-2g")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--fast", action="store_true", help="random quantized blocks written directly (no quantizers)")
    ap.add_argument("--vocab", type=Path, help="take the tokenizer from this GGUF instead of the default model")
    a = ap.parse_args()
    make(a.out, a.preset, a.seed, a.threads, a.fast, a.vocab)
    return 0


if __name__ == "__main__":
    sys.exit(main())
