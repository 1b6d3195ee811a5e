"""minfer vs llama.cpp on the CPU, side by side at several thread counts, in one command.

Two steps, because the machine that measures may have no network:

    python bench/cpu_sweep.py prepare DIR [--model M.gguf]
        (needs pip and the model) downloads the llama-cpp-python sdist and keeps the
        llama.cpp sources it bundles (trimmed: no docs, models or GPU backends), the gguf
        and pybind11 wheels, and the model's metadata and tensor shapes (not its weights).
        DIR ends up ~8 MB.

    python bench/cpu_sweep.py run DIR [--threads 16,8,4,2,1] [--reps 2] [--budget 400]
        builds minfer (this checkout) and llama.cpp (native, its CPU repack included) in
        parallel, writes a random-weight F16 model with the prepared shapes and metadata,
        quantizes it with llama.cpp's own quantizer to Q4_K_M, then per thread count runs
        `minfer bench` (pp512, tg128) and `llama-bench -fa 0,1` on it, alternating the
        engines, and prints one table row as soon as a thread count is done (ratios
        against llama.cpp's better flash-attention setting). --budget stops starting new
        thread counts after that many seconds. With $OUT set, the table, the raw JSON and
        the build logs land there too. --llama-flags adds compiler flags to llama.cpp's
        build: on a VM that does not grant AMX tile state, llama.cpp's native build crashes
        in its AMX matmul (seen on a Sapphire Rapids guest) and needs
        --llama-flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16".

    python bench/cpu_sweep.py ab [--threads 16,1] [--reps 2] [--env "MINFER_CPU_PIN=0" ...]
        minfer only, on the model and in the work directory of an earlier `run` (or
        --model M.gguf): rebuilds minfer from this checkout, then per thread count runs
        `minfer bench` (pp512, tg128) once per --env variant ("" = defaults, always
        first), alternating, and prints pp512 / tg128 per variant with its ratio to the
        defaults and the pp512 scaling over the smallest thread count. --balance adds
        bench/cpu_balance.py's per-op table (defaults) at each thread count.

Random weights do the same work per token as trained ones; the type mix is what
llama.cpp's quantizer gives the real model's shapes (Q5_0 / Q8_0 where a row of 896 is
not a multiple of 256, Q4_K / Q6_K elsewhere).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
T0 = time.time()


def say(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def sh(cmd, log=None, **kw):
    say("$ " + " ".join(map(str, cmd)))
    if log:
        with open(log, "w") as fh:
            r = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, **kw)
    else:
        r = subprocess.run(cmd, **kw)
    if r.returncode:
        tail = Path(log).read_text()[-3000:] if log else ""
        raise SystemExit(f"cpu_sweep: command failed ({r.returncode}): {' '.join(map(str, cmd))}\n{tail}")
    return r


# ----------------------------------------------------------------------------- prepare

TRIM = ["models", "docs", "media", "tools/ui", ".git", ".github", "benches", "ggml/src/ggml-cuda",
        "ggml/src/ggml-sycl", "ggml/src/ggml-vulkan", "ggml/src/ggml-opencl", "ggml/src/ggml-hexagon",
        "ggml/src/ggml-metal", "ggml/src/ggml-webgpu", "ggml/src/ggml-et", "ggml/src/ggml-cann",
        "ggml/src/ggml-musa", "ggml/src/ggml-zdnn"]


def prepare(dst: Path, model: Path | None) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    dl = dst / "dl"
    dl.mkdir(exist_ok=True)
    py = sys.executable
    # --no-build-isolation: pip would otherwise build the sdist's build requirements
    # (CMake from source) only to read its metadata.
    sh([py, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "--no-build-isolation",
        "llama-cpp-python", "-d", str(dl)])
    sh([py, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(dst), "gguf", "pybind11"])
    sdist = sorted(dl.glob("llama_cpp_python-*.tar.gz"))[-1]
    prefix = sdist.name[: -len(".tar.gz")] + "/vendor/llama.cpp/"
    out = dst / "llama-src.tar.gz"
    with tarfile.open(sdist) as src, tarfile.open(out, "w:gz") as tgt:
        for m in src.getmembers():
            if not m.name.startswith(prefix):
                continue
            rel = m.name[len(prefix):]
            if any(rel == t or rel.startswith(t + "/") for t in TRIM):
                continue
            m2 = tarfile.TarInfo("llama.cpp/" + rel) if rel else None
            if m2 is None:
                continue
            m.name = m2.name
            tgt.addfile(m, src.extractfile(m) if m.isfile() else None)
    (dst / "llama-src.version").write_text(sdist.name + "\n")
    shutil.rmtree(dl)
    if model is None:
        from minfer.io.model_cache import default_model_path  # the installed minfer's cache
        model = Path(default_model_path())
    sh([py, str(ROOT / "bench" / "shaped_model.py"), "extract", str(model), str(dst / "meta.json.gz")])
    say(f"prepared {dst}: " + ", ".join(f"{p.name} {p.stat().st_size >> 10} KiB" for p in sorted(dst.iterdir())))


# ----------------------------------------------------------------------------- run

def build_minfer(work: Path, env: dict) -> subprocess.Popen:
    import pybind11  # noqa: F401  (from the carried wheel if the image has none)
    pb = subprocess.run([sys.executable, "-m", "pybind11", "--cmakedir"], capture_output=True, text=True,
                        env=env, check=True).stdout.strip()
    b = work / "minfer-build"
    cmd = (f"cmake -S {ROOT} -B {b} -G Ninja -DCMAKE_BUILD_TYPE=Release -Dpybind11_DIR={pb} "
           f"-DPython_EXECUTABLE={sys.executable} -DMINFER_CUDA=OFF && cmake --build {b} -j{os.cpu_count()}")
    say("building minfer")
    return subprocess.Popen(cmd, shell=True, stdout=open(work / "minfer-build.log", "w"), stderr=subprocess.STDOUT,
                            env=env)


def build_llama(inputs: Path, work: Path, flags: str) -> subprocess.Popen:
    with tarfile.open(inputs / "llama-src.tar.gz") as tf:
        tf.extractall(work)
    src, b = work / "llama.cpp", work / "llama-build"
    cmd = (f"cmake -S {src} -B {b} -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF "
           f"-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DBUILD_SHARED_LIBS=OFF "
           f"-DGGML_CUDA=OFF -DCMAKE_C_FLAGS='{flags}' -DCMAKE_CXX_FLAGS='{flags}' && cmake --build {b} -j{os.cpu_count()} --target llama-bench llama-quantize")
    say("building llama.cpp")
    return subprocess.Popen(cmd, shell=True, stdout=open(work / "llama-build.log", "w"), stderr=subprocess.STDOUT)


def wait(p: subprocess.Popen, log: Path, what: str) -> None:
    if p.wait():
        raise SystemExit(f"cpu_sweep: {what} build failed:\n{log.read_text()[-4000:]}")
    say(f"{what} built")


def minfer_bench(model: Path, t: int, reps: int, env: dict, membw: bool = False) -> dict:
    # membw: also measure the STREAM-style bandwidth probe at this thread count, so tg128
    # can be stated as a fraction of what the memory system delivers.
    code = (
        "import json,sys\n"
        "from minfer.tools.bench import run_bench\n"
        f"rs = run_bench({str(model)!r}, [512], [128], {reps}, threads=[{t}], backends=['cpu'], "
        f"mem_bandwidth={'None' if membw else 'False'})\n"
        "print(json.dumps({('pp' if r.n_prompt else 'tg'): [r.avg_ts, r.stddev_ts] for r in rs}))\n"
        "tg = [r for r in rs if not r.n_prompt][0]\n"
        "print(json.dumps({'wbpt': rs[0].weight_bytes_per_token, 'membw': tg.mem_bw_bytes_per_s, "
        "'membw_frac': tg.mem_bw_frac}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if out.returncode:
        raise SystemExit(f"cpu_sweep: minfer bench failed:\n{out.stderr[-3000:]}")
    lines = out.stdout.strip().splitlines()
    res = json.loads(lines[-2])
    res.update(json.loads(lines[-1]))
    return res


NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def llama_smoke(bin_dir: Path, model: Path) -> bool:
    r = subprocess.run([str(bin_dir / "llama-bench"), "-m", str(model), "-p", "64", "-n", "0", "-r", "1", "-t", "2"],
                       capture_output=True, text=True)
    if r.returncode:
        say(f"llama-bench smoke test: exit {r.returncode}: {r.stderr.strip()[-300:]}")
    return r.returncode == 0


def llama_bench(bin_dir: Path, model: Path, t: int, reps: int) -> dict:
    out = subprocess.run([str(bin_dir / "llama-bench"), "-m", str(model), "-p", "512", "-n", "128", "-r", str(reps),
                          "-t", str(t), "-fa", "0,1", "-o", "json"], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"cpu_sweep: llama-bench failed:\n{out.stderr[-3000:]}")
    best: dict = {}
    for r in json.loads(out.stdout):
        k = "pp" if r["n_prompt"] else "tg"
        best.setdefault(k, {})[f"fa{int(bool(r['flash_attn']))}"] = r["avg_ts"]
    return best


def checkout_commit(given: str | None) -> str:
    """The commit the table names: --commit (the GPU machine's copy of the tree may carry a
    stale .git: the caller's word wins), else the checkout's HEAD."""
    return given or subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=7", "HEAD"], capture_output=True,
                                   text=True).stdout.strip() or "?"


def run(inputs: Path, threads: list[int], reps: int, budget: float, work: Path, llama_flags: str,
        commit: str | None = None) -> None:
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    wheels = sorted(glob.glob(str(inputs / "*.whl")))
    site = work / "site"
    if wheels:
        sh([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
            "--target", str(site), *wheels])
        sys.path.insert(0, str(site))
    # The sweep measures this checkout, not an installed minfer: its own build of csrc/
    # (MINFER_CORE_DIR, below) with the checkout's python/, in the child processes only.
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python"), str(site), env.get("PYTHONPATH", "")])
    pm = build_minfer(work, env)
    pl = build_llama(inputs, work, llama_flags)
    f16, q = work / "shaped-f16.gguf", work / "shaped-q4_k_m.gguf"
    sh([sys.executable, str(ROOT / "bench" / "shaped_model.py"), "make", str(inputs / "meta.json.gz"), str(f16)],
       env=env)
    wait(pl, work / "llama-build.log", "llama.cpp")
    bin_dir = work / "llama-build" / "bin"
    sh([str(bin_dir / "llama-quantize"), str(f16), str(q), "Q4_K_M", str(os.cpu_count())],
       log=work / "quantize.log")
    f16.unlink()
    if not llama_smoke(bin_dir, q) and not llama_flags:
        # A guest that lists amx_tile but was not granted the tile state kills llama.cpp's
        # AMX matmul with a signal; rebuild without it rather than report nothing.
        say("llama-bench died on a short prefill: rebuilding llama.cpp without AMX")
        shutil.rmtree(work / "llama-build")
        shutil.rmtree(work / "llama.cpp")
        pl = build_llama(inputs, work, NO_AMX)
        wait(pl, work / "llama-build.log", "llama.cpp (no AMX)")
        llama_flags = NO_AMX
    if not llama_smoke(bin_dir, q):
        raise SystemExit("cpu_sweep: llama-bench fails on this machine even without AMX (see its log)")
    wait(pm, work / "minfer-build.log", "minfer")
    env["MINFER_CORE_DIR"] = str(work / "minfer-build")
    info = subprocess.run([sys.executable, "-c", "from minfer import _core; print(_core.testing.cpu_features())"],
                          capture_output=True, text=True, env=env)
    say(f"minfer core: {info.stdout.strip() or info.stderr.strip()[-500:]}")
    commit = checkout_commit(commit)
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    head = (f"minfer {commit} vs llama.cpp {(inputs / 'llama-src.version').read_text().strip()} on {cpu} "
            f"({os.cpu_count()} CPUs), random-weight Q4_K_M with the prepared model's shapes, "
            f"pp512 / tg128 t/s, {reps} reps; llama.cpp = the better of -fa 0 and -fa 1\n\n"
            "| threads | pp512 minfer | pp512 llama.cpp | ratio | tg128 minfer | tg128 llama.cpp | ratio "
            "| probe GB/s | minfer / llama.cpp of the probe |\n"
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    if llama_flags:
        head = f"llama.cpp built with extra flags: {llama_flags}\n\n" + head
    print(head, flush=True)
    rows, raw = [head], []
    for t in threads:
        if time.time() - T0 > budget:
            say(f"budget of {budget:.0f}s spent: skipping threads {t} and after")
            break
        # The probe at every thread count: the exception (llama.cpp already reading
        # 75% of it) and its 90% target are per row.
        m = minfer_bench(q, t, reps, env, membw=True)
        ll = llama_bench(bin_dir, q, t, reps)
        lp, lt = max(ll["pp"].values()), max(ll["tg"].values())
        probe = m.get("membw") or 0.0
        frac = (f"{m['membw_frac']:.0%} / {m['membw_frac'] * lt / m['tg'][0]:.0%}"
                if m.get("membw_frac") else "-")
        row = (f"| {t} | {m['pp'][0]:.1f} | {lp:.1f} | {m['pp'][0] / lp:.2f} | {m['tg'][0]:.1f} | {lt:.1f} | "
               f"{m['tg'][0] / lt:.2f} | {probe / 1e9:.1f} | {frac} |")
        print(row, flush=True)
        rows.append(row)
        if m.get("membw_frac"):
            say(f"threads {t}: tg128 streams {m['membw_frac']:.0%} of the bandwidth probe "
                f"({m['membw'] / 1e9:.1f} GB/s)")
        raw.append({"threads": t, "minfer": m, "llama": ll})
        if out_dir:
            (out_dir / "sweep.md").write_text("\n".join(rows) + "\n")
            (out_dir / "sweep.json").write_text(json.dumps(raw, indent=1))
    by_t = {r["threads"]: r["minfer"]["pp"][0] for r in raw}
    if 1 in by_t and len(by_t) > 1:
        tmax = max(by_t)
        line = f"pp512 scaling: {tmax} threads = {by_t[tmax] / by_t[1]:.1f}x 1 thread"
        print(line, flush=True)
        rows.append("\n" + line)
        if out_dir:
            (out_dir / "sweep.md").write_text("\n".join(rows) + "\n")
    if out_dir:
        for log in ("minfer-build.log", "llama-build.log", "quantize.log"):
            if (work / log).exists():
                shutil.copy(work / log, out_dir / log)
    say("done")


def ab(threads: list[int], reps: int, work: Path, model: Path | None, variants: list[str], balance: bool,
       commit: str | None = None) -> None:
    """A/B of environment settings for minfer alone (see the module docstring)."""
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    model = model or work / "shaped-q4_k_m.gguf"
    if not model.exists():
        raise SystemExit(f"cpu_sweep ab: no model at {model}: run `cpu_sweep.py run` first or pass --model")
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    site = work / "site"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python"), str(site), env.get("PYTHONPATH", "")])
    if site.exists():
        sys.path.insert(0, str(site))
    pm = build_minfer(work, env)
    wait(pm, work / "minfer-build.log", "minfer")
    env["MINFER_CORE_DIR"] = str(work / "minfer-build")
    names = [""] + [v for v in variants if v.strip()]
    envs = []
    for v in names:
        e = dict(env)
        for kv in v.split():
            k, _, val = kv.partition("=")
            e[k] = val
        envs.append(e)
    commit = checkout_commit(commit)
    rows = [f"minfer {commit}, {model.name}, {reps} reps, variants alternating per thread count\n",
            "| threads | variant | pp512 t/s | vs defaults | tg128 t/s | vs defaults |", "|---:|---|---:|---:|---:|---:|"]
    print("\n".join(rows), flush=True)
    res: dict = {}
    for t in threads:
        for name, e in zip(names, envs):
            m = minfer_bench(model, t, reps, e)
            res[(t, name)] = m
            base = res[(t, "")]
            row = (f"| {t} | {name or 'defaults'} | {m['pp'][0]:.1f} | {m['pp'][0] / base['pp'][0]:.3f} | "
                   f"{m['tg'][0]:.1f} | {m['tg'][0] / base['tg'][0]:.3f} |")
            print(row, flush=True)
            rows.append(row)
        if balance:
            b = subprocess.run([sys.executable, str(ROOT / "bench" / "cpu_balance.py"), str(model), "-p", "512",
                                "-t", str(t), "-r", str(reps)], capture_output=True, text=True, env=envs[0])
            text = b.stdout if b.returncode == 0 else f"cpu_balance failed: {b.stderr[-1500:]}"
            print(text, flush=True)
            rows.append("\n" + text)
        if out_dir:
            (out_dir / "ab.md").write_text("\n".join(rows) + "\n")
    t0 = min(threads)
    for name in names:
        for t in threads:
            if t != t0:
                line = (f"pp512 scaling, {name or 'defaults'}: {t} threads = "
                        f"{res[(t, name)]['pp'][0] / res[(t0, name)]['pp'][0]:.1f}x {t0} thread(s)")
                print(line, flush=True)
                rows.append(line)
    if out_dir:
        (out_dir / "ab.md").write_text("\n".join(rows) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description="minfer vs llama.cpp CPU sweep (see the module docstring)")
    sp = ap.add_subparsers(dest="cmd", required=True)
    p = sp.add_parser("prepare")
    p.add_argument("dir", type=Path)
    p.add_argument("--model", type=Path)
    r = sp.add_parser("run")
    r.add_argument("dir", type=Path)
    r.add_argument("--threads", default="16,8,4,2,1")
    r.add_argument("--reps", type=int, default=2)
    r.add_argument("--budget", type=float, default=400.0, help="seconds after which no new thread count starts")
    r.add_argument("--work", type=Path, default=Path("/tmp/minfer-cpu-sweep"))
    r.add_argument("--llama-flags", default="", help="extra C/C++ flags for llama.cpp's build")
    r.add_argument("--commit", help="the commit the table names (default: the checkout's HEAD)")
    b = sp.add_parser("ab")
    b.add_argument("--threads", default="16,1")
    b.add_argument("--reps", type=int, default=2)
    b.add_argument("--work", type=Path, default=Path("/tmp/minfer-cpu-sweep"))
    b.add_argument("--model", type=Path)
    b.add_argument("--env", action="append", default=[], help='a variant: "K=V K2=V2" (repeatable)')
    b.add_argument("--balance", action="store_true", help="also print bench/cpu_balance.py per thread count")
    b.add_argument("--commit", help="the commit the table names (default: the checkout's HEAD)")
    a = ap.parse_args()
    if a.cmd == "prepare":
        prepare(a.dir, a.model)
    elif a.cmd == "ab":
        ab([int(x) for x in a.threads.split(",")], a.reps, a.work, a.model, a.env, a.balance, a.commit)
    else:
        run(a.dir, [int(x) for x in a.threads.split(",")], a.reps, a.budget, a.work, a.llama_flags, a.commit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
