"""`minfer viz`: the graph page and its JSON/SSE endpoints, on loopback only.

    GET  /                 the page (one self-contained HTML file, no external assets)
    GET  /viz/graph        minfer-graph JSON (?kind=prefill|decode, ?n=prefill tokens)
    GET  /viz/node/{id}    one node of that graph, with its latest live/trace record
    GET  /viz/trace        the --trace file, GET /viz/profile the --profile file (404 if none)
    GET  /viz/events       server-sent events of live runs: run, phase, step, text, done, run_error
    POST /viz/run          {"prompt": str, "n": int}: start a traced greedy run (409 while one runs)

A run executes in a worker thread with a Tracer attached; every forward step's node
records go out to each SSE subscriber as one `step` event. On CUDA the run traces the
kernels a normal run launches (tools/trace.py): the `phase` event lists them
(`launches`), and a node a merged kernel keeps to itself has a `merged` record. Bad requests get a JSON
{"error": ...} with a 4xx status; nothing a client sends stops the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import sys
import threading
from importlib import resources
from pathlib import Path
from typing import Optional

from minfer.errors import MinferError

MAX_PREDICT = 512
MAX_PROMPT_CHARS = 20000
DEFAULT_PREFILL_TOKENS = 8
KEEPALIVE_S = 15.0


def page_html() -> str:
    return resources.files("minfer.tools.viz").joinpath("page.html").read_text(encoding="utf-8")


class Broadcast:
    """Fan-out of events from the run thread to every SSE subscriber's asyncio queue."""

    def __init__(self) -> None:
        self._subs: set = set()
        self._lock = threading.Lock()
        self.loop: Optional[asyncio.AbstractEventLoop] = None

    def subscribe(self) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue(maxsize=1024)
        with self._lock:
            self._subs.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue) -> None:
        with self._lock:
            self._subs.discard(q)

    @staticmethod
    def _put(q: asyncio.Queue, item) -> None:
        if q.full():          # a stalled client drops old events rather than growing without bound
            q.get_nowait()
        q.put_nowait(item)

    def publish(self, event: str, data) -> None:
        if self.loop is None:
            return
        msg = f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"
        with self._lock:
            subs = list(self._subs)
        for q in subs:
            self.loop.call_soon_threadsafe(self._put, q, msg)


class VizState:
    def __init__(self, session, trace: Optional[dict], profile: Optional[dict]) -> None:
        self.session = session
        self.trace = trace
        self.profile = profile
        self.events = Broadcast()
        self.run_lock = threading.Lock()
        self.graphs: dict = {}
        self.graph_lock = threading.Lock()
        self.live: Optional[dict] = None     # the last live run's trace document

    def graph(self, kind: str, n: int) -> dict:
        key = (kind, 1 if kind == "decode" else n)
        with self.graph_lock:
            doc = self.graphs.get(key)
            if doc is None:
                doc = self.session.graph_json(key[1], decode=kind == "decode")
                self.graphs[key] = doc
        return doc

    def latest_record(self, kind: str, node_id: int) -> Optional[dict]:
        for doc in (self.live, self.trace):
            if not doc:
                continue
            for phase in reversed(doc.get("phases", [])):
                if phase.get("kind") != kind or not phase.get("steps"):
                    continue
                for r in phase["steps"][-1].get("nodes", []):
                    if r.get("id") == node_id:
                        return r
        return None

    def run(self, prompt: str, n: int) -> None:
        """The worker thread's body; holds run_lock (taken by the request) until done."""
        from minfer.sampling import SamplingParams
        from minfer.tools.trace import Tracer

        sess = self.session
        pub = self.events.publish
        counts = {"phase": 0}

        def on_step(phase: dict, step: dict) -> None:
            if not phase.get("_sent"):
                phase["_sent"] = True
                counts["phase"] += 1
                pub("phase", {"kind": phase["kind"], "graph": phase["graph"], "launches": phase.get("launches")})
            pub("step", {"kind": phase["kind"], "index": len(phase["steps"]) - 1, "nodes": step["nodes"],
                         "logits_top": step["logits_top"]})

        tracer = Tracer(sess.model_name, prompt=prompt, on_step_done=on_step)
        try:
            ids = sess.tokenizer.encode(prompt)
            sess.check_fits(len(ids), n)
            pub("run", {"prompt": prompt, "n": n, "prompt_tokens": len(ids)})
            sess.context.tracer = tracer
            res = sess.generate(ids, n, SamplingParams(temperature=0.0), stop_at_eog=False,
                               on_text=lambda s: pub("text", {"text": s}))
            tracer.finish(res.ids, sess.tokenizer.decode)
            for phase in tracer.phases:
                phase.pop("_sent", None)
            self.live = tracer.document()
            pub("done", {"ids": res.ids, "text": res.text, "steps": len(tracer.steps())})
        except MinferError as e:
            pub("run_error", {"error": str(e)})
        except Exception as e:  # noqa: BLE001 - a run failure must reach the page, not kill the server
            pub("run_error", {"error": f"{type(e).__name__}: {e}"})
        finally:
            sess.context.tracer = None
            self.run_lock.release()


