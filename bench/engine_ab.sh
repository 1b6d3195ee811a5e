#!/usr/bin/env bash
# CPU throughput of this tree against an older one, side by side on one machine (the GPU
# machine's 16-core host is quiet where the 2-core development machines are not):
# `minfer bench -p 512 -n 128` and `bench/serve_load.py -c 1,4,16`, alternating, on a
# random-weight model in the default model's shapes (its tokenizer is synthetic: the
# work per token is the same).
#
#   git archive OLD_COMMIT | tar -x -C base_tree     # the older tree, untracked
#   run(command="bash bench/engine_ab.sh", carry=[".whl", "base_tree"])
#
# Expects this tree installed already (bench/device_session.sh builds it); builds the old
# one CPU-only into /tmp/minfer-base. THREADS (16), ROUNDS (2), TOKENS (64). Logs under $OUT.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/minfer-device}
mkdir -p "$OUT"
S=$OUT/engine_ab.txt
T=${THREADS:-16}
say() { printf '%s %s\n' "$(date +%T)" "$*" | tee -a "$S"; }

if compgen -G ".whl/*.whl" >/dev/null; then python3 -m pip install -q --no-deps .whl/*.whl >/dev/null 2>&1; fi
t0=$SECONDS
rm -rf /tmp/minfer-base
python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/minfer-base -C cmake.define.MINFER_CUDA=OFF \
  -C build-dir=/tmp/minfer-base-build ./base_tree >"$OUT/build-base.log" 2>&1
say "base build rc $? in $((SECONDS - t0)) s"

M=/tmp/shaped-0.5b.gguf
python3 - "$M" <<'EOF'
import sys
sys.path.insert(0, "bench")
from cuda_bench import shapes
from minfer.testing.synth import write_model
write_model(sys.argv[1], **shapes()["0.5b"])
EOF
say "model rc $?"

for r in $(seq 1 "${ROUNDS:-2}"); do
  for v in new base; do
    if [ $v = base ]; then env=(env PYTHONPATH=/tmp/minfer-base); else env=(env); fi
    "${env[@]}" python3 -m minfer.cli bench "$M" -p 512 -n 128 -r 3 -t "$T" --backend cpu -o md \
      >"$OUT/bench-$v-$r.md" 2>"$OUT/bench-$v-$r.err"
    say "bench $v round $r rc $?: $(grep -E 'pp512|tg128' "$OUT/bench-$v-$r.md" | awk -F'|' '{print $(NF-1)}' | tr '\n' ' ')"
    "${env[@]}" python3 bench/serve_load.py "$M" -c 1,4,16 -n "${TOKENS:-64}" --rounds 2 -t "$T" --no-llama \
      --no-engine-ref >"$OUT/serve-$v-$r.log" 2>&1
    say "serve $v round $r rc $?: $(grep -E 'minfer c=' "$OUT/serve-$v-$r.log" | awk '{print $2, $3}' | tr '\n' ' ')"
  done
done
