#!/usr/bin/env bash
# One call on the GPU machine (the `device` tool's `run`): build with CUDA, the GPU test
# suite, then the benchmark table, each phase's log and time under $OUT, so one call
# (and one machine start) does what a session needs. The machine has no registry: the
# `gguf` wheel and the server's (uvicorn h11 click starlette anyio sniffio idna) travel
# with the tree (carry the folder), e.g.
#
#   pip download --no-deps gguf==0.19.0 uvicorn h11 click starlette anyio sniffio idna -d .whl/
#   python tests/gpu_models.py gpu_models   # the family / MoE checkpoints of the GPU suite
#   run(command="bash bench/device_session.sh", carry=[".whl", "gpu_models"])
#
# Knobs (environment): TESTS=0 skips the GPU suite, TESTS_K=expr narrows it (pytest -k);
# BENCH=none|0.5b|7b|all (default all) and REPS (default 3) for bench/cuda_bench.py;
# AB="NAME=VAL[ NAME=VAL];..." runs `minfer bench -p 0 -n 128` on the 0.5B and 7B shapes
# once per variant (empty = defaults; put it first: bash drops a trailing empty field),
# ROUNDS rounds (2) alternating, side by side in one run (AB_SHAPES: "7b" for one shape);
# PROBE=1 runs bench/stream_probe.cu and bench/tail_probe.cu first; HOSTBENCH=1 the CPU-side sampling and event-hop benches; STAMP=1 adds the stamped per-launch table (bench/cuda_profile.py --stamp) per shape,
# once per variant of STAMP_AB (as AB; unset: the defaults); COSTS=1 what each launch kind
# costs inside the replayed graph (bench/launch_costs.py, ROUNDS rounds; COSTS_KINDS narrows it);
# GAP=1 a step's wall outside the replay (bench/host_gap.py).
# SERVE=1: minfer serve beside llama-server (bench/cuda_serve.sh, its knobs too; carry
# llama-cuda-src.tar.gz): llama.cpp builds in the background from the start, beside the
# build and the GPU suite, and the serving table runs after them into serve.txt.
# STEPS=1: bench/batch_steps.py on the 0.5B and 7B shapes (step walls, graph builds,
# a cProfile of 64 concurrent, the per-kernel table of two steps a level) into
# steps-SHAPE.txt; STEPS_ARGS adds options, STEPS_AB variants of the batched matmuls
# (batch_steps --ab, e.g. "mmq=9 x4=0;mmq=17 x4=0"), STEPS_C the levels (1,4,16,64),
# STEPS_SHAPES narrows the shapes.
# Phases that fail are reported in summary.txt; the later ones still run.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/minfer-device}
mkdir -p "$OUT"
S=$OUT/summary.txt
phase() { printf '%s %s\n' "$(date +%T)" "$*" | tee -a "$S"; }

