"""Running the app under uvicorn: connection timeouts and a clean exit.

uvicorn has no deadline for a connection that never finishes its request headers, so
the protocol below closes one that has not started a request within `header_timeout`
(on connect, and again after each response on a kept-alive connection). On SIGTERM or
SIGINT the server stops accepting (new requests on open connections get 503), gives
in-flight requests `shutdown_timeout` seconds to finish, then stops the scheduler, which
ends the rest with a final event (503, or an error event on a stream) so every handler
returns normally; uvicorn's own hard cancel is only a backstop after that. The signal
is not re-raised afterwards (uvicorn's default), so the process exits 0. A scheduler that
gives its device up (a hung step, a CUDA fault: scheduler.py) fails its requests with a
500 and stops the server, which then exits with EXIT_DEVICE_LOST for a supervisor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass, field

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from pathlib import Path

from minfer.errors import MinferError
from minfer.server.app import Limits, create_app
from minfer.server.metrics import Metrics
from minfer.server.models import ModelPool, Served
from minfer.server.scheduler import Scheduler, SpecRequest

log = logging.getLogger("minfer.server")

# The exit status after a device failure or hang: not 0 or 1 (a clean stop, a bad
# command line), so a supervisor can tell a restart is what is wanted.
EXIT_DEVICE_LOST = 70


@dataclass
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    slots: int = 4
    ctx: int = 4096              # tokens per slot
    kv_cells: int | None = None  # KV cells all slots share (None: ctx for every slot)
    api_key: str | None = None
    max_queue: int = 64
    chunk: int = 128             # prompt tokens per step, over all newcomers
    max_batch: int | None = None  # sequences per step (None: MINFER_BATCH, else all slots)
    header_timeout: float = 10.0
    keep_alive: int = 5
    shutdown_timeout: int = 10
    limits: Limits = field(default_factory=Limits)
    log_level: str = "warning"
    speculate: str | None = None  # "ngram" | "draft": requests speculate unless they send "speculate": "off"
    draft_max: int = 8
    draft_model: object | None = None  # an opened Model: requests may send "speculate": "draft"
    models: list | None = None    # several GGUF paths behind one endpoint (loaded on first request)
    models_max: int = 1           # models loaded at once; the least recently used idle one is unloaded
    load_timeout: float = 300.0   # seconds a request waits for its model to load
    backends: list | None = None  # for models loaded later
    threads: int | None = None
    step_timeout: float = 120.0   # seconds a step may take before the device is given up (a hung kernel)
    on_fatal: object | None = None  # called with the reason when a scheduler gives its device up


def make_protocol(header_timeout: float):
    class Protocol(H11Protocol):
        """uvicorn's h11 protocol plus a deadline for the start of each request."""

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_deadline()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_deadline()

        def _arm_deadline(self) -> None:
            if not self.transport.is_closing():
                self.loop.call_later(header_timeout, self._expire, self.cycle)

        def _expire(self, cycle) -> None:
            # Still no new request since the deadline was set: an idle or half-open peer.
            if self.cycle is cycle and not self.transport.is_closing():
                self.transport.close()

    return Protocol


class _Server(uvicorn.Server):
    def __init__(self, config, sched: "Scheduler | ModelPool | None" = None, drain_s: float = 10.0):
        super().__init__(config)
        self.sched = sched
        self.drain_s = drain_s

    async def shutdown(self, sockets=None) -> None:
        if self.sched is None:
            return await super().shutdown(sockets)
        self.sched.drain()
        loop = asyncio.get_running_loop()
        # stop() joins the scheduler thread: off the event loop, which must keep
        # relaying the final events.
        timer = loop.call_later(self.drain_s, lambda: threading.Thread(target=self.sched.stop, daemon=True).start())
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        sigs = (signal.SIGINT, signal.SIGTERM)
        original = {s: signal.signal(s, self.handle_exit) for s in sigs}
        try:
            yield
        finally:
            for s, h in original.items():
                signal.signal(s, h)


def make_served(model, cfg: ServeConfig, metrics: Metrics, draft_model=None) -> Served:
    """A model's serving state. An embedding model (its GGUF declares a pooling type)
    generates nothing: its scheduler gets one small slot, and --ctx is the most tokens
    of one embedding forward (the longest input)."""
    from minfer.server.embeddings import pooling_of

    embedding = pooling_of(model) is not None
    sched = Scheduler(model, n_slots=1 if embedding else cfg.slots, n_ctx=min(cfg.ctx, 64) if embedding else cfg.ctx,
                      max_queue=cfg.max_queue, chunk=cfg.chunk, max_batch=cfg.max_batch, metrics=metrics,
                      speculate=SpecRequest(cfg.speculate, cfg.draft_max) if cfg.speculate and not embedding else None,
                      draft_model=None if embedding else draft_model, kv_cells=None if embedding else cfg.kv_cells,
                      step_timeout=cfg.step_timeout, on_fatal=cfg.on_fatal)
    return Served(model, sched, embed_arena=cfg.ctx)


