#!/usr/bin/env bash
# `minfer serve` beside llama.cpp's `llama-server` on one GPU, in one call:
# bench/serve_load.py --backend cuda on the 0.5B and 7B Qwen2 shapes (random weights,
# Q4_K_M types, Qwen2's vocabulary and chat template from llama.cpp's vocab-only GGUF),
# 128 generated tokens per request, concurrency 1, 4, 16 and 64, both servers with
# SLOTS slots of CTX tokens (llama-server: -ngl 99 -fa on -np SLOTS -c SLOTS*CTX).
#
#   here:   llama-cuda-src.tar.gz (bench/cuda_side_by_side.sh says how; tools/ui's
#           CMakeLists.txt, sources.cmake and *.in are needed for llama-server),
#           bench_vocab/ggml-vocab-qwen2.gguf, .whl/ (gguf, the server's stack, httpx)
#   device: run(command="bash bench/cuda_serve.sh", carry=["llama-cuda-src.tar.gz", "bench_vocab", ".whl"])
#
# Knobs: SHAPES ("0.5b 7b"), CONC (1,4,16,64), ROUNDS (2), SLOTS (64), CTX (512),
# SPEC=1 adds the ngram speculation comparison (serve_load.py --speculate, c = 1 and 16)
# per shape, LLAMA_ONLY=1 only builds llama.cpp (to run beside another phase),
# LLAMA_BIN=DIR takes llama-server from DIR (a carried build) instead of building it,
# SAVE_LLAMA=1 packs the built binaries into $OUT/llama-bin.tar.xz for a later call,
# NO_LLAMA=1 runs minfer alone (no llama.cpp build: when device time is short).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/minfer-serve}
mkdir -p "$OUT"
log() { printf '%s %s\n' "$(date +%T)" "$*" | tee -a "$OUT/serve.txt"; }
src=/tmp/lcpp build=/tmp/lcpp-build
lbin=${LLAMA_BIN:-$build/bin}
if [ "${NO_LLAMA:-0}" != 1 ] && [ ! -x "$lbin/llama-server" ]; then
  [ -d "$src/llama.cpp" ] || { mkdir -p "$src" && tar -xzf llama-cuda-src.tar.gz -C "$src"; }
  t0=$SECONDS
  cmake -S "$src/llama.cpp" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_USE_PREBUILT_UI=OFF -DBUILD_SHARED_LIBS=OFF \
    >"$OUT/llama-cmake.log" 2>&1 &&
    timeout "${BUILD_S:-480}" cmake --build "$build" -j"${LLAMA_JOBS:-$(nproc)}" --target llama-server llama-bench \
      >"$OUT/llama-build.log" 2>&1
  log "llama.cpp build rc $? in $((SECONDS - t0)) s"
  lbin=$build/bin
  [ -x "$lbin/llama-server" ] || { tail -5 "$OUT/llama-build.log"; exit 3; }
  if [ "${SAVE_LLAMA:-0}" = 1 ]; then
    tar -cJf "$OUT/llama-bin.tar.xz" -C "$lbin" llama-server llama-bench && log "saved llama-bin.tar.xz $(du -h "$OUT/llama-bin.tar.xz" | cut -f1)"
  fi
fi
[ "${LLAMA_ONLY:-0}" = 1 ] && exit 0
compgen -G ".whl/*.whl" >/dev/null && python3 -m pip install -q --no-deps .whl/*.whl 2>/dev/null

t0=$SECONDS
CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) python3 -m pip install -q --no-build-isolation --no-deps \
  -C cmake.define.MINFER_CUDA=ON -C build-dir=build/device . >"$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
log "minfer build in $((SECONDS - t0)) s at ${COMMIT:-?}"
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a "$OUT/serve.txt"

m=/tmp/serve-models
vocab=${VOCAB:-bench_vocab/ggml-vocab-qwen2.gguf}
[ -f "$vocab" ] || vocab=gpu_models/ggml-vocab-qwen2.gguf  # the GPU suite's carried copy
mkdir -p "$m"
for s in ${SHAPES:-0.5b 7b}; do
  f=$m/qwen2-$s.gguf
  if [ ! -f "$f" ]; then
    python3 - "$m/raw.gguf" "$s" <<'PY'
import sys
sys.path.insert(0, "bench")
from cuda_bench import shapes
from minfer.testing.synth import write_model
write_model(sys.argv[1], seed=1, with_tokenizer=False, fast=True, ctx=4096, **shapes()[sys.argv[2]])
PY
    python3 bench/with_vocab.py "$m/raw.gguf" "$vocab" "$f" && rm -f "$m/raw.gguf"
    log "wrote $s"
  fi
  t0=$SECONDS
  python3 bench/serve_load.py "$f" --backend cuda -c "${CONC:-1,4,16,64}" -n 128 --rounds "${ROUNDS:-2}" \
    --slots "${SLOTS:-64}" --ctx "${CTX:-512}" --no-engine-ref \
    $([ "${NO_LLAMA:-0}" = 1 ] && echo --no-llama || echo --llama-server "$lbin/llama-server") \
    --json "$OUT/serve-$s.json" 2>>"$OUT/serve-$s.log" | sed "s/^/$s /" | tee -a "$OUT/serve.txt"
  log "serve $s in $((SECONDS - t0)) s"
  if [ "${SPEC:-0}" = 1 ]; then
    python3 bench/serve_load.py "$f" --backend cuda --speculate -c 1,16 -n 128 --rounds 3 --slots 16 --ctx 1024 \
      --json "$OUT/spec-$s.json" 2>>"$OUT/spec-$s.log" | sed "s/^/$s /" | tee -a "$OUT/serve.txt"
  fi
done
log done
