"""Load on an OpenAI-compatible server: N concurrent chat requests, aggregate generated
tokens per second and time to first token (p50/p99), side by side with llama.cpp's
llama-server when one is available.

Usage:
    python bench/serve_load.py [MODEL] [-c 1,4,16] [-n 64] [--rounds 2] [-t 2]
                               [--slots 16] [--ctx 1024] [--url URL]
                               [--llama-server PATH | --no-llama] [--json out.json]

Without --url it starts `minfer serve MODEL` on a free loopback port (--slots, --ctx,
-t) and stops it afterwards; with --url it loads an already running server. For each
concurrency c it sends c * rounds streaming chat requests, c at a time (each worker
sends its next request when its previous one ends), every one greedy with end of
generation ignored (`ignore_eos`, as llama-server's extension) and max_tokens n, so
each generates exactly n tokens. Each request has its own prompt (a short distinct
user message; the chat template's prefix is shared, as with real clients).

  agg tok/s  completion tokens of all requests / wall time of the level
  TTFT       request sent -> first content chunk, per request (p50, p99)

Load conditions: the 1-minute load average is printed with each level, and (unless
--no-engine-ref) a plain in-process greedy generation of n tokens (Session, no server)
is timed right before and after the minfer load, so the server's rate can be read
against the engine's rate in the same window on a shared machine.

llama-server (found on PATH, or --llama-server PATH) is started with
`-m MODEL -np 8 -c 8192 -t T` (the CPU anchor) and gets the same load. With
--backend cuda, minfer serves on the GPU and llama-server gets the same slots and
context on its GPU: `-ngl 99 -fa on -np SLOTS -c SLOTS*CTX`.

--speculate: instead of the load above, code-editing requests (the workload of
`minfer bench --speculate` and bench/speculate.py: rewrite a 12-line function with type
hints; at concurrency c, c requests over two such functions; `--workload other`: its
from-scratch and prose prompts instead) with "speculate": "off"
and "ngram" back to back on one server, the order alternating between --rounds, each
request greedy with exactly -n tokens. Reports aggregate tok/s per mode (medians over
rounds), the speed-up, the drafted/accepted counts from usage, and checks that both
modes produced the same text for every request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

TOPICS = ["a lighthouse", "sorting algorithms", "the moon", "a red bicycle", "tea", "volcanoes", "a lost key",
          "prime numbers", "autumn", "a robot", "the sea", "bread", "a library", "trains", "chess", "rain"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"server exited {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise SystemExit("server did not become ready")


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


async def sse_docs(client: httpx.AsyncClient, url: str, body: dict):
    """The JSON documents of one streamed chat completion (an error document raises)."""
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        # SSE lines end at CR or LF only: aiter_lines() would also split at U+2028, U+0085
        # and the like, which JSON strings may carry unescaped.
        buf = ""
        async for text in r.aiter_text():
            buf += text
            *lines, buf = buf.split("\n")
            for line in lines:
                line = line.rstrip("\r")
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                doc = json.loads(line[6:])
                if "error" in doc:
                    raise RuntimeError(f"stream error: {doc['error']}")
                yield doc


async def one(client: httpx.AsyncClient, url: str, i: int, n: int) -> tuple[float, int, float]:
    body = {"model": "any", "messages": [{"role": "user", "content": f"Write about {TOPICS[i % len(TOPICS)]} ({i})."}],
            "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft = None
    n_tok = 0
    async for doc in sse_docs(client, url, body):
        for ch in doc.get("choices") or []:
            if ch.get("delta", {}).get("content") and ttft is None:
                ttft = time.perf_counter() - t0
        if doc.get("usage"):
            n_tok = doc["usage"]["completion_tokens"]
    return ttft if ttft is not None else time.perf_counter() - t0, n_tok, time.perf_counter() - t0


async def level(url: str, conc: int, n: int, rounds: int) -> dict:
    todo = iter(range(conc * rounds))
    ttfts, toks = [], 0
    limits = httpx.Limits(max_connections=conc + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800), limits=limits) as client:
        async def worker():
            nonlocal toks
            for i in todo:
                ttft, k, _ = await one(client, url, i, n)
                ttfts.append(ttft)
                toks += k
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(conc)))
        wall = time.perf_counter() - t0
    return {"concurrency": conc, "requests": conc * rounds, "tokens": toks, "wall_s": round(wall, 3),
            "agg_tps": round(toks / wall, 2), "ttft_p50_ms": round(pct(ttfts, 50) * 1000, 1),
            "ttft_p99_ms": round(pct(ttfts, 99) * 1000, 1)}


def run_load(name: str, url: str, concs: list[int], n: int, rounds: int) -> list[dict]:
    asyncio.run(level(url, 1, 4, 1))  # warm-up: graphs built, pages touched
    out = []
    for c in concs:
        r = asyncio.run(level(url, c, n, rounds))
        r["server"] = name
        out.append(r)
        r["load1"] = round(os.getloadavg()[0], 2)
        print(f"{name:>13} c={c:<3} {r['agg_tps']:8.2f} tok/s  TTFT p50 {r['ttft_p50_ms']:8.1f} ms  "
              f"p99 {r['ttft_p99_ms']:8.1f} ms  ({r['requests']} req, {r['tokens']} tok, {r['wall_s']:.1f} s, "
              f"load {r['load1']})", flush=True)
    return out


def edit_prompts(workload: str = "edit") -> list[str]:
    """edit: the type-hints prompt of bench/speculate.py over its two functions; other:
    its from-scratch and prose prompts (little for prompt lookup to copy)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, for bench/speculate.py
    from speculate import FUNC2, PROMPTS  # bench/speculate.py's second function and prompts
    from minfer.tools.bench import SPEC_FUNC, SPEC_PROMPT

    if workload == "other":
        return [PROMPTS["write: from scratch"], PROMPTS["prose"]]
    return [SPEC_PROMPT, SPEC_PROMPT.replace(SPEC_FUNC, FUNC2)]


