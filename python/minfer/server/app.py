"""The HTTP side: Starlette routes, server-sent events, auth, limits and errors.

Handlers never run a forward: they validate, tokenize, submit a Job to the scheduler
thread of the request's model and relay its events. Every error a client can cause is
an OpenAI-style body (protocol.ApiError; an Anthropic-style one on /v1/messages); a
fault inside one request's forward is a 500 for that request.

Endpoints: /v1/chat/completions and /v1/completions (OpenAI; tools, structured output),
/v1/responses (OpenAI's Responses API, the subset coding agents use), /v1/messages
(Anthropic's Messages API), /v1/embeddings (embedding models), /v1/models, /health,
/metrics. docs/server-api.md lists every field.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import threading
import time
import weakref
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from minfer.server.anthropic import anthropic_error_body, messages_doc, messages_sse, parse_messages
from minfer.server.embeddings import embed_request, embeddings_body, not_embedding_model, parse_embeddings
from minfer.server.generation import (ChoiceOut, ChoiceText, Run, collect, event_error, is_failure, new_id, prepare,
                                      render, sum_usage)
from minfer.server.metrics import Metrics
from minfer.server.models import ModelPool
from minfer.server.protocol import ApiError, GenRequest, bad, error_body, parse_chat, parse_completion, parse_json
from minfer.server.responses import ResponseStore, parse_responses, responses_doc, responses_sse
from minfer.server.scheduler import Event, Scheduler

log = logging.getLogger("minfer.server")


@dataclass
class Limits:
    max_body: int = 1 << 20       # bytes of a request body
    body_timeout: float = 30.0    # seconds to receive a whole body
    retry_after: int = 1          # seconds, sent with a 503


class _Hop:
    """Events from the scheduler thread onto one event loop. Waking the loop
    (call_soon_threadsafe: a write to its self-pipe, then the GIL handed over) cost
    ~16 us an event on the CI machine, and a batched step emits a token per stream: the
    first event of a burst schedules one delivery of every event that arrives before
    it runs, in the order they came."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list = []

    def put(self, q: asyncio.Queue, ev: Event) -> None:  # scheduler thread
        with self._lock:
            self._pending.append((q, ev))
            if len(self._pending) > 1:
                return          # a delivery is scheduled and has not run yet
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:    # the loop is closed: nobody is left to deliver to
            with self._lock:
                self._pending.clear()
            raise

    def _deliver(self) -> None:  # event loop
        with self._lock:
            batch, self._pending = self._pending, []
        for q, ev in batch:
            q.put_nowait(ev)


_HOPS: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Hop]" = weakref.WeakKeyDictionary()


