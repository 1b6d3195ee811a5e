"""One generation request from checked fields to events, shared by every API surface
(chat completions, completions, responses, messages).

prepare(): the prompt (the chat template renders messages and tools), the constraint
(a grammar compiled from response_format / grammar / json_schema, or from the tools
when a call is required), the token budget and the speculation; then `Run` submits the
Job and hands its events back (`events()`), one choice after another's tokens as the
scheduler makes them. `collect()` gathers a whole answer per choice; `ChoiceText`
splits an output into text and tool calls as it streams.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass, field

from minfer.grammar import Grammar, GrammarError, TokenMask
from minfer.server.protocol import ApiError, GenRequest, bad
from minfer.server.scheduler import Event, Job, QueueFull, ShuttingDown, SpecRequest
from minfer.server.tools import ToolCall, ToolFormat, ToolStream
from minfer.tokenizer import TokenizerError


@dataclass
class Prepared:
    req: GenRequest
    ids: list[int]
    n_predict: int
    grammar: Grammar | None = None
    tool_format: ToolFormat | None = None     # parse tool calls out of the output
    spec: SpecRequest | None = None


def _param_of(req: GenRequest) -> str:
    return "messages" if req.kind == "chat" else "prompt"


TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each function call, "
    "return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
    "<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")


def _plain_tool_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """For a chat template that knows nothing of tools: the tools described in the
    system message and calls and results written into the text, in the hermes spelling
    (which the server then parses), as llama.cpp does for such templates."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = "\n".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                             "arguments": c["function"]["arguments"]},
                                                            ensure_ascii=False) + "\n</tool_call>"
                              for c in m["tool_calls"])
            out.append({"role": "assistant", "content": (m["content"] + "\n" if m["content"] else "") + calls})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if tools:
        pre = TOOLS_PREAMBLE.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + pre}
        else:
            out.insert(0, {"role": "system", "content": pre})
    return out


def render(served, req: GenRequest) -> list[int]:
    """The prompt's token ids (a worker thread: templates and tokenizing take time)."""
    tok = served.tokenizer
    try:
        if req.kind == "chat":
            kw = {}
            tools = req.tools if req.tools and req.tool_choice != "none" else None
            msgs = req.messages
            if "tool" in (tok.chat_template or ""):
                if tools:
                    kw["tools"] = tools
            elif tools or any(m.get("tool_calls") or m["role"] == "tool" for m in msgs):
                msgs = _plain_tool_messages(msgs, tools)
            try:
                text = tok.render_chat(msgs, add_generation_prompt=True, **kw)
            except Exception as e:  # noqa: BLE001 - a template error is the request's fault
                raise bad(f"the chat template rejected the messages: {e}", param="messages") from None
            return tok.encode(text)
        if req.prompt_ids is not None:
            n_vocab = served.model.hp.n_vocab
            if any(not 0 <= t < n_vocab for t in req.prompt_ids):
                raise bad(f"a prompt token id is outside [0, {n_vocab})", param="prompt")
            return list(req.prompt_ids)
        return tok.encode(req.prompt_text)
    except TokenizerError as e:  # e.g. a lone surrogate (JSON "\ud800") is no UTF-8 text
        raise bad(f"the prompt cannot be tokenized: {e}", param=_param_of(req), code="invalid_encoding") from None


def constraint(served, req: GenRequest) -> tuple[Grammar | None, ToolFormat | None]:
    """The grammar the output must follow (None: free) and the tool format to parse
    calls with (None: no tools). A worker thread: the first grammar builds the
    vocabulary's index (~0.5 s for 152k tokens)."""
    fmt = served.tool_format if req.tools and req.tool_choice != "none" else None
    try:
        if fmt is not None and req.tool_choice in ("required", "function"):
            tools = req.tools if req.tool_choice == "required" else \
                [t for t in req.tools if t["function"]["name"] == req.tool_name]
            strict = any(t["function"].get("strict") for t in tools)
            eng = served.grammar
            text = fmt.grammar(tools, req.parallel_tool_calls, eng.token_ref, lenient=not strict)
            g = served.compiled(("lark", text), lambda: eng.lark(text))
            return g, fmt
        c = req.constraint
        if c is None:
            return None, fmt
        eng = served.grammar
        if c.kind == "json_object":
            return served.compiled(("json_object",), eng.json_object), fmt
        if c.kind == "json_schema":
            key = ("json_schema", json.dumps(c.schema, sort_keys=True), c.strict)
            return served.compiled(key, lambda: eng.json_schema(c.schema, strict=c.strict)), fmt
        if c.kind == "grammar":
            return served.compiled(("gbnf", c.text), lambda: eng.gbnf(c.text)), fmt
        raise bad(f"unknown constraint {c.kind!r}")
    except GrammarError as e:
        param = "tools" if req.tool_choice in ("required", "function") and fmt is not None else \
            (req.constraint.param if req.constraint else None)
        raise ApiError(400, str(e), param=param, code="invalid_schema") from None