async def edit_request(client: httpx.AsyncClient, url: str, prompt: str, n: int, speculate: str) -> tuple[str, dict]:
    body = {"model": "any", "messages": [{"role": "user", "content": prompt}], "max_tokens": n, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, "speculate": speculate}
    parts, usage = [], {}
    async for doc in sse_docs(client, url, body):
        for ch in doc.get("choices") or []:
            parts.append(ch.get("delta", {}).get("content") or "")
        if doc.get("usage"):
            usage = doc["usage"]
    return "".join(parts), usage


async def edit_level(url: str, conc: int, n: int, speculate: str, prompts: list[str]) -> dict:
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800), limits=httpx.Limits(max_connections=conc + 2)) as c:
        t0 = time.perf_counter()
        got = await asyncio.gather(*(edit_request(c, url, prompts[i % len(prompts)], n, speculate)
                                     for i in range(conc)))
        wall = time.perf_counter() - t0
    toks = sum(u["completion_tokens"] for _, u in got)
    sp = [u.get("speculation") or {} for _, u in got]
    return {"tps": toks / wall, "texts": [t for t, _ in got], "drafted": sum(x.get("drafted", 0) for x in sp),
            "accepted": sum(x.get("accepted", 0) for x in sp)}


def run_spec_compare(url: str, concs: list[int], n: int, rounds: int, workload: str = "edit") -> list[dict]:
    import statistics

    prompts = edit_prompts(workload)
    # Warm-up at the largest concurrency: graphs for the prompts, single steps and blocks,
    # and every slot then holds its prompt, so no timed round pays a prefill the other
    # mode does not.
    for mode in ("off", "ngram"):
        asyncio.run(edit_level(url, max(concs), 16, mode, prompts))
    out = []
    for c in concs:
        runs: dict = {"off": [], "ngram": []}
        texts: dict = {}
        for r in range(rounds):
            for mode in (("off", "ngram") if r % 2 == 0 else ("ngram", "off")):
                res = asyncio.run(edit_level(url, c, n, mode, prompts))
                runs[mode].append(res)
                for i, t in enumerate(res["texts"]):
                    if texts.setdefault(i, t) != t:
                        raise SystemExit(f"c={c}: request {i} differs between modes or rounds")
        off = statistics.median(x["tps"] for x in runs["off"])
        on = statistics.median(x["tps"] for x in runs["ngram"])
        d, a = runs["ngram"][-1]["drafted"], runs["ngram"][-1]["accepted"]
        row = {"workload": workload, "concurrency": c, "plain_tps": round(off, 2), "ngram_tps": round(on, 2),
               "speedup": round(on / off, 2), "drafted": d, "accepted": a,
               "per_round": [[round(x["tps"], 2) for x in runs[m]] for m in ("off", "ngram")],
               "load1": round(os.getloadavg()[0], 2)}
        out.append(row)
        print(f"{workload:>5} c={c:<3} plain {off:8.2f} tok/s  ngram {on:8.2f} tok/s  {on / off:5.2f}x  "
              f"(accepted {a}/{d} drafted; per round off {row['per_round'][0]}, ngram {row['per_round'][1]}; "
              f"load {row['load1']}; same text)", flush=True)
    return out


