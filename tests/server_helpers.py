"""Starting a `minfer serve` for tests: a subprocess on a free loopback port, waited
for through /health, stopped by SIGTERM (its exit code is checked by the caller)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import json

import httpx

# The server's own knobs that the CLI does not expose, for the limit and timeout tests.
LAUNCH = """
import sys
from minfer.model import Model
from minfer.server import ServeConfig, serve
from minfer.server.app import Limits
path, port, slots, ctx, max_queue = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
chunk, timeout = int(sys.argv[6]), float(sys.argv[7])
speculate, draft_max = (sys.argv[8] or None), int(sys.argv[9])
serve(Model.open(path, n_threads=2), ServeConfig(port=port, slots=slots, ctx=ctx, max_queue=max_queue, chunk=chunk,
      header_timeout=timeout, keep_alive=max(5, int(timeout)), shutdown_timeout=5,
      limits=Limits(max_body=64 * 1024, body_timeout=timeout),
      speculate=speculate, draft_max=draft_max))
"""


def sse_events(lines, timeout: float, until=("done", "run_error")) -> list[tuple[str, dict]]:
    """The (event, data) pairs of an SSE line iterator, up to the first event named in
    `until`; an assertion fails once `timeout` seconds have passed."""
    events, ev = [], None
    deadline = time.monotonic() + timeout
    for line in lines:
        assert time.monotonic() < deadline, f"no {until} event within {timeout} s: {events[-3:]}"
        if line.startswith("event: "):
            ev = line[7:]
        elif line.startswith("data: ") and ev:
            events.append((ev, json.loads(line[6:])))
            if ev in until:
                break
    return events


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args: list[str], port: int):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        env = dict(os.environ)
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self._wait_ready()

    @classmethod
    def cli(cls, model: str, *extra: str) -> "ServerProcess":
        port = free_port()
        return cls([sys.executable, "-m", "minfer.cli", "serve", model, "--port", str(port), "--threads", "2",
                    *extra], port)

    @classmethod
    def custom(cls, model: str, slots: int = 4, ctx: int = 256, max_queue: int = 64, chunk: int = 128,
               timeout: float = 2.0, speculate: str | None = None, draft_max: int = 8):
        """timeout: the header and body deadlines (short, for the timeout tests), and the
        idle keep-alive bound when longer than uvicorn's 5 s (a connection the server closes
        as idle just as the client reuses it loses that request);
        speculate: the server's default for requests ("ngram"), None for none."""
        port = free_port()
        return cls([sys.executable, "-c", LAUNCH, model, str(port), str(slots), str(ctx), str(max_queue), str(chunk),
                    str(timeout), speculate or "", str(draft_max)], port)

    def _wait_ready(self, timeout: float = 60.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}: {self.proc.stderr.read()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.proc.kill()
        raise RuntimeError("server did not become ready")

    def rss_kib(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        raise RuntimeError("no VmRSS")

    def terminate(self, timeout: float = 30.0) -> tuple[int, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            _, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
            raise
        return self.proc.returncode, err
