"""pp512 / tg128 of real-shaped dense-family models, minfer beside llama.cpp (not a test).

Random weights in the real shapes and metadata of Llama-3.2-1B and Gemma-3-1B (as
llama.cpp's convert_hf_to_gguf.py writes them: the metadata keys of tests/families.py's
converted tiny checkpoints, with the real dimensions), written F16 and quantized to
Q4_K_M with `minfer quantize` (byte-identical to llama-quantize's, docs/quantize.md).
Llama 3.2 carries the real Llama 3 vocabulary (llama.cpp's ggml-vocab-llama-bpe.gguf) and
its llama3 rope_freqs; Gemma 3 a synthetic 262144-token SentencePiece vocabulary. Random
weights make the same work per token as trained ones.

    python bench/families_bench.py make                  # the models, under $MINFER_CACHE/families-bench
    python bench/families_bench.py run [-t 2] [-r 3] [--rounds 2]   # minfer bench, and llama-bench when built

llama-bench is the sdist's llama.cpp (tests/llama_quants_ref fetches it), built once
natively without AMX under llama-ref/<version>/build-bench-noamx (the first run builds it,
about 10 minutes on 2 cores), run with -fa 0,1 as the README's llama.cpp rows are.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

SHAPES = {
    # name: (template variant, arch, metadata overrides, layer count, tied)
    "llama32-1b": dict(variant="llama3", arch="llama", n_embd=2048, n_layer=16, n_head=32, n_kv=8, head_dim=64,
                       n_ff=8192, n_vocab=128256, ctx=131072,
                       kv={"rope.freq_base": 500000.0, "attention.layer_norm_rms_epsilon": 1e-5}),
    "gemma3-1b": dict(variant="gemma3", arch="gemma3", n_embd=1152, n_layer=26, n_head=4, n_kv=1, head_dim=256,
                      n_ff=6912, n_vocab=262144, ctx=32768,
                      kv={"rope.freq_base": 1000000.0, "rope.freq_base_swa": 10000.0, "attention.sliding_window": 512,
                          "attention.layer_norm_rms_epsilon": 1e-6},
                      drop=("rope.scaling.type", "rope.scaling.factor")),   # 1B: no scaling (4B+: linear 8)
}


def out_dir() -> Path:
    root = Path(os.environ.get("MINFER_CACHE") or Path.home() / ".cache" / "minfer")
    return root / "families-bench"


def _llama3_factors(head_dim: int, base: float = 500000.0, factor: float = 32.0, low: float = 1.0, high: float = 4.0,
                    orig: int = 8192) -> np.ndarray:
    """Llama 3.2's rope_freqs, computed as convert_hf_to_gguf.py does."""
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    lo_w, hi_w = orig / low, orig / high
    out = []
    for f in freqs:
        w = 2 * math.pi / f
        if w < hi_w:
            out.append(1.0)
        elif w > lo_w:
            out.append(factor)
        else:
            s = (orig / w - low) / (high - low)
            out.append(1 / ((1 - s) / factor + s))
    return np.array(out, np.float32)


def _spm_vocab(n: int) -> tuple:
    toks = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    types = [3, 3, 3, 2, 3, 3]
    toks += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    letters = "abcdefghijklmnopqrstuvwxyz"
    i = 0
    while len(toks) < n:
        toks.append("\u2581" + letters[i % 26] + str(i))
        types.append(1)
        i += 1
    scores = [0.0] * 262 + [-float(k) for k in range(n - 262)]
    return toks, scores, types


