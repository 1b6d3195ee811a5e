"""Decode slowdown of JSON-schema constrained output (the server's mask path).

    python bench/schema_overhead.py [MODEL] [-c 1,16] [-n 96] [--rounds 3] [-t THREADS] [--json]

In process, through the server's scheduler (the same Job, mask hook and eager worker
as `minfer serve`; no HTTP): c sequences started together, each greedy from the same
chat prompt, max_tokens n. Three modes, interleaved round by round:

  free     no constraint, end of generation ignored (exactly n tokens)
  schema   response_format json_schema (an object with a string array), the next
           mask computed on the worker thread while the forward runs
  sync     the same schema, every mask computed in the hook (no worker): what the
           eager path saves

Per mode: the decode rate, the tokens picked from the last sequence's first token to
the last token over that time; the median over rounds. The slowdown of schema and sync
against free is the median of each round's own ratio (the three modes of a round run
back to back, so a round's ratio is what a noisy, shared machine disturbs least). The
constrained runs stop where the JSON ends (or at n): the rate is per decode step, which
does not depend on the output's text. The 1-minute load average is printed per level.
Also per mode: the process's CPU time per token over the same window (every thread:
the forward's, the scheduler's, the mask worker's), the work a schema adds, which a
shared machine's other load disturbs less than the wall clock.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from minfer.grammar import GrammarEngine, TokenMask
from minfer.model import Model
from minfer.sampling import SamplingParams
from minfer.server.scheduler import Job, Scheduler

DEFAULT_MODEL = os.path.expanduser("~/.cache/minfer/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
SCHEMA = {"type": "object", "properties": {
    "languages": {"type": "array", "items": {"type": "object", "properties": {
        "name": {"type": "string"}, "year": {"type": "integer"}, "typed": {"type": "boolean"}},
        "required": ["name", "year", "typed"], "additionalProperties": False}}},
    "required": ["languages"], "additionalProperties": False}
PROMPT = ("List as many programming languages as you can, with the year each appeared and whether it is "
          "statically typed, as JSON.")


def run_level(sched: Scheduler, ids: list[int], c: int, n: int, mode: str, grammar, executor) -> dict:
    done = threading.Event()
    lock = threading.Lock()
    stamps: dict[int, list[float]] = {i: [] for i in range(c)}
    cpus: dict[float, float] = {}        # token time -> the process's CPU time then
    left = [c]
    errors = []

    def emit(ev, i, mask):
        now, cpu = time.perf_counter(), time.process_time()
        if mask is not None and ev.kind == "token" and ev.id is not None:
            mask.on_token(ev.index, ev.id)
        with lock:
            if ev.kind == "token":
                stamps[i].append(now)
                cpus[now] = cpu
                return
            if ev.kind == "error":
                errors.append(ev.message)
            left[0] -= 1
            if left[0] == 0:
                done.set()

    jobs = []
    for i in range(c):
        mask = TokenMask(grammar, 1, executor if mode == "schema" else None) if mode != "free" else None
        jobs.append(Job(prompt_ids=ids, n_predict=n, sampling=SamplingParams(temperature=0.0),
                        emit=lambda ev, i=i, m=mask: emit(ev, i, m), stop_at_eog=mode != "free", mask=mask, n=1))
    for j in jobs:
        sched.submit(j)
    done.wait()
    if errors:
        raise SystemExit(f"error: {errors[0]}")
    # The window where every sequence decodes: from the last sequence's first token
    # (prompts are prefilled in chunks) to the last token; the tokens picked in it.
    t0 = max(s[0] for s in stamps.values())
    t1 = max(s[-1] for s in stamps.values())
    picked = sum(sum(1 for t in s if t > t0) for s in stamps.values())
    cpu_ms = (cpus[t1] - cpus[t0]) * 1000 / picked if picked else 0.0
    return {"rate": picked / (t1 - t0) if t1 > t0 else 0.0, "cpu_ms": cpu_ms,
            "per_seq": sorted(len(s) for s in stamps.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    ap.add_argument("-c", "--concurrency", default="1,16")
    ap.add_argument("-n", "--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    model = Model.open(args.model, n_threads=args.threads)
    tok = model.tokenizer
    ids = tok.encode(tok.render_chat([{"role": "user", "content": PROMPT}], add_generation_prompt=True))
    sched = Scheduler(model, n_slots=max(levels), n_ctx=len(ids) + args.tokens + 8, chunk=512)
    sched.start()
    grammar = GrammarEngine(tok, n_vocab=model.hp.n_vocab).json_schema(SCHEMA)
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minfer-mask")
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "?"
    run_level(sched, ids, 1, 8, "free", grammar, executor)      # warm the graphs
    run_level(sched, ids, 1, 8, "schema", grammar, executor)
    results = {}
    for c in levels:
        rates = {"free": [], "schema": [], "sync": []}
        cpu = {"free": [], "schema": [], "sync": []}
        toks = {"free": [], "schema": [], "sync": []}
        for r in range(args.rounds):
            order = ["free", "schema", "sync"] if r % 2 == 0 else ["sync", "schema", "free"]
            for mode in order:
                got = run_level(sched, ids, c, args.tokens, mode, grammar, executor)
                rates[mode].append(got["rate"])
                cpu[mode].append(got["cpu_ms"])
                toks[mode].append(got["per_seq"])
        med = {m: statistics.median(v) for m, v in rates.items()}
        paired = {m: statistics.median(1 - x / f for x, f in zip(rates[m], rates["free"])) for m in ("schema", "sync")}
        cpu_med = {m: statistics.median(v) for m, v in cpu.items()}
        res = {"concurrency": c, "tokens": args.tokens, "rounds": args.rounds, "threads": model.n_threads,
               "commit": commit, "rates": rates, "median": med, "load1": os.getloadavg()[0],
               "slowdown_schema": paired["schema"], "slowdown_sync": paired["sync"], "cpu_ms_per_token": cpu_med,
               "cpu_overhead_schema": cpu_med["schema"] / cpu_med["free"] - 1,
               "constrained_tokens": toks["schema"]}
        results[c] = res
        if args.json:
            print(json.dumps(res))
        else:
            print(f"c={c:2d}  free {med['free']:7.1f} tok/s   schema {med['schema']:7.1f} tok/s "
                  f"(median round {100 * res['slowdown_schema']:+.1f}% slower)   sync {med['sync']:7.1f} tok/s "
                  f"({100 * res['slowdown_sync']:+.1f}%)   rounds {args.rounds}, n {args.tokens}, "
                  f"{model.n_threads} threads, commit {commit}")
            print(f"      rates free {['%.1f' % x for x in rates['free']]} schema "
                  f"{['%.1f' % x for x in rates['schema']]} sync {['%.1f' % x for x in rates['sync']]}; "
                  f"constrained outputs {toks['schema'][0]} tokens; load {res['load1']:.2f}")
            print(f"      CPU ms per token (all threads): free {cpu_med['free']:.2f} schema {cpu_med['schema']:.2f} "
                  f"({100 * res['cpu_overhead_schema']:+.1f}%) sync {cpu_med['sync']:.2f}")
    sched.stop()
    executor.shutdown()


if __name__ == "__main__":
    main()
