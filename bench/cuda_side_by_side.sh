#!/usr/bin/env bash
# minfer beside llama.cpp on one GPU, in one call: llama.cpp's CUDA build from the
# llama-cpp-python sdist's sources, then pp512 / tg128 of the Llama-3.1-8B and
# Qwen3-30B-A3B shapes (random weights, Q4_K_M types as llama.cpp's quantizer gives
# them; the vocabularies from llama.cpp's vocab-only GGUFs) with `minfer bench --backend
# cuda` and `llama-bench -ngl 99 -fa 1`, alternating, ROUNDS rounds of REPS repetitions.
#
#   here:   tar the sdist's llama.cpp (GPU backends but CUDA trimmed) into llama-cuda-src.tar.gz,
#           copy ggml-vocab-{llama-bpe,qwen2}.gguf into bench_vocab/
#   device: run(command="bash bench/cuda_side_by_side.sh", carry=["llama-cuda-src.tar.gz", "bench_vocab", ".whl"])
#
# The llama.cpp build (sm_90 only, bench/cuda_serve.sh's) stays in /tmp between calls on
# a warm machine; a call that runs out of time resumes it. SHAPES narrows the models
# (llama8b qwen3-30b).
set -u
OUT=${OUT:-/tmp/minfer-side}
mkdir -p "$OUT"
log() { printf '%s %s\n' "$(date +%T)" "$*" | tee -a "$OUT/side.txt"; }
compgen -G ".whl/*.whl" >/dev/null && python3 -m pip install -q --no-deps .whl/*.whl
# llama.cpp's CUDA build (llama-bench and llama-server) is bench/cuda_serve.sh's.
build=/tmp/lcpp-build
OUT=$OUT LLAMA_ONLY=1 bash bench/cuda_serve.sh || exit 3
t0=$SECONDS
CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) python3 -m pip install -q --no-build-isolation --no-deps \
  -C cmake.define.MINFER_CUDA=ON -C build-dir=build/device . >"$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
log "minfer build in $((SECONDS - t0)) s at ${COMMIT:-?}"
m=/tmp/side-models
mkdir -p "$m"
for s in ${SHAPES:-llama8b qwen3-30b}; do
  f=$m/$s.gguf
  if [ ! -f "$f" ]; then
    if [ "$s" = llama8b ]; then
      python3 - "$m/raw.gguf" <<'PY'
import sys
sys.path.insert(0, "bench")
from cuda_bench import shapes
from minfer.testing.synth import write_model
write_model(sys.argv[1], seed=1, with_tokenizer=False, fast=True, ctx=4096, **shapes()["llama8b"])
PY
      python3 bench/with_vocab.py "$m/raw.gguf" bench_vocab/ggml-vocab-llama-bpe.gguf "$f" && rm -f "$m/raw.gguf"
    else
      python3 bench/moe_shape.py "$f" --preset qwen3-30b-a3b --fast --threads "$(nproc)" --vocab bench_vocab/ggml-vocab-qwen2.gguf >/dev/null
    fi
    log "wrote $s"
  fi
  for r in $(seq "${ROUNDS:-2}"); do
    python3 -m minfer.cli bench "$f" --backend cuda -p 512 -n 128 -r "${REPS:-3}" 2>/dev/null | grep -E "pp512|tg128" | sed "s/^/minfer $s r$r /" | tee -a "$OUT/side.txt"
    "$build/bin/llama-bench" -m "$f" -ngl 99 -fa 1 -p 512 -n 128 -r "${REPS:-3}" 2>/dev/null | grep -E "pp512|tg128" | sed "s/^/llama.cpp $s r$r /" | tee -a "$OUT/side.txt"
  done
done
log done
