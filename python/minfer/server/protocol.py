"""Request validation for the OpenAI-style endpoints: a JSON body in, a checked
request out, or an ApiError that the app answers with an OpenAI error body
({"error": {"message", "type", "param", "code"}}).

Validation is strict: unknown fields, wrong types and out-of-range values are 400s,
never silently ignored, so a client learns at once that a knob it sent does nothing.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

from minfer.sampling import SamplingParams
from minfer.server.tools import TOOL_NAME

# The defaults of an unset sampling knob follow llama.cpp's server (and `minfer generate`).
DEFAULTS = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)
MAX_STOP = 4           # as OpenAI
MAX_STOP_LEN = 256
MAX_TOKENS_LIMIT = 1 << 20  # anything beyond is nonsense for any context we can hold


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or _type_for(status)
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _type_for(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 503:
        return "server_overloaded"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def bad(message: str, param: str | None = None, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass
class GenRequest:
    """What both endpoints reduce to: a prompt (text or token ids) and how to generate."""

    kind: str                          # "chat" | "completion"
    messages: list[dict] | None = None
    prompt_text: str | None = None
    prompt_ids: list[int] | None = None
    max_tokens: int | None = None      # None: up to the end of the context
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False
    model: str | None = None
    speculate: str | None = None       # "off" | "ngram" | "draft"; None: the server's default
    draft_max: int | None = None       # None: the server's default
    n: int = 1                         # choices
    logprobs: int | None = None        # None: off; N >= 0: each token's logprob and N alternatives
    tools: list[dict] | None = None    # [{"type": "function", "function": {name, description, parameters, strict}}]
    tool_choice: str = "auto"          # "auto" | "none" | "required" | "function" (tool_name names it)
    tool_name: str | None = None
    parallel_tool_calls: bool = True
    constraint: "Constraint | None" = None   # structured output (response_format, grammar, json_schema)


@dataclass
class Constraint:
    """What the output must be: kind "json_object" (any JSON object), "json_schema"
    (schema; strict: unimplemented keywords refused rather than ignored), "grammar"
    (GBNF or Lark text) or "regex"."""

    kind: str
    schema: dict | None = None
    strict: bool = True
    text: str | None = None
    name: str | None = None
    param: str = "response_format"


def parse_json(body: bytes) -> dict:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad(f"the request body is not valid UTF-8 (byte {e.start})", code="invalid_encoding") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise bad(f"the request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}",
                  code="invalid_json") from None
    except RecursionError:
        raise bad("the request body is nested too deeply", code="invalid_json") from None
    except ValueError as e:  # e.g. an integer literal over Python's digit limit
        raise bad(f"the request body is not acceptable JSON: {e}", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise bad("the request body must be a JSON object", code="invalid_json")
    return obj


_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stream",
           "stream_options", "n", "user", "ignore_eos", "repeat_penalty", "presence_penalty",
           "frequency_penalty", "logprobs", "logit_bias", "speculate", "draft_max",
           # structured output: OpenAI's response_format; llama.cpp's grammar (GBNF) and json_schema
           "response_format", "grammar", "json_schema",
           # accepted and not acted on: they change nothing a local server produces
           "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"}
MAX_N = 16            # choices per request (each takes a slot)
MAX_LOGPROBS = 20     # OpenAI's bound on top_logprobs
SPECULATE = ("off", "ngram", "draft")   # the request extension's values
DRAFT_MAX_LIMIT = 64
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                         "parallel_tool_calls"}
MAX_TOOLS = 128
MAX_SCHEMA_BYTES = 256 * 1024
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "suffix"}


def parse_chat(obj: dict) -> GenRequest:
    _no_unknown(obj, CHAT_FIELDS)
    req = GenRequest(kind="chat")
    _common(obj, req)
    if "messages" not in obj:
        raise bad("'messages' is required", param="messages", code="missing_required_parameter")
    msgs = obj["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty array", param="messages", code="invalid_type")
    req.messages = check_history([_message(m, i) for i, m in enumerate(msgs)])
    req.tools = parse_tools(obj.get("tools"), "tools")
    req.tool_choice, req.tool_name = parse_tool_choice(obj.get("tool_choice"), req.tools, "tool_choice")
    req.parallel_tool_calls = True if obj.get("parallel_tool_calls") is None else \
        _opt_bool(obj, "parallel_tool_calls")
    mct = obj.get("max_completion_tokens")
    if mct is not None:
        req.max_tokens = _max_tokens(mct, "max_completion_tokens")
    # Chat: "logprobs": true turns them on, "top_logprobs": N (0-20) asks for alternatives.
    lp = obj.get("logprobs")
    if lp is not None and not isinstance(lp, bool):
        raise bad("'logprobs' must be a boolean", param="logprobs", code="invalid_type")
    top = obj.get("top_logprobs")
    if top is not None:
        if not _is_int(top) or not 0 <= top <= MAX_LOGPROBS:
            raise bad(f"'top_logprobs' must be an integer in [0, {MAX_LOGPROBS}]", param="top_logprobs",
                      code="invalid_type")
        if not lp:
            raise bad("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    req.logprobs = (int(top) if top is not None else 0) if lp else None
    return req


def parse_completion(obj: dict) -> GenRequest:
    _no_unknown(obj, COMPLETION_FIELDS)
    req = GenRequest(kind="completion")
    if "max_tokens" not in obj:
        req.max_tokens = 16  # OpenAI's default for completions
    _common(obj, req)
    if "prompt" not in obj:
        raise bad("'prompt' is required", param="prompt", code="missing_required_parameter")
    p = obj["prompt"]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        req.prompt_text = p
    elif isinstance(p, list) and p and all(_is_int(t) for t in p):
        req.prompt_ids = [int(t) for t in p]
    elif isinstance(p, list):
        raise bad("'prompt' must be a string, a list of token ids, or a list of one of those "
                  "(one prompt per request)", param="prompt", code="invalid_type")
    else:
        raise bad("'prompt' must be a string or a list of token ids", param="prompt", code="invalid_type")
    # Completions: "logprobs": N (0-5 in OpenAI's API; up to 20 here) alternatives per token.
    lp = obj.get("logprobs")
    if lp is not None:
        if isinstance(lp, bool) or not _is_int(lp) or not 0 <= lp <= MAX_LOGPROBS:
            raise bad(f"'logprobs' must be an integer in [0, {MAX_LOGPROBS}]", param="logprobs", code="invalid_type")
        req.logprobs = int(lp)
    if obj.get("echo"):
        raise bad("'echo' is not supported", param="echo", code="unsupported_parameter")
    if obj.get("suffix") is not None:
        raise bad("'suffix' is not supported", param="suffix", code="unsupported_parameter")
    return req


def _logit_bias(v) -> tuple:
    """OpenAI's logit_bias: an object mapping token ids (as strings) to a bias in
    [-100, 100]. Ids beyond the vocabulary are refused later, where it is known."""
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise bad("'logit_bias' must be an object mapping token ids to numbers", param="logit_bias",
                  code="invalid_type")
    out = []
    for k, b in v.items():
        try:
            t = int(k)
        except ValueError:
            raise bad(f"'logit_bias' keys must be token ids, got {k!r}", param="logit_bias") from None
        if t < 0 or str(t) != str(k).strip():
            raise bad(f"'logit_bias' keys must be token ids, got {k!r}", param="logit_bias")
        val = _number(b, "logit_bias")
        if not -100.0 <= val <= 100.0:
            raise bad(f"'logit_bias' values must be in [-100, 100], got {b} for token {t}", param="logit_bias")
        out.append((t, val))
    return tuple(sorted(out))


def _no_unknown(obj: dict, allowed: set[str]) -> None:
    unknown = sorted(k for k in obj if k not in allowed)
    if unknown:
        raise bad(f"unknown field {unknown[0]!r}", param=unknown[0], code="unknown_parameter")


def _common(obj: dict, req: GenRequest) -> None:
    m = obj.get("model")
    if m is not None and not isinstance(m, str):
        raise bad("'model' must be a string", param="model", code="invalid_type")
    req.model = m
    if obj.get("max_tokens") is not None:
        req.max_tokens = _max_tokens(obj["max_tokens"], "max_tokens")
    n = obj.get("n")
    if n is not None and (not _is_int(n) or not 1 <= n <= MAX_N):
        raise bad(f"'n' must be an integer in [1, {MAX_N}]", param="n", code="invalid_type")
    req.n = int(n) if n is not None else 1
    if obj.get("user") is not None and not isinstance(obj["user"], str):
        raise bad("'user' must be a string", param="user", code="invalid_type")
    presence = _opt_number(obj, "presence_penalty", 0.0, -2.0, 2.0)
    frequency = _opt_number(obj, "frequency_penalty", 0.0, -2.0, 2.0)
    bias = _logit_bias(obj.get("logit_bias"))

    temp = _opt_number(obj, "temperature", DEFAULTS["temperature"], 0.0, 2.0)
    top_p = _opt_number(obj, "top_p", DEFAULTS["top_p"], 0.0, 1.0)
    if top_p == 0.0:
        top_p = 1e-9  # "only the most likely token": keep the first candidate
    min_p = _opt_number(obj, "min_p", DEFAULTS["min_p"], 0.0, 1.0)
    if min_p >= 1.0:
        raise bad("'min_p' must be in [0, 1)", param="min_p")
    rp = _opt_number(obj, "repeat_penalty", 1.0, 0.0, 10.0)
    if rp <= 0.0:
        raise bad("'repeat_penalty' must be > 0", param="repeat_penalty")
    top_k = obj.get("top_k", DEFAULTS["top_k"])
    if top_k is None:
        top_k = DEFAULTS["top_k"]
    if not _is_int(top_k) or top_k < 0 or top_k > 1 << 31:
        raise bad("'top_k' must be a non-negative integer", param="top_k", code="invalid_type")
    seed = obj.get("seed")
    if seed is not None and (not _is_int(seed) or not -(1 << 63) <= seed < 1 << 64):
        raise bad("'seed' must be an integer", param="seed", code="invalid_type")
    if seed is not None and seed < 0:
        seed &= (1 << 64) - 1
    req.sampling = SamplingParams(temperature=temp, top_k=int(top_k), top_p=top_p, min_p=min_p,
                                  repeat_penalty=rp, seed=seed, presence_penalty=presence,
                                  frequency_penalty=frequency, logit_bias=bias)

    stop = obj.get("stop")
    if stop is None:
        req.stop = []
    elif isinstance(stop, str):
        req.stop = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        if len(stop) > MAX_STOP:
            raise bad(f"'stop' takes at most {MAX_STOP} strings", param="stop")
        req.stop = list(stop)
    else:
        raise bad("'stop' must be a string or an array of strings", param="stop", code="invalid_type")
    if any(len(s) > MAX_STOP_LEN for s in req.stop):
        raise bad(f"a stop string is longer than {MAX_STOP_LEN} characters", param="stop")

    req.stream = _opt_bool(obj, "stream")
    so = obj.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise bad("'stream_options' must be an object", param="stream_options", code="invalid_type")
        extra = [k for k in so if k not in ("include_usage", "continuous_usage_stats", "include_obfuscation")]
        if extra:
            raise bad(f"unknown field 'stream_options.{extra[0]}'", param=f"stream_options.{extra[0]}",
                      code="unknown_parameter")
        req.include_usage = _opt_bool(so, "include_usage", "stream_options.include_usage")
        if not req.stream:
            raise bad("'stream_options' is only allowed with 'stream': true", param="stream_options")
    req.ignore_eos = _opt_bool(obj, "ignore_eos")
    _speculation(obj, req)
    req.constraint = parse_constraint(obj)
    if obj.get("store") is not None and not isinstance(obj["store"], bool):
        raise bad("'store' must be a boolean", param="store", code="invalid_type")
    md = obj.get("metadata")
    if md is not None and not isinstance(md, dict):
        raise bad("'metadata' must be an object", param="metadata", code="invalid_type")


def parse_constraint(obj: dict) -> "Constraint | None":
    """response_format (OpenAI), or llama.cpp's "grammar" / "json_schema" fields; at
    most one of them."""
    given = [k for k in ("response_format", "grammar", "json_schema") if obj.get(k) is not None]
    if len(given) > 1:
        raise bad(f"send one of 'response_format', 'grammar' and 'json_schema', not {given[0]!r} and {given[1]!r}",
                  param=given[1])
    if not given:
        return None
    k = given[0]
    v = obj[k]
    if k == "grammar":
        if not isinstance(v, str) or not v.strip():
            raise bad("'grammar' must be a non-empty string (GBNF or Lark)", param="grammar", code="invalid_type")
        return Constraint("grammar", text=v, param="grammar")
    if k == "json_schema":
        if not isinstance(v, dict):
            raise bad("'json_schema' must be a JSON schema object", param="json_schema", code="invalid_type")
        _schema_size(v, "json_schema")
        return Constraint("json_schema", schema=v, strict=True, param="json_schema")
    return response_format(v, "response_format")


def response_format(v, param: str, flat: bool = False) -> "Constraint | None":
    """OpenAI's response_format ({"type": "text" | "json_object" | "json_schema", ...}).
    flat: the Responses API's text.format, where name/schema/strict sit beside type."""
    if not isinstance(v, dict):
        raise bad(f"'{param}' must be an object", param=param, code="invalid_type")
    t = v.get("type")
    if t == "text":
        _only(v, {"type"}, param)
        return None
    if t == "json_object":
        _only(v, {"type"}, param)
        return Constraint("json_object", param=param)
    if t == "json_schema":
        if flat:
            js = v
            _only(v, {"type", "name", "schema", "strict", "description"}, param)
        else:
            _only(v, {"type", "json_schema"}, param)
            js = v.get("json_schema")
            if not isinstance(js, dict):
                raise bad(f"'{param}.json_schema' must be an object with 'name' and 'schema'",
                          param=f"{param}.json_schema", code="invalid_type")
            _only(js, {"name", "schema", "strict", "description"}, f"{param}.json_schema")
        where = param if flat else f"{param}.json_schema"
        name = js.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
            raise bad(f"'{where}.name' must be 1-64 letters, digits, '_' or '-'", param=f"{where}.name")
        schema = js.get("schema", {})
        if not isinstance(schema, dict):
            raise bad(f"'{where}.schema' must be a JSON schema object", param=f"{where}.schema",
                      code="invalid_type")
        _schema_size(schema, f"{where}.schema")
        strict = js.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad(f"'{where}.strict' must be a boolean", param=f"{where}.strict", code="invalid_type")
        return Constraint("json_schema", schema=schema, strict=bool(strict), name=name, param=f"{where}.schema")
    raise bad(f"'{param}.type' must be \"text\", \"json_object\" or \"json_schema\"", param=f"{param}.type")


