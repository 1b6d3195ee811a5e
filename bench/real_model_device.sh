#!/usr/bin/env bash
# The default model on the GPU machine, which has no registry: the 491 MB file travels as
# slices of at most 60 MiB, one per call of the `device` tool, in back-to-back calls (the
# machine keeps /tmp while it stays warm). Locally:
#
#   mkdir -p .slices && echo .slices/ >> .git/info/exclude
#   split -b 62914560 -d -a 1 ~/.cache/minfer/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf .slices/p
#   run(command="bash bench/real_model_device.sh stash", carry=[".slices/p0"])   # p1 ... p7 likewise
#   run(command="bash bench/real_model_device.sh check", carry=[".slices/p7"])   # the last one
#
# `stash` moves the carried slices to /tmp/minfer-real; `check` (after stashing what it
# carries) assembles them, checks the sha256, and writes $OUT/real.txt: the greedy text of
# the README's prompt on the CPU (every core) and on CUDA, whether they are equal, and
# `minfer bench` on CUDA. The minfer build must already be installed (bench/device_session.sh
# in an earlier call on the same warm machine).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/minfer-device}
mkdir -p "$OUT" /tmp/minfer-real
SHA=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
for f in .slices/p*; do
  [ -e "$f" ] && mv "$f" /tmp/minfer-real/
done
ls -l /tmp/minfer-real
[ "${1:-stash}" = check ] || exit 0

M=/tmp/minfer-real/model.gguf
cat /tmp/minfer-real/p[0-9] >"$M"
R=$OUT/real.txt
got=$(sha256sum "$M" | cut -d' ' -f1)
echo "sha256 $got ($([ "$got" = "$SHA" ] && echo ok || echo MISMATCH))" | tee "$R"
[ "$got" = "$SHA" ] || exit 1
P="Write a Python function that returns the n-th Fibonacci number."
for b in cpu cuda; do
  python3 -m minfer.cli generate "$M" "$P" --chat -n 96 --temp 0 --backend "$b" >"$OUT/gen-$b.txt" 2>"$OUT/gen-$b.err"
  echo "generate --backend $b rc $?: $(tail -1 "$OUT/gen-$b.err")" >>"$R"
done
if cmp -s "$OUT/gen-cpu.txt" "$OUT/gen-cuda.txt"; then
  echo "greedy text: CPU and CUDA equal ($(wc -c <"$OUT/gen-cpu.txt") bytes)" >>"$R"
else
  echo "greedy text: CPU and CUDA differ" >>"$R"
  diff "$OUT/gen-cpu.txt" "$OUT/gen-cuda.txt" >>"$R"
fi
python3 -m minfer.cli bench "$M" --backend cuda -p 512 -n 128 -r 5 >>"$R" 2>&1
echo "bench rc $?" >>"$R"
cat "$R"
