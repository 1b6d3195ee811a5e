"""Time to the first token of a CLI run, with and without the start-up overlap (the
weights repacked on a thread while the tokenizer is built; MINFER_WARM=0 turns it off),
side by side in one run: each round runs both, in alternating order.

    python bench/first_token.py [MODEL] [--rounds 5] [--threads N]

Prints the medians of the process's wall time and of minfer's own load + prompt time
(`minfer generate --json`: everything up to the first pick).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def once(model: str, warm: bool, threads: int | None) -> tuple[float, float]:
    cmd = [sys.executable, "-m", "minfer.cli", "generate", model, "def fibonacci(n):", "-n", "1", "--temp", "0",
           "--json"] + (["-t", str(threads)] if threads else [])
    env = dict(os.environ, MINFER_WARM="1" if warm else "0")
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    wall = time.perf_counter() - t0
    tm = json.loads(res.stdout)["timings"]
    return wall, (tm["load_ms"] + tm["prompt_ms"]) / 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.model is None:
        from minfer.io.model_cache import default_model_path
        a.model = str(default_model_path(pull=True, progress=True))
    got: dict = {True: [], False: []}
    for r in range(a.rounds):
        for warm in ((True, False) if r % 2 else (False, True)):
            got[warm].append(once(a.model, warm, a.threads))
    for warm in (False, True):
        walls, firsts = zip(*got[warm])
        print(f"{'overlapped' if warm else 'in turn    '}: process {statistics.median(walls):.2f} s, "
              f"load + prompt {statistics.median(firsts):.2f} s (medians of {a.rounds}; "
              f"first token at {', '.join(f'{x:.2f}' for x in firsts)})")


if __name__ == "__main__":
    main()
