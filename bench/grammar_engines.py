"""Grammar engines for structured output, side by side on one vocabulary.

For each engine that imports (llguidance, xgrammar, outlines-core): the time to build
its tokenizer index over the model's vocabulary, the time to compile a JSON schema,
the time of one token mask while a schema-valid document is fed token by token (the
per-step cost a constrained decode pays), and which JSON-schema features compile.

    python bench/grammar_engines.py [MODEL.gguf] [--json]

MODEL defaults to the default model (~/.cache/minfer/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf).
The tokenizer is minfer's (rebuilt from the GGUF); each engine gets the tokens' raw
bytes. xgrammar needs torch and transformers at import; install it beside them with
`pip install --no-deps xgrammar apache-tvm-ffi` to try it without pulling triton.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from importlib.metadata import version

import numpy as np

from minfer.tokenizer import TOKEN_TYPE_UNUSED, Tokenizer

DEFAULT_MODEL = os.path.expanduser("~/.cache/minfer/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                                                                                          "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "email", "tags", "address", "role"],
    "additionalProperties": False,
}
DOC = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "tags": ["math", "engines", "poetry"],
       "address": {"city": "London", "zip": "12345"}, "role": "admin"}

# Feature -> (schema, a document valid against it, one that is not). An engine
# "enforces" a feature when its mask lets the valid document through to an accepting
# end and stops the invalid one; it may also compile a schema and not enforce a keyword.
FEATURES = {
    "enum/const": ({"enum": ["a", "b", 3]}, '"b"', '"c"'),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "string"}]}, '"x"', "true"),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "boolean"}]}, "true", '"x"'),
    "allOf": ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"required": ["a"]}]},
              '{"a":1}', '{}'),
    "$ref (local)": ({"$defs": {"p": {"type": "integer"}}, "type": "object", "properties": {"x": {"$ref": "#/$defs/p"}}},
                     '{"x":2}', '{"x":"2"}'),
    "$ref (recursive)": ({"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
        "$ref": "#/$defs/node"}, '{"v":1,"kids":[{"v":2,"kids":[]}]}', '{"v":1,"kids":[{"v":"a"}]}'),
    "pattern": ({"type": "string", "pattern": "^[a-z]+-[0-9]{2,4}$"}, '"ab-123"', '"ab-1"'),
    "format: date-time": ({"type": "string", "format": "date-time"}, '"2024-01-02T03:04:05Z"', '"yesterday"'),
    "minLength/maxLength": ({"type": "string", "minLength": 2, "maxLength": 5}, '"abc"', '"abcdef"'),
    "minimum/maximum (int)": ({"type": "integer", "minimum": -5, "maximum": 300}, "299", "301"),
    "exclusiveMinimum (number)": ({"type": "number", "exclusiveMinimum": 0.5}, "0.75", "0.5"),
    "minItems/maxItems": ({"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
                          "[1,2]", "[1]"),
    "prefixItems (tuple)": ({"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}],
                             "items": False}, '[1,"a"]', '[1,2]'),
    "additionalProperties schema": ({"type": "object", "additionalProperties": {"type": "integer"}},
                                    '{"k":1}', '{"k":"v"}'),
    "additionalProperties false": ({"type": "object", "properties": {"a": {"type": "integer"}},
                                    "additionalProperties": False}, '{"a":1}', '{"b":1}'),
    "required": ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                  "required": ["b"]}, '{"b":1}', '{"a":1}'),
    "type list (nullable)": ({"type": ["string", "null"]}, "null", "1"),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1,2]", "[1,1]"),
}


def vocab(tok: Tokenizer) -> tuple[list[bytes], list[int]]:
    """Each token's bytes (specials as their text) and the special ids; unused
    placeholder tokens get b"" (never allowed)."""
    toks, special = [], []
    for i in range(tok.n_vocab):
        b = tok.token_bytes(i)
        ty = tok.token_type(i)
        if ty == TOKEN_TYPE_UNUSED:
            toks.append(b"")
        elif tok.is_special(i):
            toks.append(b)
            special.append(i)
        else:
            toks.append(b)
    return toks, special


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok: Tokenizer):
        from minfer.grammar import GrammarEngine

        self.version = version("llguidance")
        self.eos = tok.eos_id
        self.engine = GrammarEngine(tok)
        self.engine.lltokenizer()

    def compile(self, schema: dict):
        return self.engine.json_schema(schema)

    def matcher(self, compiled):
        return compiled.matcher()

    def mask(self, m) -> np.ndarray:
        return m.allowed()

    def accept(self, m, t: int) -> None:
        m.accept(t)


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok: Tokenizer):
        import xgrammar as xgr

        self.xgr = xgr
        self.version = version("xgrammar")
        self.eos = tok.eos_id
        toks, _ = vocab(tok)
        info = xgr.TokenizerInfo(toks, vocab_type=xgr.VocabType.RAW, vocab_size=tok.n_vocab,
                                 stop_token_ids=sorted(tok.eot_ids))
        self.compiler = xgr.GrammarCompiler(info, max_threads=2)
        self.n_vocab = tok.n_vocab
        self.bitmask = xgr.allocate_token_bitmask(1, tok.n_vocab)

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=True)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def mask(self, m) -> np.ndarray:
        m.fill_next_token_bitmask(self.bitmask)
        bm = self.bitmask.numpy()[0]
        return np.unpackbits(bm.view(np.uint8), bitorder="little")[:self.n_vocab].astype(bool)

    def accept(self, m, t: int) -> None:
        assert m.accept_token(t)


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tok: Tokenizer):
        import outlines_core
        from outlines_core import Vocabulary

        self.oc = outlines_core
        self.version = version("outlines-core")
        toks, special = vocab(tok)
        self.eos = eos = tok.eos_id
        mapping: dict = {}
        sp = set(special)
        for i, b in enumerate(toks):
            if not b or i in sp:
                continue
            mapping.setdefault(b, []).append(i)
        self.vocabulary = Vocabulary(eos, mapping)
        self.n_vocab = tok.n_vocab

    def compile(self, schema: dict):
        from outlines_core import Index
        from outlines_core.json_schema import build_regex_from_schema

        regex = build_regex_from_schema(json.dumps(schema))
        return Index(regex, self.vocabulary)

    def matcher(self, compiled):
        return self.oc.Guide(compiled)

    def mask(self, m) -> np.ndarray:
        out = np.zeros(self.n_vocab, dtype=bool)
        out[np.asarray(m.get_tokens(), dtype=np.int64)] = True
        return out

    def accept(self, m, t: int) -> None:
        m.advance(t)


def walk(eng, compiled, ids: list[int]) -> bool:
    """Whether the mask lets `ids` through, ending where the grammar may end (one of
    the end-of-generation ids allowed next)."""
    m = eng.matcher(compiled)
    for t in ids:
        if not eng.mask(m)[t]:
            return False
        eng.accept(m, t)
    return bool(eng.mask(m)[eng.eos])


def run_engine(cls, tok: Tokenizer, ids: list[int]) -> dict:
    t0 = time.perf_counter()
    try:
        eng = cls(tok)
    except Exception as e:  # noqa: BLE001 - report an engine that is not installed or fails
        return {"engine": cls.name, "error": f"{type(e).__name__}: {e}"}
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = eng.compile(SCHEMA)
    compile_ms = (time.perf_counter() - t0) * 1000
    masks = []
    m = eng.matcher(compiled)
    for t in ids:
        t0 = time.perf_counter()
        a = eng.mask(m)
        masks.append((time.perf_counter() - t0) * 1000)
        if not a[t]:
            return {"engine": cls.name, "error": f"the document's token {t} was masked out"}
        eng.accept(m, t)
    coverage = {}
    for feat, (schema, good, bad) in FEATURES.items():
        try:
            c = eng.compile(schema)
        except Exception:  # noqa: BLE001
            coverage[feat] = "refused"
            continue
        try:
            ok = walk(eng, c, tok.encode(good)) and not walk(eng, c, tok.encode(bad))
        except Exception:  # noqa: BLE001
            ok = False
        coverage[feat] = "enforced" if ok else "not enforced"
    return {"engine": cls.name, "version": eng.version, "tokenizer_build_s": round(build_s, 3),
            "compile_ms": round(compile_ms, 2), "mask_ms_median": round(statistics.median(masks), 4),
            "mask_ms_mean": round(statistics.fmean(masks), 4), "mask_ms_max": round(max(masks), 4),
            "tokens": len(ids), "coverage": coverage}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    ap.add_argument("--json", action="store_true", help="one JSON object per engine")
    args = ap.parse_args()
    tok = Tokenizer.from_gguf_path(args.model)
    ids = tok.encode(json.dumps(DOC))
    for cls in (LLGuidance, XGrammar, OutlinesCore):
        r = run_engine(cls, tok, ids)
        if args.json:
            print(json.dumps(r))
            continue
        if "error" in r:
            print(f"{r['engine']}: {r['error']}")
            continue
        cov = sum(v == "enforced" for v in r["coverage"].values())
        print(f"{r['engine']} {r['version']}: tokenizer {r['tokenizer_build_s']} s, compile {r['compile_ms']} ms, "
              f"mask median {r['mask_ms_median']} ms (mean {r['mask_ms_mean']}, max {r['mask_ms_max']}) over "
              f"{r['tokens']} tokens; schema features enforced {cov}/{len(FEATURES)}")
        for what in ("refused", "not enforced"):
            names = [k for k, v in r["coverage"].items() if v == what]
            if names:
                print(f"   {what}: " + ", ".join(names))


if __name__ == "__main__":
    main()