def build(model, cfg: ServeConfig):
    """(app, pool, metrics). With a model: that model, loaded (every request's 'model'
    maps to it). Without one: cfg.models, each loaded on its first request."""
    metrics = Metrics()
    if model is not None:
        pool = ModelPool(default=make_served(model, cfg, metrics, cfg.draft_model))
    else:
        if not cfg.models:
            raise MinferError("no model to serve")
        from minfer.model import Model

        paths = {}
        for p in cfg.models:
            p = Path(p)
            if p.name in paths:
                if paths[p.name].resolve() == p.resolve():   # one file named twice (a MODEL inside --models-dir)
                    continue
                raise MinferError(f"two models are named {p.name} ({paths[p.name]} and {p})")
            paths[p.name] = p

        def loader(path: Path) -> Served:
            s = make_served(Model.open(path, backends=cfg.backends, n_threads=cfg.threads), cfg, metrics)
            s.scheduler.start()
            return s

        pool = ModelPool(paths, loader, max_loaded=cfg.models_max, load_timeout=cfg.load_timeout)
    app = create_app(pool, metrics, api_key=cfg.api_key, limits=cfg.limits)
    return app, pool, metrics


def uvicorn_server(app, cfg: ServeConfig, sched: "Scheduler | ModelPool | None" = None) -> uvicorn.Server:
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level, access_log=False,
                            http=make_protocol(cfg.header_timeout), timeout_keep_alive=cfg.keep_alive,
                            timeout_graceful_shutdown=cfg.shutdown_timeout + 5, lifespan="on",
                            limit_concurrency=None, backlog=512)
    return _Server(config, sched, drain_s=cfg.shutdown_timeout)


def listen(host: str, port: int) -> socket.socket:
    """Bind here rather than in uvicorn, so a busy port is one line and exit 1."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(512)
    except OSError as e:
        raise MinferError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def serve(model, cfg: ServeConfig) -> None:
    """Serve until SIGTERM/SIGINT; returns normally after a graceful shutdown. model:
    an opened Model, or None to serve cfg.models (several, loaded on demand)."""
    sock = listen(cfg.host, cfg.port)
    failed: list[str] = []

    def on_fatal(why: str) -> None:
        # From a scheduler or watchdog thread: uvicorn polls should_exit.
        failed.append(why)
        server.should_exit = True

    cfg.on_fatal = on_fatal
    app, pool, _ = build(model, cfg)
    server = uvicorn_server(app, cfg, pool)
    if model is not None:
        sched = pool.single.scheduler
        kind = "embeddings" if pool.single.is_embedding else \
            f"{cfg.slots} slots x {sched.n_ctx} tokens" + \
            (f" sharing {sched.ctx.n_cells} KV cells" if sched.ctx.pooled else "") + f", batch up to {sched.max_batch}"
        sys.stderr.write(f"minfer serve: {model.path.name} on http://{cfg.host}:{cfg.port} "
                         f"({kind}, {model.n_threads} threads"
                         + (f", speculate {cfg.speculate} up to {cfg.draft_max}" if cfg.speculate else "")
                         + (f", draft model {cfg.draft_model.path.name}" if cfg.draft_model is not None else "") + ")\n")
    else:
        sys.stderr.write(f"minfer serve: {len(pool.paths)} models on http://{cfg.host}:{cfg.port} "
                         f"(up to {pool.max_loaded} loaded, each {cfg.slots} slots x {cfg.ctx} tokens)\n")
    sys.stderr.flush()
    server.run(sockets=[sock])
    if threading.current_thread() is threading.main_thread():
        # A second signal during the last cleanup must not kill the process with it.
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_IGN)
    if failed:
        # The device is lost or hung: a scheduler thread may never return from it, and
        # the runtime's own exit handlers could wait on it too. Exit now, non-zero.
        sys.stderr.write(f"minfer serve: exiting for a restart: {failed[0]}\n")
        sys.stderr.flush()
        os._exit(EXIT_DEVICE_LOST)
    if not pool.stop(timeout=cfg.shutdown_timeout):
        log.error("the scheduler did not stop in time")
    sys.stderr.write("minfer serve: stopped\n")