def _only(obj: dict, allowed: set, where: str) -> None:
    extra = sorted(k for k in obj if k not in allowed)
    if extra:
        raise bad(f"unknown field '{where}.{extra[0]}'", param=f"{where}.{extra[0]}", code="unknown_parameter")


def _schema_size(schema, where: str) -> None:
    if len(json.dumps(schema)) > MAX_SCHEMA_BYTES:
        raise bad(f"'{where}' is larger than {MAX_SCHEMA_BYTES} bytes", param=where)


def parse_tools(v, param: str, flat: bool = False) -> list[dict] | None:
    """OpenAI function tools, normalized to {"type": "function", "function": {name,
    description, parameters, strict}}. flat: the Responses API's spelling, where the
    function's fields sit beside "type"."""
    if v is None:
        return None
    if not isinstance(v, list):
        raise bad(f"'{param}' must be an array of tools", param=param, code="invalid_type")
    if len(v) > MAX_TOOLS:
        raise bad(f"'{param}' takes at most {MAX_TOOLS} tools", param=param)
    out, names = [], set()
    for i, t in enumerate(v):
        where = f"{param}[{i}]"
        if not isinstance(t, dict):
            raise bad(f"'{where}' must be an object", param=where, code="invalid_type")
        if t.get("type") != "function":
            raise bad(f"'{where}.type' must be \"function\" (the only tool type this server runs)",
                      param=f"{where}.type", code="unsupported_parameter")
        if flat:
            _only(t, {"type", "name", "description", "parameters", "strict"}, where)
            f, fw = t, where
        else:
            _only(t, {"type", "function"}, where)
            f, fw = t.get("function"), f"{where}.function"
            if not isinstance(f, dict):
                raise bad(f"'{fw}' must be an object", param=fw, code="invalid_type")
            _only(f, {"name", "description", "parameters", "strict"}, fw)
        name = f.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise bad(f"'{fw}.name' must be 1-64 letters, digits, '_', '-', '.' or ':'", param=f"{fw}.name")
        if name in names:
            raise bad(f"two tools are named {name!r}", param=f"{fw}.name")
        names.add(name)
        desc = f.get("description")
        if desc is not None and not isinstance(desc, str):
            raise bad(f"'{fw}.description' must be a string", param=f"{fw}.description", code="invalid_type")
        params = f.get("parameters")
        if params is not None:
            if not isinstance(params, dict):
                raise bad(f"'{fw}.parameters' must be a JSON schema object", param=f"{fw}.parameters",
                          code="invalid_type")
            if params.get("type", "object") != "object":
                raise bad(f"'{fw}.parameters' must describe an object (\"type\": \"object\")",
                          param=f"{fw}.parameters")
            _schema_size(params, f"{fw}.parameters")
        strict = f.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad(f"'{fw}.strict' must be a boolean", param=f"{fw}.strict", code="invalid_type")
        fn = {"name": name}
        if desc is not None:
            fn["description"] = desc
        fn["parameters"] = params if params is not None else {"type": "object", "properties": {}}
        if strict is not None:
            fn["strict"] = strict
        out.append({"type": "function", "function": fn})
    return out or None


