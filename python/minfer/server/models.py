"""The models behind one endpoint.

`Served` is one loaded model and what serving it needs: its scheduler (slots, batching),
its grammar engine (built on the first constrained request), its tool-call format (from
the chat template), a worker thread for eager token masks, an embedder when the GGUF
declares a pooling type, and a small cache of compiled grammars.

`ModelPool` maps a request's `model` to a Served. With one model (the default) every
name maps to it, as before. With several (`minfer serve --models-dir DIR` or `--model`
given more than once) /v1/models lists them all, a request's `model` picks one, a model
is loaded on its first request (concurrent requests for it wait for that one load,
bounded by `load_timeout`), and past `max_loaded` models the least recently used idle
one is unloaded (its scheduler stopped, its memory released).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from minfer.server.protocol import ApiError
from minfer.server.tools import detect

log = logging.getLogger("minfer.server")


def model_name(path: Path) -> str:
    return path.name


class Served:
    GRAMMAR_CACHE = 64

    def __init__(self, model, scheduler, name: str | None = None, embed_arena: int | None = None):
        self.model = model
        self.scheduler = scheduler
        self.name = name or model_name(model.path)
        self.tokenizer = model.tokenizer
        self.created = int(time.time())
        self.tool_format = detect(self.tokenizer.chat_template)
        self._engine = None
        self._engine_lock = threading.Lock()
        self._grammars: collections.OrderedDict = collections.OrderedDict()
        self._glock = threading.Lock()
        self.mask_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minfer-mask")
        self.active = 0               # requests in flight (an unload waits for none)
        self.last_used = time.monotonic()
        from minfer.server.embeddings import Embedder, pooling_of

        self.pooling = pooling_of(model)
        self.embedder = None
        if self.pooling is not None:
            self.embedder = Embedder(model, self.pooling, **({"arena": embed_arena} if embed_arena else {}))

    @property
    def is_embedding(self) -> bool:
        return self.embedder is not None

    @property
    def grammar(self):
        with self._engine_lock:
            if self._engine is None:
                from minfer.grammar import GrammarEngine

                self._engine = GrammarEngine(self.tokenizer, n_vocab=self.model.hp.n_vocab)
            return self._engine

    def compiled(self, key: tuple, make: Callable):
        """A compiled grammar from the cache, else make() (GrammarError propagates)."""
        with self._glock:
            g = self._grammars.get(key)
            if g is not None:
                self._grammars.move_to_end(key)
                return g
        g = make()
        with self._glock:
            self._grammars[key] = g
            while len(self._grammars) > self.GRAMMAR_CACHE:
                self._grammars.popitem(last=False)
        return g

    def close(self, timeout: float = 10.0) -> None:
        self.scheduler.stop(timeout)
        self.mask_executor.shutdown(wait=False, cancel_futures=True)
        if self.embedder is not None:
            self.embedder.close()


class ModelPool:
    """name -> Served. `loader(path) -> Served` opens a model (on a worker thread)."""

    def __init__(self, paths: dict[str, Path] | None = None, loader: Callable | None = None,
                 max_loaded: int = 1, load_timeout: float = 300.0, default: Served | None = None):
        self.paths = dict(paths or {})
        self.loader = loader
        self.max_loaded = max(1, max_loaded)
        self.load_timeout = load_timeout
        self.loaded: collections.OrderedDict[str, Served] = collections.OrderedDict()
        self._loading: dict[str, asyncio.Future] = {}
        self.single = default if not self.paths else None
        if default is not None:
            self.loaded[default.name] = default
            self.paths.setdefault(default.name, Path(default.model.path))
        self._draining = False
        self._lock = threading.Lock()

    # -- what /v1/models lists ---------------------------------------------------------
    def names(self) -> list[str]:
        return sorted(self.paths)

    def resolve(self, name: str | None) -> str:
        if self.single is not None:
            return self.single.name
        if name is None:
            if len(self.paths) == 1:
                return next(iter(self.paths))
            raise ApiError(400, "'model' is required: this server serves several models (GET /v1/models)",
                           param="model", code="missing_required_parameter")
        if name in self.paths:
            return name
        for cand in (name + ".gguf", name.removesuffix(".gguf")):
            if cand in self.paths:
                return cand
        low = {k.lower(): k for k in self.paths}
        for cand in (name.lower(), name.lower() + ".gguf"):
            if cand in low:
                return low[cand]
        raise ApiError(404, f"the model {name!r} does not exist on this server (GET /v1/models lists them)",
                       param="model", code="model_not_found")

    # -- getting one ---------------------------------------------------------------------
    async def acquire(self, name: str | None) -> Served:
        """The Served for a request's model, loaded if need be; its `active` count is
        raised until release()."""
        key = self.resolve(name)
        end = time.monotonic() + self.load_timeout
        while True:
            s = self.loaded.get(key)
            if s is not None:
                self.loaded.move_to_end(key)
                s.active += 1
                s.last_used = time.monotonic()
                return s
            if self._draining:
                raise ApiError(503, "the server is shutting down", code="shutting_down")
            fut = self._loading.get(key)
            if fut is None:
                fut = asyncio.get_running_loop().create_future()
                self._loading[key] = fut
                asyncio.ensure_future(self._load(key, fut))
            left = end - time.monotonic()
            if left <= 0:
                raise ApiError(503, f"the model {key!r} is still loading; retry later", code="model_loading",
                               headers={"Retry-After": "5"})
            try:
                await asyncio.wait_for(asyncio.shield(fut), timeout=left)
            except asyncio.TimeoutError:
                raise ApiError(503, f"the model {key!r} is still loading; retry later", code="model_loading",
                               headers={"Retry-After": "5"}) from None

    def release(self, s: Served) -> None:
        s.active = max(0, s.active - 1)
        s.last_used = time.monotonic()

    async def _load(self, key: str, fut: asyncio.Future) -> None:
        from starlette.concurrency import run_in_threadpool

        try:
            await self._make_room()
            s = await run_in_threadpool(self.loader, self.paths[key])
            s.name = key
            self.loaded[key] = s
            fut.set_result(s)
        except ApiError as e:
            fut.set_exception(e)
        except Exception as e:  # noqa: BLE001 - a model that does not load is the request's answer
            log.exception("loading %s failed", key)
            fut.set_exception(ApiError(500, f"the model {key!r} failed to load: {e}", code="model_load_failed"))
        finally:
            self._loading.pop(key, None)
            if not fut.done():
                fut.set_exception(ApiError(500, f"the model {key!r} failed to load", code="model_load_failed"))
            else:
                fut.exception()   # retrieved: no 'never retrieved' warning when nobody waits

    async def _make_room(self) -> None:
        """Unload least recently used idle models until one more fits (waiting, bounded,
        while every loaded model has requests in flight)."""
        from starlette.concurrency import run_in_threadpool

        end = time.monotonic() + self.load_timeout
        while len(self.loaded) + 1 > self.max_loaded:
            idle = [s for s in self.loaded.values() if s.active == 0]
            if not idle:
                if time.monotonic() > end:
                    raise ApiError(503, "every loaded model is busy; retry later", code="models_busy",
                                   headers={"Retry-After": "5"})
                await asyncio.sleep(0.05)
                continue
            victim = min(idle, key=lambda s: s.last_used)
            self.loaded.pop(victim.name, None)
            log.info("unloading %s", victim.name)
            await run_in_threadpool(victim.close)

    # -- the scheduler interface the runner drives -----------------------------------------
    def start(self) -> None:
        for s in list(self.loaded.values()):
            if not s.scheduler.alive:
                s.scheduler.start()

    def drain(self) -> None:
        self._draining = True
        for s in list(self.loaded.values()):
            s.scheduler.drain()

    def stop(self, timeout: float = 10.0) -> bool:
        self._draining = True
        ok = True
        for s in list(self.loaded.values()):
            ok = s.scheduler.stop(timeout) and ok
        for s in list(self.loaded.values()):
            s.mask_executor.shutdown(wait=False, cancel_futures=True)
            if s.embedder is not None:
                s.embedder.close()
        return ok

    @property
    def alive(self) -> bool:
        return all(s.scheduler.alive for s in self.loaded.values())
