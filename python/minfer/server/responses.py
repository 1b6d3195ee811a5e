"""POST /v1/responses: the subset of OpenAI's Responses API that coding agents use.

Input: a string or a list of items (messages with input_text / output_text parts,
function_call and function_call_output items; reasoning items are skipped),
`instructions` (a system message for this response only, as OpenAI: not carried over
by previous_response_id), function `tools` with `tool_choice` and
`parallel_tool_calls`, `text.format` (json_object / json_schema), `max_output_tokens`,
sampling knobs, `stream`, and `previous_response_id`: a response's conversation (its
input and output) is kept in memory for the server's lifetime (the newest
`ResponseStore.LIMIT`; `store: false` keeps none), so a turn sends only its new items.
Output: message and function_call items, usage, status "completed" or "incomplete"
(max_output_tokens); streaming sends the documented event types (response.created ...
response.completed).
"""

from __future__ import annotations

import collections
import json
import threading
import time

from minfer.server.generation import ChoiceOut, ChoiceText, Run, event_error, is_failure, new_id, split_stream
from minfer.server.protocol import (ApiError, GenRequest, _common, _max_tokens, _no_unknown, _only, _opt_bool, bad,
                                    check_history, parse_tool_choice, parse_tools, response_format, tool_arguments)

RESPONSES_FIELDS = {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls",
                    "max_output_tokens", "temperature", "top_p", "stream", "previous_response_id", "store",
                    "metadata", "text", "reasoning", "user", "truncation", "include", "prompt_cache_key",
                    "safety_identifier", "service_tier", "stream_options", "background", "seed", "top_k", "min_p",
                    "stop", "presence_penalty", "frequency_penalty", "logit_bias", "max_tool_calls"}
# Passed to the common parser (the rest are this API's own).
_SAMPLING = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "presence_penalty",
             "frequency_penalty", "logit_bias", "user", "metadata", "store", "service_tier", "prompt_cache_key",
             "safety_identifier")


class ResponseStore:
    """Responses kept for previous_response_id and GET /v1/responses/{id}."""

    LIMIT = 10000

    def __init__(self):
        self._items: collections.OrderedDict[str, tuple[list, dict]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def put(self, rid: str, messages: list[dict], doc: dict) -> None:
        with self._lock:
            self._items[rid] = (messages, doc)
            while len(self._items) > self.LIMIT:
                self._items.popitem(last=False)

    def messages(self, rid: str) -> list[dict]:
        with self._lock:
            got = self._items.get(rid)
        if got is None:
            raise ApiError(400, f"previous response {rid!r} not found (responses are kept in memory while the "
                           f"server runs, and only with store not false)", param="previous_response_id",
                           code="previous_response_not_found")
        return [dict(m) for m in got[0]]

    def get_doc(self, rid: str) -> dict:
        with self._lock:
            got = self._items.get(rid)
        if got is None:
            raise ApiError(404, f"response {rid!r} not found", param="response_id", code="not_found")
        return got[1]


def _parts_text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"'{where}.content' must be a string or an array of content parts", param=where,
                  code="invalid_type")
    out = []
    for j, p in enumerate(content):
        t = p.get("type") if isinstance(p, dict) else None
        if t in ("input_text", "output_text", "text") and isinstance(p.get("text"), str):
            out.append(p["text"])
        elif t == "refusal" and isinstance(p.get("refusal"), str):
            out.append(p["refusal"])
        elif t in ("input_image", "input_file", "input_audio"):
            raise bad(f"'{where}.content[{j}]' is an {t} part; this server takes text only", param=where,
                      code="unsupported_parameter")
        else:
            raise bad(f"'{where}.content[{j}]' must be an input_text or output_text part", param=where,
                      code="invalid_type")
    return "".join(out)


def input_messages(v) -> list[dict]:
    """The Responses API's input as chat messages (tool calls as assistant tool_calls,
    their outputs as tool messages)."""
    if isinstance(v, str):
        return [{"role": "user", "content": v}]
    if not isinstance(v, list):
        raise bad("'input' must be a string or an array of items", param="input", code="invalid_type")
    msgs: list[dict] = []
    for i, it in enumerate(v):
        where = f"input[{i}]"
        if not isinstance(it, dict):
            raise bad(f"'{where}' must be an object", param=where, code="invalid_type")
        t = it.get("type", "message")
        if t == "message":
            role = it.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad(f"'{where}.role' must be user, assistant, system or developer", param=f"{where}.role")
            text = _parts_text(it.get("content"), where)
            msgs.append({"role": "system" if role == "developer" else role, "content": text})
        elif t == "function_call":
            name, args, cid = it.get("name"), it.get("arguments", "{}"), it.get("call_id")
            if not isinstance(name, str) or not name or not isinstance(cid, str) or not cid:
                raise bad(f"'{where}' needs 'call_id', 'name' and 'arguments'", param=where)
            call = {"id": cid, "type": "function",
                    "function": {"name": name, "arguments": tool_arguments(args, f"{where}.arguments")}}
            last = msgs[-1] if msgs else None
            if last is not None and last["role"] == "assistant":   # the same turn's calls
                last.setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif t == "function_call_output":
            cid, out = it.get("call_id"), it.get("output")
            if not isinstance(cid, str) or not cid:
                raise bad(f"'{where}.call_id' is required", param=f"{where}.call_id",
                          code="missing_required_parameter")
            if not isinstance(out, str):
                out = _parts_text(out, where) if isinstance(out, list) else json.dumps(out)
            msgs.append({"role": "tool", "tool_call_id": cid, "content": out})
        elif t in ("reasoning", "item_reference"):
            continue          # nothing of ours to replay: this model's reasoning is in its text
        else:
            raise bad(f"'{where}.type' {t!r} is not supported (message, function_call, function_call_output)",
                      param=f"{where}.type", code="unsupported_parameter")
    return msgs


