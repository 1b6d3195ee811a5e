"""Speculative decoding and session files on the real model, side by side in one run.

    MINFER_CACHE=/work/cache python bench/speculate.py [--reps 3] [--n 120] [--threads 2]
                                                        [--draft-max 8] [--kv-tokens 4000]

For each rep and prompt, plain greedy and `--speculate ngram` greedy run back to back
(the order alternates between reps) on one loaded model, so load from other processes
hits both alike; medians over reps are reported with the load average before and
after. Output ids must be identical (checked). Then a ~kv-tokens conversation is
prefilled, saved and restored: file size, save and restore time vs re-processing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time

import numpy as np

from minfer.tools.bench import SPEC_FUNC as FUNC  # the `minfer bench --speculate` workload

FUNC2 = '''def word_counts(path, min_len=1, lower=True):
    counts = {}
    with open(path) as f:
        for line in f:
            for word in line.split():
                word = word.strip(".,;:!?\\"'()")
                if lower:
                    word = word.lower()
                if len(word) >= min_len:
                    counts[word] = counts.get(word, 0) + 1
    items = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return items
'''
PROMPTS = {
    "edit: type hints": f"Rewrite this function with type hints. Reply with the code only.\n\n```python\n{FUNC}```",
    "edit: rename + docstring": f"Rename the variable `counts` to `freq` in this function and add a docstring. "
                                f"Reply with the code only.\n\n```python\n{FUNC2}```",
    "write: from scratch": "Write a Python function that parses an INI file into a dict of sections without "
                           "using configparser.",
    "prose": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


def loadavg() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        return "?"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--n", type=int, default=120)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--draft-max", type=int, default=8)
    ap.add_argument("--kv-tokens", type=int, default=4000)
    ap.add_argument("--only", choices=["spec", "kv"], default=None)
    ap.add_argument("--backend", default=None, help="cpu or cuda (default: the best available)")
    ap.add_argument("--commit", help="the commit the output names (default: the checkout's HEAD)")
    a = ap.parse_args()
    from minfer.io.model_cache import default_model_path
    from minfer.model import Model
    from minfer.sampling import SamplingParams
    from minfer.session import Session
    from minfer.speculate import Speculation

    path = a.model or default_model_path(pull=False)
    model = Model.open(path, n_threads=a.threads, backends=[a.backend] if a.backend else None)
    tok = model.tokenizer
    greedy = SamplingParams(temperature=0.0)
    print(f"model {os.path.basename(str(path))}, backend {a.backend or 'default'}, {a.threads} threads, "
          f"commit {a.commit or commit()}, "
          f"load average at start {loadavg()}")
    if a.only != "kv":
        s = Session(model, n_ctx=2048)
        spec = Speculation("ngram", draft_max=a.draft_max)
        ids = {k: tok.encode(tok.render_chat([{"role": "user", "content": v}])) for k, v in PROMPTS.items()}
        # Warm-up: every prompt once in both modes, so the graphs of every block size the
        # adaptive depth picks are built (and on CUDA captured) before anything is timed.
        for p in ids.values():
            for sp_ in (None, spec):
                s.generate(p, a.n, greedy, stop_at_eog=False, speculate=sp_)
        rows = {k: {"plain": [], "spec": [], "drafted": 0, "accepted": 0} for k in PROMPTS}
        for rep in range(a.reps):
            for name, p in ids.items():
                order = ("plain", "spec") if rep % 2 == 0 else ("spec", "plain")
                out = {}
                for kind in order:
                    r = s.generate(p, a.n, greedy, stop_at_eog=False, speculate=spec if kind == "spec" else None)
                    tps = (len(r.ids) - 1) / (r.timings.gen_ms / 1000)
                    rows[name][kind].append(tps)
                    out[kind] = r
                    if kind == "spec":
                        rows[name]["drafted"] += r.timings.drafted
                        rows[name]["accepted"] += r.timings.accepted
                assert out["plain"].ids == out["spec"].ids, f"{name}: speculative output differs"
                print(f"  rep {rep + 1} {name}: plain {rows[name]['plain'][-1]:.2f} t/s, "
                      f"ngram {rows[name]['spec'][-1]:.2f} t/s (load {loadavg()})", flush=True)
        print(f"\n| prompt | plain t/s | ngram t/s | speed-up | drafted | accepted |")
        print("|---|---:|---:|---:|---:|---:|")
        for name, r in rows.items():
            p, q = statistics.median(r["plain"]), statistics.median(r["spec"])
            acc = r["accepted"] / r["drafted"] if r["drafted"] else 0.0
            print(f"| {name} | {p:.2f} | {q:.2f} | {q / p:.2f}x | {r['drafted']} | "
                  f"{r['accepted']} ({100 * acc:.0f}%) |")
        print(f"\nload average at end {loadavg()}; medians over {a.reps} reps, {a.n} tokens each, greedy, "
              f"outputs identical")
        del s
    if a.only != "spec":
        kv_bench(model, a.kv_tokens, tok)


def kv_bench(model, n_tokens: int, tok) -> None:
    from minfer.session import Session
    from minfer.session_file import model_sha256

    text = (FUNC + FUNC2) * 200
    ids = tok.encode(text)[:n_tokens]
    s = Session(model, n_ctx=n_tokens + 64)
    t0 = time.perf_counter()
    s.forward(ids, n_out=1)
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    model_sha256(model)
    sha = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as d:
        f = os.path.join(d, "conv.minfer")
        t0 = time.perf_counter()
        size = s.save(f)
        save = time.perf_counter() - t0
        t0 = time.perf_counter()
        r = Session.load(model, f)
        restore = time.perf_counter() - t0
        same = np.array_equal(r.forward([42])[-1], s.forward([42])[-1])
    print(f"\n| {len(ids)}-token conversation | time |\n|---|---:|")
    print(f"| re-processing (prefill) | {prefill * 1000:.0f} ms |")
    print(f"| restore (read, checksum, KV write) | {restore * 1000:.0f} ms |")
    print(f"| save (atomic) | {save * 1000:.0f} ms |")
    print(f"| model sha256 (once per process) | {sha * 1000:.0f} ms |")
    print(f"\nfile size {size / 1e6:.1f} MB ({size / len(ids) / 1024:.1f} KiB per token); next-token logits after "
          f"restore identical: {same}; load average {loadavg()}")


if __name__ == "__main__":
    main()
