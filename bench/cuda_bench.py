"""One command on the GPU machine: write the benchmark-shaped random-weight models (qwen2
0.5B and 7B shapes, and a Llama-3.1-8B shape: tensor types as llama.cpp's Q4_K_M gives
them), run `minfer bench --backend cuda -p 512 -n 128 -r 5` on each, and print the table
with the ratios to the issue's llama.cpp anchors (llama.cpp 82bb485, one H200, CUDA graphs
and FA on, medians). The Llama shape has no anchor yet: llama.cpp is to be measured
beside it on the same machine (its target is 2x llama.cpp's tg128).

    python bench/cuda_bench.py [--out DIR] [--reps 5] [--only 0.5b|7b|llama8b]

Assumes minfer is installed with the CUDA backend (pip install --no-build-isolation
-C cmake.define.MINFER_CUDA=ON .).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from minfer.testing.synth import LLAMA31_ROPE, write_model

ANCHORS = {  # llama.cpp tok/s: (pp512, tg128); None: not measured yet
    "0.5b": (53583.0, 879.0),
    "7b": (10074.0, 271.0),
    "llama8b": (None, None),
}
TARGETS = {"0.5b": (1.0, 2.0), "7b": (1.5, 2.0), "llama8b": (None, 2.0)}  # required ratios (pp512, tg128)


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v / ffn_down get more bits in Q4_K_M."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def shapes():
    return {
        # 0.5B: rows of 896 are not whole 256-blocks, so llama.cpp falls back to Q5_0/Q8_0
        # there; ffn_down (4864 = 19 x 256) keeps the K-quants.
        "0.5b": dict(arch="qwen2", n_layer=24, n_embd=896, n_ff=4864, n_head=14, n_head_kv=2, n_vocab=151936,
                     tie_embeddings=True,
                     types={"token_embd": "Q8_0", "output": "Q8_0", "attn_q": "Q5_0", "attn_k": "Q5_0",
                            "attn_v": "Q5_0", "attn_output": "Q5_0", "ffn_gate": "Q5_0", "ffn_up": "Q5_0",
                            "ffn_down": "Q4_K"},
                     layer_types=lambda i: ({"attn_v": "Q8_0", "ffn_down": "Q6_K"} if use_more_bits(i, 24) else {})),
        "7b": dict(arch="qwen2", n_layer=28, n_embd=3584, n_ff=18944, n_head=28, n_head_kv=4, n_vocab=152064,
                   types={"token_embd": "Q4_K", "output": "Q6_K", "attn_q": "Q4_K", "attn_k": "Q4_K",
                          "attn_v": "Q4_K", "attn_output": "Q4_K", "ffn_gate": "Q4_K", "ffn_up": "Q4_K",
                          "ffn_down": "Q4_K"},
                   layer_types=lambda i: ({"attn_v": "Q6_K", "ffn_down": "Q6_K"} if use_more_bits(i, 28) else {})),
        # Llama-3.1-8B: interleaved RoPE with the llama3 rope_freqs factors, base 5e5, GQA
        # 32/8, untied output; Q4_K_M as llama.cpp makes it (Q4_K, a Q6_K output, and Q6_K
        # attn_v / ffn_down on the use_more_bits layers: 193 Q4_K and 33 Q6_K tensors).
        "llama8b": dict(arch="llama", n_layer=32, n_embd=4096, n_ff=14336, n_head=32, n_head_kv=8, n_vocab=128256,
                        rope_base=500000.0, eps=1e-5, llama3_rope=LLAMA31_ROPE,
                        types={"token_embd": "Q4_K", "output": "Q6_K", "attn_q": "Q4_K", "attn_k": "Q4_K",
                               "attn_v": "Q4_K", "attn_output": "Q4_K", "ffn_gate": "Q4_K", "ffn_up": "Q4_K",
                               "ffn_down": "Q4_K"},
                        layer_types=lambda i: ({"attn_v": "Q6_K", "ffn_down": "Q6_K"} if use_more_bits(i, 32) else {})),
    }


def model_path(out: Path, name: str) -> Path:
    """Where a shape's file goes (the qwen2 shapes' names predate the llama one)."""
    return out / f"{shapes()[name]['arch']}-{name}-q4km-shape.gguf"


def type_bytes(path: Path) -> dict:
    import gguf
    r = gguf.GGUFReader(str(path))
    out: dict = {}
    for t in r.tensors:
        out[t.tensor_type.name] = out.get(t.tensor_type.name, 0) + int(t.n_bytes)
    return out


def decode_details(path: Path, n_ctx: int = 640, steps: int = 128) -> dict:
    """Kernel nodes per decode graph, decode-graph build+lower+first run and capture
    times, host time per reused greedy step (wall minus the replay's device time), and
    device memory in use."""
    import numpy as np

    from minfer import _core
    from minfer.session import Session

    free0, total = _core.testing.cuda_mem_info()
    s = Session.open(path, n_ctx=n_ctx, backends=["cuda"])
    s.forward(list(range(1, 9)), n_out=1)
    _core.cuda_sync()
    t0 = time.perf_counter()
    s.forward([9], copy=None)  # build + lower + validate/upload + direct run
    _core.cuda_sync()
    t1 = time.perf_counter()
    s.forward([10], copy=None)  # capture + first replay
    _core.cuda_sync()
    t2 = time.perf_counter()
    ls = s.context.cache.lowered.splits[0]
    info = _core.testing.cuda_plan_info(ls.plan)
    t = 11
    walls, enq = [], []
    for _ in range(steps):
        a = time.perf_counter()
        s.forward([t], copy=None)  # host work: inputs H2D + the graph launch, no wait
        b = time.perf_counter()
        t = s.argmax_last()        # argmax launch, 4-byte D2H, the one wait
        c = time.perf_counter()
        walls.append(c - a)
        enq.append(b - a)
    free1, _ = _core.testing.cuda_mem_info()
    sampled = sampled_steps(s, steps)
    return dict(graph_nodes=info["graph_nodes"], launches=info["launches"], build_lower_run_ms=(t1 - t0) * 1e3,
                capture_ms=(t2 - t1) * 1e3, step_wall_us=float(np.median(walls)) * 1e6,
                host_us=float(np.median(enq)) * 1e6, device_mem_mib=(free0 - free1) / 2**20, **sampled)


def sampled_steps(s, steps: int) -> dict:
    """Median wall of a sampled decode step (the CLI's default filters: temperature 0.8,
    top-k 40, top-p 0.95, min-p 0.05) as the generation loop runs it on CUDA, with the
    candidates selected on the device (DeviceRow) and with the row read back and
    filtered on the host (HostRow, as before the device selection), beside greedy steps:
    the three kinds in turn, so each sees the same positions (a step's attention grows
    with the context). The device-sampled steps are timed in parts: the forward's
    enqueue, the candidates (the wait for the step included), the filters and draw."""
    import numpy as np

    from minfer.logits_check import check_logits_finite
    from minfer.sampling import HostRow, Sampler, SamplingParams

    ctx = s.context
    smp = Sampler(SamplingParams(seed=1))

    class Given:
        """The candidates DeviceRow.best returned, for the draw alone."""

        def __init__(self, src, got):
            self.n, self.got = src.n, got

        def takes(self, k):
            return k <= self.got[0].size

        def best(self, k, ids):
            return self.got[0][:k], self.got[1][:k], None

    walls = {"greedy": [], "dev": [], "host": []}
    parts = {"enqueue": [], "select": [], "draw": []}
    t = 11
    for i in range(3 * steps):
        mode = ("greedy", "dev", "host")[i % 3]
        a = time.perf_counter()
        if mode == "greedy":
            s.forward([t], copy=None)
            t = s.argmax_last()
        elif mode == "dev":
            s.forward([t], copy=None)
            b = time.perf_counter()
            src = ctx.last_row(i)
            got = src.best(40, None)
            c = time.perf_counter()
            t = smp.sample(Given(src, got))
            d = time.perf_counter()
            parts["enqueue"].append(b - a)
            parts["select"].append(c - b)
            parts["draw"].append(d - c)
        else:
            row = s.forward([t], copy=False)[-1]
            check_logits_finite(row, i)
            t = smp.sample(HostRow(row))
        walls[mode].append(time.perf_counter() - a)
        smp.accept(t)
    med = {k: float(np.median(v)) * 1e6 for k, v in {**walls, **parts}.items()}
    return dict(sampled_dev_us=med["dev"], sampled_host_us=med["host"], greedy_beside_us=med["greedy"],
                select_us=med["select"], filters_us=med["draw"], sampled_enqueue_us=med["enqueue"])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/minfer-bench")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--only", choices=sorted(ANCHORS))
    args = ap.parse_args()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, cfg in shapes().items():
        if args.only and name != args.only:
            continue
        path = model_path(out, name)
        if not path.exists():
            t0 = time.time()
            write_model(path, seed=1, with_tokenizer=False, fast=True, ctx=4096, **cfg)
            print(f"wrote {path} in {time.time() - t0:.1f} s", file=sys.stderr)
        tb = type_bytes(path)
        print(f"{name}: bytes per type (MB) " + ", ".join(f"{k} {v / 1e6:.1f}" for k, v in sorted(tb.items())),
              file=sys.stderr)
        cmd = [sys.executable, "-m", "minfer.cli", "bench", str(path), "--backend", "cuda", "-p", "512",
               "-n", "128", "-r", str(args.reps), "-o", "json"]
        print("$ " + " ".join(cmd), file=sys.stderr)
        res = subprocess.run(cmd, capture_output=True, text=True)
        sys.stderr.write(res.stderr[-3000:])
        if res.returncode != 0:
            print(f"{name}: bench failed (exit {res.returncode})", file=sys.stderr)
            return 1
        det = decode_details(path)
        print(f"{name}: decode graph {det['graph_nodes']} kernel nodes ({det['launches']} launches); "
              f"build+lower+first run {det['build_lower_run_ms']:.1f} ms, capture+replay {det['capture_ms']:.1f} ms; "
              f"greedy step wall {det['step_wall_us']:.0f} us (median of 128), of which host enqueue "
              f"{det['host_us']:.0f} us; device memory {det['device_mem_mib']:.0f} MiB; sampled step wall "
              f"{det['sampled_dev_us']:.0f} us with the candidates selected on the device, "
              f"{det['sampled_host_us']:.0f} us with the row read back, greedy {det['greedy_beside_us']:.0f} us "
              f"in the same run (device-sampled step: enqueue {det['sampled_enqueue_us']:.0f} us, candidates "
              f"{det['select_us']:.0f} us with the wait for the step, filters and draw {det['filters_us']:.0f} us)",
              file=sys.stderr)
        for r in json.loads(res.stdout):
            test = "pp512" if r["n_prompt"] else "tg128"
            anchor = ANCHORS[name][0 if test == "pp512" else 1]
            need = TARGETS[name][0 if test == "pp512" else 1]
            ts = statistics.median(r["samples_ts"])  # medians of the repetitions, as the anchors
            rows.append((f"{name} {test}", anchor, ts, ts / anchor if anchor else None, need, r.get("mem_bw_frac")))
    print("| test | llama.cpp t/s | minfer t/s | ratio | required | mem_bw_frac |")
    print("|---|---:|---:|---:|---:|---:|")
    for t, a, m, ratio, need, frac in rows:
        fr = f"{frac:.2f}" if frac else ""
        an = f"{a:,.0f}" if a else "(to measure)"
        rt = f"{ratio:.2f}x" if ratio else ""
        nd = f"{need:.1f}x" if need else ""
        print(f"| {t} | {an} | {m:,.0f} | {rt} | {nd} | {fr} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