def plan(scheduler, req: GenRequest, ids: list[int]) -> int:
    n_ctx = scheduler.n_ctx
    if not ids:
        raise bad("the prompt is empty after tokenization", param=_param_of(req))
    if len(ids) >= n_ctx:
        raise bad(f"the prompt ({len(ids)} tokens) does not fit in the context of {n_ctx} tokens "
                  f"(leave room for at least one generated token)", param=_param_of(req),
                  code="context_length_exceeded")
    n = req.max_tokens if req.max_tokens is not None else n_ctx - len(ids)
    if len(ids) + n > n_ctx:
        raise bad(f"the prompt ({len(ids)} tokens) + max_tokens ({n}) = {len(ids) + n} exceeds the context "
                  f"of {n_ctx} tokens", param="max_tokens", code="context_length_exceeded")
    return n


def speculation(scheduler, req: GenRequest, constrained: bool) -> SpecRequest | None:
    """The request's own choice, else the server's default (`serve --speculate`).
    A constrained output is never drafted (a draft would skip the mask)."""
    default = scheduler.speculate
    if constrained:
        if req.speculate in ("ngram", "draft"):
            raise bad("'speculate' cannot be combined with structured output or a required tool call "
                      "(each token is masked by the grammar)", param="speculate", code="unsupported_parameter")
        return None
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


def check_sampling(served, req: GenRequest) -> None:
    n_vocab = served.model.hp.n_vocab
    for t, _ in req.sampling.logit_bias:
        if t >= n_vocab:
            raise bad(f"'logit_bias' names token {t}, outside the vocabulary [0, {n_vocab})", param="logit_bias")
    if req.n > len(served.scheduler.slots):
        raise bad(f"'n' = {req.n} choices need as many slots; this server has {len(served.scheduler.slots)} "
                  f"(minfer serve --slots)", param="n")


async def prepare(served, req: GenRequest, run_in_threadpool) -> Prepared:
    if served.is_embedding:
        raise bad(f"the model {served.name!r} is an embedding model: it serves /v1/embeddings only",
                  param="model", code="model_is_embedding")
    check_sampling(served, req)
    ids = await run_in_threadpool(render, served, req)
    n_predict = plan(served.scheduler, req, ids)
    grammar, fmt = None, None
    if req.constraint is not None or (req.tools and req.tool_choice != "none"):
        grammar, fmt = await run_in_threadpool(constraint, served, req)
    if grammar is not None and req.ignore_eos:
        raise bad("'ignore_eos' cannot be combined with structured output (the grammar ends the output)",
                  param="ignore_eos")
    spec = speculation(served.scheduler, req, grammar is not None)
    return Prepared(req, ids, n_predict, grammar, fmt, spec)


class Run:
    """A submitted job and its events."""

    def __init__(self, served, prep: Prepared, relay, retry_after: int = 1):
        self.served = served
        self.prep = prep
        self.req = prep.req
        self.relay = relay
        self.mask = TokenMask(prep.grammar, n=prep.req.n, executor=served.mask_executor) \
            if prep.grammar is not None else None
        emit = relay.emit
        if self.mask is not None:
            mask = self.mask

            def masked_emit(ev: Event, _emit=relay.emit) -> None:   # scheduler thread
                if ev.kind == "token" and ev.id is not None:
                    mask.on_token(ev.index, ev.id)            # the next mask, while the forward runs
                _emit(ev)
            emit = masked_emit
        req = prep.req
        self.job = Job(prompt_ids=prep.ids, n_predict=prep.n_predict, sampling=req.sampling, emit=emit,
                       stop=req.stop, stop_at_eog=not req.ignore_eos, speculate=prep.spec, n=req.n,
                       logprobs=req.logprobs, mask=self.mask)
        try:
            served.scheduler.submit(self.job)
        except QueueFull:
            raise ApiError(503, "the server is busy: too many requests are waiting; retry later",
                           code="queue_full", headers={"Retry-After": str(retry_after)}) from None
        except ShuttingDown:
            raise ApiError(503, "the server is shutting down", code="shutting_down",
                           headers={"Retry-After": str(retry_after)}) from None
        self.watcher: asyncio.Future | None = None
        self.first: Event | None = None

    async def get(self) -> Event:
        return await self.relay.get(self.served.scheduler)

    async def start(self, request) -> Event:
        """Watch the client and wait for the first event."""
        self.watcher = asyncio.ensure_future(watch_disconnect(request, self.job))
        try:
            self.first = await self.get()
        except BaseException:
            self.close()
            raise
        return self.first

    def close(self) -> None:
        self.job.cancel()     # no-op when finished; frees the slots otherwise
        if self.watcher is not None:
            self.watcher.cancel()

    @property
    def client_gone(self) -> bool:
        return self.job.client_gone


