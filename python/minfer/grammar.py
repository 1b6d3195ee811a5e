"""Constrained decoding: grammars compiled to a per-step token mask (llguidance).

A `GrammarEngine` holds one vocabulary's llguidance tokenizer (built once: ~0.6 s for a
152k vocabulary) and compiles grammars: a JSON schema, "any JSON object", a Lark
grammar (llguidance's dialect: `%json {schema}` embeds a schema, `<name>` a special
token), GBNF (llama.cpp's grammar format), or a regex. A compiled `Grammar` is
immutable and checked: a grammar that does not compile, or whose first step allows no
token at all, is a `GrammarError` (the server's 400), never a failure mid-decode.

`Grammar.matcher()` starts one decode's state; `Matcher.allowed()` is the boolean mask
over the model's vocabulary (True = allowed) for the next token and `accept(id)`
advances it. `TokenMask` is the engine's mask hook (engine.Sequence.mask) for a request
of n sequences: one matcher per sequence, kept in step with `seq.ids`, and, when given
an executor, each next mask computed eagerly on a worker thread as soon as a token is
picked (`on_token`), so it is ready while the forward runs (the compiled forward and
llguidance both release the GIL).

Why llguidance: no dependencies (a 3 MB abi3 wheel), a mask in ~20-150 us on a 152k
vocabulary (its lexer walks a token trie; no precomputed per-state token tables, so
compiling a schema takes under a millisecond), an Earley parser (recursive schemas,
Lark and GBNF grammars), and the broadest JSON-schema coverage of the engines we
compared (docs/server-api.md; bench/grammar_engines.py).
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import Executor, Future
from typing import Any

import numpy as np

from minfer.errors import MinferError

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5

# JSON output: whitespace between tokens is bounded, so a model that likes whitespace
# (or a random one) still has to make progress; 0-8 of space, tab, CR, LF.
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,8}"


class GrammarError(MinferError, ValueError):
    """A grammar or schema that cannot be compiled (or allows nothing)."""


def _llg():
    try:
        import llguidance
    except ImportError:  # pragma: no cover - a dependency of minfer
        raise GrammarError("constrained decoding needs the 'llguidance' package (pip install llguidance)") from None
    return llguidance


def _is_special(tok, i: int) -> bool:
    ty = tok.token_type(i)
    b = tok.token_bytes(i)
    return ty == TOKEN_TYPE_CONTROL or (ty == TOKEN_TYPE_USER_DEFINED and b.startswith(b"<") and b.endswith(b">"))


class _Vocab:
    """What llguidance's TokenizerWrapper reads: each token's bytes (special tokens as
    0xFF + their text, so a grammar names them as <|im_end|>; unused placeholders as
    b"": never allowed), the special ids, and an encode function."""

    def __init__(self, tok, n_vocab: int):
        self.eos_token_id = tok.eos_id if tok.eos_id is not None else min(tok.eot_ids, default=0)
        self.bos_token_id = tok.bos_id
        tokens, special = [], []
        for i in range(tok.n_vocab):
            b = tok.token_bytes(i)
            ty = tok.token_type(i)
            if ty == TOKEN_TYPE_UNUSED:
                tokens.append(b"")
            elif _is_special(tok, i):
                tokens.append(b"\xff" + b)
                special.append(i)
            else:
                tokens.append(b)
        tokens += [b""] * (n_vocab - len(tokens))   # rows of the output past the tokenizer's
        self.tokens = tokens
        self.special_token_ids = special
        self._tok = tok

    def __call__(self, text) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        # llguidance encodes pieces of the output (forced text, lexemes), which continue
        # a generation: a SentencePiece vocabulary must not put a ▁ before them.
        return self._tok.encode(text, add_bos=False, add_space_prefix=False)


class GrammarEngine:
    """Compiles grammars for one tokenizer (and the model's vocabulary size, which may
    exceed the tokenizer's). Thread-safe; the llguidance tokenizer is built on first use."""

    def __init__(self, tokenizer, n_vocab: int | None = None):
        self.tokenizer = tokenizer
        self.n_vocab = int(n_vocab if n_vocab is not None else tokenizer.n_vocab)
        if self.n_vocab < tokenizer.n_vocab:
            raise MinferError(f"the model's vocabulary ({self.n_vocab}) is smaller than its tokenizer's "
                              f"({tokenizer.n_vocab})")
        self.eog_ids = sorted(tokenizer.eot_ids)
        self._llt = None
        self._lock = threading.Lock()

    def lltokenizer(self):
        with self._lock:
            if self._llt is None:
                llg = _llg()
                self._llt = llg.LLTokenizer(llg.TokenizerWrapper(_Vocab(self.tokenizer, self.n_vocab)),
                                            n_vocab=self.n_vocab, eos_token=self.eog_ids or None)
            return self._llt

    def token_ref(self, text: str) -> str:
        """How a Lark grammar spells `text`: the special token it is (<[id]>), else the
        string literal."""
        try:
            ids = self.tokenizer.encode(text, add_bos=False)
        except Exception:  # noqa: BLE001
            ids = []
        if len(ids) == 1 and self.tokenizer.token_bytes(ids[0]) == text.encode() and _is_special(self.tokenizer, ids[0]):
            return f"<[{ids[0]}]>"
        return json.dumps(text)

    # -- compiling ---------------------------------------------------------------------
    def json_schema(self, schema: Any, strict: bool = True) -> "Grammar":
        """A JSON value valid against `schema`. strict=False ignores keywords the
        engine does not implement (they are then not enforced) instead of refusing."""
        if schema is True:
            schema = {}
        if not isinstance(schema, dict):
            raise GrammarError("a JSON schema must be an object")
        opts = {"whitespace_pattern": JSON_WHITESPACE, "lenient": not strict}
        try:
            text = _llg().LLMatcher.grammar_from_json_schema(schema, overrides=opts)
        except (ValueError, TypeError) as e:
            raise GrammarError(f"the JSON schema is invalid: {e}") from None
        return self._compile(text, "JSON schema")

    def json_object(self) -> "Grammar":
        """Any JSON object (OpenAI's response_format {"type": "json_object"})."""
        return self.json_schema({"type": "object"})

    def lark(self, text: str) -> "Grammar":
        if not isinstance(text, str) or not text.strip():
            raise GrammarError("a grammar must be a non-empty string")
        return self._compile(_llg().LLMatcher.grammar_from_lark(text), "grammar")

    def gbnf(self, text: str) -> "Grammar":
        """llama.cpp's GBNF (llguidance converts it; Lark text is taken as is)."""
        if not isinstance(text, str) or not text.strip():
            raise GrammarError("a grammar must be a non-empty string")
        try:
            g = _llg().grammar_from("gbnf", text)
        except (ValueError, TypeError, KeyError, IndexError, AssertionError) as e:
            raise GrammarError(f"the grammar does not parse: {e}") from None
        return self._compile(g, "grammar")

    def regex(self, pattern: str) -> "Grammar":
        return self._compile(_llg().LLMatcher.grammar_from_regex(pattern), "regex")

    def _compile(self, text: str, what: str) -> "Grammar":
        try:
            return self._compile_checked(text, what)
        except GrammarError:
            raise
        except (ValueError, TypeError, RuntimeError, OverflowError) as e:   # the engine's own complaint
            raise GrammarError(f"the {what} cannot be compiled: {_first_line(str(e))}") from None

    def _compile_checked(self, text: str, what: str) -> "Grammar":
        llg = _llg()
        llt = self.lltokenizer()
        is_err, msgs = llg.LLMatcher.validate_grammar_with_warnings(text, llt)
        if is_err:
            raise GrammarError(f"the {what} cannot be compiled: {_first_line(msgs[0] if msgs else 'unknown error')}")
        g = Grammar(self, text, warnings=list(msgs))
        m = g.matcher()               # compiles the lexer; a first mask proves something is allowed
        if not m.allowed().any():
            raise GrammarError(f"the {what} allows no output at all")
        return g


def _first_line(msg: str, limit: int = 400) -> str:
    msg = msg.strip()
    return msg if len(msg) <= limit else msg[:limit] + "..."


class Grammar:
    """A compiled, checked grammar; `matcher()` starts a decode over it."""

    def __init__(self, engine: GrammarEngine, text: str, warnings: list[str] | None = None):
        self.engine = engine
        self.text = text
        self.warnings = warnings or []

    def matcher(self) -> "Matcher":
        return Matcher(self)


class Matcher:
    """One decode's grammar state: allowed() -> the next token's mask, accept(id)."""

    def __init__(self, grammar: Grammar):
        llg = _llg()
        self.grammar = grammar
        self.n_vocab = grammar.engine.n_vocab
        self._m = llg.LLMatcher(grammar.engine.lltokenizer(), grammar.text, log_level=0)
        if self._m.is_error():
            raise GrammarError(f"the grammar cannot be compiled: {_first_line(self._m.get_error())}")
        self._words = np.full((self.n_vocab + 31) // 32, -1, dtype=np.int32)
        self.consumed = 0
        self.eog = np.asarray(grammar.engine.eog_ids, dtype=np.int64)

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None

    @property
    def accepting(self) -> bool:
        return self._m.is_accepting()

    def allowed(self) -> np.ndarray:
        """The next token's mask. A matcher in an error state (it cannot happen through
        the engine, whose picks obey the mask) or one whose grammar is complete allows
        the end-of-generation tokens only."""
        m = self._m
        if m.is_error() or m.is_stopped():
            out = np.zeros(self.n_vocab, dtype=bool)
            out[self.eog] = True
            return out
        w = self._words
        m.unsafe_compute_mask_ptr(w.ctypes.data, w.nbytes)   # GIL released inside
        return np.unpackbits(w.view(np.uint8), bitorder="little", count=self.n_vocab).view(bool)

    def accept(self, tid: int) -> bool:
        self.consumed += 1
        if self._m.is_stopped():
            return True
        return self._m.consume_token(int(tid))

    def valid(self, ids: list[int]) -> bool:
        """Whether these tokens, from the start, form a complete output of the grammar."""
        m = _llg().LLMatcher(self.grammar.engine.lltokenizer(), self.grammar.text, log_level=0)
        return m.consume_tokens([int(t) for t in ids]) and m.is_accepting()


class TokenMask:
    """The engine's mask hook (engine.Sequence.mask) for the n sequences of a request.

    Each sequence (by seq.index) gets its own matcher, kept in step with seq.ids when
    called. With an executor, `on_token(index, id)` (call it on the thread that steps the
    engine, right after the pick's event) consumes the token and computes the next mask
    on the executor, while the next forward runs; the hook then only waits for it."""

    def __init__(self, grammar: Grammar, n: int = 1, executor: Executor | None = None):
        self.grammar = grammar
        self.matchers = [grammar.matcher() for _ in range(n)]
        self.executor = executor
        self._next: list[Future | None] = [None] * n
        self.eager_hits = 0          # masks that were ready (or computing) when asked for
        self.sync_masks = 0          # masks computed in the hook

    def on_token(self, index: int, tid: int) -> None:
        if self.executor is None or not 0 <= index < len(self.matchers):
            return
        prev = self._next[index]
        if prev is not None:
            prev.result()
        m = self.matchers[index]
        self._next[index] = self.executor.submit(self._advance, m, tid)

    @staticmethod
    def _advance(m: Matcher, tid: int):
        m.accept(tid)
        return m.consumed, m.allowed()

    def __call__(self, seq) -> np.ndarray:
        i = seq.index
        m = self.matchers[i]
        ids = seq.ids
        fut, self._next[i] = self._next[i], None
        ready = None
        if fut is not None:
            consumed, mask = fut.result()
            if consumed == len(ids):
                ready = mask
        for t in ids[m.consumed:]:          # tokens the eager path did not see
            m.accept(t)
        if ready is not None and m.consumed == len(ids):
            self.eager_hits += 1
            return ready
        self.sync_masks += 1
        return m.allowed()

    def error(self) -> str | None:
        for m in self.matchers:
            if m.error:
                return m.error
        return None


def schema_of(obj: Any) -> str:
    """A schema as compact JSON (for messages and grammars)."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