def parse_tool_choice(v, tools: list[dict] | None, param: str, flat: bool = False) -> tuple[str, str | None]:
    """("auto" | "none" | "required", None) or ("function", name)."""
    if v is None:
        return ("auto", None)
    if isinstance(v, str):
        if v not in ("auto", "none", "required"):
            raise bad(f"'{param}' must be \"auto\", \"none\", \"required\" or a named function",
                      param=param)
        if v == "required" and not tools:
            raise bad(f"'{param}': \"required\" needs 'tools'", param=param)
        return (v, None)
    if isinstance(v, dict) and v.get("type") == "function":
        if flat:
            _only(v, {"type", "name"}, param)
            name = v.get("name")
        else:
            _only(v, {"type", "function"}, param)
            f = v.get("function")
            name = f.get("name") if isinstance(f, dict) else None
        if not isinstance(name, str):
            raise bad(f"'{param}' names no function", param=param, code="invalid_type")
        if not tools or name not in {t["function"]["name"] for t in tools}:
            raise bad(f"'{param}' names {name!r}, which is not one of 'tools'", param=param)
        return ("function", name)
    raise bad(f"'{param}' must be \"auto\", \"none\", \"required\" or {{\"type\": \"function\", ...}}",
              param=param, code="invalid_type")


def _speculation(obj: dict, req: GenRequest) -> None:
    """The extension fields: "speculate": "ngram" | "draft" | "off" and "draft_max":
    1..64. Whether this server has a draft model is the app's check."""
    sp = obj.get("speculate")
    if sp is not None:
        if not isinstance(sp, str):
            raise bad("'speculate' must be a string: \"ngram\", \"draft\" or \"off\"", param="speculate",
                      code="invalid_type")
        if sp not in SPECULATE:
            raise bad(f"'speculate' must be \"ngram\", \"draft\" or \"off\", got {sp!r}", param="speculate")
        req.speculate = sp
    dm = obj.get("draft_max")
    if dm is not None:
        if not _is_int(dm):
            raise bad("'draft_max' must be an integer", param="draft_max", code="invalid_type")
        if not 1 <= dm <= DRAFT_MAX_LIMIT:
            raise bad(f"'draft_max' must be in [1, {DRAFT_MAX_LIMIT}], got {dm}", param="draft_max")
        if sp == "off":
            raise bad("'draft_max' needs speculation, but 'speculate' is \"off\"", param="draft_max")
        req.draft_max = dm


