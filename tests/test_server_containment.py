"""A device that stops answering is contained (scheduler.py, runner.py): a step that
does not return within step_timeout, or a device error that leaves the device unusable,
fails every running and waiting request with a 500 and one log line, refuses new ones,
and ends `minfer serve` with exit status 70; an ordinary step error fails only its
requests and the server goes on."""

from __future__ import annotations

import queue
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from minfer.model import Model
from minfer.sampling import SamplingParams
from minfer.server.scheduler import Job, Scheduler, ShuttingDown, device_lost
from minfer.testing import write_model

GREEDY = SamplingParams(temperature=0.0)
LOST = "CUDA error cudaErrorIllegalAddress (an illegal memory access was encountered) in cudaStreamSynchronize"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Model:
    path = tmp_path_factory.mktemp("contain") / "m.gguf"
    write_model(path, n_embd=64, n_head=4, n_head_kv=2, n_ff=128)
    return Model.open(path, n_threads=2)


def submit(sched, q, k, n=8):
    ids = [int(t) for t in np.random.default_rng(k).integers(3, 200, size=6)]
    sched.submit(Job(prompt_ids=ids, n_predict=n, sampling=GREEDY, stop_at_eog=False,
                     emit=lambda ev, k=k: q.put((k, ev))))


def finals(q, n, timeout=30.0):
    """The final event of each of n jobs (the first one a job got)."""
    out: dict = {}
    end = time.monotonic() + timeout
    while len(out) < n:
        k, ev = q.get(timeout=max(0.1, end - time.monotonic()))
        if ev.kind != "token":
            out.setdefault(k, ev)
    return out


def test_sticky_cuda_errors_are_told_apart():
    assert device_lost(RuntimeError(LOST))
    assert not device_lost(RuntimeError("CUDA error cudaErrorMemoryAllocation (out of memory) in cudaMalloc"))
    assert not device_lost(ValueError("bad token"))


def test_a_hung_step_fails_every_request_and_gives_up(model, caplog):
    fatal: list = []
    sched = Scheduler(model, n_slots=2, n_ctx=64, step_timeout=0.5, on_fatal=fatal.append)
    release = threading.Event()
    real = sched.engine.step
    sched.engine.step = lambda: release.wait() or real()   # the "kernel" never returns
    sched.start()
    q: queue.Queue = queue.Queue()
    t0 = time.monotonic()
    for k in range(3):                                     # two running, one waiting
        submit(sched, q, k)
    got = finals(q, 3, timeout=10)
    assert time.monotonic() - t0 < 5
    assert all(ev.kind == "error" and ev.status == 500 and "has not returned in 0.5 s" in ev.message
               for ev in got.values()), got
    assert len(fatal) == 1 and "hung kernel" in fatal[0]
    assert any("failing every request" in r.getMessage() for r in caplog.records)
    with pytest.raises(ShuttingDown, match="restarting"):
        submit(sched, q, 9)
    release.set()


def test_a_lost_device_fails_its_requests_and_gives_up(model):
    fatal: list = []
    sched = Scheduler(model, n_slots=2, n_ctx=64, on_fatal=fatal.append)

    def broken():
        raise RuntimeError(LOST)
    sched.engine.step = broken
    sched.start()
    q: queue.Queue = queue.Queue()
    submit(sched, q, 0)
    got = finals(q, 1)
    assert got[0].kind == "error" and got[0].status == 500
    deadline = time.monotonic() + 5
    while not fatal and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fatal and "cudaErrorIllegalAddress" in fatal[0]
    with pytest.raises(ShuttingDown):
        submit(sched, q, 1)


def test_an_ordinary_step_error_fails_only_its_requests(model):
    fatal: list = []
    sched = Scheduler(model, n_slots=2, n_ctx=64, on_fatal=fatal.append)
    real, calls = sched.engine.step, [0]

    def once():
        calls[0] += 1
        if calls[0] == 2:
            raise ValueError("a bug in one step")
        return real()
    sched.engine.step = once
    sched.start()
    try:
        q: queue.Queue = queue.Queue()
        submit(sched, q, 0)
        assert finals(q, 1)[0].status == 500
        submit(sched, q, 1)
        assert finals(q, 1)[1].kind == "done"
        assert not fatal
    finally:
        assert sched.stop()


def test_serve_exits_70_after_a_lost_device(model, tmp_path):
    """The whole server: a request on a server whose device is lost gets a 500, and the
    process exits with status 70 on its own."""
    script = tmp_path / "serve.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        from minfer.model import Model
        from minfer.server import ServeConfig, serve
        from minfer.server import scheduler

        def broken(self):
            raise RuntimeError({LOST!r})
        scheduler.Scheduler._step = broken
        m = Model.open({str(model.path)!r}, n_threads=1)
        serve(m, ServeConfig(port=int(sys.argv[1]), slots=1, ctx=64))
    """))
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, str(script), str(port)], stderr=subprocess.PIPE, text=True)
    try:
        import httpx
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.2)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=30)
        assert r.status_code == 500 and "cudaErrorIllegalAddress" in r.json()["error"]["message"]
        assert proc.wait(timeout=30) == 70
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read()
    assert "exiting for a restart" in err and "Traceback" not in err
