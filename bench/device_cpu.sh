#!/usr/bin/env bash
# One call on the GPU machine's CPU (the `device` tool's `run`): minfer beside llama.cpp at
# every thread count (bench/cpu_sweep.py run: both built there, the shaped Q4_K_M made
# there), the K-quant and AMX tests on that build (real tiles where the CPU has them), and
# the AMX prefill's tiles against the vector kernel (bench/amx_prefill.py) at the thread
# counts of AMX_T, and bench/cpu_balance.py's per-op prefill table at BALANCE_T.
# Each phase's log and time land under $OUT; a phase that fails does not stop the next.
#
#   python bench/cpu_sweep.py prepare sweep_in/llama --model SHAPED.gguf   # here, with network
#   run(command="COMMIT=<rev> bash bench/device_cpu.sh sweep_in/llama", carry=["sweep_in"])
#
# Knobs (environment): THREADS (1,16,2,4,8), REPS (2), BUDGET (300: seconds after which the
# sweep starts no new thread count), AMX_T (4,16; empty: none), BALANCE_T (2,4; empty:
# none), TESTS=0 skips the tests.
# About 300 s for the sweep's five thread counts of the Llama-3.2-1B shape on the 16-core
# Xeon, 30 for the tests, 20 a thread count for amx_prefill.
set -u
cd "$(dirname "$0")/.."
IN=${1:?usage: bash bench/device_cpu.sh SWEEP_DIR (from bench/cpu_sweep.py prepare)}
OUT=${OUT:-/tmp/minfer-device-cpu}
W=${WORK:-/tmp/minfer-cpu-sweep}
mkdir -p "$OUT" "$W"
S=$OUT/summary.txt
phase() { printf '%s %s\n' "$(date +%T)" "$*" | tee -a "$S"; }
phase "start at ${COMMIT:-$(git log --oneline -1 2>/dev/null || echo '?')}: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2), $(nproc) CPUs"

t0=$SECONDS
python3 bench/cpu_sweep.py run "$IN" --threads "${THREADS:-1,16,2,4,8}" --reps "${REPS:-2}" \
  --budget "${BUDGET:-300}" --work "$W" ${COMMIT:+--commit "$COMMIT"} >"$OUT/sweep.log" 2>&1
phase "sweep rc $? in $((SECONDS - t0)) s -> sweep.log (table: sweep.md)"

# The sweep's own build of this checkout, with the wheels it unpacked.
export MINFER_CORE_DIR=$W/minfer-build PYTHONPATH=python:$W/site
if [ "${TESTS:-1}" = 1 ]; then
  t0=$SECONDS
  python3 -m pytest -q -p no:cacheprovider tests/test_repack_k.py tests/test_amx_emulated.py \
    tests/test_work_split.py >"$OUT/tests.log" 2>&1
  phase "tests rc $? in $((SECONDS - t0)) s: $(tail -1 "$OUT/tests.log")"
fi

for t in $(echo "${AMX_T-4,16}" | tr , ' '); do
  t0=$SECONDS
  { echo "== $t threads"; python3 bench/amx_prefill.py "$W/shaped-q4_k_m.gguf" -t "$t" --rounds 3; } \
    >>"$OUT/amx_prefill.txt" 2>&1
  phase "amx_prefill -t $t rc $? in $((SECONDS - t0)) s -> amx_prefill.txt"
done
# Where a prefill's threads spend their time per op at these thread counts.
if [ -n "${BALANCE_T-2,4}" ]; then
  t0=$SECONDS
  python3 bench/cpu_balance.py "$W/shaped-q4_k_m.gguf" -p 512 -t "${BALANCE_T-2,4}" -r 3 >"$OUT/balance.txt" 2>&1
  phase "cpu_balance -t ${BALANCE_T-2,4} rc $? in $((SECONDS - t0)) s -> balance.txt"
fi
phase "done"
