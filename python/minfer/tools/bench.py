"""`minfer bench`: prompt-processing (pp) and text-generation (tg) throughput, measured
and printed the way llama-bench does it, so scripts that read llama-bench output read ours.

What is timed mirrors llama-bench:
- ppN: from an empty KV cache, one forward of N random tokens (logits for the last only).
- tgN: after an untimed 1-token prefill, N sequential single-token decode steps.
- Every forward reads its logits back into host memory, as llama.cpp's decode does, and
  the bench takes them as the read-only view the generation loop samples from: no second
  host copy (on CUDA that copy of the 600 KB row was 5-10% of a 0.5B step).
Each test gets one warm-up run, then `reps` timed repetitions; the KV cache is reset
outside the timed region. t/s is computed per sample and then averaged (llama-bench's
order, which is not the same as tokens / mean time).

Our extras on top of llama-bench's fields: peak RSS, and for tg the fraction of the
machine's memory bandwidth the decode uses (weight bytes per token x tok/s divided by
what the STREAM-style probe in `minfer.tools.membw` read with the test's thread count,
measured before that thread count's tests: one thread cannot stream what all cores do).
"""

from __future__ import annotations

import csv
import functools
import gc
import io
import json
import math
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from minfer.errors import MinferError

__all__ = [
    "BenchArgumentError", "BenchResult", "FIELDS", "format_results", "parse_int_list", "run_bench",
    "time_pp", "time_tg", "random_tokens", "measure_bandwidth_isolated", "peak_rss_bytes",
]


class BenchArgumentError(MinferError, ValueError):
    """A bench parameter is malformed (also a ValueError, so argument parsers catch it)."""


# llama-bench's field names, in its order, restricted to the ones that mean something
# for minfer; then ours. JSON/CSV consumers key on these names.
LLAMA_FIELDS = [
    "build_commit", "build_number", "cpu_info", "gpu_info", "backends",
    "model_filename", "model_type", "model_size", "model_n_params", "n_batch",
    "n_ubatch", "n_threads", "type_k", "type_v", "n_gpu_layers", "flash_attn",
    "n_prompt", "n_gen", "n_depth", "test_time", "avg_ns", "stddev_ns", "avg_ts", "stddev_ts",
]
EXTRA_FIELDS = ["peak_rss_bytes", "mem_bw_frac", "mem_bw_bytes_per_s", "weight_bytes_per_token",
                "speculate", "drafted", "accepted"]
FIELDS = LLAMA_FIELDS + ["samples_ns", "samples_ts"] + EXTRA_FIELDS


def parse_int_list(text: str | int | Iterable[int]) -> list[int]:
    """'128,512' -> [128, 512]. Zero is kept (it means "skip this test", as in llama-bench)."""
    if isinstance(text, int):
        items: list[object] = [text]
    elif isinstance(text, str):
        items = [s.strip() for s in text.split(",")]
    else:
        items = list(text)
    if not items:
        raise BenchArgumentError(f"expected a comma-separated list of integers, got {text!r}")
    out = []
    for it in items:
        try:
            v = int(it) if not isinstance(it, float) else None
        except (TypeError, ValueError):
            v = None
        if v is None or isinstance(it, bool):
            raise BenchArgumentError(
                f"expected a comma-separated list of non-negative integers like '128,512', "
                f"got {text!r} (bad item {it!r})")
        if v < 0:
            raise BenchArgumentError(f"negative value {v} in {text!r}; use 0 to skip a test")
        out.append(v)
    return out


def _mean(v: Sequence[float]) -> float:
    return sum(v) / len(v) if v else 0.0


def _stdev(v: Sequence[float]) -> float:
    # Sample standard deviation, 0 for fewer than two samples, as llama-bench.
    if len(v) <= 1:
        return 0.0
    m = _mean(v)
    return math.sqrt(max(0.0, sum((x - m) ** 2 for x in v) / (len(v) - 1)))