def _text_content(content, where: str, allow_none: bool = False) -> str | None:
    """A message's content: a string or an array of text parts, joined."""
    if content is None and allow_none:
        return None
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") in ("image_url", "input_audio", "file", "image"):
                raise bad(f"'{where}.content[{j}]' is a {part['type']} part; this server takes text only",
                          param=f"{where}.content", code="unsupported_parameter")
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                    and set(part) <= {"type", "text"}):
                raise bad(f"'{where}.content[{j}]' must be a text part ({{\"type\": \"text\", \"text\": ...}})",
                          param=f"{where}.content", code="invalid_type")
            parts.append(part["text"])
        return "".join(parts)
    if not isinstance(content, str):
        raise bad(f"'{where}.content' must be a string or an array of text parts", param=f"{where}.content",
                  code="invalid_type")
    return content


def tool_arguments(args, where: str) -> dict:
    """A call's arguments as the chat template wants them (an object), from OpenAI's
    JSON text (or an object)."""
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError as e:
            raise bad(f"'{where}' is not valid JSON: {e}", param=where) from None
        except RecursionError:
            raise bad(f"'{where}' is nested too deeply", param=where) from None
    if not isinstance(args, dict):
        raise bad(f"'{where}' must be a JSON object (as a string)", param=where, code="invalid_type")
    return args


