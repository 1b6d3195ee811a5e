"""`minfer quantize` against llama.cpp's llama-quantize on a 0.5B F16 model (not a test).

    python bench/quantize_bench.py                 # F16 -> Q4_K_M, 2 threads, both tools
    python bench/quantize_bench.py --types Q4_K_M,Q8_0 --threads 2 --reps 2
    python bench/quantize_bench.py --record-plans  # llama-quantize --dry-run of every TYPE
                                                   #  -> tests/data/llama_quantize_plans.json
    python bench/quantize_bench.py --rmse          # per-type RMSE, ours vs llama.cpp's, on
                                                   #  the model's own weights

The F16 model: the default model (Qwen2.5-Coder-0.5B-Instruct Q4_K_M) dequantized and
written as F16 by `minfer quantize ... F16` itself (2-D weights F16, norms and biases F32,
the shapes and metadata of the real model), cached as $MINFER_CACHE/qwen2.5-coder-0.5b-f16.gguf.

llama-quantize is built from the same llama-cpp-python sdist that tests/llama_quants_ref.py
uses (vendor/llama.cpp), with CMake + Ninja, target llama-quantize only, in
$MINFER_CACHE/llama-ref/<version>/build-quantize (kept between runs). Besides the times,
the two outputs are compared tensor by tensor: types and bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import llama_quants_ref as ref  # noqa: E402
from minfer.io.gguf_file import GGUFFile  # noqa: E402
from minfer.io.model_cache import default_model_path  # noqa: E402

PLAN_FILE = ROOT / "tests" / "data" / "llama_quantize_plans.json"
ALL_FTYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K", "F16", "BF16"]


def minfer_exe() -> str:
    here = Path(sys.executable).with_name("minfer")
    return str(here) if here.exists() else "minfer"


def f16_model() -> Path:
    src = default_model_path(pull=True, progress=True)
    out = src.parent / "qwen2.5-coder-0.5b-f16.gguf"
    if not out.exists():
        print(f"writing the F16 model {out} from {src.name}", file=sys.stderr)
        subprocess.run([minfer_exe(), "quantize", str(src), str(out), "F16"], check=True, stdout=subprocess.DEVNULL)
    return out


def llama_quantize() -> Path:
    build = ref.cache_dir() / "build-quantize"
    exe = build / "bin" / "llama-quantize"
    if exe.exists():
        return exe
    src = ref.unpack_full()
    cmake = shutil.which("cmake")
    if cmake is None:
        raise SystemExit("cmake is needed to build llama-quantize (pip install cmake ninja)")
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    t0 = time.perf_counter()
    subprocess.run([cmake, "-S", str(src), "-B", str(build), *gen, "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
                    "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                    "-DLLAMA_BUILD_SERVER=OFF", "-DGGML_NATIVE=ON"], check=True, stdout=subprocess.DEVNULL)
    subprocess.run([cmake, "--build", str(build), "--target", "llama-quantize", "-j", str(os.cpu_count() or 2)],
                   check=True, stdout=subprocess.DEVNULL)
    print(f"built llama-quantize in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return exe


_DRY = re.compile(r"^\[\s*\d+/\s*\d+\]\s+(\S+)\s+-\s+\[[^\]]*\],\s+type =\s+(\S+),\s+size =.*?(?:\((\S+)\))?\s*$")


def dry_run_plan(exe: Path, model: Path, ftype: str) -> list[tuple[str, str]]:
    p = subprocess.run([str(exe), "--dry-run", str(model), ftype], capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"llama-quantize --dry-run {ftype} failed:\n{p.stderr[-2000:]}")
    plan = []
    for line in (p.stdout + p.stderr).splitlines():
        m = _DRY.match(line.strip())
        if m:
            plan.append((m.group(1), (m.group(3) or m.group(2)).upper()))
    return plan


def record_plans(exe: Path, model: Path) -> None:
    doc = {"source": f"llama-quantize --dry-run (llama-cpp-python {ref.VERSION} sdist, vendor/llama.cpp) "
                     f"on the default model dequantized to F16 (bench/quantize_bench.py)",
           "plans": {ft: dry_run_plan(exe, model, ft) for ft in ALL_FTYPES}}
    # one tensor per line: diffs of a re-record stay readable
    lines = ["{", f'"source": {json.dumps(doc["source"])},', '"plans": {']
    for i, (ft, plan) in enumerate(doc["plans"].items()):
        lines.append(f"{json.dumps(ft)}: [")
        lines += [f"  {json.dumps(list(e))}{',' if j < len(plan) - 1 else ''}" for j, e in enumerate(plan)]
        lines.append("]" + ("," if i < len(doc["plans"]) - 1 else ""))
    lines += ["}", "}"]
    PLAN_FILE.write_text("\n".join(lines) + "\n")
    print(f"wrote {PLAN_FILE} ({len(doc['plans'])} plans, {len(doc['plans']['Q4_K_M'])} tensors each)")


def timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    dt = time.perf_counter() - t0
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stderr[-2000:]}")
    return dt


def compare_files(a: Path, b: Path) -> str:
    if a.stat().st_size == b.stat().st_size:
        with open(a, "rb") as fa, open(b, "rb") as fb:
            while True:
                ca, cb = fa.read(1 << 24), fb.read(1 << 24)
                if ca != cb:
                    break
                if not ca:
                    return "identical files"
    with GGUFFile.open(a) as ga, GGUFFile.open(b) as gb:
        if list(ga.tensors) != list(gb.tensors):
            return "tensor lists differ"
        bad_type = [n for n in ga.tensors if ga.tensors[n].type != gb.tensors[n].type]
        bad_bytes = [n for n in ga.tensors if not bad_type.count(n)
                     and not np.array_equal(ga.tensor_data(n), gb.tensor_data(n))]
        return (f"{len(ga.tensors)} tensors: {len(ga.tensors) - len(bad_type)} same type, "
                f"{len(ga.tensors) - len(bad_type) - len(bad_bytes)} same bytes"
                + (f"; type differs: {bad_type[:5]}" if bad_type else "")
                + (f"; bytes differ: {bad_bytes[:5]}" if bad_bytes else ""))


def rmse_table(model: Path) -> None:
    """Per type, RMSE of ours and llama.cpp's quantization of real weights (the F16 model's
    ffn_down of layers 0/12/23 for the K-quants, their attn_q and ffn_up for the rest: these
    were dequantized from the Q4_K_M file, so they sit on its grids) and of random tensors
    (256 x 4864: normal, and Student-t df 2 with row scales over 3 decades)."""
    from minfer import _core

    rng = np.random.default_rng(0)
    normal = (rng.standard_normal((256, 4864)) * 0.02).astype(np.float32)
    heavy = (rng.standard_t(2, (256, 4864)) * 0.01 * np.exp(rng.uniform(-3.5, 3.5, (256, 1)))).astype(np.float32)
    print("| type | data | RMSE minfer | RMSE llama.cpp | ratio | bytes equal |")
    print("|---|---|---|---|---|---|")
    with GGUFFile.open(model) as gf:
        def real(t):
            names = ([f"blk.{i}.ffn_down.weight" for i in (0, 12, 23)] if t.endswith("_K") else
                     [f"blk.{i}.{r}.weight" for i in (0, 12, 23) for r in ("attn_q", "ffn_up")])
            for name in names:
                info = gf.tensors[name]
                yield _core.dequantize(info.type_name, gf.tensor_data(name), info.shape[0], 2)

        for t, data, xs in [(t, d, None) for d in ("model", "normal", "heavy")
                            for t in ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16"]]:
            xs = real(t) if data == "model" else [normal if data == "normal" else heavy]
            se_a = se_b = n = 0.0
            same = True
            for x in xs:
                a, b = _core.quantize(t, x, 2), ref.quantize(t, x)
                same &= bool(np.array_equal(a, b))
                da = _core.dequantize(t, a, x.shape[1], 2).astype(np.float64)
                db = _core.dequantize(t, b, x.shape[1], 2).astype(np.float64)
                se_a += float(((da - x) ** 2).sum())
                se_b += float(((db - x) ** 2).sum())
                n += x.size
            ra, rb = (se_a / n) ** 0.5, (se_b / n) ** 0.5
            print(f"| {t} | {data} | {ra:.4e} | {rb:.4e} | {ra / rb if rb else 1.0:.4f} | {same} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="Q4_K_M", help="comma list, or 'all'")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--record-plans", action="store_true")
    ap.add_argument("--rmse", action="store_true")
    ap.add_argument("--ours-only", action="store_true", help="skip building/running llama-quantize")
    args = ap.parse_args()
    model = f16_model()
    if args.rmse:
        rmse_table(model)
        return
    exe = None if args.ours_only else llama_quantize()
    if args.record_plans:
        record_plans(exe, model)
        return
    out_dir = model.parent / "quantize-bench"
    out_dir.mkdir(exist_ok=True)
    print(f"model: {model.name} ({model.stat().st_size / 2**20:.0f} MiB), threads {args.threads}, cpus {os.cpu_count()}")
    print("| type | minfer quantize (s) | llama-quantize (s) | outputs |")
    print("|---|---|---|---|")
    # "all" skips F16: the model is F16 already, which minfer quantize refuses
    for ft in ([t for t in ALL_FTYPES if t != "F16"] if args.types == "all" else args.types.split(",")):
        ours, theirs = out_dir / f"minfer-{ft}.gguf", out_dir / f"llama-{ft}.gguf"
        t_ours = min(timed([minfer_exe(), "quantize", str(model), str(ours), ft, "-t", str(args.threads), "--force"])
                     for _ in range(args.reps))
        if exe is None:
            print(f"| {ft} | {t_ours:.2f} | - | - |")
            continue
        t_theirs = min(timed([str(exe), str(model), str(theirs), ft, str(args.threads)]) for _ in range(args.reps))
        print(f"| {ft} | {t_ours:.2f} | {t_theirs:.2f} | {compare_files(ours, theirs)} |")


if __name__ == "__main__":
    main()
