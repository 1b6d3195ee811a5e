"""The server's hop of events from the scheduler thread onto the event loop: one
call_soon_threadsafe per event (as before) against server.app._Hop (one per burst),
side by side in one process.

    python bench/event_hop.py [--streams 16] [--steps 2000] [--rounds 3]

A thread plays the scheduler: each step emits one event to each of `streams` queues,
as a batched decode step hands out one token per stream, while coroutines on the loop
await their queue (as the SSE responses do). Reported per step: the emitting thread's
time (what the scheduler spends before its next forward) and the wall of the whole run
divided by the steps; medians over rounds, the two ways alternating.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time

from minfer.server.app import _Hop


def one_round(streams: int, steps: int, hopped: bool) -> tuple[float, float]:
    async def main():
        loop = asyncio.get_running_loop()
        qs = [asyncio.Queue() for _ in range(streams)]
        hop = _Hop(loop)
        emit_time = []

        def scheduler():
            for step in range(steps):
                t = time.perf_counter()
                for q in qs:
                    if hopped:
                        hop.put(q, step)
                    else:
                        loop.call_soon_threadsafe(q.put_nowait, step)
                emit_time.append(time.perf_counter() - t)

        async def stream(q):
            for _ in range(steps):
                await q.get()

        t0 = time.perf_counter()
        th = threading.Thread(target=scheduler)
        th.start()
        await asyncio.gather(*(stream(q) for q in qs))
        th.join()
        return statistics.median(emit_time), (time.perf_counter() - t0) / steps

    return asyncio.run(main())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    res = {False: [], True: []}
    for r in range(a.rounds):
        for hopped in ((False, True) if r % 2 == 0 else (True, False)):
            res[hopped].append(one_round(a.streams, a.steps, hopped))
    for hopped, name in ((False, "call_soon_threadsafe each"), (True, "_Hop (one per burst)")):
        emit = statistics.median(x[0] for x in res[hopped])
        wall = statistics.median(x[1] for x in res[hopped])
        print(f"{name:<27} {a.streams} streams: emit {emit * 1e6:7.1f} us a step, wall {wall * 1e6:7.1f} us a step")


if __name__ == "__main__":
    main()