def _message(m, i: int) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad(f"'{where}' must be an object", param=where, code="invalid_type")
    role = m.get("role")
    if role not in ("system", "developer", "user", "assistant", "tool"):
        raise bad(f"'{where}.role' must be one of system, developer, user, assistant, tool",
                  param=f"{where}.role")
    allowed = {"role", "content", "name"}
    if role == "assistant":
        allowed |= {"tool_calls", "refusal"}
    if role == "tool":
        allowed |= {"tool_call_id"}
    extra = [k for k in m if k not in allowed]
    if extra:
        raise bad(f"unknown field '{where}.{extra[0]}'", param=f"{where}.{extra[0]}", code="unknown_parameter")
    name = m.get("name")
    if name is not None and not isinstance(name, str):
        raise bad(f"'{where}.name' must be a string", param=f"{where}.name", code="invalid_type")
    if role == "assistant":
        calls = m.get("tool_calls")
        content = _text_content(m.get("content"), where, allow_none=True)
        if calls is None or calls == []:
            if content is None:
                raise bad(f"'{where}' needs 'content' or 'tool_calls'", param=f"{where}.content")
            return {"role": "assistant", "content": content}
        if not isinstance(calls, list):
            raise bad(f"'{where}.tool_calls' must be an array", param=f"{where}.tool_calls", code="invalid_type")
        out = []
        for j, c in enumerate(calls):
            cw = f"{where}.tool_calls[{j}]"
            if not isinstance(c, dict) or c.get("type", "function") != "function" or not isinstance(
                    c.get("function"), dict):
                raise bad(f"'{cw}' must be {{\"id\", \"type\": \"function\", \"function\": {{name, arguments}}}}",
                          param=cw, code="invalid_type")
            _only(c, {"id", "type", "function"}, cw)
            f = c["function"]
            _only(f, {"name", "arguments"}, f"{cw}.function")
            if not isinstance(f.get("name"), str) or not f["name"]:
                raise bad(f"'{cw}.function.name' must be a non-empty string", param=f"{cw}.function.name")
            cid = c.get("id")
            if cid is not None and not isinstance(cid, str):
                raise bad(f"'{cw}.id' must be a string", param=f"{cw}.id", code="invalid_type")
            out.append({"id": cid or f"call_{i}_{j}", "type": "function",
                        "function": {"name": f["name"],
                                     "arguments": tool_arguments(f.get("arguments", "{}"), f"{cw}.function.arguments")}})
        return {"role": "assistant", "content": content or "", "tool_calls": out}
    content = _text_content(m.get("content"), where)
    if role == "tool":
        tid = m.get("tool_call_id")
        if not isinstance(tid, str) or not tid:
            raise bad(f"'{where}.tool_call_id' is required for a tool message", param=f"{where}.tool_call_id",
                      code="missing_required_parameter")
        msg = {"role": "tool", "content": content, "tool_call_id": tid}
        if name:
            msg["name"] = name
        return msg
    return {"role": "system" if role == "developer" else role, "content": content}