# The copy on the GPU machine may carry older git metadata than its files: COMMIT=<rev>
# (the caller's `git rev-parse --short HEAD`) names what the files are.
phase "start at ${COMMIT:-$(git log --oneline -1 2>/dev/null || echo no git) (git metadata of the copy, which may lag: COMMIT= names the files)}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem --format=csv,noheader >>"$S" 2>&1
# Wheels carried in .whl/ (gguf; the server's stack for tests/test_cuda_server.py).
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-deps .whl/*.whl >>"$S" 2>&1
fi

# PROBE=1: bench/stream_probe.cu (read-bandwidth ceilings of the matvec's access
# patterns, event-timed) and bench/tail_probe.cu (the same reads by the global timer inside
# the kernel, block end times, static vs dynamic work), standalone, into probe.txt before
# the build.
if [ "${PROBE:-0}" = 1 ]; then
  t0=$SECONDS
  nvcc -O3 -arch=sm_90 -std=c++17 -o /tmp/stream_probe bench/stream_probe.cu >"$OUT/probe.txt" 2>&1 &&
    /tmp/stream_probe >>"$OUT/probe.txt" 2>&1 &&
    nvcc -O3 -arch=sm_90 -std=c++17 -o /tmp/tail_probe bench/tail_probe.cu >>"$OUT/probe.txt" 2>&1 &&
    /tmp/tail_probe >>"$OUT/probe.txt" 2>&1
  phase "probe rc $? in $((SECONDS - t0)) s -> probe.txt"
fi

llama_bg=
if [ "${SERVE:-0}" = 1 ] && [ "${NO_LLAMA:-0}" != 1 ]; then
  (OUT=$OUT LLAMA_ONLY=1 LLAMA_JOBS=${LLAMA_JOBS:-12} bash bench/cuda_serve.sh >"$OUT/llama-bg.log" 2>&1) &
  llama_bg=$!
fi

t0=$SECONDS
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
# build/device (git-ignored) stays on a warm machine between calls: the next build is incremental.
python3 -m pip install -q --no-build-isolation --no-deps -C cmake.define.MINFER_CUDA=ON -C build-dir=build/device . >"$OUT/build.log" 2>&1
rc=$?
phase "build rc $rc in $((SECONDS - t0)) s"
[ $rc -eq 0 ] || { tail -40 "$OUT/build.log" >>"$S"; exit 1; }
python3 -c "from minfer import _core; assert _core.HAS_CUDA" >>"$S" 2>&1 || { phase "no CUDA in the build"; exit 1; }
# BUILD_B="NAME=VAL ..." (CMake definitions): a second build of the same tree into
# /tmp/minfer-b, for A/Bs of build options (an AB variant "PYTHONPATH=/tmp/minfer-b").
# BUILD_B_SRC=DIR builds that tree instead (e.g. an older commit, `git archive` into an
# untracked folder that travels with the working tree): code before vs after, side by side.
# BUILD_C / BUILD_C_SRC: a third one the same way, into /tmp/minfer-c.
build_extra() {  # NAME DEFS SRC
  local name=$1 defs=$2 src=${3:-.} d t0=$SECONDS
  local bopts=()
  for d in $defs; do bopts+=(-C "cmake.define.$d"); done
  rm -rf "/tmp/minfer-$name"
  case $src in /* | . | ./* | ../*) ;; *) src=./$src ;; esac  # pip takes a bare name for a package
  python3 -m pip install -q --no-build-isolation --no-deps --target "/tmp/minfer-$name" -C cmake.define.MINFER_CUDA=ON \
    -C "build-dir=/tmp/minfer-$name-build" "${bopts[@]}" "$src" >"$OUT/build-$name.log" 2>&1
  phase "build $name ($src $defs) rc $? in $((SECONDS - t0)) s"
}
if [ -n "${BUILD_B:-}" ] || [ -n "${BUILD_B_SRC:-}" ]; then build_extra b "${BUILD_B:-}" "${BUILD_B_SRC:-.}"; fi
if [ -n "${BUILD_C:-}" ] || [ -n "${BUILD_C_SRC:-}" ]; then build_extra c "${BUILD_C:-}" "${BUILD_C_SRC:-.}"; fi

# The family / MoE checkpoints of the GPU suite, made where transformers is (carry the
# folder: python tests/gpu_models.py gpu_models).
[ -d gpu_models ] && export GPU_SUITE_MODELS=$PWD/gpu_models
if [ "${TESTS:-1}" = 1 ]; then
  t0=$SECONDS
  python3 -m pytest tests/test_cuda*.py -m cuda -q -p no:cacheprovider --durations=10 ${TESTS_K:+-k "$TESTS_K"} \
    >"$OUT/tests.log" 2>&1
  phase "tests rc $? in $((SECONDS - t0)) s: $(tail -1 "$OUT/tests.log")"
fi

models=$OUT/models
mkdir -p "$models"
if [ -n "${AB:-}" ] || [ "${STAMP:-0}" = 1 ] || [ -n "${NCU:-}" ] || [ "${COSTS:-0}" = 1 ] || [ "${GAP:-0}" = 1 ]; then
  # The benchmark-shaped models, written once (cuda_bench.py names them the same way).
  python3 - "$models" >>"$S" 2>&1 <<'EOF'
import sys
from pathlib import Path
sys.path.insert(0, "bench")
from cuda_bench import shapes
from minfer.testing.synth import write_model
for name, cfg in shapes().items():
    p = Path(sys.argv[1]) / f"qwen2-{name}-q4km-shape.gguf"
    if not p.exists():
        write_model(p, seed=1, with_tokenizer=False, fast=True, ctx=4096, **cfg)
EOF
fi

if [ -n "${AB:-}" ]; then
  t0=$SECONDS
  IFS=';' read -r -a variants <<<"$AB"
  for round in $(seq "${ROUNDS:-2}"); do
    for shape in ${AB_SHAPES:-0.5b 7b}; do
      for v in "${variants[@]}"; do
        env_args=()
        [ -n "$v" ] && read -r -a env_args <<<"$v"
        tg=$(env "${env_args[@]}" python3 -m minfer.cli bench "$models/qwen2-$shape-q4km-shape.gguf" --backend cuda \
          -p 0 -n 128 -r 3 -o json 2>>"$OUT/ab.log" |
          python3 -c "import json,sys,statistics; print(round(statistics.median(json.load(sys.stdin)[0]['samples_ts']),1))")
        phase "ab round $round $shape [${v:-defaults}] tg128 $tg"
      done
    done
  done
  phase "ab done in $((SECONDS - t0)) s"
fi

if [ "${STAMP:-0}" = 1 ]; then
  IFS=';' read -r -a svariants <<<"${STAMP_AB:-}"
  [ ${#svariants[@]} -gt 0 ] || svariants=("")
  for shape in 0.5b 7b; do
    for i in "${!svariants[@]}"; do
      v=${svariants[$i]}
      env_args=()
      [ -n "$v" ] && read -r -a env_args <<<"$v"
      env "${env_args[@]}" python3 bench/cuda_profile.py "$models/qwen2-$shape-q4km-shape.gguf" 32 --at 64 --stamp \
        >"$OUT/stamp-$shape-$i.txt" 2>&1
      phase "stamp $shape [${v:-defaults}] rc $? -> stamp-$shape-$i.txt"
    done
  done
fi

if [ "${COSTS:-0}" = 1 ]; then
  t0=$SECONDS
  python3 bench/launch_costs.py "$models"/qwen2-0.5b-q4km-shape.gguf "$models"/qwen2-7b-q4km-shape.gguf \
    --rounds "${ROUNDS:-2}" ${COSTS_KINDS:+--kinds "$COSTS_KINDS"} >"$OUT/costs.txt" 2>"$OUT/costs.log"
  phase "launch costs rc $? in $((SECONDS - t0)) s -> costs.txt"
  cat "$OUT/costs.txt" >>"$S"
fi

# GAP=1: where a step's wall goes outside the replay (bench/host_gap.py), per shape.
if [ "${GAP:-0}" = 1 ]; then
  for shape in 0.5b 7b; do
    python3 bench/host_gap.py "$models/qwen2-$shape-q4km-shape.gguf" >>"$S" 2>>"$OUT/gap.log"
    phase "host gap $shape rc $?"
  done
fi

# SCHEMA=1: the decode slowdown of JSON-schema output on CUDA (bench/schema_overhead.py,
# c = 1 and 16) on the 0.5B shape given the real Qwen2 vocabulary (carry the vocab-only
# GGUF as VOCAB=path, e.g. llama.cpp's ggml-vocab-qwen2.gguf) into schema.txt.
if [ "${SCHEMA:-0}" = 1 ]; then
  t0=$SECONDS
  python3 - "$models" >>"$S" 2>&1 <<'EOF2'
import sys
from pathlib import Path
sys.path.insert(0, "bench")
from cuda_bench import shapes
from minfer.testing.synth import write_model
p = Path(sys.argv[1]) / "qwen2-0.5b-q4km-shape.gguf"
if not p.exists():
    write_model(p, seed=1, with_tokenizer=False, fast=True, ctx=4096, **shapes()["0.5b"])
EOF2
  python3 bench/with_vocab.py "$models/qwen2-0.5b-q4km-shape.gguf" "${VOCAB:-ggml-vocab-qwen2.gguf}" "$models/schema.gguf" &&
    python3 bench/schema_overhead.py "$models/schema.gguf" -c 1,16 -n 96 --rounds "${ROUNDS:-3}" >"$OUT/schema.txt" 2>&1
  phase "schema overhead rc $? in $((SECONDS - t0)) s -> schema.txt"
  tail -8 "$OUT/schema.txt" >>"$S"
fi

# HOSTBENCH=1: the host-side benches that need no GPU, on this machine's CPU (the picks'
# filters, bench/sampling.py; the server's event hop, bench/event_hop.py) into host.txt.
if [ "${HOSTBENCH:-0}" = 1 ]; then
  t0=$SECONDS
  { python3 bench/sampling.py --steps 300 && python3 bench/event_hop.py; } >"$OUT/host.txt" 2>&1
  phase "host benches rc $? in $((SECONDS - t0)) s -> host.txt"
fi

BENCH=${BENCH:-all}
if [ "$BENCH" != none ]; then
  t0=$SECONDS
  only=()
  [ "$BENCH" = all ] || only=(--only "$BENCH")
  python3 bench/cuda_bench.py --out "$models" --reps "${REPS:-3}" "${only[@]}" >"$OUT/bench.log" 2>&1
  phase "bench rc $? in $((SECONDS - t0)) s"
  tail -30 "$OUT/bench.log" >>"$S"
fi
# NCU="SHAPE:SKIP:COUNT ..." (e.g. "7b:464:12"): Nsight Compute on COUNT matvec launches
# of direct (ungraphed) decode (bench/cuda_profile.py: a 4-token prompt and warm-up steps
# first), after SKIP of them, into ncu-SHAPE-SKIP.txt. Which launch a SKIP reaches is not
# worked out here: read the kernel name and grid size in the output (on the 7B, "7b:466"
# gave a q|k|v launch and "7b:564" an o projection). NCU_KERNEL: the kernel-name regex
# (k_matvec; k_matvec_bulk: only the staged launches, on the 7B 28 gate|up and the
# output matvec a step, so "7b:27:3" gave three gate|up launches). NCU_ARGS: more ncu options
# (e.g. "--clock-control none" for the clocks as found rather than base clocks). NCU_SRC=1
# adds a per-SASS-instruction listing (executed counts, stall samples) of the same launches.
if [ -n "${NCU:-}" ]; then
  ncu_bin=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute*/ncu 2>/dev/null | head -1)
  if [ -z "$ncu_bin" ]; then
    phase "ncu: not found"
  else
    for spec in $NCU; do
      IFS=: read -r shape skip count <<<"$spec"
      MINFER_NO_CUDA_GRAPH=1 timeout "${NCU_TIMEOUT:-150}" "$ncu_bin" ${NCU_ARGS:-} --kernel-name "regex:${NCU_KERNEL:-k_matvec}" \
        --launch-skip "$skip" --launch-count "$count" --section SpeedOfLight --section WarpStateStats \
        --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
        --section InstructionStats --section SchedulerStats --section ComputeWorkloadAnalysis \
        python3 bench/cuda_profile.py "$models/qwen2-$shape-q4km-shape.gguf" 1 >"$OUT/ncu-$shape-$skip.txt" 2>&1
      phase "ncu $shape $skip rc $?"
      # NCU_SRC=1: the same launches' per-instruction counts and stall samples (SASS).
      if [ "${NCU_SRC:-0}" = 1 ]; then
        MINFER_NO_CUDA_GRAPH=1 timeout "${NCU_TIMEOUT:-150}" "$ncu_bin" ${NCU_ARGS:-} --kernel-name "regex:${NCU_KERNEL:-k_matvec}" \
          --launch-skip "$skip" --launch-count "$count" --section SourceCounters --page source --print-source sass --csv \
          python3 bench/cuda_profile.py "$models/qwen2-$shape-q4km-shape.gguf" 1 >"$OUT/ncu-src-$shape-$skip.csv" 2>&1
        phase "ncu source $shape $skip rc $?"
      fi
    done
  fi
