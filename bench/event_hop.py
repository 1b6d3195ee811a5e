"""The server's relay of events from the scheduler thread to the SSE responses, as it
was (one call_soon_threadsafe per event, each get wrapped in asyncio.wait_for) against
server.app._Relay (one hop per burst of events, gets without a task of their own),
side by side in one process.

    python bench/event_hop.py [--streams 16] [--steps 2000] [--rounds 3]

A thread plays the scheduler: each step emits one event to each of `streams` relays,
as a batched decode step hands out one token per stream, while one coroutine per relay
awaits its events (as the SSE responses do). Reported per step: the emitting thread's
time (what the scheduler spends before its next forward) and the wall of the whole run
divided by the steps (the loop's share of the GIL shows here); medians over rounds,
the two ways alternating.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time

from minfer.server.app import _Relay


class _Alive:
    alive = True


class _BeforeRelay:
    """The relay before _Hop: one loop wake-up per event, each get its own task."""

    def __init__(self, loop):
        self.loop, self.q = loop, asyncio.Queue()

    def emit(self, ev) -> None:
        self.loop.call_soon_threadsafe(self.q.put_nowait, ev)

    async def get(self, sched):
        return await asyncio.wait_for(self.q.get(), timeout=1.0)


def one_round(streams: int, steps: int, new: bool) -> tuple[float, float]:
    async def main():
        loop = asyncio.get_running_loop()
        relays = [(_Relay if new else _BeforeRelay)(loop) for _ in range(streams)]
        emit_time = []

        def scheduler():
            for step in range(steps):
                t = time.perf_counter()
                for r in relays:
                    r.emit(step)
                emit_time.append(time.perf_counter() - t)

        async def stream(r):
            for _ in range(steps):
                await r.get(_Alive)

        t0 = time.perf_counter()
        th = threading.Thread(target=scheduler)
        th.start()
        await asyncio.gather(*(stream(r) for r in relays))
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
        for new in ((False, True) if r % 2 == 0 else (True, False)):
            res[new].append(one_round(a.streams, a.steps, new))
    for new, name in ((False, "before (per event, wait_for)"), (True, "_Relay (hop, timeout)")):
        emit = statistics.median(x[0] for x in res[new])
        wall = statistics.median(x[1] for x in res[new])
        print(f"{name:<29} {a.streams} streams: emit {emit * 1e6:7.1f} us a step, wall {wall * 1e6:7.1f} us a step")


if __name__ == "__main__":
    main()
