"""A random-weight mixture-of-experts GGUF in a chosen shape, written straight to
Q4_K_M (for the MoE rows of docs/performance.md).

    python bench/moe_shape.py OUT.gguf [--preset qwen3moe-2g] [--seed 0] [--threads 2]

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
"""

from __future__ import annotations

import argparse
import sys
import time
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

    r = gguf.GGUFReader(str(src))
    fields = []
    for f in r.fields.values():
        if not f.name.startswith("tokenizer."):
            continue
        vt = f.types[0]
        sub = f.types[1] if vt == gguf.GGUFValueType.ARRAY and len(f.types) > 1 else None
        fields.append((f.name, f.contents(), vt, sub))
    n_vocab = len(r.fields["tokenizer.ggml.tokens"].contents())
    return fields, n_vocab


def make(out: Path, preset: str, seed: int, n_threads: int) -> None:
    import gguf
    from gguf import GGMLQuantizationType as QT

    from minfer import _core
    from minfer.io.model_cache import default_model_path
    from minfer.tools.quantize import make_plan

    p = PRESETS[preset]
    arch = p["arch"]
    tok, n_vocab = tokenizer_fields(default_model_path(pull=True, progress=False))
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
    for e in plan:
        t, nbytes = sizes[e.name]
        n0 = int(e.shape[0])
        rows = int(np.prod(e.shape[1:])) if len(e.shape) > 1 else 1
        if len(e.shape) == 1 or e.shape[-1] == 1:
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
    w.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="qwen3moe-2g")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    make(a.out, a.preset, a.seed, a.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