class _Relay:
    """Events of one job, hopped from the scheduler thread onto the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        hop = _HOPS.get(loop)
        if hop is None:
            hop = _HOPS[loop] = _Hop(loop)
        self.hop = hop
        self.q: asyncio.Queue[Event] = asyncio.Queue()

    def emit(self, ev: Event) -> None:  # scheduler thread
        self.hop.put(self.q, ev)

    async def get(self, sched: Scheduler) -> Event:
        # An event already here is taken without waiting, and a wait is bounded by
        # asyncio.timeout: wait_for wrapped every get in a task of its own (~30 us of the
        # loop's time an event on the CI machine, GIL the scheduler thread waits for).
        while True:
            if not self.q.empty():
                return self.q.get_nowait()
            try:
                async with asyncio.timeout(1.0):
                    return await self.q.get()
            except TimeoutError:
                if not sched.alive:  # never wait on a scheduler that is gone
                    return Event("error", status=503, message="the server is shutting down")


def create_app(pool: ModelPool, metrics: Metrics, api_key: str | None = None,
               limits: Limits | None = None) -> Starlette:
    """The routes over a ModelPool (one model, or several picked by the request's
    'model')."""
    limits = limits or Limits()
    responses_store = ResponseStore()

    def respond_error(endpoint: str, e: ApiError, anthropic: bool = False) -> JSONResponse:
        metrics.on_request(endpoint, e.status)
        body = anthropic_error_body(e) if anthropic else e.body()
        return JSONResponse(body, status_code=e.status, headers=e.headers)

    def check_auth(request: Request) -> None:
        if api_key is None:
            return
        got = request.headers.get("authorization", "")
        scheme, _, token = got.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode()):
            return
        xkey = request.headers.get("x-api-key")     # the Anthropic SDK's header
        if xkey is not None and hmac.compare_digest(xkey.strip().encode(), api_key.encode()):
            return
        raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                       code="invalid_api_key")

    async def read_body(request: Request) -> bytes:
        cl = request.headers.get("content-length")
        if cl is not None:
            try:
                n = int(cl)
            except ValueError:
                raise bad("the Content-Length header is not a number", code="invalid_header") from None
            if n > limits.max_body:
                raise ApiError(413, f"the request body ({n} bytes) is over the limit of {limits.max_body} bytes",
                               code="body_too_large")
        parts, size = [], 0

        async def read():
            nonlocal size
            async for chunk in request.stream():
                size += len(chunk)
                if size > limits.max_body:
                    raise ApiError(413, f"the request body is over the limit of {limits.max_body} bytes",
                                   code="body_too_large")
                parts.append(chunk)

        try:
            await asyncio.wait_for(read(), timeout=limits.body_timeout)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {limits.body_timeout:g} s",
                           code="timeout") from None
        return b"".join(parts)

    async def start_run(request: Request, req: GenRequest, served) -> Run:
        """Prepare and submit; the Run's first event is in run.first."""
        prep = await prepare(served, req, run_in_threadpool)
        run = Run(served, prep, _Relay(asyncio.get_running_loop()), limits.retry_after)
        await run.start(request)
        return run

    async def generation(request: Request, parse, respond, anthropic: bool = False) -> Response:
        """The frame of every generating endpoint: auth, body, parse, the model, the run,
        errors. respond(run, served, extra) makes the answer from a started run."""
        endpoint = request.url.path
        served = None
        try:
            check_auth(request)
            obj = parse_json(await read_body(request))
            req, extra = parse(obj)
            served = await pool.acquire(req.model)
            run = await start_run(request, req, served)
        except ApiError as e:
            if served is not None:
                pool.release(served)
            return respond_error(endpoint, e, anthropic)
        except ClientDisconnect:  # gone while sending its body: nobody to answer
            if served is not None:
                pool.release(served)
            metrics.on_request(endpoint, 499)
            return Response(status_code=499)
        except BaseException:
            if served is not None:
                pool.release(served)
            raise
        first = run.first
        if is_failure(first):
            run.close()
            pool.release(served)
            if run.client_gone:
                metrics.on_request(endpoint, 499)
                return Response(status_code=499)
            return respond_error(endpoint, event_error(first), anthropic)
        if run.req.stream:
            metrics.on_request(endpoint, 200)

            async def body():
                try:
                    async for piece in respond(run, served, extra):
                        yield piece
                finally:
                    run.close()
                    pool.release(served)

            return StreamingResponse(body(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            out = await collect(run)
        finally:
            pool.release(served)
        if run.client_gone:
            metrics.on_request(endpoint, 499)  # nginx's "client closed request": nobody to answer
            return Response(status_code=499)
        if isinstance(out, Event):
            return respond_error(endpoint, event_error(out), anthropic)
        try:
            doc = respond(run, served, extra, out)
        except ApiError as e:
            return respond_error(endpoint, e, anthropic)
        metrics.on_request(endpoint, 200)
        return JSONResponse(doc)

    # -- chat completions and completions (OpenAI) ------------------------------------------
    def chat_respond(run: Run, served, extra, out=None):
        if out is None:
            return sse_openai(run, served, "chat")
        return openai_doc(run, served, "chat", out)

    def completion_respond(run: Run, served, extra, out=None):
        if out is None:
            return sse_openai(run, served, "completion")
        return openai_doc(run, served, "completion", out)

    def openai_doc(run: Run, served, kind: str, choices: list[ChoiceOut]) -> dict:
        req, tok = run.req, served.tokenizer
        out = []
        for i, c in enumerate(choices):
            finish = _finish_reason(c.reason)
            lp = _logprobs_doc(kind, c.tokens, tok) if req.logprobs is not None else None
            if kind == "chat":
                msg = {"role": "assistant", "content": c.content}
                if c.calls:
                    msg["content"] = c.content or None
                    msg["tool_calls"] = [{"id": t.id, "type": "function",
                                          "function": {"name": t.name, "arguments": t.arguments}} for t in c.calls]
                    finish = "length" if c.reason == "length" else "tool_calls"
                out.append({"index": i, "message": msg, "logprobs": lp, "finish_reason": finish})
            else:
                out.append({"index": i, "text": c.text, "logprobs": lp, "finish_reason": finish})
        usage = sum_usage([c.done.usage for c in choices])
        return {"id": new_id("chatcmpl-" if kind == "chat" else "cmpl-"),
                "object": "chat.completion" if kind == "chat" else "text_completion",
                "created": int(time.time()), "model": served.name, "choices": out, "usage": usage,
                "system_fingerprint": "minfer"}

    async def sse_openai(run: Run, served, kind: str):
        req, tok = run.req, served.tokenizer
        chat = kind == "chat"
        rid = new_id("chatcmpl-" if chat else "cmpl-")
        created_now = int(time.time())
        obj_name = "chat.completion.chunk" if chat else "text_completion"
        texts = [ChoiceText(run.prep.tool_format if chat else None, req) for _ in range(req.n)]

        def doc(choice: dict) -> str:
            d = {"id": rid, "object": obj_name, "created": created_now, "model": served.name, "choices": [choice],
                 "system_fingerprint": "minfer"}
            if req.include_usage:
                d["usage"] = None
            return _sse(d)

        def chunk(i: int, text: str | None, finish: str | None, role: bool = False, ev: Event | None = None) -> str:
            lp = _logprobs_doc(kind, [ev], tok) if ev is not None and req.logprobs is not None else None
            if chat:
                delta = {}
                if role:
                    delta["role"] = "assistant"
                if text is not None:
                    delta["content"] = text
                return doc({"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish})
            return doc({"index": i, "text": text or "", "logprobs": lp, "finish_reason": finish})

        def call_chunks(i: int, k: int, call) -> list[str]:
            head = {"index": k, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
            args = {"index": k, "function": {"arguments": call.arguments}}
            return [doc({"index": i, "delta": {"tool_calls": [head]}, "logprobs": None, "finish_reason": None}),
                    doc({"index": i, "delta": {"tool_calls": [args]}, "logprobs": None, "finish_reason": None})]

        def items(i: int, its: list, ev: Event | None = None) -> list[str]:
            out, sent_ev = [], False
            for k, v in its:
                if k == "text":
                    out.append(chunk(i, v, None, ev=None if sent_ev else ev))
                    sent_ev = True
                else:
                    out += call_chunks(i, texts[i].calls_sent, v)
                    texts[i].calls_sent += 1
            if ev is not None and not sent_ev and req.logprobs is not None:
                out.append(chunk(i, "", None, ev=ev))
            return out

        for t in texts:
            t.calls_sent = 0
        usages = []
        if chat:
            for i in range(req.n):
                yield chunk(i, "", None, role=True)
        ev, left = run.first, req.n
        while True:
            if is_failure(ev):
                yield _sse(event_error(ev).body())
                return
            i = ev.index
            if ev.kind == "token":
                for piece in items(i, texts[i].feed(ev.text), ev):
                    yield piece
            else:
                for piece in items(i, texts[i].feed(ev.text) + texts[i].finish()):
                    yield piece
                finish = "tool_calls" if texts[i].calls_sent and ev.reason != "length" else _finish_reason(ev.reason)
                yield chunk(i, None if chat else "", finish)
                usages.append(ev.usage)
                left -= 1
                if left == 0:
                    break
            ev = await run.get()
        if req.include_usage:
            yield _sse({"id": rid, "object": obj_name, "created": created_now, "model": served.name,
                        "choices": [], "usage": sum_usage(usages), "system_fingerprint": "minfer"})
        yield "data: [DONE]\n\n"

    async def chat_completions(request: Request) -> Response:
        return await generation(request, lambda obj: (parse_chat(obj), None), chat_respond)

    async def completions(request: Request) -> Response:
        return await generation(request, lambda obj: (parse_completion(obj), None), completion_respond)

    # -- responses (OpenAI) -------------------------------------------------------------------
    def responses_parse(obj):
        return parse_responses(obj, responses_store)

    def responses_respond(run: Run, served, extra, out=None):
        if out is None:
            return responses_sse(run, served, extra, responses_store)
        return responses_doc(run, served, extra, out, responses_store)

    async def responses(request: Request) -> Response:
        return await generation(request, responses_parse, responses_respond)

    async def get_response(request: Request) -> Response:
        try:
            check_auth(request)
            doc = responses_store.get_doc(request.path_params["rid"])
        except ApiError as e:
            return respond_error("/v1/responses/{id}", e)
        metrics.on_request("/v1/responses/{id}", 200)
        return JSONResponse(doc)

    # -- messages (Anthropic) ---------------------------------------------------------------
    def messages_respond(run: Run, served, extra, out=None):
        if out is None:
            return messages_sse(run, served, extra)
        return messages_doc(run, served, extra, out)

    async def messages(request: Request) -> Response:
        return await generation(request, parse_messages, messages_respond, anthropic=True)

    async def count_tokens(request: Request) -> Response:
        endpoint = request.url.path
        served = None
        try:
            check_auth(request)
            obj = parse_json(await read_body(request))
            req, _ = parse_messages({**obj, "max_tokens": 1}, count_only=True)
            served = await pool.acquire(req.model)
            ids = await run_in_threadpool(render, served, req)
        except ApiError as e:
            return respond_error(endpoint, e, anthropic=True)
        finally:
            if served is not None:
                pool.release(served)
        metrics.on_request(endpoint, 200)
        return JSONResponse({"input_tokens": len(ids)})

    # -- embeddings ------------------------------------------------------------------------
    async def embeddings(request: Request) -> Response:
        endpoint = request.url.path
        served = None
        try:
            check_auth(request)
            parsed = parse_embeddings(parse_json(await read_body(request)))
            served = await pool.acquire(parsed["model"])
            if not served.is_embedding:
                raise not_embedding_model(served.name)
            vecs, n = await run_in_threadpool(embed_request, served.embedder, served.model.hp.n_vocab, parsed)
            doc = embeddings_body(vecs, parsed["format"], served.name, n)
        except ApiError as e:
            return respond_error(endpoint, e)
        except ClientDisconnect:
            metrics.on_request(endpoint, 499)
            return Response(status_code=499)
        finally:
            if served is not None:
                pool.release(served)
        metrics.on_request(endpoint, 200)
        return JSONResponse(doc)

    # -- the rest --------------------------------------------------------------------------
    async def models(request: Request) -> Response:
        try:
            check_auth(request)
        except ApiError as e:
            return respond_error("/v1/models", e)
        metrics.on_request("/v1/models", 200)
        data = []
        for name in pool.names():
            s = pool.loaded.get(name)
            entry = {"id": name, "object": "model", "created": s.created if s else created, "owned_by": "minfer"}
            if s is not None:
                entry["meta"] = {"n_ctx": s.scheduler.n_ctx, "slots": len(s.scheduler.slots), "arch": s.model.hp.arch,
                                 "loaded": True, "embedding": s.is_embedding, "tool_format": s.tool_format.name}
            else:
                entry["meta"] = {"loaded": False}
            data.append(entry)
        return JSONResponse({"object": "list", "data": data})

    created = int(time.time())

    async def health(request: Request) -> Response:
        if not pool.alive:
            return JSONResponse({"status": "error", "message": "the scheduler is not running"}, status_code=503)
        slots = sum(len(s.scheduler.slots) for s in pool.loaded.values())
        busy = sum(s.scheduler.slots_busy for s in pool.loaded.values())
        queue = sum(s.scheduler.queue_depth for s in pool.loaded.values())
        doc = {"status": "ok", "slots_idle": slots - busy, "slots_busy": busy, "queue": queue}
        if pool.single is None:
            doc["models_loaded"] = list(pool.loaded)
        return JSONResponse(doc)

    async def metrics_route(request: Request) -> Response:
        try:
            check_auth(request)
        except ApiError as e:
            return respond_error("/metrics", e)
        ss = list(pool.loaded.values())
        return PlainTextResponse(metrics.render(sum(s.scheduler.queue_depth for s in ss),
                                                sum(s.scheduler.slots_busy for s in ss),
                                                sum(len(s.scheduler.slots) for s in ss),
                                                sum(s.scheduler.ctx.builds for s in ss)),
                                 media_type="text/plain; version=0.0.4")

    async def http_error(request: Request, exc: HTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return JSONResponse(error_body(str(exc.detail), "invalid_request_error", None, code),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    async def server_error(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error in %s", request.url.path)
        return JSONResponse(error_body(f"internal error: {exc}", "server_error", None, None), status_code=500)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        pool.start()
        yield
        await run_in_threadpool(pool.stop)

    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/responses", responses, methods=["POST"]),
            Route("/v1/responses/{rid}", get_response, methods=["GET"]),
            Route("/v1/messages", messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
            Route("/v1/embeddings", embeddings, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics_route, methods=["GET"]),
        ],
        exception_handlers={HTTPException: http_error, Exception: server_error},
        lifespan=lifespan,
    )


def _token_entry(tok, t: int, lp: float) -> dict:
    b = tok.token_bytes(t)
    return {"token": b.decode("utf-8", errors="replace"), "logprob": lp, "bytes": list(b)}


def _logprobs_doc(kind: str, evs: list, tok) -> dict:
    """OpenAI's logprobs object for token events: chat's `content` list, or the
    completions API's parallel arrays."""
    if kind == "chat":
        content = []
        for ev in evs:
            e = _token_entry(tok, ev.id, ev.logprob)
            e["top_logprobs"] = [_token_entry(tok, t, lp) for t, lp in (ev.top_logprobs or [])]
            content.append(e)
        return {"content": content, "refusal": None}
    tokens, lps, tops, offsets, at = [], [], [], [], 0
    for ev in evs:
        piece = tok.token_bytes(ev.id).decode("utf-8", errors="replace")
        tokens.append(piece)
        lps.append(ev.logprob)
        tops.append({tok.token_bytes(t).decode("utf-8", errors="replace"): lp for t, lp in (ev.top_logprobs or [])})
        offsets.append(at)
        at += len(piece)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def _sse(doc: dict) -> str:
    return "data: " + json.dumps(doc, ensure_ascii=False, separators=(",", ":")) + "\n\n"


def _finish_reason(reason: str | None) -> str:
    return "length" if reason == "length" else "stop"