@dataclass
class BenchResult:
    """One test (one row of llama-bench output)."""

    model_filename: str
    model_type: str
    model_size: int
    model_n_params: int
    backends: str
    n_threads: int
    n_prompt: int
    n_gen: int
    samples_ns: list[int]
    n_depth: int = 0  # tokens already in the context when the test starts (llama-bench's -d)
    n_batch: int = 0
    n_ubatch: int = 0
    type_k: str = "f16"  # the KV element type the session ran with (--kv-type)
    type_v: str = "f16"
    n_gpu_layers: int = 0
    flash_attn: int = 0  # llama-bench's integer flash_attn_type; minfer has one attention path
    build_commit: str = "unknown"
    build_number: int = 0
    cpu_info: str = ""
    gpu_info: str = ""
    test_time: str = ""
    peak_rss_bytes: int = 0
    mem_bw_bytes_per_s: float | None = None
    weight_bytes_per_token: int | None = None
    extra: dict = field(default_factory=dict)
    test: str = ""                 # a name other than ppN/tgN (the speculative mode's rows)
    speculate: str | None = None   # speculative rows: the drafter, and its drafted/accepted totals
    drafted: int | None = None
    accepted: int | None = None

    @property
    def n_tokens(self) -> int:
        return self.n_prompt + self.n_gen

    @property
    def test_name(self) -> str:
        if self.test:
            return self.test
        if self.n_prompt > 0 and self.n_gen == 0:
            name = f"pp{self.n_prompt}"
        elif self.n_gen > 0 and self.n_prompt == 0:
            name = f"tg{self.n_gen}"
        else:
            name = f"pp{self.n_prompt}+tg{self.n_gen}"
        return f"{name} @ d{self.n_depth}" if self.n_depth else name

    @property
    def samples_ts(self) -> list[float]:
        return [1e9 * self.n_tokens / ns for ns in self.samples_ns if ns > 0]

    @property
    def avg_ns(self) -> int:
        return int(_mean(self.samples_ns))

    @property
    def stddev_ns(self) -> int:
        return int(_stdev(self.samples_ns))

    @property
    def avg_ts(self) -> float:
        return _mean(self.samples_ts)

    @property
    def stddev_ts(self) -> float:
        return _stdev(self.samples_ts)

    @property
    def mem_bw_frac(self) -> float | None:
        # Only decode is bandwidth-bound; prefill reuses each weight across many tokens.
        if self.n_prompt != 0 or not self.mem_bw_bytes_per_s or not self.weight_bytes_per_token:
            return None
        return self.weight_bytes_per_token * self.avg_ts / self.mem_bw_bytes_per_s

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in FIELDS}


# ----------------------------------------------------------------------------- output


def _fmt_size(nbytes: int) -> str:
    if nbytes < 1024 ** 3:
        return f"{nbytes / 1024 / 1024:.2f} MiB"
    return f"{nbytes / 1024 ** 3:.2f} GiB"


def _fmt_params(n: int) -> str:
    if n < 1000 ** 3:
        return f"{n / 1e6:.2f} M"
    return f"{n / 1e9:.2f} B"


# (header, width); negative width = left aligned, as llama-bench's markdown printer.
_MD_COLUMNS = [
    ("model", -30), ("size", 10), ("params", 10), ("backend", -10), ("threads", 7),
    ("test", 15), ("t/s", 20),
]
_MD_EXTRA_COLUMNS = [("peak RSS", 10), ("mem bw", 7)]
_MD_KV_COLUMNS = [("type_k", -6), ("type_v", -6)]


def _md_row(cells: Sequence[str], cols: Sequence[tuple[str, int]]) -> str:
    parts = [f"{c:<{-w}}" if w < 0 else f"{c:>{w}}" for c, (_, w) in zip(cells, cols)]
    return "| " + " | ".join(parts) + " |"


