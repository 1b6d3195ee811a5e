"""The HTTP side: Starlette routes, server-sent events, auth, limits and errors.

Handlers never run a forward: they validate, tokenize, submit a Job to the scheduler
thread and relay its events. Every error a client can cause is an OpenAI-style body
(protocol.ApiError); a fault inside one request's forward is a 500 for that request.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import threading
import time
import uuid
import weakref
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from minfer.server.metrics import Metrics
from minfer.server.protocol import ApiError, GenRequest, bad, error_body, parse_chat, parse_completion, parse_json
from minfer.server.scheduler import Event, Job, QueueFull, Scheduler, ShuttingDown, SpecRequest
from minfer.tokenizer import TokenizerError

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


def create_app(model, scheduler: Scheduler, metrics: Metrics, api_key: str | None = None,
               limits: Limits | None = None) -> Starlette:
    limits = limits or Limits()
    tok = model.tokenizer
    model_id = model.path.name
    created = int(time.time())

    def respond_error(endpoint: str, e: ApiError) -> JSONResponse:
        metrics.on_request(endpoint, e.status)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    def check_auth(request: Request) -> None:
        if api_key is None:
            return
        got = request.headers.get("authorization", "")
        scheme, _, token = got.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
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

    def tokenize(req: GenRequest) -> list[int]:
        try:
            return _tokenize(req)
        except TokenizerError as e:  # e.g. a lone surrogate (JSON "\ud800") is no UTF-8 text
            raise bad(f"the prompt cannot be tokenized: {e}", param="messages" if req.kind == "chat" else "prompt",
                      code="invalid_encoding") from None

    def _tokenize(req: GenRequest) -> list[int]:
        if req.kind == "chat":
            try:
                text = tok.render_chat(req.messages, add_generation_prompt=True)
            except Exception as e:  # noqa: BLE001 - a template error is the request's fault
                raise bad(f"the chat template rejected the messages: {e}", param="messages") from None
            return tok.encode(text)
        if req.prompt_ids is not None:
            n_vocab = model.hp.n_vocab
            if any(not 0 <= t < n_vocab for t in req.prompt_ids):
                raise bad(f"a prompt token id is outside [0, {n_vocab})", param="prompt")
            return list(req.prompt_ids)
        return tok.encode(req.prompt_text)

    def plan(req: GenRequest, ids: list[int]) -> int:
        n_ctx = scheduler.n_ctx
        if not ids:
            raise bad("the prompt is empty after tokenization", param="prompt" if req.kind != "chat" else "messages")
        if len(ids) >= n_ctx:
            raise bad(f"the prompt ({len(ids)} tokens) does not fit in the context of {n_ctx} tokens "
                      f"(leave room for at least one generated token)", param="messages" if req.kind == "chat"
                      else "prompt", code="context_length_exceeded")
        n = req.max_tokens if req.max_tokens is not None else n_ctx - len(ids)
        if len(ids) + n > n_ctx:
            raise bad(f"the prompt ({len(ids)} tokens) + max_tokens ({n}) = {len(ids) + n} exceeds the context "
                      f"of {n_ctx} tokens", param="max_tokens", code="context_length_exceeded")
        return n

    def speculation(req: GenRequest) -> SpecRequest | None:
        """The request's own choice, else the server's default (`serve --speculate`)."""
        default = scheduler.speculate
        mode = req.speculate if req.speculate is not None else (default.mode if default else "off")
        if mode == "off":
            if req.draft_max is not None:
                raise bad("'draft_max' needs speculation: this server does not speculate by default, send "
                          "\"speculate\": \"ngram\" with it", param="draft_max")
            return None
        if mode == "draft" and scheduler.draft_model is None:
            raise bad("'speculate': \"draft\" needs a draft model, and this server has none (start minfer serve "
                      "with --draft-model PATH); \"ngram\" (prompt lookup) needs none", param="speculate",
                      code="unsupported_parameter")
        return SpecRequest(mode, req.draft_max if req.draft_max is not None
                           else (default.draft_max if default else SpecRequest.draft_max))

    async def watch_disconnect(request: Request, job: Job) -> None:
        """Cancel the job when the client goes away (the scheduler drops it at the
        next step boundary and frees the slot)."""
        try:
            while True:
                msg = await request.receive()
                if msg["type"] == "http.disconnect":
                    job.client_gone = True
                    job.cancel()
                    return
        except (asyncio.CancelledError, Exception):  # noqa: BLE001
            return

    def check_sampling(req: GenRequest) -> None:
        n_vocab = model.hp.n_vocab
        for t, _ in req.sampling.logit_bias:
            if t >= n_vocab:
                raise bad(f"'logit_bias' names token {t}, outside the vocabulary [0, {n_vocab})", param="logit_bias")
        if req.n > len(scheduler.slots):
            raise bad(f"'n' = {req.n} choices need as many slots; this server has {len(scheduler.slots)} "
                      f"(minfer serve --slots)", param="n")

    async def generate(request: Request, kind: str) -> Response:
        endpoint = request.url.path
        try:
            check_auth(request)
            obj = parse_json(await read_body(request))
            req = parse_chat(obj) if kind == "chat" else parse_completion(obj)
            check_sampling(req)
            ids = await run_in_threadpool(tokenize, req)
            n_predict = plan(req, ids)
            spec = speculation(req)
            relay = _Relay(asyncio.get_running_loop())
            job = Job(prompt_ids=ids, n_predict=n_predict, sampling=req.sampling, emit=relay.emit,
                      stop=req.stop, stop_at_eog=not req.ignore_eos, speculate=spec, n=req.n,
                      logprobs=req.logprobs)
            try:
                scheduler.submit(job)
            except QueueFull:
                raise ApiError(503, "the server is busy: too many requests are waiting; retry later",
                               code="queue_full", headers={"Retry-After": str(limits.retry_after)}) from None
            except ShuttingDown:
                raise ApiError(503, "the server is shutting down", code="shutting_down",
                               headers={"Retry-After": str(limits.retry_after)}) from None
        except ApiError as e:
            return respond_error(endpoint, e)
        except ClientDisconnect:  # gone while sending its body: nobody to answer
            metrics.on_request(endpoint, 499)
            return Response(status_code=499)
        watcher = asyncio.ensure_future(watch_disconnect(request, job))
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        try:
            first = await relay.get(scheduler)
        except BaseException:
            job.cancel()
            watcher.cancel()
            raise
        if first.kind == "error" or (first.kind == "done" and first.reason == "cancelled"):
            watcher.cancel()
            job.cancel()
            if job.client_gone:
                metrics.on_request(endpoint, 499)
                return Response(status_code=499)
            return respond_error(endpoint, _event_error(first))
        if req.stream:
            metrics.on_request(endpoint, 200)
            return StreamingResponse(sse(kind, rid, req, job, relay, first, watcher), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        choices = [_Choice() for _ in range(req.n)]
        try:
            ev, left = first, req.n
            while True:
                if ev.kind == "error" or (ev.kind == "done" and ev.reason == "cancelled"):
                    break
                c = choices[ev.index]
                if ev.kind == "token":
                    c.parts.append(ev.text)
                    if req.logprobs is not None:
                        c.lps.append(ev)
                else:
                    c.parts.append(ev.text)
                    c.done = ev
                    left -= 1
                    if left == 0:
                        break
                ev = await relay.get(scheduler)
        finally:
            job.cancel()     # no-op when finished; frees the slots when this task was cancelled
            watcher.cancel()
        if job.client_gone:
            metrics.on_request(endpoint, 499)  # nginx's "client closed request": nobody to answer
            return Response(status_code=499)
        if ev.kind == "error" or ev.reason == "cancelled":
            return respond_error(endpoint, _event_error(ev))
        metrics.on_request(endpoint, 200)
        out = []
        for i, c in enumerate(choices):
            text = "".join(c.parts)
            finish = _finish_reason(c.done.reason)
            lp = _logprobs_doc(kind, c.lps, tok) if req.logprobs is not None else None
            if kind == "chat":
                out.append({"index": i, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                            "finish_reason": finish})
            else:
                out.append({"index": i, "text": text, "logprobs": lp, "finish_reason": finish})
        usage = _sum_usage([c.done.usage for c in choices])
        return JSONResponse({"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
                             "created": int(time.time()), "model": model_id, "choices": out, "usage": usage,
                             "system_fingerprint": "minfer"})

    async def sse(kind, rid, req, job, relay, first, watcher):
        chat = kind == "chat"
        created_now = int(time.time())
        obj_name = "chat.completion.chunk" if chat else "text_completion"

        def chunk(i: int, text: str | None, finish: str | None, role: bool = False, ev: Event | None = None) -> str:
            lp = _logprobs_doc(kind, [ev], tok) if ev is not None and req.logprobs is not None else None
            if chat:
                delta = {}
                if role:
                    delta["role"] = "assistant"
                if text is not None:
                    delta["content"] = text
                choice = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}
            else:
                choice = {"index": i, "text": text or "", "logprobs": lp, "finish_reason": finish}
            doc = {"id": rid, "object": obj_name, "created": created_now, "model": model_id, "choices": [choice],
                   "system_fingerprint": "minfer"}
            if req.include_usage:
                doc["usage"] = None
            return _sse(doc)

        usages = []
        try:
            if chat:
                for i in range(req.n):
                    yield chunk(i, "", None, role=True)
            ev, left = first, req.n
            while True:
                if ev.kind == "error" or (ev.kind == "done" and ev.reason == "cancelled"):
                    err = _event_error(ev)
                    yield _sse(err.body())
                    return
                if ev.kind == "token":
                    if ev.text or req.logprobs is not None:
                        yield chunk(ev.index, ev.text, None, ev=ev)
                else:
                    if ev.text:
                        yield chunk(ev.index, ev.text, None)
                    yield chunk(ev.index, None if chat else "", _finish_reason(ev.reason))
                    usages.append(ev.usage)
                    left -= 1
                    if left == 0:
                        break
                ev = await relay.get(scheduler)
            if req.include_usage:
                yield _sse({"id": rid, "object": obj_name, "created": created_now, "model": model_id,
                            "choices": [], "usage": _sum_usage(usages), "system_fingerprint": "minfer"})
            yield "data: [DONE]\n\n"
        finally:
            job.cancel()
            watcher.cancel()

    async def chat_completions(request: Request) -> Response:
        return await generate(request, "chat")

    async def completions(request: Request) -> Response:
        return await generate(request, "completion")

    async def models(request: Request) -> Response:
        try:
            check_auth(request)
        except ApiError as e:
            return respond_error("/v1/models", e)
        metrics.on_request("/v1/models", 200)
        return JSONResponse({"object": "list", "data": [{
            "id": model_id, "object": "model", "created": created, "owned_by": "minfer",
            "meta": {"n_ctx": scheduler.n_ctx, "slots": len(scheduler.slots), "arch": model.hp.arch}}]})

    async def health(request: Request) -> Response:
        if not scheduler.alive:
            return JSONResponse({"status": "error", "message": "the scheduler is not running"}, status_code=503)
        return JSONResponse({"status": "ok", "slots_idle": len(scheduler.slots) - scheduler.slots_busy,
                             "slots_busy": scheduler.slots_busy, "queue": scheduler.queue_depth})

    async def metrics_route(request: Request) -> Response:
        try:
            check_auth(request)
        except ApiError as e:
            return respond_error("/metrics", e)
        return PlainTextResponse(metrics.render(scheduler.queue_depth, scheduler.slots_busy, len(scheduler.slots),
                                                scheduler.ctx.builds),
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
        if not scheduler.alive:
            scheduler.start()
        yield
        await run_in_threadpool(scheduler.stop)

    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics_route, methods=["GET"]),
        ],
        exception_handlers={HTTPException: http_error, Exception: server_error},
        lifespan=lifespan,
    )


class _Choice:
    def __init__(self):
        self.parts: list[str] = []
        self.lps: list[Event] = []
        self.done: Event | None = None


def _sum_usage(usages: list[dict]) -> dict:
    """One request's usage over its choices: the prompt once, the completions summed."""
    u = dict(usages[0])
    if len(usages) > 1:
        done = sum(x["completion_tokens"] for x in usages)
        u["completion_tokens"] = done
        u["total_tokens"] = u["prompt_tokens"] + done
    return u


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



def _event_error(ev: Event) -> ApiError:
    if ev.kind == "done":  # cancelled without a client gone: the server is stopping
        return ApiError(503, "the request was cancelled: the server is shutting down", code="shutting_down")
    code = "shutting_down" if ev.status == 503 else "inference_failed"
    return ApiError(ev.status, ev.message, code=code)