def make(name: str) -> Path:
    import gguf

    import families
    from minfer.testing.gguf_io import fields

    s = SHAPES[name]
    d = out_dir()
    d.mkdir(parents=True, exist_ok=True)
    q = d / f"{name}-Q4_K_M.gguf"
    if q.exists():
        return q
    f16 = d / f"{name}-F16.gguf"
    tmpl = gguf.GGUFReader(str(families.ensure(s["variant"], ("F32",))["F32"]))
    a = s["arch"]
    w = gguf.GGUFWriter(str(f16), a)
    dims = {"embedding_length": s["n_embd"], "block_count": s["n_layer"], "attention.head_count": s["n_head"],
            "attention.head_count_kv": s["n_kv"], "attention.key_length": s["head_dim"],
            "attention.value_length": s["head_dim"], "feed_forward_length": s["n_ff"], "context_length": s["ctx"],
            "vocab_size": s["n_vocab"], "rope.dimension_count": s["head_dim"]}
    dims.update(s["kv"])
    skip = {"general.architecture", "general.file_type", "general.name", "general.size_label"}
    for k, v, vt, sub in fields(tmpl):
        if k in skip or k.startswith("tokenizer.ggml."):
            continue
        short = k[len(a) + 1:] if k.startswith(a + ".") else None
        if short in dims or short in s.get("drop", ()):
            continue
        w.add_key_value(k, v, vt, sub_type=sub)
    for short, v in dims.items():
        if short == "vocab_size" and a != "llama":
            continue
        vt = gguf.GGUFValueType.FLOAT32 if isinstance(v, float) else gguf.GGUFValueType.UINT32
        w.add_key_value(f"{a}.{short}", v, vt)
    w.add_name(name)
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_F16))
    if a == "llama":
        voc = gguf.GGUFReader(str(families.vocab_dir() / "ggml-vocab-llama-bpe.gguf"))
        for k, v, vt, sub in fields(voc):
            if k.startswith("tokenizer."):
                w.add_key_value(k, v, vt, sub_type=sub)
    else:
        toks, scores, types = _spm_vocab(s["n_vocab"])
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(toks)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(2)
        w.add_eos_token_id(1)
        w.add_add_space_prefix(False)
    rng = np.random.default_rng(0)
    E, F, H, KV, HD = s["n_embd"], s["n_ff"], s["n_head"], s["n_kv"], s["head_dim"]

    def mat(rows, cols):
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    def vec(n, one=True):
        return np.ones(n, np.float32) if one else np.zeros(n, np.float32)

    w.add_tensor("token_embd.weight", mat(s["n_vocab"], E))
    w.add_tensor("output_norm.weight", vec(E))
    if a == "llama":
        w.add_tensor("rope_freqs.weight", _llama3_factors(HD))
    for il in range(s["n_layer"]):
        p = f"blk.{il}."
        w.add_tensor(p + "attn_norm.weight", vec(E))
        w.add_tensor(p + "attn_q.weight", mat(H * HD, E))
        w.add_tensor(p + "attn_k.weight", mat(KV * HD, E))
        w.add_tensor(p + "attn_v.weight", mat(KV * HD, E))
        w.add_tensor(p + "attn_output.weight", mat(E, H * HD))
        w.add_tensor(p + "ffn_norm.weight", vec(E))
        w.add_tensor(p + "ffn_gate.weight", mat(F, E))
        w.add_tensor(p + "ffn_up.weight", mat(F, E))
        w.add_tensor(p + "ffn_down.weight", mat(E, F))
        if a == "gemma3":
            w.add_tensor(p + "attn_q_norm.weight", vec(HD))
            w.add_tensor(p + "attn_k_norm.weight", vec(HD))
            w.add_tensor(p + "post_attention_norm.weight", vec(E))
            w.add_tensor(p + "post_ffw_norm.weight", vec(E))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = subprocess.run([sys.executable, "-m", "minfer.cli", "quantize", str(f16), str(q), "Q4_K_M"])
    if r.returncode != 0:
        raise SystemExit(f"minfer quantize failed for {f16}")
    f16.unlink()
    return q


NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def llama_bench(build: bool = False) -> Path | None:
    """llama-bench of the sdist's llama.cpp, built natively without AMX (VMs that report
    AMX do not all grant it, and ggml's AMX path then crashes), as bench/cpu_sweep.py
    builds it; build=True builds it when missing (~10 minutes on 2 cores)."""
    import llama_quants_ref

    d = llama_quants_ref.cache_dir() / "build-bench-noamx"
    p = d / "bin" / "llama-bench"
    if p.exists() or not build:
        return p if p.exists() else None
    src = llama_quants_ref.unpack_full()
    subprocess.run(["cmake", "-S", str(src), "-B", str(d), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                    "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                    "-DLLAMA_BUILD_SERVER=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_CUDA=OFF",
                    f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"], check=True)
    subprocess.run(["cmake", "--build", str(d), "-j2", "--target", "llama-bench"], check=True)
    return p


def _minfer(path: Path, threads: int, reps: int, pp: int, tg: int) -> list:
    r = subprocess.run([sys.executable, "-m", "minfer.cli", "bench", str(path), "-p", str(pp), "-n", str(tg),
                        "-t", str(threads), "-r", str(reps), "-o", "json"], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"minfer bench failed on {path}: {r.stderr[-2000:]}")
    return [(f"pp{row['n_prompt']}" if row["n_prompt"] else f"tg{row['n_gen']}", "", row["avg_ts"], row["stddev_ts"])
            for row in json.loads(r.stdout)]


def _llama(lb: Path, path: Path, threads: int, reps: int, pp: int, tg: int) -> list:
    env = dict(os.environ, LD_LIBRARY_PATH=str(lb.parent))
    r = subprocess.run([str(lb), "-m", str(path), "-p", str(pp), "-n", str(tg), "-t", str(threads), "-r", str(reps),
                        "-fa", "0,1", "-o", "json"], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"llama-bench failed on {path}: {r.stderr[-2000:]}")
    return [(f"pp{row['n_prompt']}" if row["n_prompt"] else f"tg{row['n_gen']}", f"fa={int(row.get('flash_attn', 0))}",
             row["avg_ts"], row["stddev_ts"]) for row in json.loads(r.stdout)]


def run(threads: int, reps: int, pp: int, tg: int, rounds: int) -> list:
    """Rounds alternate the engines (minfer, then llama.cpp, per model), so a neighbour
    slowing the machine slows both."""
    rows = []
    lb = llama_bench(build=True)
    paths = {name: make(name) for name in SHAPES}
    print(f"load average before: {os.getloadavg()[0]:.2f}", flush=True)
    print("| round | model | engine | test | t/s |\n|---|---|---|---|---|", flush=True)

    def add(rnd, name, engine, test, ts, sd):
        rows.append({"round": rnd, "model": name, "engine": engine, "test": test, "t/s": ts, "stddev": sd})
        print(f"| {rnd} | {name} Q4_K_M | {engine} | {test} | {ts:.2f} ± {sd:.2f} |", flush=True)

    for rnd in range(1, rounds + 1):
        for name, path in paths.items():
            for test, note, ts, sd in _minfer(path, threads, reps, pp, tg):
                add(rnd, name, "minfer", test, ts, sd)
            if lb is not None:
                for test, note, ts, sd in _llama(lb, path, threads, reps, pp, tg):
                    add(rnd, name, f"llama.cpp {note}", test, ts, sd)
    print(f"load average after: {os.getloadavg()[0]:.2f}", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sp = ap.add_subparsers(dest="cmd", required=True)
    sp.add_parser("make")
    r = sp.add_parser("run")
    r.add_argument("-t", "--threads", type=int, default=2)
    r.add_argument("-r", "--repetitions", type=int, default=3)
    r.add_argument("-p", "--n-prompt", type=int, default=512)
    r.add_argument("-n", "--n-gen", type=int, default=128)
    r.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    if args.cmd == "make":
        for name in SHAPES:
            print(make(name))
        return 0
    run(args.threads, args.repetitions, args.n_prompt, args.n_gen, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