def _format_md(results: Sequence[BenchResult], extras: bool) -> str:
    # As llama-bench: the KV type columns appear when some test ran with a non-default type.
    kv_cols = any((r.type_k, r.type_v) != ("f16", "f16") for r in results)
    cols = _MD_COLUMNS[:5] + (_MD_KV_COLUMNS if kv_cols else []) + _MD_COLUMNS[5:] + (_MD_EXTRA_COLUMNS if extras else [])
    lines = [
        _md_row([h for h, _ in cols], cols),
        "|" + "".join(f" {'-' * (abs(w) - 1)}{':' if w > 0 else '-'} |" for _, w in cols),
    ]
    for r in results:
        cells = [
            r.model_type, _fmt_size(r.model_size), _fmt_params(r.model_n_params), r.backends,
            str(r.n_threads), *([r.type_k, r.type_v] if kv_cols else []), r.test_name,
            f"{r.avg_ts:.2f} ± {r.stddev_ts:.2f}",
        ]
        if extras:
            frac = r.mem_bw_frac
            cells += [f"{r.peak_rss_bytes / 1024 / 1024:.0f} MiB",
                      "-" if frac is None else f"{100 * frac:.1f}%"]
        lines.append(_md_row(cells, cols))
    if results:
        r0 = results[0]
        lines.append("")
        lines.append(f"build: {r0.build_commit} ({r0.build_number})")
        for r in results:
            if r.speculate and r.drafted is not None:
                acc = 100 * r.accepted / r.drafted if r.drafted else 0.0
                lines.append(f"{r.test_name}: {r.drafted} tokens drafted, {r.accepted} accepted ({acc:.0f}%); "
                             f"output identical to plain greedy")
        probes = {r.n_threads: r.mem_bw_bytes_per_s for r in results if r.mem_bw_bytes_per_s}
        if extras and probes:
            if len(set(probes.values())) == 1:
                said = f"{next(iter(probes.values())) / 1e9:.1f} GB/s"
            else:
                said = ", ".join(f"{bw / 1e9:.1f} GB/s with {t} thread{'s' * (t != 1)}" for t, bw in probes.items())
            lines.append(f"memory bandwidth (STREAM-style probe): {said}; "
                         "mem bw = weight bytes per token x t/s / the probe of its thread count")
    return "\n".join(lines)


def _json_value(r: BenchResult, name: str):
    v = getattr(r, name)
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def _format_json(results: Sequence[BenchResult]) -> str:
    return json.dumps([{n: _json_value(r, n) for n in FIELDS} for r in results],
                      indent=2, ensure_ascii=False)


def _csv_cell(v) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, float):
        return f"{v:.6f}"  # std::to_string's precision
    if isinstance(v, list):
        return " ".join(_csv_cell(x) for x in v)
    return str(v)


def _format_csv(results: Sequence[BenchResult]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, quoting=csv.QUOTE_ALL, lineterminator="\n")
    buf.write(",".join(FIELDS) + "\n")  # llama-bench leaves the header unquoted
    for r in results:
        w.writerow([_csv_cell(getattr(r, n)) for n in FIELDS])
    return buf.getvalue().rstrip("\n")


def format_results(results: Sequence[BenchResult], fmt: str = "md", *, extras: bool = True) -> str:
    """Renders results as llama-bench does: 'md' table, 'json' list of objects, or 'csv'.

    extras adds our peak-RSS and memory-bandwidth columns to the md table (json and csv
    always carry them as extra fields, which llama-bench readers ignore)."""
    if fmt == "md":
        return _format_md(results, extras)
    if fmt == "json":
        return _format_json(results)
    if fmt == "csv":
        return _format_csv(results)
    raise BenchArgumentError(f"unknown output format {fmt!r}; expected md, json or csv")


# ----------------------------------------------------------------------------- runner


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # macOS reports bytes, Linux KiB


@functools.lru_cache(maxsize=1)
def build_info() -> tuple[str, int]:
    """(short commit, commit count) of the source tree minfer runs from, if it is a git checkout."""
    here = Path(__file__).resolve().parent

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(here), *args], capture_output=True, text=True,
                              timeout=5, check=True).stdout.strip()

    try:
        return git("rev-parse", "--short=7", "HEAD"), int(git("rev-list", "--count", "HEAD"))
    except (OSError, subprocess.SubprocessError, ValueError):
        from minfer import __version__
        return __version__, 0


@functools.lru_cache(maxsize=1)
def cpu_info() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


def _runs_on_cuda(backends) -> bool:
    """Whether the engine's first-choice backend will be CUDA (mem_bw_frac then divides
    by the device's copy bandwidth, measured in this run)."""
    from minfer.errors import BackendError
    from minfer.backends import select_backends
    try:
        entries = select_backends(list(backends) if backends is not None else None)
    except BackendError:
        return False
    return bool(entries) and entries[0].name == "cuda"