fi
# MOE=1: the whole Qwen3-30B-A3B shape (bench/moe_shape.py --fast, Qwen2's vocabulary from
# bench_vocab/ or gpu_models/) into moe.txt: `minfer bench` pp512 / tg128, the per-kind
# decode table by events (direct launches) and by stamps (inside the replay), and a
# 512-token prefill's. MOE_STEPS: decode steps profiled (16); MOE_BENCH=0 leaves out
# `minfer bench` (bench/cuda_side_by_side.sh measures it beside llama.cpp).
if [ "${MOE:-0}" = 1 ]; then
  t0=$SECONDS
  mf=$models/qwen3-30b-a3b.gguf
  voc=bench_vocab/ggml-vocab-qwen2.gguf
  [ -f "$voc" ] || voc=gpu_models/ggml-vocab-qwen2.gguf
  [ -f "$mf" ] || python3 bench/moe_shape.py "$mf" --preset qwen3-30b-a3b --fast --threads "$(nproc)" --vocab "$voc" >>"$OUT/moe.log" 2>&1
  phase "moe shape rc $? in $((SECONDS - t0)) s"
  {
    [ "${MOE_BENCH:-1}" = 1 ] && python3 -m minfer.cli bench "$mf" --backend cuda -p 512 -n 128 -r "${REPS:-3}"
    MINFER_CUDA_PROFILE=1 MINFER_NO_CUDA_GRAPH=1 python3 bench/cuda_profile.py "$mf" "${MOE_STEPS:-16}" --at 64
    python3 bench/cuda_profile.py "$mf" "${MOE_STEPS:-16}" --at 64 --stamp
    MINFER_CUDA_PROFILE=1 MINFER_NO_CUDA_GRAPH=1 python3 bench/cuda_profile.py "$mf" 2 --prefill 512
  } >"$OUT/moe.txt" 2>&1
  phase "moe profile rc $? in $((SECONDS - t0)) s -> moe.txt"
