"""POST /v1/messages: Anthropic's Messages API over the same generation.

Request: `model`, `max_tokens` (required), `system` (a string or text blocks),
`messages` (user / assistant; content a string or blocks: text, tool_use, tool_result;
thinking blocks of earlier turns are skipped), `tools` (name, description,
input_schema), `tool_choice` (auto, any, tool, none; disable_parallel_tool_use),
`stop_sequences`, `temperature`, `top_p`, `top_k`, `stream`, `metadata`; cache_control
marks are accepted (the server reuses a slot's KV prefix on its own). Answer: text
and tool_use blocks, `stop_reason` (end_turn, max_tokens, stop_sequence, tool_use),
usage; streaming sends message_start, content_block_start / _delta / _stop,
message_delta and message_stop. Errors are Anthropic's ({"type": "error", "error":
{"type", "message"}}). POST /v1/messages/count_tokens counts a request's prompt.
"""

from __future__ import annotations

import json
import secrets

from minfer.server.generation import ChoiceOut, ChoiceText, Run, event_error, is_failure, new_id, split_stream
from minfer.server.protocol import (ApiError, Constraint, GenRequest, _common, _max_tokens, _no_unknown, _only, _opt_bool, bad,
                                    check_history, parse_tool_choice, parse_tools)

MESSAGES_FIELDS = {"model", "max_tokens", "messages", "system", "stop_sequences", "stream", "temperature", "top_p",
                   "top_k", "tools", "tool_choice", "metadata", "thinking", "output_config",
                   # accepted and not acted on (routing, caching and accounting hints)
                   "service_tier", "cache_control", "inference_geo", "speed", "diagnostics", "user_profile_id",
                   "workspace_id"}

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error"}


def anthropic_error_body(e: ApiError) -> dict:
    t = _ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": t, "message": e.message}}


def _text_blocks(v, where: str) -> str:
    if isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise bad(f"'{where}' must be a string or an array of text blocks", param=where, code="invalid_type")
    out = []
    for j, b in enumerate(v):
        if not (isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)):
            if isinstance(b, dict) and b.get("type") in ("image", "document"):
                raise bad(f"'{where}[{j}]' is an {b['type']} block; this server takes text only", param=where,
                          code="unsupported_parameter")
            raise bad(f"'{where}[{j}]' must be a text block", param=where, code="invalid_type")
        _only(b, {"type", "text", "cache_control", "citations"}, f"{where}[{j}]")
        out.append(b["text"])
    return "".join(out)


