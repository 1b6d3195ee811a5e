"""Side-by-side throughput of minfer and llama.cpp on the same GGUF, in one process.

Usage:
    pip install llama-cpp-python          # or: pip install 'minfer[peer]'; compiles llama.cpp
                                          # (CMAKE_ARGS="-DGGML_NATIVE=ON" for a native build)
    python bench/compare.py [MODEL] [-p 512] [-n 128] [-r 5] [-t THREADS] [--fa on|off|both]
                            [--json out.json]

MODEL defaults to minfer's default model. The two engines are timed alternately
(minfer pp, llama pp, minfer tg, llama tg, ... repeated r times) so that a neighbour
stealing a core, or the CPU clocking down, hurts both engines alike rather than
whichever happened to run second. Both are loaded once, warmed up once per test, and
timed exactly the same way as `minfer bench` / llama-bench:
  ppN  one decode of N random tokens from an empty KV cache, logits for the last only
       (llama.cpp gets n_batch = n_ubatch >= N, so it is one ubatch too);
  tgN  after an untimed 1-token prefill, N single-token decodes, each synchronized.
llama.cpp is driven through llama-cpp-python's low-level ctypes API (llama_decode on a
llama_batch), not its high-level Llama class, so no sampling or detokenizing is timed.

Prints per-test medians (t/s), minfer/llama ratios, and the llama.cpp build bundled by
llama-cpp-python (package version, ggml version/commit, system info).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import statistics
import sys
import time
from pathlib import Path

from minfer.tools.bench import (
    BenchArgumentError, parse_int_list, peak_rss_bytes, random_tokens, time_pp, time_tg,
)
from minfer.errors import MinferError


class LlamaPeer:
    """One llama.cpp model + context, timed like minfer.tools.bench.time_pp / time_tg."""

    def __init__(self, path: Path, n_ctx: int, n_batch: int, n_threads: int, flash_attn: bool):
        import llama_cpp as L

        self.L = L
        L.llama_backend_init()
        if hasattr(L, "llama_log_set"):
            # llama.cpp's load chatter would bury the table; failures still surface
            # through the return values checked below.
            self._log_cb = L.llama_log_callback(lambda level, text, user: None)
            L.llama_log_set(self._log_cb, ctypes.c_void_p(0))
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = 0
        load = getattr(L, "llama_model_load_from_file", None) or L.llama_load_model_from_file
        self.model = load(str(path).encode(), mp)
        if not self.model:
            raise MinferError(f"llama.cpp could not load {path}")
        cp = L.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = n_batch
        cp.n_ubatch = n_batch
        cp.n_threads = n_threads
        cp.n_threads_batch = n_threads
        cp.no_perf = True
        if hasattr(cp, "flash_attn_type"):
            cp.flash_attn_type = (L.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn
                                  else L.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        else:  # older bindings: a plain bool
            cp.flash_attn = flash_attn
        init = getattr(L, "llama_init_from_model", None) or L.llama_new_context_with_model
        self.ctx = init(self.model, cp)
        if not self.ctx:
            raise MinferError("llama.cpp could not create a context")
        vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(vocab)
        self.batch = L.llama_batch_init(n_batch, 0, 1)
        self.n_batch = n_batch

    def _clear(self) -> None:
        L = self.L
        if hasattr(L, "llama_memory_clear"):
            L.llama_memory_clear(L.llama_get_memory(self.ctx), True)
        elif hasattr(L, "llama_kv_self_clear"):
            L.llama_kv_self_clear(self.ctx)
        else:
            L.llama_kv_cache_clear(self.ctx)

    def _fill(self, toks, pos0: int) -> None:
        b = self.batch
        n = len(toks)
        for i, t in enumerate(toks):
            b.token[i] = t
            b.pos[i] = pos0 + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = 1 if i == n - 1 else 0
        b.n_tokens = n

    def _decode(self) -> None:
        rc = self.L.llama_decode(self.ctx, self.batch)
        if rc != 0:
            raise MinferError(f"llama_decode failed with {rc}")
        self.L.llama_synchronize(self.ctx)

    def time_pp(self, toks) -> int:
        if len(toks) > self.n_batch:
            raise BenchArgumentError(f"pp{len(toks)} exceeds the peer's n_batch {self.n_batch}")
        self._clear()
        self._fill(toks, 0)  # filling the batch from Python is setup, not llama.cpp's work
        t0 = time.perf_counter_ns()
        self._decode()
        return time.perf_counter_ns() - t0

    def time_tg(self, toks, n: int) -> int:
        self._clear()
        self._fill(toks[:1], 0)
        self._decode()
        b = self.batch
        self._fill(toks[1:2], 1)
        t0 = time.perf_counter_ns()
        for i in range(1, n + 1):
            # Only token and position change between steps; the rest of the batch stays.
            b.token[0] = toks[i]
            b.pos[0] = i
            self._decode()
        return time.perf_counter_ns() - t0

    def close(self) -> None:
        L = self.L
        L.llama_batch_free(self.batch)
        L.llama_free(self.ctx)
        (getattr(L, "llama_model_free", None) or L.llama_free_model)(self.model)


def llama_build_info() -> dict:
    """What llama.cpp llama-cpp-python bundles: package version, ggml version/commit, features."""
    import llama_cpp as L

    info = {"llama_cpp_python": getattr(L, "__version__", "unknown")}
    libdir = Path(L.__file__).parent / "lib"
    for so in sorted(libdir.glob("libggml-base*")) + sorted(libdir.glob("libggml.*")):
        try:
            lib = ctypes.CDLL(str(so))
        except OSError:
            continue
        for fn in ("ggml_version", "ggml_commit"):
            f = getattr(lib, fn, None)
            if f is not None and fn not in info:
                f.restype = ctypes.c_char_p
                info[fn] = (f() or b"").decode()
    try:
        info["system_info"] = L.llama_print_system_info().decode().strip()
    except Exception as e:  # informational only
        info["system_info"] = f"unavailable ({e})"
    return info


def _median_ts(samples_ns: list[int], n_tokens: int) -> float:
    return statistics.median(1e9 * n_tokens / s for s in samples_ns)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="minfer vs llama.cpp, alternating, same GGUF.")
    ap.add_argument("model", nargs="?", default=None, help="GGUF path (default: minfer's default model)")
    ap.add_argument("-p", "--n-prompt", default="512")
    ap.add_argument("-n", "--n-gen", default="128")
    ap.add_argument("-r", "--repetitions", type=int, default=5)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--fa", choices=["on", "off", "both"], default="on",
                    help="llama.cpp flash attention (both: one peer context for each)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--json", default=None, help="also write all samples and build info here")
    a = ap.parse_args(argv)

    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama-cpp-python is not installed: pip install llama-cpp-python", file=sys.stderr)
        return 2
    from minfer.backends import default_threads
    from minfer.session import Session

    try:
        pps = [p for p in parse_int_list(a.n_prompt) if p > 0]
        tgs = [n for n in parse_int_list(a.n_gen) if n > 0]
    except ValueError as e:
        ap.error(str(e))
    if a.repetitions < 1:
        ap.error("-r must be >= 1")
    if a.model is None:
        from minfer.io.model_cache import default_model_path
        path = Path(default_model_path(pull=True, progress=True))
    else:
        path = Path(a.model)
    threads = a.threads or default_threads()
    n_ctx = max([*pps, *(n + 1 for n in tgs), 1])
    n_batch = max([*pps, 1])

    build = llama_build_info()
    print(f"model: {path}", file=sys.stderr)
    print(f"threads: {threads}, reps: {a.repetitions}", file=sys.stderr)

    eng = Session.open(path, n_ctx=n_ctx, n_threads=threads)
    rss_minfer = peak_rss_bytes()
    fa_modes = {"on": [True], "off": [False], "both": [True, False]}[a.fa]
    peers = {fa: LlamaPeer(path, n_ctx, n_batch, threads, fa) for fa in fa_modes}
    n_vocab = eng.model_info["n_vocab"]
    if any(p.n_vocab != n_vocab for p in peers.values()):
        print("warning: the engines disagree on the vocabulary size", file=sys.stderr)

    tests = [("pp", p) for p in pps] + [("tg", n) for n in tgs]
    toks = {t: random_tokens(n_vocab, t[1] + 1, a.seed) for t in tests}
    runners = [("minfer", lambda kind, n, tk: time_pp(eng, tk[:n]) if kind == "pp" else time_tg(eng, tk, n))]
    for fa, peer in peers.items():
        runners.append((f"llama.cpp fa={'on' if fa else 'off'}",
                        lambda kind, n, tk, peer=peer: peer.time_pp(tk[:n]) if kind == "pp" else peer.time_tg(tk, n)))

    samples: dict[tuple[str, str], list[int]] = {}
    for kind, n in tests:  # warm-up: one pass each, not recorded
        for name, fn in runners:
            fn(kind, min(n, 1) if kind == "tg" else n, toks[(kind, n)])
    for r in range(a.repetitions):
        for kind, n in tests:
            for name, fn in runners:
                print(f"compare: rep {r + 1}/{a.repetitions} {kind}{n} {name}", file=sys.stderr)
                samples.setdefault((f"{kind}{n}", name), []).append(fn(kind, n, toks[(kind, n)]))

    names = [name for name, _ in runners]
    peers_ = names[1:]
    header = ["test"] + [f"{nm} t/s" for nm in names] + [f"minfer / {nm}" for nm in peers_]
    rows = []
    report = {"model": str(path), "threads": threads, "reps": a.repetitions, "llama_cpp": build,
              "tests": {}}
    for kind, n in tests:
        test = f"{kind}{n}"
        med = {nm: _median_ts(samples[(test, nm)], n) for nm in names}
        ratios = {nm: med["minfer"] / med[nm] for nm in peers_}
        rows.append([test] + [f"{med[nm]:.2f}" for nm in names] + [f"{ratios[nm]:.3f}x" for nm in peers_])
        report["tests"][test] = {"median_ts": med, "samples_ns": {nm: samples[(test, nm)] for nm in names},
                                 "ratio_minfer_over": ratios}
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print("| " + " | ".join(h.rjust(w) for h, w in zip(header, widths)) + " |")
    print("|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |")
    print()
    print(f"llama-cpp-python {build['llama_cpp_python']}, ggml {build.get('ggml_version', '?')} "
          f"(commit {build.get('ggml_commit', '?')})")
    print(f"llama.cpp system info: {build['system_info']}")
    print(f"peak RSS: minfer alone after load {rss_minfer / 2**20:.0f} MiB; "
          f"both engines {peak_rss_bytes() / 2**20:.0f} MiB (measure RSS per engine with `minfer bench`)")
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=2))
    for peer in peers.values():
        peer.close()
    del eng
    gc.collect()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