def measure_bandwidth_isolated(n_threads: int | None = None) -> float:
    """The membw probe with n_threads threads (None: the physical cores), run in a child
    process: its arrays (hundreds of MiB) would otherwise become this process's peak RSS
    and hide the engine's."""
    import minfer
    pkg_parent = str(Path(minfer.__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([pkg_parent, *filter(None, [env.get("PYTHONPATH")])])
    code = f"from minfer.tools.membw import measure_bandwidth; print(repr(measure_bandwidth({n_threads!r})))"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env=env, timeout=300, check=True).stdout
        return float(out.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
        raise MinferError(f"memory-bandwidth probe failed: {e}") from None


def _default_engine_loader(path, *, n_ctx, n_threads, backends, kv_type="f16"):
    from minfer.session import Session
    return Session.open(path, n_ctx=n_ctx, n_threads=n_threads, backends=backends, kv_type=kv_type)


def _now_rfc3339() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def run_bench(
    model_path: str | os.PathLike,
    n_prompt: Sequence[int] = (512,),
    n_gen: Sequence[int] = (128,),
    reps: int = 5,
    threads: Sequence[int] | None = None,
    backends: Sequence[str] | None = None,
    progress: Callable[[str], None] | None = None,
    *,
    seed: int = 1234,
    warmup: bool = True,
    n_ctx: int | None = None,
    mem_bandwidth: float | bool | None = None,
    engine_loader: Callable | None = None,
    kv_type: str = "f16",
    n_depth: Sequence[int] = (0,),
) -> list[BenchResult]:
    """Runs every pp test in n_prompt and tg test in n_gen for each thread count, at each
    depth of n_depth (tokens prefilled, untimed, before the test: llama-bench's -d).

    Zeros in n_prompt / n_gen are skipped. threads=None uses the engine's default.
    backends is passed to Session.open as is (None = automatic choice).
    mem_bandwidth: None measures it here (bytes/s; on the CPU once per thread count, with
    that many threads), a number uses that, False skips it (mem_bw_frac is then absent).
    engine_loader(path, n_ctx=, n_threads=, backends=) replaces Session.open, for tests
    and for embedding in other harnesses."""
    model_path = Path(model_path)
    pps = [p for p in parse_int_list(list(n_prompt)) if p > 0]
    tgs = [n for n in parse_int_list(list(n_gen)) if n > 0]
    depths = parse_int_list(list(n_depth)) or [0]
    if threads is None:
        from minfer.backends import default_threads
        threads = [default_threads()]
    ths = parse_int_list(list(threads))
    if any(t < 1 for t in ths):
        raise BenchArgumentError(f"thread counts must be >= 1, got {list(threads)}")
    if not isinstance(reps, int) or isinstance(reps, bool) or reps < 1:
        raise BenchArgumentError(f"repetitions must be an integer >= 1, got {reps!r}")
    if not model_path.is_file():
        raise MinferError(f"model file not found: {model_path}")
    say = progress or (lambda s: None)
    load = engine_loader or functools.partial(_default_engine_loader, kv_type=kv_type)
    if not pps and not tgs:
        return []

    if mem_bandwidth is None and _runs_on_cuda(backends):
        say("minfer bench: measuring device copy bandwidth")
        from minfer import _core
        mem_bandwidth = float(_core.testing.cuda_copy_bandwidth())
    probed: dict[int, float] = {}

    def bandwidth(n_threads: int) -> float | None:
        if mem_bandwidth is False:
            return None
        if mem_bandwidth is not None:
            return float(mem_bandwidth)
        if n_threads not in probed:
            say(f"minfer bench: measuring memory bandwidth with {n_threads} thread(s)")
            probed[n_threads] = measure_bandwidth_isolated(n_threads)
        return probed[n_threads]

    # Room for the deepest context plus the biggest prompt, or the 1-token prefill plus
    # every decode step.
    need_ctx = max(depths) + max([*pps, *(n + 1 for n in tgs), 1])
    ctx = n_ctx if n_ctx is not None else need_ctx
    if ctx < need_ctx:
        raise BenchArgumentError(f"n_ctx {ctx} is smaller than the largest test needs ({need_ctx})")

    commit, build_number = build_info()
    total = len(ths) * len(depths) * (len(pps) + len(tgs))
    idx = 0
    results: list[BenchResult] = []
    for n_threads in ths:
        eng = load(model_path, n_ctx=ctx, n_threads=n_threads,
                   backends=list(backends) if backends is not None else None)
        try:
            info = eng.model_info   # Session.model_info: exactly these keys, nothing guessed
            n_vocab = int(info["n_vocab"])
            base = dict(
                model_filename=str(model_path),
                model_type=str(info["type"]),
                model_size=int(info["size_bytes"]),
                model_n_params=int(info["n_params"]),
                backends=",".join(eng.backend_names),
                n_threads=n_threads,
                type_k=str(eng.kv_type),
                type_v=str(eng.kv_type),
                build_commit=commit, build_number=build_number,
                cpu_info=cpu_info(),
                mem_bw_bytes_per_s=bandwidth(n_threads),
                weight_bytes_per_token=int(info["weight_bytes_per_token"]),
            )
            tests = [(d, "pp", p) for d in depths for p in pps] + [(d, "tg", g) for d in depths for g in tgs]
            for depth, kind, n in tests:
                idx += 1
                tag = f"minfer bench: {idx}/{total} {kind}{n}{f' @ d{depth}' if depth else ''} t={n_threads}"
                pre = random_tokens(n_vocab, depth, seed + 1)
                toks = random_tokens(n_vocab, n + 1, seed)
                if kind == "pp":
                    def one() -> int:
                        return time_pp(eng, toks[:n], pre)
                    warm = one
                else:
                    def one() -> int:
                        return time_tg(eng, toks, n, pre)

                    def warm() -> int:
                        # As llama-bench's tg warm-up: exercise the decode path once.
                        return time_tg(eng, toks, 1, pre)
                if warmup:
                    say(f"{tag}: warm-up")
                    warm()
                samples = []
                for r in range(reps):
                    say(f"{tag}: run {r + 1}/{reps}")
                    samples.append(one())
                results.append(BenchResult(
                    **base,
                    n_prompt=n if kind == "pp" else 0,
                    n_gen=n if kind == "tg" else 0,
                    n_depth=depth,
                    n_batch=n if kind == "pp" else 1,
                    n_ubatch=n if kind == "pp" else 1,
                    samples_ns=samples,
                    test_time=_now_rfc3339(),
                    peak_rss_bytes=peak_rss_bytes(),
                ))
                res = results[-1]
                frac = res.mem_bw_frac
                say(f"{tag}: {res.avg_ts:.2f} ± {res.stddev_ts:.2f} t/s"
                    + (f", {100 * frac:.1f}% of memory bandwidth" if frac is not None else ""))
        finally:
            # Two engines must never hold their weights and pools at once.
            del eng
            gc.collect()
    return results


def time_pp(eng, toks: Sequence[int], pre: Sequence[int] = ()) -> int:
    """ns for one forward of toks after an empty KV and an untimed forward of pre (the
    depth)."""
    eng.reset()
    if pre:
        eng.forward(list(pre), n_out=1, copy=False)
    t0 = time.perf_counter_ns()
    eng.forward(list(toks), n_out=1, copy=False)
    return time.perf_counter_ns() - t0


def time_tg(eng, toks: Sequence[int], n: int, pre: Sequence[int] = ()) -> int:
    """ns for n single-token decode steps after an untimed prefill of pre (the depth) and
    one token.

    toks needs n + 1 ids: toks[0] is the prefill, toks[1..n] are fed one by one."""
    if len(toks) < n + 1:
        raise BenchArgumentError(f"tg{n} needs {n + 1} token ids, got {len(toks)}")
    eng.reset()
    fwd = eng.forward
    fwd([*pre, toks[0]], n_out=1, copy=False)
    steps = [[t] for t in toks[1:n + 1]]
    t0 = time.perf_counter_ns()
    for step in steps:
        fwd(step, n_out=1, copy=False)
    return time.perf_counter_ns() - t0


def random_tokens(n_vocab: int, n: int, seed: int) -> list[int]:
    # Random ids, as llama-bench uses: the work per token does not depend on the id.
    return np.random.default_rng(seed).integers(0, n_vocab, size=n).tolist()


# ----------------------------------------------------------------------------- speculative mode

# A code-editing chat turn: the answer copies most of the prompt, which is what prompt
# lookup is for (the reference workload: a 12-line function, type hints added).
SPEC_FUNC = '''def merge_intervals(intervals):
    if not intervals:
        return []
    intervals = sorted(intervals, key=lambda x: x[0])
    merged = [list(intervals[0])]
    for start, end in intervals[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return [tuple(m) for m in merged]
'''
SPEC_PROMPT = f"Rewrite this function with type hints. Reply with the code only.\n\n```python\n{SPEC_FUNC}```"


def run_spec_bench(model_path, n_gen: Sequence[int] = (120,), reps: int = 3, threads: Sequence[int] | None = None,
                   backends: Sequence[str] | None = None, mode: str = "ngram", draft_max: int = 8,
                   draft_model=None, progress: Callable[[str], None] | None = None,
                   prompt: str = SPEC_PROMPT, kv_type: str = "f16") -> list[BenchResult]:
    """tgN on a code-editing chat prompt, plain greedy and speculative greedy run back to
    back in every repetition (the order alternating), so both see the same machine load.
    t/s counts N decode steps after the untimed prefill; outputs must be identical."""
    from minfer.model import Model
    from minfer.sampling import SamplingParams
    from minfer.session import Session
    from minfer.speculate import Speculation

    say = progress or (lambda s: None)
    tgs = [n for n in parse_int_list(list(n_gen)) if n > 0]
    if threads is None:
        from minfer.backends import default_threads
        threads = [default_threads()]
    commit, build_number = build_info()
    greedy = SamplingParams(temperature=0.0)
    results: list[BenchResult] = []
    for n_threads in parse_int_list(list(threads)):
        model = Model.open(model_path, backends=list(backends) if backends else None, n_threads=n_threads)
        tok = model.tokenizer
        ids = tok.encode(tok.render_chat([{"role": "user", "content": prompt}]))
        spec = Speculation.open(mode, draft_max=draft_max, draft_model_path=draft_model, target=model)
        s = Session(model, n_ctx=len(ids) + max(tgs, default=0) + 2, kv_type=kv_type)
        info = model.info
        base = dict(model_filename=str(model_path), model_type=str(info["type"]), model_size=int(info["size_bytes"]),
                    model_n_params=int(info["n_params"]), backends=",".join(s.backend_names), n_threads=n_threads,
                    build_commit=commit, build_number=build_number, cpu_info=cpu_info(), n_batch=1, n_ubatch=1,
                    type_k=kv_type, type_v=kv_type)
        s.generate(ids, 4, greedy, speculate=spec)  # warm-up: graphs for the prompt, 1 and a block
        for n in tgs:
            samples: dict = {"plain": [], mode: []}
            drafted = accepted = 0
            for r in range(reps):
                order = ["plain", mode] if r % 2 == 0 else [mode, "plain"]
                out = {}
                for kind in order:
                    res = s.generate(ids, n + 1, greedy, stop_at_eog=False,
                                     speculate=spec if kind == mode else None)
                    samples[kind].append(int(res.timings.gen_ms * 1e6))
                    out[kind] = res.ids
                    if kind == mode:
                        drafted += res.timings.drafted
                        accepted += res.timings.accepted
                if out["plain"] != out[mode]:
                    raise MinferError(f"speculative output differs from plain greedy (rep {r + 1})")
                say(f"minfer bench: tg{n} t={n_threads} rep {r + 1}/{reps}: plain "
                    f"{n / samples['plain'][-1] * 1e9:.2f} t/s, {mode} {n / samples[mode][-1] * 1e9:.2f} t/s")
            now = _now_rfc3339()
            results.append(BenchResult(**base, n_prompt=0, n_gen=n, samples_ns=samples["plain"], test_time=now,
                                       test=f"tg{n} edit", peak_rss_bytes=peak_rss_bytes()))
            results.append(BenchResult(**base, n_prompt=0, n_gen=n, samples_ns=samples[mode], test_time=now,
                                       test=f"tg{n} edit+{mode}", speculate=mode, drafted=drafted,
                                       accepted=accepted, peak_rss_bytes=peak_rss_bytes()))
        del s, spec, model
        gc.collect()
    return results