def _messages(v) -> list[dict]:
    if not isinstance(v, list) or not v:
        raise bad("'messages' must be a non-empty array", param="messages", code="invalid_type")
    out: list[dict] = []
    for i, m in enumerate(v):
        where = f"messages.{i}"
        if not isinstance(m, dict):
            raise bad(f"'{where}' must be an object", param=where, code="invalid_type")
        _only(m, {"role", "content"}, where)
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise bad(f"'{where}.role' must be \"user\" or \"assistant\"", param=f"{where}.role")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise bad(f"'{where}.content' must be a string or an array of blocks", param=f"{where}.content",
                      code="invalid_type")
        texts, calls, results = [], [], []
        for j, b in enumerate(content):
            bw = f"{where}.content.{j}"
            t = b.get("type") if isinstance(b, dict) else None
            if t == "text":
                texts.append(_text_blocks([b], bw))
            elif t == "tool_use" and role == "assistant":
                _only(b, {"type", "id", "name", "input", "cache_control", "caller", "toolset_name"}, bw)
                if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                    raise bad(f"'{bw}' needs 'id' and 'name'", param=bw)
                inp = b.get("input", {})
                if not isinstance(inp, dict):
                    raise bad(f"'{bw}.input' must be an object", param=f"{bw}.input", code="invalid_type")
                calls.append({"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": inp}})
            elif t == "tool_result" and role == "user":
                _only(b, {"type", "tool_use_id", "content", "is_error", "cache_control", "toolset_name"}, bw)
                if not isinstance(b.get("tool_use_id"), str):
                    raise bad(f"'{bw}.tool_use_id' is required", param=f"{bw}.tool_use_id",
                              code="missing_required_parameter")
                c = b.get("content", "")
                text = _text_blocks(c, f"{bw}.content") if c is not None else ""
                if b.get("is_error"):
                    text = "Error: " + text
                results.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": text})
            elif t in ("thinking", "redacted_thinking") and role == "assistant":
                continue
            elif t in ("image", "document"):
                raise bad(f"'{bw}' is an {t} block; this server takes text only", param=bw,
                          code="unsupported_parameter")
            else:
                raise bad(f"'{bw}.type' {t!r} is not supported here (text, tool_use in assistant messages, "
                          f"tool_result in user messages)", param=f"{bw}.type")
        if role == "assistant":
            msg = {"role": "assistant", "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        else:
            out += results
            if texts or not results:
                out.append({"role": "user", "content": "".join(texts)})
    return out


def _tools(v) -> list[dict] | None:
    if v is None:
        return None
    if not isinstance(v, list):
        raise bad("'tools' must be an array", param="tools", code="invalid_type")
    conv = []
    for i, t in enumerate(v):
        where = f"tools.{i}"
        if not isinstance(t, dict):
            raise bad(f"'{where}' must be an object", param=where, code="invalid_type")
        if t.get("type", "custom") != "custom":
            raise bad(f"'{where}.type' {t.get('type')!r}: only custom (client) tools are supported", param=where,
                      code="unsupported_parameter")
        _only(t, {"type", "name", "description", "input_schema", "cache_control", "strict", "defer_loading",
                  "eager_input_streaming", "input_examples", "allowed_callers"}, where)
        if "input_schema" not in t:
            raise bad(f"'{where}.input_schema' is required", param=f"{where}.input_schema",
                      code="missing_required_parameter")
        f = {"type": "function", "name": t.get("name"), "parameters": t["input_schema"]}
        if t.get("description") is not None:
            f["description"] = t["description"]
        if t.get("strict") is not None:
            f["strict"] = t["strict"]
        conv.append(f)
    return parse_tools(conv, "tools", flat=True)


def _tool_choice(v, tools) -> tuple[str, str | None, bool]:
    if v is None:
        return ("auto", None, True)
    if not isinstance(v, dict):
        raise bad("'tool_choice' must be an object", param="tool_choice", code="invalid_type")
    _only(v, {"type", "name", "disable_parallel_tool_use"}, "tool_choice")
    parallel = not v.get("disable_parallel_tool_use", False)
    t = v.get("type")
    if t == "auto":
        return ("auto", None, parallel)
    if t == "none":
        return ("none", None, parallel)
    if t == "any":
        choice, _ = parse_tool_choice("required", tools, "tool_choice")
        return (choice, None, parallel)
    if t == "tool":
        choice, name = parse_tool_choice({"type": "function", "name": v.get("name")}, tools, "tool_choice", flat=True)
        return (choice, name, parallel)
    raise bad("'tool_choice.type' must be auto, any, tool or none", param="tool_choice.type")


def parse_messages(obj: dict, count_only: bool = False) -> tuple[GenRequest, dict]:
    _no_unknown(obj, MESSAGES_FIELDS)
    req = GenRequest(kind="chat")
    common = {k: obj[k] for k in ("model", "top_p", "top_k", "metadata") if k in obj}
    if obj.get("stop_sequences") is not None:
        common["stop"] = obj["stop_sequences"]
    if obj.get("temperature") is not None:
        common["temperature"] = obj["temperature"]
        if not isinstance(obj["temperature"], (int, float)) or isinstance(obj["temperature"], bool) or \
                not 0 <= obj["temperature"] <= 1:
            raise bad("'temperature' must be a number in [0, 1]", param="temperature")
    try:
        _common(common, req)
    except ApiError as e:
        if e.param == "stop":
            e.param = "stop_sequences"
            e.message = e.message.replace("'stop'", "'stop_sequences'")
        raise
    req.stream = _opt_bool(obj, "stream")
    if "max_tokens" not in obj and not count_only:
        raise bad("'max_tokens' is required", param="max_tokens", code="missing_required_parameter")
    if not count_only:
        req.max_tokens = _max_tokens(obj["max_tokens"], "max_tokens")
    if "messages" not in obj:
        raise bad("'messages' is required", param="messages", code="missing_required_parameter")
    msgs = _messages(obj["messages"])
    system = obj.get("system")
    if system is not None:
        s = _text_blocks(system, "system")
        if s:
            msgs = [{"role": "system", "content": s}] + msgs
    req.messages = check_history(msgs)
    req.tools = _tools(obj.get("tools"))
    req.tool_choice, req.tool_name, req.parallel_tool_calls = _tool_choice(obj.get("tool_choice"), req.tools)
    oc = obj.get("output_config")
    if oc is not None:
        if not isinstance(oc, dict):
            raise bad("'output_config' must be an object", param="output_config", code="invalid_type")
        _only(oc, {"format", "effort"}, "output_config")
        f = oc.get("format")
        if f is not None:
            if not isinstance(f, dict) or f.get("type") != "json_schema" or not isinstance(f.get("schema"), dict):
                raise bad("'output_config.format' must be {\"type\": \"json_schema\", \"schema\": {...}}",
                          param="output_config.format")
            _only(f, {"type", "schema"}, "output_config.format")
            req.constraint = Constraint("json_schema", schema=f["schema"], strict=True, param="output_config.format")
    th = obj.get("thinking")
    if th is not None and not (isinstance(th, dict) and th.get("type") in ("enabled", "disabled")):
        raise bad("'thinking' must be {\"type\": \"enabled\" | \"disabled\", ...}", param="thinking")
    return req, {"stop_sequences": req.stop}


def _tool_id() -> str:
    return "toolu_" + secrets.token_hex(12)


def _usage(u: dict, output: int | None = None) -> dict:
    cached = u["prompt_tokens_details"]["cached_tokens"]
    return {"input_tokens": u["prompt_tokens"] - cached, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0, "output_tokens": u["completion_tokens"] if output is None else output}


def _stop(reason: str | None, calls: bool, stops: list[str]) -> tuple[str, str | None]:
    if reason == "length":
        return "max_tokens", None
    if calls:
        return "tool_use", None
    if reason == "stop" and stops:
        # The engine says a stop string ended it, not which: with one there is no doubt.
        return "stop_sequence", stops[0] if len(stops) == 1 else None
    return "end_turn", None


def _tool_use(call) -> dict:
    return {"type": "tool_use", "id": _tool_id(), "name": call.name, "input": json.loads(call.arguments)}


def messages_doc(run: Run, served, extra: dict, out: list[ChoiceOut]) -> dict:
    c = out[0]
    content = []
    if c.content:
        content.append({"type": "text", "text": c.content})
    content += [_tool_use(t) for t in c.calls]
    reason, seq = _stop(c.reason, bool(c.calls), extra["stop_sequences"])
    return {"id": new_id("msg_"), "type": "message", "role": "assistant", "model": served.name, "content": content,
            "stop_reason": reason, "stop_sequence": seq, "usage": _usage(c.done.usage)}


def _event(type_: str, **data) -> str:
    return f"event: {type_}\ndata: " + json.dumps({"type": type_, **data}, ensure_ascii=False,
                                                   separators=(",", ":")) + "\n\n"


async def messages_sse(run: Run, served, extra: dict):
    n_prompt = len(run.prep.ids)
    yield _event("message_start", message={
        "id": new_id("msg_"), "type": "message", "role": "assistant", "model": served.name, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": n_prompt, "output_tokens": 0, "cache_read_input_tokens": 0,
                  "cache_creation_input_tokens": 0}})
    yield _event("ping")
    ct = ChoiceText(run.prep.tool_format, run.req)
    state = {"block": -1, "text_open": False, "pending": "", "calls": 0}

    def handle(items):
        for k, v in items:
            if k == "text":
                state["pending"] += v
                if not state["pending"].strip():
                    continue
                if not state["text_open"]:
                    state["block"] += 1
                    state["text_open"] = True
                    yield _event("content_block_start", index=state["block"],
                                 content_block={"type": "text", "text": ""})
                delta, state["pending"] = state["pending"], ""
                yield _event("content_block_delta", index=state["block"], delta={"type": "text_delta", "text": delta})
            else:
                if state["text_open"]:
                    yield _event("content_block_stop", index=state["block"])
                    state["text_open"] = False
                state["pending"] = ""
                state["block"] += 1
                state["calls"] += 1
                block = _tool_use(v)
                yield _event("content_block_start", index=state["block"],
                             content_block={"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}})
                yield _event("content_block_delta", index=state["block"],
                             delta={"type": "input_json_delta", "partial_json": v.arguments})
                yield _event("content_block_stop", index=state["block"])

    async for items, ev in split_stream(run, ct):
        if ev is not None and is_failure(ev):
            yield _event("error", error=anthropic_error_body(event_error(ev))["error"])
            return
        for piece in handle(items):
            yield piece
        if ev is None:
            continue
        if state["text_open"]:
            yield _event("content_block_stop", index=state["block"])
        reason, seq = _stop(ev.reason, state["calls"] > 0, extra["stop_sequences"])
        yield _event("message_delta", delta={"stop_reason": reason, "stop_sequence": seq},
                     usage=_usage(ev.usage))
        yield _event("message_stop")
        return
