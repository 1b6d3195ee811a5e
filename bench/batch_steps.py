"""Where a batched server step's time goes, without the HTTP layer: an in-process Engine
over one Context of SLOTS sequences (as `minfer serve --slots SLOTS --ctx CTX` makes),
kept full at concurrency c: c sequences of a short prompt and N greedy tokens each, a
finished one replaced at once (continuous batching), `--rounds` sequences per slot.

    python bench/batch_steps.py MODEL.gguf [-c 1,4,16,64] [-n 128] [--rounds 2]
                                [--slots 64] [--ctx 512] [--profile 64]

Per concurrency: generated tok/s, steps, median / p90 step wall (ms), graph builds
during the level, and the row counts of the steps. --profile C: cProfile of level C
(top functions by own time), to tell Python per step from waiting on the device.
--ab "mmq=9 x4=0;mmq=17 x4=0": each level once more per variant, side by side, each in a
context of its own (CUDA): mmq=N, blocks of N columns and more take the tensor cores
(k_mmq; 1073741824: never); x4=U, launches of 2 to 8 columns of rows of U units and more
take the four-rows-a-block matvec (1073741824: never). --kernels K: `minfer profile`'s per-kernel table (CUDA events per launch; host clocks
on the CPU) of K steps from the middle of every level, the top rows of each.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import numpy as np


def level(ctx, slots, conc: int, n: int, rounds: int, seed: int = 0, kernels: int = 0) -> dict:
    from minfer.engine import Engine, Sequence
    from minfer.sampling import SamplingParams

    rng = np.random.default_rng(seed)
    vocab = min(ctx.model.hp.n_vocab, 30000)
    eng = Engine(ctx, slots[:conc], chunk=512)
    todo = conc * rounds
    started = 0

    def start(slot: int) -> None:
        nonlocal started
        prompt = [int(t) for t in rng.integers(10, vocab, size=24)]
        eng.add(Sequence(prompt, n, SamplingParams(temperature=0.0), stop_at_eog=False), slot)
        started += 1

    for i in range(conc):
        start(i)
    walls, rows = [], []
    prof = None
    b0, t0 = ctx.builds, time.perf_counter()
    while True:
        if kernels and len(walls) == n // 2:   # the middle of the level: every slot decoding
            prof = _profiler(ctx)
            ctx.tracer = prof
        elif prof is not None and len(walls) == n // 2 + kernels:
            ctx.tracer = None
        s0 = time.perf_counter()
        more = eng.step()
        walls.append((time.perf_counter() - s0) * 1000)
        if eng._launch is not None:
            rows.append(sum(len(t) for _, t, _ in eng._launch.items))
        for i in eng.free_slots():
            if started < todo:
                start(i)
        if not more and started >= todo:
            break
    wall = time.perf_counter() - t0
    ctx.tracer = None
    toks = todo * n
    return {"c": conc, "tps": toks / wall, "steps": len(walls), "med_ms": statistics.median(walls),
            "p90_ms": float(np.percentile(walls, 90)), "builds": ctx.builds - b0,
            "rows": sorted(set(rows))[:12], "kernels": prof.document() if prof is not None else None}


def _profiler(ctx):
    from minfer.tools.profile import Profiler

    tensors = ctx.model.defn.tensors

    def weight_bytes(name: str) -> int:
        t = tensors.get(name)
        return int(t.nbytes) if t is not None else 0

    return Profiler(ctx.model.path if hasattr(ctx.model, "path") else "model", weight_bytes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("-c", "--concurrency", default="1,4,16,64")
    ap.add_argument("-n", "--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--profile", type=int, default=0, help="cProfile this concurrency level")
    ap.add_argument("--kernels", type=int, default=0, help="per-kernel table of this many steps a level")
    ap.add_argument("--ab", default="", help='variants of the batched matmuls, e.g. "mmq=9 x4=0;mmq=17 x4=0"')
    ap.add_argument("--backend", default=None)
    a = ap.parse_args(argv)
    from minfer.model import Model
    from minfer.session import Context

    model = Model.open(a.model, backends=[a.backend] if a.backend else None)
    ctx = Context(model, n_ctx=a.ctx, n_seq=a.slots)
    slots = [ctx.session(i) for i in range(a.slots)]
    level(ctx, slots, 1, 8, 1)  # warm-up
    for c in [int(x) for x in a.concurrency.split(",")]:
        if c == a.profile:
            pr = cProfile.Profile()
            pr.enable()
            r = level(ctx, slots, c, a.tokens, a.rounds, kernels=a.kernels)
            pr.disable()
        else:
            r = level(ctx, slots, c, a.tokens, a.rounds, kernels=a.kernels)
        print(f"c={r['c']:<3} {r['tps']:9.1f} tok/s  {r['steps']} steps  step median {r['med_ms']:.2f} ms  "
              f"p90 {r['p90_ms']:.2f} ms  builds {r['builds']}  rows {r['rows']}", flush=True)
        if a.ab:
            from minfer import _core

            hooks = {"mmq": _core.testing.cuda_set_mmq_min_cols, "x4": _core.testing.cuda_set_x4_cols_units}
            defaults = {k: f(0) for k, f in hooks.items()}
            for k, f in hooks.items():
                f(defaults[k])
            for variant in a.ab.split(";"):
                for kv in variant.split():
                    k, v = kv.split("=")
                    hooks[k](int(v))
                # A context of its own: its graphs are captured under this choice.
                c2 = Context(model, n_ctx=a.ctx, n_seq=a.slots)
                s2 = [c2.session(i) for i in range(a.slots)]
                level(c2, s2, 1, 8, 1)
                ab = level(c2, s2, c, a.tokens, a.rounds)
                print(f"      {variant:<28} {ab['tps']:9.1f} tok/s  step median {ab['med_ms']:.2f} ms  "
                      f"p90 {ab['p90_ms']:.2f} ms", flush=True)
                del c2, s2
                for k, f in hooks.items():
                    f(defaults[k])
        if r["kernels"] is not None:
            from minfer.tools.profile import format_profile

            print(format_profile(r["kernels"], top=12), flush=True)
        if c == a.profile:
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
            print(s.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
