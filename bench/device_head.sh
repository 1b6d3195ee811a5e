#!/usr/bin/env bash
# bench/device_session.sh on a committed snapshot rather than the working tree (which may
# hold uncommitted work in progress): make the snapshot here,
#
#   git archive --format=tar -o head.tar HEAD
#   run(command="bash bench/device_head.sh", carry=["head.tar", ".whl", "gpu_models"])
#
# It is synced into /tmp/minfer-head file by file (only changed files are rewritten, with
# fresh mtimes, so a second call on a warm machine rebuilds incrementally), the carried
# folders are linked in, and device_session.sh runs there with this call's environment.
set -eu
src=/tmp/minfer-head new=/tmp/minfer-head.new
rm -rf "$new" && mkdir -p "$new" "$src"
tar -xf head.tar -C "$new"
(cd "$new" && find . -type f) | while read -r f; do
  if ! cmp -s "$new/$f" "$src/$f"; then mkdir -p "$(dirname "$src/$f")" && cp "$new/$f" "$src/$f"; fi
done
for d in .whl gpu_models; do [ -e "$d" ] && ln -sfn "$PWD/$d" "$src/$d"; done
cd "$src" && exec bash bench/device_session.sh
