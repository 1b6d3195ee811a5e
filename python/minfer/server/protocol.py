"""Request validation for the OpenAI-style endpoints: a JSON body in, a checked
request out, or an ApiError that the app answers with an OpenAI error body
({"error": {"message", "type", "param", "code"}}).

Validation is strict: unknown fields, wrong types and out-of-range values are 400s,
never silently ignored, so a client learns at once that a knob it sent does nothing.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from minfer.sampling import SamplingParams

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
           "frequency_penalty", "logprobs", "logit_bias", "speculate", "draft_max"}
MAX_N = 16            # choices per request (each takes a slot)
MAX_LOGPROBS = 20     # OpenAI's bound on top_logprobs
SPECULATE = ("off", "ngram", "draft")   # the request extension's values
DRAFT_MAX_LIMIT = 64
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs"}
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
    req.messages = [_message(m, i) for i, m in enumerate(msgs)]
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


def _message(m, i: int) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad(f"'{where}' must be an object", param=where, code="invalid_type")
    extra = [k for k in m if k not in ("role", "content", "name")]
    if extra:
        raise bad(f"unknown field '{where}.{extra[0]}'", param=f"{where}.{extra[0]}", code="unknown_parameter")
    role = m.get("role")
    if role not in ("system", "developer", "user", "assistant"):
        raise bad(f"'{where}.role' must be one of system, developer, user, assistant",
                  param=f"{where}.role")
    content = m.get("content")
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                    and set(part) <= {"type", "text"}):
                raise bad(f"'{where}.content[{j}]' must be a text part ({{\"type\": \"text\", \"text\": ...}})",
                          param=f"{where}.content", code="invalid_type")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise bad(f"'{where}.content' must be a string or an array of text parts", param=f"{where}.content",
                  code="invalid_type")
    name = m.get("name")
    if name is not None and not isinstance(name, str):
        raise bad(f"'{where}.name' must be a string", param=f"{where}.name", code="invalid_type")
    return {"role": "system" if role == "developer" else role, "content": content}


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