def parse_responses(obj: dict, store: ResponseStore) -> tuple[GenRequest, dict]:
    _no_unknown(obj, RESPONSES_FIELDS)
    req = GenRequest(kind="chat")
    _common({k: obj[k] for k in _SAMPLING if k in obj}, req)
    req.stream = _opt_bool(obj, "stream")
    if obj.get("background"):
        raise bad("'background' responses are not supported", param="background", code="unsupported_parameter")
    if "input" not in obj:
        raise bad("'input' is required", param="input", code="missing_required_parameter")
    prev = obj.get("previous_response_id")
    msgs = []
    if prev is not None:
        if not isinstance(prev, str):
            raise bad("'previous_response_id' must be a string", param="previous_response_id", code="invalid_type")
        msgs = store.messages(prev)
    new = input_messages(obj["input"])
    instr = obj.get("instructions")
    if instr is not None and not isinstance(instr, str):
        raise bad("'instructions' must be a string", param="instructions", code="invalid_type")
    convo = msgs + new
    if not convo:
        raise bad("'input' is empty", param="input")
    req.messages = check_history(([{"role": "system", "content": instr}] if instr else []) + [dict(m) for m in convo])
    if obj.get("max_output_tokens") is not None:
        req.max_tokens = _max_tokens(obj["max_output_tokens"], "max_output_tokens")
    req.tools = parse_tools(obj.get("tools"), "tools", flat=True)
    req.tool_choice, req.tool_name = parse_tool_choice(obj.get("tool_choice"), req.tools, "tool_choice", flat=True)
    ptc = obj.get("parallel_tool_calls")
    if ptc is not None and not isinstance(ptc, bool):
        raise bad("'parallel_tool_calls' must be a boolean", param="parallel_tool_calls", code="invalid_type")
    req.parallel_tool_calls = True if ptc is None else ptc
    text = obj.get("text")
    if text is not None:
        if not isinstance(text, dict):
            raise bad("'text' must be an object", param="text", code="invalid_type")
        _only(text, {"format", "verbosity"}, "text")
        if text.get("format") is not None:
            req.constraint = response_format(text["format"], "text.format", flat=True)
    reasoning = obj.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, dict):
        raise bad("'reasoning' must be an object", param="reasoning", code="invalid_type")
    trunc = obj.get("truncation")
    if trunc not in (None, "disabled", "auto"):
        raise bad("'truncation' must be \"disabled\" or \"auto\"", param="truncation")
    so = obj.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise bad("'stream_options' must be an object", param="stream_options", code="invalid_type")
    extra = {"convo": convo, "instructions": instr, "previous_response_id": prev,
             "store": obj.get("store") is not False, "metadata": obj.get("metadata") or {},
             "max_output_tokens": req.max_tokens, "text": text or {"format": {"type": "text"}},
             "tools": obj.get("tools") or [], "tool_choice": obj.get("tool_choice") or "auto",
             "temperature": obj.get("temperature"), "top_p": obj.get("top_p"), "reasoning": reasoning,
             "user": obj.get("user"), "id": new_id("resp_"), "created_at": int(time.time())}
    return req, extra


def _usage(u: dict) -> dict:
    return {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
            "total_tokens": u["total_tokens"],
            "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens_details": {"reasoning_tokens": 0}}


def _doc(run: Run, served, extra: dict, status: str, output: list, usage: dict | None, reason: str | None) -> dict:
    req = run.req
    return {
        "id": extra["id"], "object": "response", "created_at": extra["created_at"], "status": status,
        "background": False, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": extra["instructions"], "max_output_tokens": extra["max_output_tokens"],
        "model": served.name, "output": output, "parallel_tool_calls": req.parallel_tool_calls,
        "previous_response_id": extra["previous_response_id"], "reasoning": extra["reasoning"] or
        {"effort": None, "summary": None}, "store": extra["store"],
        "temperature": req.sampling.temperature, "text": extra["text"], "tool_choice": extra["tool_choice"],
        "tools": extra["tools"], "top_p": req.sampling.top_p, "truncation": "disabled",
        "usage": _usage(usage) if usage else None, "user": extra["user"], "metadata": extra["metadata"],
    }


