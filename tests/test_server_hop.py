"""The events' hop from the scheduler thread onto the event loop (server.app._Hop): a
burst of events wakes the loop once, every event arrives, each queue in its order, and
a closed loop is an error for the emitter, never events piling up unseen."""

from __future__ import annotations

import asyncio
import threading

import pytest

from minfer.server.app import _Hop


def test_a_burst_is_one_delivery_in_order_and_the_next_burst_rearms():
    loop = asyncio.new_event_loop()
    try:
        hop = _Hop(loop)
        deliveries = []
        inner = hop._deliver

        def counted():
            deliveries.append(len(hop._pending))
            inner()

        hop._deliver = counted
        qs = [asyncio.Queue() for _ in range(4)]

        def burst(base):
            for i in range(100):
                hop.put(qs[i % 4], base + i)

        # The loop is not running while the thread emits: one delivery must carry all.
        th = threading.Thread(target=burst, args=(0,))
        th.start()
        th.join()

        async def take(n):
            return [[await q.get() for _ in range(n)] for q in qs]

        got = loop.run_until_complete(take(25))
        assert got == [[i for i in range(100) if i % 4 == k] for k in range(4)]
        assert deliveries == [100]
        burst(1000)  # from this thread, the loop idle again: a second delivery
        got = loop.run_until_complete(take(25))
        assert got == [[1000 + i for i in range(100) if i % 4 == k] for k in range(4)]
        assert deliveries == [100, 100]
    finally:
        loop.close()


def test_a_closed_loop_refuses_every_event():
    loop = asyncio.new_event_loop()
    hop = _Hop(loop)
    q = asyncio.Queue()
    loop.close()
    for ev in range(3):
        with pytest.raises(RuntimeError):
            hop.put(q, ev)
        assert hop._pending == []


def test_relay_get_takes_what_is_there_and_never_waits_on_a_gone_scheduler():
    """_Relay.get: events emitted from another thread come in order; with nothing
    queued and the scheduler gone, the wait ends (after its 1 s bound) in a 503 event
    instead of hanging the response."""
    from minfer.server.app import _Relay

    class Sched:
        alive = True

    async def main():
        relay = _Relay(asyncio.get_running_loop())
        th = threading.Thread(target=lambda: [relay.emit(i) for i in range(5)])
        th.start()
        th.join()
        got = [await relay.get(Sched) for _ in range(5)]
        Sched.alive = False
        gone = await asyncio.wait_for(relay.get(Sched), timeout=5)
        return got, gone

    got, gone = asyncio.run(main())
    assert got == [0, 1, 2, 3, 4]
    assert gone.kind == "error" and gone.status == 503 and "shutting down" in gone.message