def create_app(state: VizState):
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import HTMLResponse, JSONResponse, StreamingResponse
    from starlette.routing import Route

    def err(status: int, msg: str) -> JSONResponse:
        return JSONResponse({"error": msg}, status_code=status)

    def graph_args(request: Request):
        kind = request.query_params.get("kind", "prefill")
        if kind not in ("prefill", "decode"):
            return None, err(400, f"kind must be 'prefill' or 'decode', got {kind!r}")
        raw = request.query_params.get("n", str(DEFAULT_PREFILL_TOKENS))
        try:
            n = int(raw)
        except ValueError:
            return None, err(400, f"n must be an integer, got {raw!r}")
        if not 1 <= n <= state.session.n_ctx:
            return None, err(400, f"n must be in 1..{state.session.n_ctx}, got {n}")
        return (kind, n), None

    async def index(request: Request):
        return HTMLResponse(page_html())

    async def graph(request: Request):
        args, bad = graph_args(request)
        if bad:
            return bad
        doc = await asyncio.to_thread(state.graph, *args)
        return JSONResponse(doc)

    async def node(request: Request):
        args, bad = graph_args(request)
        if bad:
            return bad
        raw = request.path_params["node_id"]
        try:
            nid = int(raw)
        except ValueError:
            return err(400, f"node id must be an integer, got {raw!r}")
        doc = await asyncio.to_thread(state.graph, *args)
        if not 0 <= nid < len(doc["nodes"]):
            return err(404, f"unknown node {nid}: the {args[0]} graph has nodes 0..{len(doc['nodes']) - 1}")
        return JSONResponse({"node": doc["nodes"][nid], "record": state.latest_record(args[0], nid)})

    async def trace(request: Request):
        if state.trace is None:
            return err(404, "no trace loaded (start with --trace FILE)")
        return JSONResponse(state.trace)

    async def live(request: Request):
        if state.live is None:
            return err(404, "no live run yet (POST /viz/run)")
        return JSONResponse(state.live)

    async def profile(request: Request):
        if state.profile is None:
            return err(404, "no profile loaded (start with --profile FILE)")
        return JSONResponse(state.profile)

    async def info(request: Request):
        e = state.session
        return JSONResponse({"model": e.model_name, "backends": e.backend_names, "n_ctx": e.n_ctx,
                             "trace": state.trace is not None, "profile": state.profile is not None,
                             "running": state.run_lock.locked(), "max_predict": MAX_PREDICT})

    async def run(request: Request):
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return err(400, f"malformed JSON body: {e}")
        if not isinstance(body, dict):
            return err(400, "the body must be a JSON object {\"prompt\": str, \"n\": int}")
        prompt, n = body.get("prompt"), body.get("n", 8)
        if not isinstance(prompt, str) or not prompt:
            return err(400, "prompt must be a non-empty string")
        if len(prompt) > MAX_PROMPT_CHARS:
            return err(400, f"prompt is longer than {MAX_PROMPT_CHARS} characters")
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_PREDICT:
            return err(400, f"n must be an integer in 1..{MAX_PREDICT}")
        try:   # a prompt that cannot fit is the request's fault: 400 now, not a failed run later
            n_prompt = len(await asyncio.to_thread(state.session.tokenizer.encode, prompt))
            state.session.check_fits(n_prompt, n)
        except MinferError as e:
            return err(400, str(e))
        if not state.run_lock.acquire(blocking=False):
            return err(409, "a run is already in progress; wait for its 'done' event")
        threading.Thread(target=state.run, args=(prompt, n), name="minfer-viz-run", daemon=True).start()
        return JSONResponse({"status": "started", "prompt": prompt, "n": n}, status_code=202)

    async def events(request: Request):
        q = state.events.subscribe()

        async def stream():
            try:
                yield "event: hello\ndata: {}\n\n"
                while True:
                    try:
                        msg = await asyncio.wait_for(q.get(), timeout=KEEPALIVE_S)
                    except asyncio.TimeoutError:
                        msg = ": keepalive\n\n"
                    yield msg
            finally:
                state.events.unsubscribe(q)

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def not_found(request: Request, exc):
        return err(getattr(exc, "status_code", 404), f"{request.method} {request.url.path}: "
                                                      f"{getattr(exc, 'detail', 'not found')}")

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.events.loop = asyncio.get_running_loop()
        yield

    routes = [
        Route("/", index), Route("/viz", index), Route("/viz/", index),
        Route("/viz/info", info), Route("/viz/graph", graph), Route("/viz/node/{node_id}", node),
        Route("/viz/trace", trace), Route("/viz/live", live), Route("/viz/profile", profile),
        Route("/viz/events", events), Route("/viz/run", run, methods=["POST"]),
    ]
    from starlette.exceptions import HTTPException

    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: not_found})


def _check_port(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError as e:
            raise MinferError(f"cannot listen on 127.0.0.1:{port}: {e.strerror or e}") from None


def serve(model_path: Path, port: int = 8081, trace: Optional[Path] = None, profile: Optional[Path] = None,
          n_ctx: int = 512, n_threads: Optional[int] = None, backends: Optional[list] = None,
          kv_type: str = "f16") -> None:
    import uvicorn

    from minfer.session import Session
    from minfer.tools.profile import load_profile
    from minfer.tools.trace import load_trace

    trace_doc = load_trace(str(trace)) if trace is not None else None
    profile_doc = load_profile(str(profile)) if profile is not None else None
    _check_port(port)
    session = Session.open(model_path, n_ctx=n_ctx, n_threads=n_threads, backends=backends, kv_type=kv_type)
    state = VizState(session, trace_doc, profile_doc)
    state.graph("prefill", DEFAULT_PREFILL_TOKENS)      # fail before serving if the graph cannot build
    sys.stderr.write(f"minfer viz: serving {session.model_name} at http://127.0.0.1:{port}/\n")
    sys.stderr.flush()
    config = uvicorn.Config(create_app(state), host="127.0.0.1", port=port, log_level="warning",
                            timeout_graceful_shutdown=1, lifespan="on")
    uvicorn.Server(config).run()