fi
if [ "${STEPS:-0}" = 1 ]; then
  for shape in ${STEPS_SHAPES:-0.5b 7b}; do
    python3 - "$models" "$shape" >>"$S" 2>&1 <<'EOF3'
import sys
from pathlib import Path
sys.path.insert(0, "bench")
from cuda_bench import shapes
from minfer.testing.synth import write_model
p = Path(sys.argv[1]) / f"qwen2-{sys.argv[2]}-q4km-shape.gguf"
if not p.exists():
    write_model(p, seed=1, with_tokenizer=False, fast=True, ctx=4096, **shapes()[sys.argv[2]])
EOF3
    # The engine detokenizes: the shape with Qwen2's vocabulary (carried in gpu_models/).
    sv=$models/qwen2-$shape-vocab.gguf
    [ -f "$sv" ] || python3 bench/with_vocab.py "$models/qwen2-$shape-q4km-shape.gguf" \
      "${VOCAB:-gpu_models/ggml-vocab-qwen2.gguf}" "$sv" >>"$S" 2>&1
    timeout "${STEPS_S:-150}" python3 bench/batch_steps.py "$sv" -c "${STEPS_C:-1,4,16,64}" -n 64 \
      --profile 64 --kernels 2 ${STEPS_ARGS:-} ${STEPS_AB:+--ab "$STEPS_AB"} >"$OUT/steps-$shape.txt" 2>&1
    phase "batch steps $shape rc $? -> steps-$shape.txt"
    head -4 "$OUT/steps-$shape.txt" >>"$S"
  done
fi

if [ "${SERVE:-0}" = 1 ]; then
  [ -n "$llama_bg" ] && { wait "$llama_bg"; phase "llama.cpp build: $(tail -1 "$OUT/llama-bg.log")"; }
  t0=$SECONDS
  OUT=$OUT bash bench/cuda_serve.sh >/dev/null 2>&1
  phase "serve rc $? in $((SECONDS - t0)) s -> serve.txt"
  grep -E "minfer|llama-server|x$" "$OUT/serve.txt" >>"$S"
fi
phase "done"