def _message_item(mid: str, text: str, status: str = "completed") -> dict:
    return {"id": mid, "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(call, status: str = "completed") -> dict:
    return {"id": "fc_" + call.id.removeprefix("call_"), "type": "function_call", "status": status,
            "call_id": call.id, "name": call.name, "arguments": call.arguments}


def _remember(store: ResponseStore, extra: dict, text: str | None, calls: list, doc: dict) -> None:
    if not extra["store"]:
        return
    msg = {"role": "assistant", "content": text or ""}
    if calls:
        msg["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": json.loads(c.arguments)}} for c in calls]
    store.put(extra["id"], extra["convo"] + [msg], doc)


def responses_doc(run: Run, served, extra: dict, out: list[ChoiceOut], store: ResponseStore) -> dict:
    c = out[0]
    items = []
    if c.content:
        items.append(_message_item(new_id("msg_"), c.content))
    items += [_call_item(t) for t in c.calls]
    status = "incomplete" if c.reason == "length" else "completed"
    doc = _doc(run, served, extra, status, items, c.done.usage, c.reason)
    _remember(store, extra, c.content, c.calls, doc)
    return doc


def _event(seq: list, type_: str, **data) -> str:
    seq[0] += 1
    doc = {"type": type_, "sequence_number": seq[0], **data}
    return f"event: {type_}\ndata: " + json.dumps(doc, ensure_ascii=False, separators=(",", ":")) + "\n\n"


async def responses_sse(run: Run, served, extra: dict, store: ResponseStore):
    seq = [-1]
    yield _event(seq, "response.created", response=_doc(run, served, extra, "in_progress", [], None, None))
    yield _event(seq, "response.in_progress", response=_doc(run, served, extra, "in_progress", [], None, None))
    ct = ChoiceText(run.prep.tool_format, run.req)
    output: list[dict] = []
    msg = {"id": None, "index": None, "text": "", "pending": ""}
    calls: list = []

    def open_message():
        msg["id"] = new_id("msg_")
        msg["index"] = len(output)
        output.append(None)
        yield _event(seq, "response.output_item.added", output_index=msg["index"],
                     item={"id": msg["id"], "type": "message", "status": "in_progress", "role": "assistant",
                           "content": []})
        yield _event(seq, "response.content_part.added", item_id=msg["id"], output_index=msg["index"],
                     content_index=0, part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})

    def close_message():
        if msg["id"] is None:
            return
        text = msg["text"]
        yield _event(seq, "response.output_text.done", item_id=msg["id"], output_index=msg["index"],
                     content_index=0, text=text, logprobs=[])
        yield _event(seq, "response.content_part.done", item_id=msg["id"], output_index=msg["index"],
                     content_index=0, part={"type": "output_text", "text": text, "annotations": [], "logprobs": []})
        item = _message_item(msg["id"], text)
        output[msg["index"]] = item
        yield _event(seq, "response.output_item.done", output_index=msg["index"], item=item)
        msg["id"] = None

    def handle(items):
        for k, v in items:
            if k == "text":
                msg["pending"] += v
                if not msg["pending"].strip():
                    continue          # whitespace waits: it may only precede a call
                if msg["id"] is None:
                    yield from open_message()
                delta, msg["pending"] = msg["pending"], ""
                msg["text"] += delta
                yield _event(seq, "response.output_text.delta", item_id=msg["id"], output_index=msg["index"],
                             content_index=0, delta=delta, logprobs=[])
            else:
                yield from close_message()
                msg["pending"] = ""
                calls.append(v)
                item = _call_item(v, "in_progress")
                idx = len(output)
                output.append(None)
                yield _event(seq, "response.output_item.added", output_index=idx, item={**item, "arguments": ""})
                yield _event(seq, "response.function_call_arguments.delta", item_id=item["id"], output_index=idx,
                             delta=v.arguments)
                yield _event(seq, "response.function_call_arguments.done", item_id=item["id"], output_index=idx,
                             arguments=v.arguments, name=v.name)
                done = _call_item(v)
                output[idx] = done
                yield _event(seq, "response.output_item.done", output_index=idx, item=done)

    async for items, ev in split_stream(run, ct):
        if ev is not None and is_failure(ev):
            err = event_error(ev)
            yield _event(seq, "error", code=err.code, message=err.message, param=None)
            return
        for piece in handle(items):
            yield piece
        if ev is None:
            continue
        if msg["pending"] and msg["pending"].strip() == "" and msg["id"] is not None:
            msg["text"] += msg["pending"]
        for piece in close_message():
            yield piece
        status = "incomplete" if ev.reason == "length" else "completed"
        doc = _doc(run, served, extra, status, [o for o in output if o is not None], ev.usage, ev.reason)
        text = "".join(o["content"][0]["text"] for o in output if o and o["type"] == "message")
        _remember(store, extra, text, calls, doc)
        yield _event(seq, "response.completed" if status == "completed" else "response.incomplete", response=doc)
        return