async def watch_disconnect(request, job: Job) -> None:
    """Cancel the job when the client goes away (the scheduler drops it at the next
    step boundary and frees the slot)."""
    try:
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                job.client_gone = True
                job.cancel()
                return
    except (asyncio.CancelledError, Exception):  # noqa: BLE001
        return


def is_failure(ev: Event) -> bool:
    return ev.kind == "error" or (ev.kind == "done" and ev.reason == "cancelled")


def event_error(ev: Event) -> ApiError:
    if ev.kind == "done":  # cancelled without a client gone: the server is stopping
        return ApiError(503, "the request was cancelled: the server is shutting down", code="shutting_down")
    code = "shutting_down" if ev.status == 503 else "inference_failed"
    return ApiError(ev.status, ev.message, code=code)


async def split_stream(run: Run, ct: "ChoiceText"):
    """A one-choice run's output as it arrives, split into text and tool calls: yields
    (items, None) per token, then (items, the final event) once, or ([], the failing
    event) (is_failure) and stops. The streaming loop of the Messages and Responses APIs."""
    ev = run.first
    while True:
        if is_failure(ev):
            yield [], ev
            return
        if ev.kind == "token":
            yield ct.feed(ev.text), None
            ev = await run.get()
            continue
        yield ct.feed(ev.text) + ct.finish(), ev
        return


@dataclass
class ChoiceOut:
    """One choice's whole answer."""

    text: str = ""
    tokens: list = field(default_factory=list)     # token events (logprobs)
    done: Event | None = None
    content: str | None = None                     # text outside tool calls
    calls: list[ToolCall] = field(default_factory=list)

    @property
    def reason(self) -> str | None:
        return self.done.reason if self.done else None


async def collect(run: Run) -> list[ChoiceOut] | Event:
    """Every choice's answer, or the event that failed the request."""
    req = run.req
    choices = [ChoiceOut() for _ in range(req.n)]
    parts: list[list[str]] = [[] for _ in range(req.n)]
    ev, left = run.first, req.n
    try:
        while True:
            if is_failure(ev):
                return ev
            c = choices[ev.index]
            parts[ev.index].append(ev.text)
            if ev.kind == "token":
                if req.logprobs is not None:
                    c.tokens.append(ev)
            else:
                c.done = ev
                left -= 1
                if left == 0:
                    break
            ev = await run.get()
    finally:
        run.close()
    fmt = run.prep.tool_format
    for c, p in zip(choices, parts):
        c.text = "".join(p)
        if fmt is not None:
            st = ToolStream(fmt, req.parallel_tool_calls, tool_names(req), tool_schemas(req))
            items = st.feed(c.text) + st.finish()
            c.calls = [v for k, v in items if k == "call"]
            text = "".join(v for k, v in items if k == "text")
            c.content = text.strip() if c.calls else text
        else:
            c.content = c.text
    return choices


def tool_names(req: GenRequest) -> list[str]:
    return [t["function"]["name"] for t in req.tools or ()]


def tool_schemas(req: GenRequest) -> dict:
    return {t["function"]["name"]: t["function"].get("parameters") or {} for t in req.tools or ()}


class ChoiceText:
    """A streaming choice: text pieces in, ("text", str) / ("call", ToolCall) items out."""

    def __init__(self, fmt: ToolFormat | None, req: GenRequest):
        self.stream = ToolStream(fmt, req.parallel_tool_calls, tool_names(req), tool_schemas(req)) \
            if fmt is not None else None
        self.calls = 0

    def feed(self, text: str) -> list:
        if self.stream is None:
            return [("text", text)] if text else []
        items = self.stream.feed(text)
        self.calls += sum(k == "call" for k, _ in items)
        return items

    def finish(self) -> list:
        if self.stream is None:
            return []
        items = self.stream.finish()
        self.calls += sum(k == "call" for k, _ in items)
        return items


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def sum_usage(usages: list[dict]) -> dict:
    """One request's usage over its choices: the prompt once, the completions summed."""
    u = dict(usages[0])
    if len(usages) > 1:
        done = sum(x["completion_tokens"] for x in usages)
        u["completion_tokens"] = done
        u["total_tokens"] = u["prompt_tokens"] + done
    return u
