"""Tool calling: how each model family writes a call, parsed out of its output and,
when the request demands a call, made a grammar so the output can be nothing else.

The chat template renders `tools` and the history's calls and results (as transformers
does); the model answers in its family's own spelling:

  hermes   Qwen2.5 / Qwen3 / Hermes:  <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>
  llama3   Llama 3.1+:  {"name": ..., "parameters": {...}} as the whole answer, or after <|python_tag|>
  mistral  [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]   or   [TOOL_CALLS]name[ARGS]{...}
  qwen3coder  Qwen3-Coder:  <tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n</function>\n</tool_call>

`detect(template)` picks the family from the chat template's text (hermes when it names
none). `ToolStream` parses an output as it streams: text that cannot be part of a call
marker is released at once, a call is released when it is complete (hermes: at its
closing tag; the others at the end of the output), and a block that does not parse as
a call is released as text. Non-streaming answers go through the same parser, so both
agree.

`call_grammar(...)` is the Lark grammar (llguidance) of "one or more calls of these
tools with arguments valid against their schemas" in the family's spelling, for
tool_choice "required" or a named function.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass

from minfer.grammar import JSON_WHITESPACE

TOOL_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str          # the arguments object as JSON text


class ToolFormat:
    name = "base"
    starts: tuple[str, ...] = ()    # markers that open a call anywhere in the text
    json_at_start = False           # a bare JSON object as the whole answer is a call

    def new_id(self) -> str:
        return "call_" + secrets.token_hex(12)

    def block_end(self, buf: str) -> int | None:
        """Where the call block at the start of buf ends (None: not yet / at the end)."""
        return None

    def parse_block(self, block: str, schemas: dict | None = None) -> list[tuple[str, dict]] | None:
        """(name, arguments) of each call in a block, or None when it is not calls.
        schemas: each tool's parameters schema by name (formats that write values as
        text type them by it)."""
        raise NotImplementedError

    def grammar(self, tools: list[dict], parallel: bool, ref, lenient: bool) -> str:
        raise NotImplementedError


def _args_of(obj) -> dict | None:
    if isinstance(obj, str):
        try:
            obj = json.loads(obj)
        except ValueError:
            return None
    return obj if isinstance(obj, dict) else None


def _call_of(obj, args_keys=("arguments", "parameters")) -> tuple[str, dict] | None:
    if not isinstance(obj, dict):
        return None
    if obj.get("type") == "function" and isinstance(obj.get("function"), dict):
        obj = obj["function"]
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    for k in args_keys:
        if k in obj:
            args = _args_of(obj[k])
            return (name, args) if args is not None else None
    return (name, {})


def _json_values(text: str) -> list | None:
    """The JSON values of text written one after another (separated by whitespace, ';'
    or ','), or None when anything else is there."""
    dec = json.JSONDecoder()
    out, i, n = [], 0, len(text)
    while True:
        while i < n and text[i] in " \t\r\n;,":
            i += 1
        if i >= n:
            return out
        try:
            v, i = dec.raw_decode(text, i)
        except ValueError:
            return None
        out.append(v)


def _schema(params: dict | None, lenient: bool) -> dict:
    s = dict(params) if isinstance(params, dict) else {"type": "object", "properties": {}}
    s.setdefault("type", "object")
    return s


def _with_ws(schema: dict, lenient: bool) -> dict:
    s = dict(schema)
    xg = dict(s.get("x-guidance") or {})
    xg.setdefault("whitespace_pattern", JSON_WHITESPACE)
    xg.setdefault("lenient", lenient)
    s["x-guidance"] = xg
    return s


def _call_schema(tools: list[dict], args_key: str, lenient: bool) -> dict:
    alts = []
    for t in tools:
        f = t["function"]
        alts.append({"type": "object", "properties": {"name": {"const": f["name"]},
                                                     args_key: _schema(f.get("parameters"), lenient)},
                     "required": ["name", args_key], "additionalProperties": False})
    return alts[0] if len(alts) == 1 else {"anyOf": alts}


def _unfence(text: str) -> str:
    """A JSON answer in a markdown code fence (```json ... ```), unwrapped."""
    t = text.strip()
    if t.startswith("```"):
        t = t[3:]
        if t.startswith("json"):
            t = t[4:]
        t = t.rstrip()
        if t.endswith("```"):
            t = t[:-3]
    return t.strip()


class Hermes(ToolFormat):
    name = "hermes"
    starts = ("<tool_call>",)
    END = "</tool_call>"
    # Small Qwen models often answer a call as a bare (or ```json-fenced) JSON object
    # instead of inside <tool_call>: taken as a call when it names a tool (as llama.cpp does).
    json_at_start = True

    def block_end(self, buf: str) -> int | None:
        if not buf.startswith("<tool_call>"):
            return None               # a bare JSON answer: parsed at the end
        j = buf.find(self.END)
        return None if j < 0 else j + len(self.END)

    def parse_block(self, block: str, schemas: dict | None = None):
        if block.startswith("<tool_call>"):
            body = block[len("<tool_call>"):]
            if body.endswith(self.END):
                body = body[:-len(self.END)]
        else:
            body = _unfence(block)
        vals = _json_values(body.strip())
        if not vals:
            return None
        calls = [_call_of(v) for v in vals]
        return None if any(c is None for c in calls) else calls

    def grammar(self, tools, parallel, ref, lenient):
        schema = json.dumps(_with_ws(_call_schema(tools, "arguments", lenient), lenient))
        rep = ' ("\\n" call)*' if parallel else ""
        return (f"start: call{rep}\n"
                f"call: {ref('<tool_call>')} \"\\n\" args \"\\n\" {ref('</tool_call>')}\n"
                f"args: %json {schema}\n")


class Llama3(ToolFormat):
    name = "llama3"
    starts = ("<|python_tag|>",)
    json_at_start = True

    def parse_block(self, block: str, schemas: dict | None = None):
        body = block[len("<|python_tag|>"):] if block.startswith("<|python_tag|>") else block
        vals = _json_values(body.strip())
        if not vals:
            return None
        calls = [_call_of(v, ("parameters", "arguments")) for v in vals]
        return None if any(c is None for c in calls) else calls

    def grammar(self, tools, parallel, ref, lenient):
        schema = json.dumps(_with_ws(_call_schema(tools, "parameters", lenient), lenient))
        return f"start: args\nargs: %json {schema}\n"


class Mistral(ToolFormat):
    name = "mistral"
    starts = ("[TOOL_CALLS]",)
    ALNUM = string.ascii_letters + string.digits

    def __init__(self, args_tag: bool = False):
        self.args_tag = args_tag      # the [TOOL_CALLS]name[ARGS]{...} spelling (v11 templates)

    def new_id(self) -> str:
        # Mistral's templates insist on 9 alphanumeric characters.
        return "".join(secrets.choice(self.ALNUM) for _ in range(9))

    def parse_block(self, block: str, schemas: dict | None = None):
        calls = []
        for part in block.split("[TOOL_CALLS]")[1:]:
            part = part.strip()
            if "[ARGS]" in part:
                name, _, args = part.partition("[ARGS]")
                name = name.split("[CALL_ID]")[0]        # Mistral Small 3.2 may write its own id
                a = _json_values(args.strip())
                if not name.strip() or not a or len(a) != 1 or not isinstance(a[0], dict):
                    return None
                calls.append((name.strip(), a[0]))
                continue
            vals = _json_values(part)
            if not vals:
                return None
            for v in vals:
                for item in (v if isinstance(v, list) else [v]):
                    c = _call_of(item)
                    if c is None:
                        return None
                    calls.append(c)
        return calls or None

    def grammar(self, tools, parallel, ref, lenient):
        if self.args_tag:
            alts = []
            for t in tools:
                f = t["function"]
                s = json.dumps(_with_ws(_schema(f.get("parameters"), lenient), lenient))
                alts.append(f"{ref('[TOOL_CALLS]')} {json.dumps(f['name'])} {ref('[ARGS]')} %json {s}")
            rep = "+" if parallel else ""
            return "start: (" + " | ".join(f"({a})" for a in alts) + ")" + rep + "\n"
        arr = {"type": "array", "items": _call_schema(tools, "arguments", lenient), "minItems": 1}
        if not parallel:
            arr["maxItems"] = 1
        return f"start: {ref('[TOOL_CALLS]')} args\nargs: %json {json.dumps(_with_ws(arr, lenient))}\n"


class Qwen3Coder(ToolFormat):
    """Qwen3-Coder's XML calls: <tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n
    </function>\n</tool_call>, values as text (typed by the parameter's schema: a
    string stays text, anything else is read as JSON)."""

    name = "qwen3coder"
    starts = ("<tool_call>", "<function=")
    FUNC = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
    PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)

    def block_end(self, buf: str) -> int | None:
        end = "</tool_call>" if buf.startswith("<tool_call>") else "</function>"
        j = buf.find(end)
        return None if j < 0 else j + len(end)

    def parse_block(self, block: str, schemas: dict | None = None):
        funcs = self.FUNC.findall(block)
        if not funcs:
            return None
        rest = self.FUNC.sub("", block).replace("<tool_call>", "").replace("</tool_call>", "")
        if rest.strip():
            return None
        calls = []
        for name, body in funcs:
            name = name.strip()
            props = ((schemas or {}).get(name) or {}).get("properties") or {}
            args = {}
            for pname, raw in self.PARAM.findall(body):
                pname = pname.strip()
                t = (props.get(pname) or {}).get("type")
                if t == "string" or (isinstance(t, list) and "string" in t and raw.strip()[:1] not in "{[\""):
                    args[pname] = raw
                    continue
                try:
                    args[pname] = json.loads(raw)
                except ValueError:
                    args[pname] = raw
            if self.PARAM.sub("", body).strip():
                return None
            calls.append((name, args))
        return calls

    def grammar(self, tools, parallel, ref, lenient):
        rules, alts = [], []
        for k, t in enumerate(tools):
            f = t["function"]
            params = _schema(f.get("parameters"), lenient)
            req = set(params.get("required") or ())
            parts = []
            for j, (pname, ps) in enumerate((params.get("properties") or {}).items()):
                ps = ps if isinstance(ps, dict) else {}
                head = json.dumps(f"<parameter={pname}>\n")
                if ps.get("type") == "string":
                    # Text without "</", then the closing tag, as one lexeme: the text's
                    # own newlines and the one before the tag cannot be confused.
                    rules.append(f"v{k}_{j}: /([^<]|<[^\\/])*\\n<\\/parameter>\\n/")
                    part = f"{head} v{k}_{j}"
                else:
                    rules.append(f"v{k}_{j}: %json {json.dumps(_with_ws(ps, lenient))}")
                    part = f"{head} v{k}_{j} " + json.dumps("\n</parameter>\n")
                parts.append(part if pname in req else f"({part})?")
            body = " ".join([json.dumps(f"<function={f['name']}>\n"), *parts, json.dumps("</function>\n")])
            rules.append(f"f{k}: {body}")
            alts.append(f"f{k}")
        call = f"call: {ref('<tool_call>')} \"\\n\" ({' | '.join(alts)}) {ref('</tool_call>')}"
        rep = ' ("\\n" call)*' if parallel else ""
        return "\n".join([f"start: call{rep}", call, *rules]) + "\n"


FORMATS = {"hermes": Hermes, "llama3": Llama3, "mistral": Mistral, "qwen3coder": Qwen3Coder}


def detect(template: str | None) -> ToolFormat:
    t = template or ""
    if "<function=" in t and "<parameter=" in t:
        return Qwen3Coder()
    if "[TOOL_CALLS]" in t:
        return Mistral(args_tag="[ARGS]" in t)
    if "<tool_call>" in t:
        return Hermes()
    if "<|python_tag|>" in t or ("ipython" in t and "parameters" in t):
        return Llama3()
    return Hermes()


class ToolStream:
    """Splits an output into text and tool calls as it arrives: feed(piece) and
    finish() return items, ("text", str) or ("call", ToolCall). parallel=False keeps
    the first call only (the rest of the output is dropped)."""

    def __init__(self, fmt: ToolFormat, parallel: bool = True, names=None, schemas: dict | None = None):
        self.fmt = fmt
        self.parallel = parallel
        self.names = set(names) if names is not None else None   # a call of another name is text
        self.schemas = schemas
        self.buf = ""
        self.in_call = False
        self.seen_text = False        # non-blank text released (a bare JSON answer is then text)
        self.calls = 0

    def _hold(self) -> int:
        """Characters at the end of buf that may still become a call marker."""
        buf = self.buf
        if self.fmt.json_at_start and not self.seen_text and (
                not buf.strip() or "```json".startswith(buf.lstrip()[:7])):
            return len(buf)
        best = 0
        for m in self.fmt.starts:
            for k in range(min(len(m) - 1, len(buf)), 0, -1):
                if buf.endswith(m[:k]):
                    best = max(best, k)
                    break
        return best

    def _find_start(self) -> int | None:
        buf = self.buf
        if self.fmt.json_at_start and not self.seen_text:
            s = buf.lstrip()
            if s.startswith("{") or s.startswith("```json"):
                return len(buf) - len(s)
        hits = [i for i in (buf.find(m) for m in self.fmt.starts) if i >= 0]
        return min(hits) if hits else None

    def _text(self, s: str, out: list) -> None:
        if s:
            if s.strip():
                self.seen_text = True
            if out and out[-1][0] == "text":
                out[-1] = ("text", out[-1][1] + s)
            else:
                out.append(("text", s))

    def _calls(self, block: str, out: list) -> None:
        if not self.parallel and self.calls:
            return                    # a second call where one was asked for: dropped
        parsed = self.fmt.parse_block(block, self.schemas)
        if parsed is not None and self.names is not None and any(n not in self.names for n, _ in parsed):
            parsed = None
        if parsed is None:
            self._text(block, out)
            return
        for name, args in parsed:
            if not self.parallel and self.calls:
                break
            self.calls += 1
            out.append(("call", ToolCall(self.fmt.new_id(), name, json.dumps(args, ensure_ascii=False))))

    def feed(self, piece: str) -> list:
        self.buf += piece
        out: list = []
        while True:
            if not self.in_call:
                i = self._find_start()
                if i is None:
                    keep = self._hold()
                    self._text(self.buf[:len(self.buf) - keep], out)
                    self.buf = self.buf[len(self.buf) - keep:]
                    return out
                self._text(self.buf[:i], out)
                self.buf = self.buf[i:]
                self.in_call = True
            j = self.fmt.block_end(self.buf)
            if j is None:
                return out
            block, self.buf = self.buf[:j], self.buf[j:]
            self.in_call = False
            self._calls(block, out)

    def finish(self) -> list:
        out: list = []
        if self.in_call:
            self._calls(self.buf, out)
        else:
            self._text(self.buf, out)
        self.buf = ""
        self.in_call = False
        return out


def split_output(fmt: ToolFormat, text: str, parallel: bool = True, names=None,
                 schemas: dict | None = None) -> tuple[str, list[ToolCall]]:
    """A whole output: its text (outside calls, stripped) and its calls."""
    st = ToolStream(fmt, parallel, names, schemas)
    items = st.feed(text) + st.finish()
    content = "".join(v for k, v in items if k == "text")
    calls = [v for k, v in items if k == "call"]
    return (content.strip() if calls else content), calls