def engine_ref(model: str, n: int, threads: int) -> dict:
    """Greedy generation of n tokens by a plain Session in this process: the engine's
    rate in the same window (prompt: a short chat message, like the load's)."""
    from minfer.sampling import SamplingParams
    from minfer.session import Session

    s = Session.open(model, n_ctx=512, n_threads=threads)
    tok = s.tokenizer
    ids = tok.encode(tok.render_chat([{"role": "user", "content": "Write about tea (0)."}]))
    s.generate(ids, 4, SamplingParams(temperature=0.0), stop_at_eog=False)  # warm-up
    r = s.generate(ids, n, SamplingParams(temperature=0.0), stop_at_eog=False)
    total = (r.timings.prompt_ms + r.timings.gen_ms) / 1000
    out = {"server": "engine (no server)", "concurrency": 1, "tokens": len(r.ids), "decode_tps": round(r.gen_tps, 2),
           "agg_tps": round(len(r.ids) / total, 2), "ttft_p50_ms": round(r.timings.prompt_ms, 1),
           "load1": round(os.getloadavg()[0], 2)}
    print(f"{'engine':>13} c=1   {out['agg_tps']:8.2f} tok/s  (decode {out['decode_tps']:.2f} tok/s, first token "
          f"{out['ttft_p50_ms']:.1f} ms, load {out['load1']})", flush=True)
    return out


def backend_args(a: argparse.Namespace) -> list[str]:
    return ["--backend", a.backend] if a.backend else []


def llama_args(a: argparse.Namespace) -> list[str]:
    """llama-server's slots and context: on a GPU the same as minfer's, every layer
    offloaded with flash attention (its best); on the CPU the issue's anchor."""
    if a.backend and "cuda" in a.backend.lower():
        return ["-ngl", "99", "-fa", "on", "-np", str(a.slots), "-c", str(a.slots * a.ctx)]
    return ["-np", "8", "-c", "8192"]


def stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", help="GGUF (default: minfer's default model)")
    ap.add_argument("-c", "--concurrency", default="1,4,16")
    ap.add_argument("-n", "--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="requests per worker at each level")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=1024, help="tokens per slot")
    ap.add_argument("--backend", help="minfer serve --backend (cuda: llama-server offloads every layer, FA on, "
                    "the same slots and context)")
    ap.add_argument("--url", help="load a running server instead of starting minfer serve")
    ap.add_argument("--llama-server", help="path of llama.cpp's llama-server (default: on PATH)")
    ap.add_argument("--no-llama", action="store_true", help="skip llama-server even if found")
    ap.add_argument("--no-engine-ref", action="store_true", help="skip the in-process engine reference")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--speculate", action="store_true",
                    help="code-editing requests with speculation off and ngram, side by side (see above)")
    ap.add_argument("--workload", default="edit", help="with --speculate: edit, other (from scratch and prose), "
                    "or a comma list of both")
    a = ap.parse_args(argv)
    try:
        concs = [int(x) for x in a.concurrency.split(",") if x.strip()]
    except ValueError:
        ap.error("-c takes a comma list of integers")
    if not concs or min(concs) < 1 or a.tokens < 1 or a.rounds < 1:
        ap.error("concurrency, tokens and rounds must be >= 1")
    model = a.model
    if model is None and (a.url is None or not a.no_llama):
        from minfer.io.model_cache import default_model_path

        model = str(default_model_path(pull=False))
    results = []
    if a.speculate:
        loads = [w.strip() for w in a.workload.split(",") if w.strip()]
        if not loads or any(w not in ("edit", "other") for w in loads):
            ap.error("--workload takes edit, other or both")
        if a.url:
            results = [r for w in loads for r in run_spec_compare(a.url.rstrip("/"), concs, a.tokens, a.rounds, w)]
        else:
            port = free_port()
            proc = subprocess.Popen([sys.executable, "-m", "minfer.cli", "serve", model, "--port", str(port),
                                     "--threads", str(a.threads), "--slots", str(a.slots), "--ctx", str(a.ctx),
                                     *backend_args(a)], env=dict(os.environ))
            try:
                wait_ready(f"http://127.0.0.1:{port}", proc)
                results = [r for w in loads
                           for r in run_spec_compare(f"http://127.0.0.1:{port}", concs, a.tokens, a.rounds, w)]
            finally:
                stop(proc)
        if a.json:
            Path(a.json).write_text(json.dumps({"load": os.getloadavg(), "tokens": a.tokens, "threads": a.threads,
                                                "speculate": results}, indent=1))
        return 0
    if a.url:
        results += run_load("server", a.url.rstrip("/"), concs, a.tokens, a.rounds)
    else:
        port = free_port()
        cmd = [sys.executable, "-m", "minfer.cli", "serve", model, "--port", str(port), "--threads", str(a.threads),
               "--slots", str(a.slots), "--ctx", str(a.ctx), "--max-queue", "256", *backend_args(a)]
        if not a.no_engine_ref:
            results.append(engine_ref(model, a.tokens, a.threads))
        proc = subprocess.Popen(cmd, env=dict(os.environ))
        try:
            wait_ready(f"http://127.0.0.1:{port}", proc)
            results += run_load("minfer", f"http://127.0.0.1:{port}", concs, a.tokens, a.rounds)
        finally:
            code = stop(proc)
            if code != 0:
                print(f"minfer serve exited {code}", file=sys.stderr)
        if not a.no_engine_ref:
            results.append(engine_ref(model, a.tokens, a.threads))
    llama = None if a.no_llama else (a.llama_server or shutil.which("llama-server"))
    if llama:
        port = free_port()
        proc = subprocess.Popen([llama, "-m", model, *llama_args(a), "-t", str(a.threads), "--host",
                                 "127.0.0.1", "--port", str(port)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        try:
            wait_ready(f"http://127.0.0.1:{port}", proc)
            results += run_load("llama-server", f"http://127.0.0.1:{port}", concs, a.tokens, a.rounds)
        finally:
            stop(proc)
    else:
        print("(no llama-server on PATH and none given with --llama-server: minfer only)")
    if llama and not a.url:
        by = {(r["server"], r["concurrency"]): r for r in results}
        for c in concs:
            m, l_ = by.get(("minfer", c)), by.get(("llama-server", c))
            if m and l_ and l_["agg_tps"] > 0:
                print(f"c={c}: minfer / llama-server = {m['agg_tps'] / l_['agg_tps']:.2f}x")
    if a.json:
        Path(a.json).write_text(json.dumps({"load": os.getloadavg(), "tokens": a.tokens, "threads": a.threads,
                                            "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
