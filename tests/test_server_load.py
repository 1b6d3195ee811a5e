"""`minfer serve` under load and on shutdown: 1,000 requests at 32 concurrent are all
answered (200, or 503 when the wait queue is full), none lost, memory flat; SIGTERM
with requests in flight exits 0 within a bound."""

from __future__ import annotations

import asyncio
import collections
import json
import signal
import time

import httpx
import pytest

from minfer.testing import write_model
from server_helpers import ServerProcess

N_REQUESTS = 1000
CONCURRENCY = 32
RSS_BOUND_KIB = 24 * 1024  # growth allowed after the first 100 requests (allocator slack, counters)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("serve_load") / "tiny.gguf"
    write_model(path, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, ctx=512)
    return str(path)


async def _load(url: str, n: int, conc: int, rss_probe, stream_every: int = 5) -> tuple[collections.Counter, list, int]:
    statuses: collections.Counter = collections.Counter()
    bad: list = []
    done = 0
    rss_100 = None
    idx = iter(range(n))
    limits = httpx.Limits(max_connections=conc, max_keepalive_connections=conc)
    async with httpx.AsyncClient(timeout=300, limits=limits) as c:
        async def worker():
            nonlocal done, rss_100
            for i in idx:
                body = {"messages": [{"role": "user", "content": f"request {i} " + "x y " * (i % 7)}],
                        "max_tokens": 1 + i % 4, "temperature": 0 if i % 2 else 0.7, "seed": i}
                if i % stream_every == 0:
                    body["stream"] = True
                    async with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
                        text = (await r.aread()).decode()
                    ok = r.status_code != 200 or text.rstrip().endswith("data: [DONE]")
                else:
                    r = await c.post(url + "/v1/chat/completions", json=body)
                    ok = r.status_code != 200 or r.json()["usage"]["completion_tokens"] >= 1
                statuses[r.status_code] += 1
                if r.status_code == 503:
                    ok = ok and "retry-after" in r.headers
                if not ok or r.status_code not in (200, 503):
                    bad.append((i, r.status_code))
                done += 1
                if done == 100:
                    rss_100 = rss_probe()

        await asyncio.gather(*(worker() for _ in range(conc)))
    return statuses, bad, rss_100


def test_thousand_requests_at_32_concurrent(model_path):
    # Connection deadlines far above any pause of a client under load: a kept-alive
    # connection closed by the server just as the client reuses it would lose a request.
    srv = ServerProcess.custom(model_path, slots=8, ctx=128, max_queue=16, chunk=64, timeout=60)
    try:
        t0 = time.monotonic()
        statuses, bad, rss_100 = asyncio.run(_load(srv.url, N_REQUESTS, CONCURRENCY, srv.rss_kib))
        elapsed = time.monotonic() - t0
        rss_end = srv.rss_kib()
        assert not bad, bad[:10]
        assert sum(statuses.values()) == N_REQUESTS  # every one answered, none lost
        assert set(statuses) <= {200, 503} and statuses[200] > 0
        assert rss_end <= rss_100 + RSS_BOUND_KIB, (rss_100, rss_end)
        h = httpx.get(srv.url + "/health").json()
        assert h == {"status": "ok", "slots_idle": 8, "slots_busy": 0, "queue": 0}
        m = httpx.get(srv.url + "/metrics").text
        answered = sum(int(float(line.split()[-1])) for line in m.splitlines()
                       if line.startswith('minfer_requests_total{endpoint="/v1/chat/completions"'))
        assert answered == N_REQUESTS
        val = {line.split()[0]: float(line.split()[1]) for line in m.splitlines() if line and line[0] != "#"
               and "{" not in line}
        # Continuous batching happened: steps carried several sequences on average. How
        # many depends on how fast 32 clients refill 8 slots of 1-4 token requests; on the
        # 2-core CI machine clients and server share the cores and 1.49 was seen (2.x when
        # idle), so this bound only says batching is real. test_scheduler checks it exactly.
        assert val["minfer_batch_sequences_total"] / val["minfer_steps_total"] > 1.25
        print(f"\n{N_REQUESTS} requests in {elapsed:.1f} s: {dict(statuses)}; RSS after 100 {rss_100} KiB, "
              f"after all {rss_end} KiB")
    finally:
        code, err = srv.terminate()
    assert code == 0, err


def test_sigterm_with_requests_in_flight_exits_0(model_path):
    """In-flight requests longer than the drain bound (5 s here): the server stops
    accepting, cancels them after the bound with a final answer each, exits 0."""
    # Requests far longer than the drain bound on any machine: an idle fast one ran 8,000
    # tokens of this tiny model inside the 5 s drain (so the stream ended with [DONE]).
    srv = ServerProcess.custom(model_path, slots=2, ctx=65536, max_queue=4)

    async def go():
        streaming = asyncio.Event()
        async with httpx.AsyncClient(timeout=60) as c:
            async def long(stream: bool):
                body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 60000, "ignore_eos": True,
                        "temperature": 0, "stream": stream}
                if not stream:
                    r = await c.post(srv.url + "/v1/chat/completions", json=body)
                    return r.status_code, r.text
                parts = []
                async with c.stream("POST", srv.url + "/v1/chat/completions", json=body) as r:
                    async for chunk in r.aiter_text():
                        parts.append(chunk)
                        streaming.set()
                    return r.status_code, "".join(parts)

            # The stream first, and only once it is under way the two others (one takes the
            # second slot, one waits): arrival order decides who gets a slot, so a fixed
            # sleep on a loaded machine could leave the stream queued (then it is a 503).
            tasks = [asyncio.ensure_future(long(True))]
            await asyncio.wait_for(streaming.wait(), 60)
            tasks += [asyncio.ensure_future(long(False)) for _ in range(2)]
            end = time.monotonic() + 60
            while time.monotonic() < end:
                m = (await c.get(srv.url + "/metrics")).text
                if "minfer_queue_depth 1" in m and "minfer_slots_busy 2" in m:
                    break
                await asyncio.sleep(0.05)
            t0 = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            results = await asyncio.gather(*tasks)
            return results, time.monotonic() - t0

    try:
        results, took = asyncio.run(go())
    finally:  # a failure above must not leave the server running
        code, err = srv.terminate(timeout=30)
    assert code == 0, err
    assert took < 5 + 5  # the drain bound plus a step and the replies
    assert "Traceback" not in err, err
    statuses = sorted(s for s, _ in results)
    # Two ran (one streaming), one waited in the queue: all answered, none finished
    # its 60000 tokens: non-streaming ones get a 503 "shutting_down", the stream ends
    # with an error event instead of [DONE].
    for status, text in results:
        if status == 503:
            assert json.loads(text)["error"]["code"] == "shutting_down"
        else:
            assert status == 200 and '"code":"shutting_down"' in text and "[DONE]" not in text, text[-300:]
    assert statuses == [200, 503, 503]


def test_sigint_on_an_idle_server_exits_0(model_path):
    srv = ServerProcess.cli(model_path, "--slots", "1", "--ctx", "64")
    srv.proc.send_signal(signal.SIGINT)
    code, err = srv.terminate(timeout=20)
    assert code == 0 and "Traceback" not in err, err


def test_busy_port_is_one_line_and_exit_1(model_path):
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "minfer.cli", "serve", model_path, "--port", str(port), "--ctx", "64"],
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [f"minfer: error: cannot listen on 127.0.0.1:{port}: Address already in use"]