def check_history(msgs: list[dict]) -> list[dict]:
    """A tool message answers a call made earlier in the conversation; it gets that
    call's function name (templates that print it read message.name)."""
    names = {}
    for i, m in enumerate(msgs):
        for c in m.get("tool_calls", ()):
            names[c["id"]] = c["function"]["name"]
        if m["role"] == "tool":
            n = names.get(m["tool_call_id"])
            if n is None:
                raise bad(f"'messages[{i}].tool_call_id' ({m['tool_call_id']!r}) answers no tool call of an "
                          f"earlier assistant message", param=f"messages[{i}].tool_call_id")
            m.setdefault("name", n)
    return msgs


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad(f"'{name}' must be a number", param=name, code="invalid_type")
    v = float(v)
    if not math.isfinite(v):
        raise bad(f"'{name}' must be finite", param=name)
    return v


def _opt_number(obj: dict, name: str, default: float, lo: float, hi: float) -> float:
    v = obj.get(name)
    if v is None:
        return default
    v = _number(v, name)
    if not lo <= v <= hi:
        raise bad(f"'{name}' must be in [{lo:g}, {hi:g}], got {v:g}", param=name)
    return v


def _opt_bool(obj: dict, name: str, param: str | None = None) -> bool:
    v = obj.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad(f"'{param or name}' must be a boolean", param=param or name, code="invalid_type")
    return v


def _max_tokens(v, name: str) -> int:
    if not _is_int(v):
        raise bad(f"'{name}' must be an integer", param=name, code="invalid_type")
    if v < 1:
        raise bad(f"'{name}' must be at least 1, got {v}", param=name)
    if v > MAX_TOKENS_LIMIT:
        raise bad(f"'{name}' is too large ({v})", param=name)
    return v
