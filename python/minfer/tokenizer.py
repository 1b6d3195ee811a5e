"""Tokenizers rebuilt from a GGUF file's `tokenizer.*` metadata.

GGUF carries no tokenizer.json: only the vocabulary, merges or scores, token types and
special ids. Two models, as llama.cpp names them in tokenizer.ggml.model:

- "gpt2": byte-level BPE with a named pre-tokenizer split (tokenizer.ggml.pre: qwen2,
  llama-bpe, smollm, gpt-2, gpt-4o, ...), rebuilt on top of HF `tokenizers` (fast and
  exact);
- "llama": SentencePiece BPE (Llama 2, Mistral, TinyLlama, CodeLlama, Gemma, Phi-3):
  scores, byte fallback (<0xXX> tokens) and the ▁ space, tokenized exactly as llama.cpp's
  llm_tokenizer_spm does (the highest-scoring adjacent pair merges first, the leftmost on
  a tie; a space prefix at the start and after every special token when
  tokenizer.ggml.add_space_prefix, the default).

Either way we keep our own byte table for decoding so that streaming and whole-text
decode agree byte for byte. Chat templates live in `minfer.chat`; `Tokenizer.render_chat` is the
entry point the engine and CLI use.

Public API
    Tokenizer.from_metadata(metadata) / Tokenizer.from_gguf_path(path)
    tok.encode(text, add_bos=None) -> list[int]     tok.decode(ids) -> str
    tok.token_to_piece(id) -> str (raw vocab spelling, e.g. 'Ġhello')
    tok.token_bytes(id) -> bytes                    tok.id_of(text) -> int
    tok.n_vocab, tok.bos_id, tok.eos_id, tok.eot_ids, tok.add_bos, tok.chat_template
    tok.render_chat(messages, add_generation_prompt=True, **kwargs) -> str
    StreamDecoder(tok).push(id) -> str / .flush() -> str
    format_tokens(tok, ids, pieces) -> str (JSON for `minfer tokenize`)
"""

from __future__ import annotations

import codecs
import heapq
import json
import operator
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from minfer.chat import render_chat as _render_chat
from minfer.errors import GGUFError, MinferError, UnsupportedModelError
from minfer.io.gguf_file import GGUFFile

TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6

# The split regexes each `tokenizer.ggml.pre` value stands for, applied in order (each
# splits the pieces the previous one left, matches and gaps alike, as llama.cpp's
# unicode_regex_split and a tokenizers Sequence of isolated Splits both do), in the form
# the model's own tokenizer.json writes them. llama.cpp knows these by name only, so a
# name we have not verified against its reference tokenizer is refused rather than
# silently tokenized with a wrong split (which would degrade output quietly).
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizer:
    splits: tuple            # regexes, applied in order
    ignore_merges: bool = False  # a whole piece that is a token is taken as is (llama3, tekken)
    add_bos: bool = False    # llama.cpp's default when tokenizer.ggml.add_bos_token is absent


_LLAMA3 = PreTokenizer((_LLAMA3_SPLIT,), ignore_merges=True, add_bos=True)
_DIGITS_GPT2 = PreTokenizer((r"\p{N}", _GPT2_SPLIT))   # llama.cpp's STARCODER / SMOLLM group
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "qwen2": PreTokenizer((_QWEN2_SPLIT,)),
    "llama-bpe": _LLAMA3, "llama3": _LLAMA3, "llama-v3": _LLAMA3,   # Llama 3 / 3.1 / 3.2
    "smollm": _DIGITS_GPT2, "starcoder": _DIGITS_GPT2,               # SmolLM / SmolLM2, StarCoder
    "gpt-2": PreTokenizer((_GPT2_SPLIT,)),
    "gpt-4o": PreTokenizer((_GPT4O_SPLIT,)),                         # Phi-4-mini
    "tekken": PreTokenizer((_TEKKEN_SPLIT,), ignore_merges=True, add_bos=True),  # Mistral Nemo
}
# Texts of end-of-generation tokens across model families, the same list llama.cpp
# falls back on when a GGUF names no eot/eom id. Only those present in a vocab count.
_EOG_TEXTS = (
    "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
    "<|end_of_text|>", "<EOT>", "<｜end▁of▁sentence｜>",
)
# A FIM-trained coder that emits these has left the answer; llama.cpp stops on them too.
_FIM_EOG_TEXTS = ("<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")


class TokenizerError(MinferError, ValueError):
    """Bad input to the tokenizer: an unknown token id or text, a non-string, bad messages."""


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE.

    Printable Latin-1 bytes stand for themselves; the rest (controls, space, 0x7f-0xa0,
    0xad) are shifted to U+0100 upward so every byte has a visible, non-space spelling.
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


_BYTE_TO_CHAR = bytes_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}


# str.translate table turning a byte-alphabet spelling into a latin-1 string of its bytes.
# Low characters that are NOT in the alphabet (space, controls) map to a non-latin-1
# character so the latin-1 encode fails and marks the token as plain text.
_UNSPELL = {ord(c): chr(b) for c, b in _CHAR_TO_BYTE.items()}
_UNSPELL.update({cp: "\U0010ffff" for cp in range(256) if cp not in _UNSPELL})


def _spelled_bytes(token: str) -> bytes | None:
    """The bytes a byte-alphabet token stands for, or None if it is not byte-spelled."""
    try:
        return token.translate(_UNSPELL).encode("latin-1")
    except UnicodeEncodeError:
        return None


def _respell(token: str) -> str:
    """The byte-alphabet spelling of a token stored as plain text (a llama.cpp quirk)."""
    return "".join(_BYTE_TO_CHAR[b] for b in token.encode("utf-8"))


def _str_list(metadata: Mapping[str, Any], key: str) -> list[str]:
    value = metadata.get(key)
    if value is None:
        raise GGUFError(f"metadata key {key!r} is missing; cannot build a tokenizer")
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise GGUFError(f"metadata key {key!r} must be an array of strings, got {type(value).__name__}")
    out = []
    for i, v in enumerate(value):
        if isinstance(v, bytes):
            try:
                v = v.decode("utf-8")
            except UnicodeDecodeError:
                raise GGUFError(f"{key}[{i}] is not valid UTF-8") from None
        if not isinstance(v, str):
            raise GGUFError(f"{key}[{i}] must be a string, got {type(v).__name__}")
        out.append(v)
    return out


def _opt_id(metadata: Mapping[str, Any], key: str, n_vocab: int) -> int | None:
    value = metadata.get(key)
    if value is None:
        return None
    try:
        value = int(value)
    except (TypeError, ValueError):
        raise GGUFError(f"metadata key {key!r} must be an integer token id, got {value!r}") from None
    if not 0 <= value < n_vocab:
        raise GGUFError(f"metadata key {key!r} = {value} is outside the vocabulary [0, {n_vocab})")
    return value


class _Spm:
    """llama.cpp's llm_tokenizer_spm over one fragment of raw text (no special tokens in
    it): split into characters, repeatedly merge the adjacent pair whose concatenation is
    the highest-scoring token (the leftmost on a tie), then emit each symbol's id, or its
    UTF-8 bytes as <0xXX> byte tokens when it is not a token (byte fallback)."""

    def __init__(self, text_to_id: dict, scores: list, byte_ids: list, unk_id: int | None):
        self.text_to_id, self.scores, self.byte_ids, self.unk_id = text_to_id, scores, byte_ids, unk_id

    def encode(self, text: str, out: list) -> None:
        n = len(text)
        if n == 0:
            return
        t2i, scores = self.text_to_id, self.scores
        start = list(range(n))     # symbol i spans text[start[i]:start[i] + size[i]]
        size = [1] * n
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        heap: list = []

        def bigram(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            piece = text[start[left]:start[left] + size[left] + size[right]]
            tid = t2i.get(piece)
            if tid is not None:
                # Max score first, then the leftmost pair (llm_bigram_spm::comparator).
                heapq.heappush(heap, (-scores[tid], left, right, size[left] + size[right]))

        for i in range(1, n):
            bigram(i - 1, i)
        while heap:
            _, left, right, sz = heapq.heappop(heap)
            if size[left] == 0 or size[right] == 0 or size[left] + size[right] != sz:
                continue  # one side was merged away since
            size[left] += size[right]
            size[right] = 0
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            bigram(prev[left], left)
            bigram(left, nxt[left])
        i = 0
        while i != -1:
            piece = text[start[i]:start[i] + size[i]]
            tid = t2i.get(piece)
            if tid is not None:
                out.append(tid)
            else:
                for b in piece.encode("utf-8"):
                    bid = self.byte_ids[b]
                    if bid is None:
                        if self.unk_id is None:
                            raise TokenizerError(f"byte 0x{b:02X} has no <0x{b:02X}> token and there is no unknown token")
                        bid = self.unk_id
                    out.append(bid)
            i = nxt[i]


class Tokenizer:
    """A GGUF vocabulary's tokenizer (byte-level BPE or SentencePiece). Build with
    `from_metadata`."""

    def __init__(
        self,
        tokens: list[str],
        token_types: list[int],
        merges: list[str],
        pre: str,
        bos_id: int | None = None,
        eos_id: int | None = None,
        add_bos: bool = False,
        chat_template: str | None = None,
        extra_eog_ids: Iterable[int] = (),
        *,
        model: str = "gpt2",
        scores: list[float] | None = None,
        add_space_prefix: bool = True,
        unk_id: int | None = None,
    ) -> None:
        if model not in ("gpt2", "llama"):
            raise UnsupportedModelError(f"unsupported tokenizer model tokenizer.ggml.model={model!r}; supported: "
                                        f"gpt2 (byte-level BPE), llama (SentencePiece)")
        if model == "gpt2" and pre not in PRE_TOKENIZERS:
            raise UnsupportedModelError(
                f"unsupported pre-tokenizer tokenizer.ggml.pre={pre!r}; "
                f"supported: {', '.join(sorted(PRE_TOKENIZERS))}"
            )
        if len(token_types) != len(tokens):
            raise GGUFError(
                f"tokenizer.ggml.token_type has {len(token_types)} entries but there are {len(tokens)} tokens"
            )
        if not tokens:
            raise GGUFError("tokenizer.ggml.tokens is empty")

        self.model = model
        self._tokens = tokens
        self._types = token_types
        self.pre = pre
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.add_bos = bool(add_bos)
        self.chat_template = chat_template
        self.add_space_prefix = bool(add_space_prefix) if model == "llama" else False
        self._text_to_id = {tok: i for i, tok in reversed(list(enumerate(tokens)))}

        if model == "gpt2":
            self._init_bpe(tokens, token_types, merges, PRE_TOKENIZERS[pre])
        else:
            self._init_spm(tokens, token_types, scores, unk_id)

        eog = {i for i in (eos_id, *extra_eog_ids) if i is not None}
        for text in (*_EOG_TEXTS, *_FIM_EOG_TEXTS):
            i = self._text_to_id.get(text)
            # llama.cpp takes these texts as end of generation whatever their type (and
            # makes them control tokens); a SentencePiece vocabulary often stores them as
            # user-defined (Gemma's <end_of_turn>, Phi-3's <|end|>).
            if i is not None and token_types[i] in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED):
                eog.add(i)
        self.eot_ids: frozenset[int] = frozenset(eog)

    def _init_bpe(self, tokens: list[str], token_types: list[int], merges: list[str], pre: PreTokenizer) -> None:
        from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        special = {i for i, t in enumerate(token_types) if t in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)}
        # Control/user-defined tokens decode to their literal text; every other token is a
        # byte-alphabet spelling of raw bytes (respelled first if stored as plain text).
        vocab: dict[str, int] = {}
        self._bytes: list[bytes] = []
        for i, tok in enumerate(tokens):
            if i in special:
                vocab.setdefault(tok, i)
                self._bytes.append(tok.encode("utf-8"))
                continue
            raw = _spelled_bytes(tok)
            if raw is None:
                vocab.setdefault(_respell(tok), i)
                raw = tok.encode("utf-8")
            else:
                vocab.setdefault(tok, i)
            self._bytes.append(raw)

        pairs = []
        for k, m in enumerate(merges):
            a, sep, b = m.partition(" ")
            if not sep or not a or not b or " " in b:
                raise GGUFError(f"tokenizer.ggml.merges[{k}] = {m!r} is not two pieces separated by one space")
            pairs.append((a, b))

        model = models.BPE(
            vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="",
            end_of_word_suffix="", fuse_unk=False, byte_fallback=False, ignore_merges=pre.ignore_merges,
        )
        del vocab, pairs  # the BPE model holds its own copy; keep resident memory down
        hf = HFTokenizer(model)
        hf.pre_tokenizer = pre_tokenizers.Sequence([
            *(pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.splits),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        hf.decoder = decoders.ByteLevel()
        # Control tokens are matched whole in the raw text (never normalized or split) so
        # a prompt's `<|im_start|>` is one id, as the chat template intends.
        control = [
            AddedToken(tokens[i], normalized=False, special=True)
            for i in sorted(special) if token_types[i] == TOKEN_TYPE_CONTROL
        ]
        user = [
            AddedToken(tokens[i], normalized=False, special=False)
            for i in sorted(special) if token_types[i] == TOKEN_TYPE_USER_DEFINED
        ]
        if control:
            hf.add_special_tokens(control)
        if user:
            hf.add_tokens(user)
        self._hf = hf
        self._encode_text = lambda text: hf.encode(text, add_special_tokens=False).ids

    def _init_spm(self, tokens: list[str], token_types: list[int], scores: list[float] | None,
                  unk_id: int | None) -> None:
        if scores is None:
            scores = [0.0] * len(tokens)
        if len(scores) != len(tokens):
            raise GGUFError(f"tokenizer.ggml.scores has {len(scores)} entries but there are {len(tokens)} tokens")
        # llama.cpp's token_to_id keeps the last of duplicate texts, and the merge loop
        # looks every text up there, whatever the token's type.
        t2i = {tok: i for i, tok in enumerate(tokens)}
        byte_ids: list = [None] * 256
        self._bytes = []
        for i, (tok, ty) in enumerate(zip(tokens, token_types)):
            if ty == TOKEN_TYPE_BYTE:
                m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", tok)
                if m is None:
                    raise GGUFError(f"byte token {i} is spelled {tok!r}, not <0xXX>")
                b = int(m.group(1), 16)
                if byte_ids[b] is None:
                    byte_ids[b] = t2i.get(f"<0x{b:02X}>", i)
                self._bytes.append(bytes([b]))
            elif ty in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED, TOKEN_TYPE_UNKNOWN):
                self._bytes.append(tok.encode("utf-8"))
            elif ty == TOKEN_TYPE_UNUSED:
                self._bytes.append(b"")
            else:  # normal: ▁ stands for a space
                self._bytes.append(tok.replace("\u2581", " ").encode("utf-8"))
        self._spm = _Spm(t2i, [float(x) for x in scores], byte_ids, unk_id)
        # llama.cpp's special-token partition: control, user-defined and unknown tokens are
        # cut out of the text first, the longest first; the pieces between are SPM text.
        special = sorted({tok for tok, ty in zip(tokens, token_types)
                          if ty in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED, TOKEN_TYPE_UNKNOWN) and tok},
                         key=lambda t: -len(t.encode("utf-8")))
        self._special_re = re.compile("|".join(map(re.escape, special))) if special else None
        self._encode_text = self._encode_spm

    def _encode_spm(self, text: str, first_prefix: bool = True) -> list[int]:
        out: list[int] = []
        prev_special = first_prefix  # prefix the first fragment with a space, like llama.cpp
        pos = 0
        matches = self._special_re.finditer(text) if self._special_re is not None else ()
        for m in (*matches, None):
            end = m.start() if m is not None else len(text)
            if end > pos:
                frag = text[pos:end]
                if self.add_space_prefix and prev_special:
                    frag = " " + frag
                self._spm.encode(frag.replace(" ", "\u2581"), out)
                prev_special = False
            if m is not None:
                out.append(self._text_to_id_last(m.group(0)))
                prev_special = True
                pos = m.end()
        return out

    def _text_to_id_last(self, text: str) -> int:
        return self._spm.text_to_id[text]

    # -- construction --------------------------------------------------------------------
    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> "Tokenizer":
        """Build from GGUF metadata as a plain dict (key -> Python value or numpy array)."""
        model = metadata.get("tokenizer.ggml.model")
        if model is None:
            raise GGUFError("metadata has no tokenizer (tokenizer.ggml.model is missing)")
        if model not in ("gpt2", "llama"):
            raise UnsupportedModelError(
                f"unsupported tokenizer model tokenizer.ggml.model={model!r}; supported: gpt2 (byte-level BPE), "
                f"llama (SentencePiece)"
            )
        pre = metadata.get("tokenizer.ggml.pre")
        if model == "gpt2" and pre is None:
            raise UnsupportedModelError(
                "tokenizer.ggml.pre is missing, so the pre-tokenizer split is unknown; "
                f"supported: {', '.join(sorted(PRE_TOKENIZERS))}"
            )
        if model == "gpt2" and str(pre) not in PRE_TOKENIZERS:
            raise UnsupportedModelError(
                f"unsupported pre-tokenizer tokenizer.ggml.pre={pre!r}; "
                f"supported: {', '.join(sorted(PRE_TOKENIZERS))}"
            )
        tokens = _str_list(metadata, "tokenizer.ggml.tokens")
        merges = _str_list(metadata, "tokenizer.ggml.merges") if model == "gpt2" else []
        raw_types = metadata.get("tokenizer.ggml.token_type")
        if raw_types is None:
            types = [TOKEN_TYPE_NORMAL] * len(tokens)
        else:
            try:
                types = [int(t) for t in raw_types]
            except (TypeError, ValueError):
                raise GGUFError("tokenizer.ggml.token_type must be an array of integers") from None
        scores = None
        if model == "llama":
            raw = metadata.get("tokenizer.ggml.scores")
            if raw is not None:
                try:
                    scores = [float(x) for x in raw]
                except (TypeError, ValueError):
                    raise GGUFError("tokenizer.ggml.scores must be an array of numbers") from None
        n = len(tokens)
        extra = [
            i for i in (_opt_id(metadata, "tokenizer.ggml.eot_token_id", n),
                        _opt_id(metadata, "tokenizer.ggml.eom_token_id", n))
            if i is not None
        ]
        template = metadata.get("tokenizer.chat_template")
        if template is not None and not isinstance(template, str):
            raise GGUFError("tokenizer.chat_template must be a string")
        # llama.cpp's defaults where the file says nothing: SentencePiece adds BOS (ids
        # 1 and 2 for BOS and EOS, 0 unknown) and a space prefix; BPE adds BOS only for
        # the pre-tokenizers that ask for it (Llama 3).
        if model == "llama":
            add_bos_default = True
            bos = _opt_id(metadata, "tokenizer.ggml.bos_token_id", n) if "tokenizer.ggml.bos_token_id" in metadata \
                else (1 if n > 1 else None)
            eos = _opt_id(metadata, "tokenizer.ggml.eos_token_id", n) if "tokenizer.ggml.eos_token_id" in metadata \
                else (2 if n > 2 else None)
            unk = _opt_id(metadata, "tokenizer.ggml.unknown_token_id", n) if "tokenizer.ggml.unknown_token_id" in \
                metadata else 0
        else:
            add_bos_default = PRE_TOKENIZERS[str(pre)].add_bos
            bos = _opt_id(metadata, "tokenizer.ggml.bos_token_id", n)
            eos = _opt_id(metadata, "tokenizer.ggml.eos_token_id", n)
            unk = None
        return cls(
            tokens, types, merges, str(pre) if pre is not None else "default",
            bos_id=bos,
            eos_id=eos,
            add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", add_bos_default)),
            chat_template=template,
            extra_eog_ids=extra,
            model=str(model),
            scores=scores,
            add_space_prefix=bool(metadata.get("tokenizer.ggml.add_space_prefix", True)),
            unk_id=unk,
        )

    @classmethod
    def from_gguf_path(cls, path: str | os.PathLike) -> "Tokenizer":
        """Read only what the tokenizer needs from a GGUF file and build it."""
        return cls.from_metadata(read_gguf_metadata(path))

    # -- vocabulary ------------------------------------------------------------------------
    @property
    def n_vocab(self) -> int:
        return len(self._tokens)

    def _check_id(self, i: Any) -> int:
        if isinstance(i, bool):
            raise TokenizerError("token id must be an integer, got bool")
        try:
            i = operator.index(i)
        except TypeError:
            raise TokenizerError(f"token id must be an integer, got {type(i).__name__}") from None
        if not 0 <= i < len(self._tokens):
            raise TokenizerError(f"token id {i} is outside the vocabulary [0, {len(self._tokens)})")
        return i

    def token_to_piece(self, i: int) -> str:
        """The token's spelling in the vocabulary (byte alphabet: ' hello' is 'Ġhello')."""
        return self._tokens[self._check_id(i)]

    def token_bytes(self, i: int) -> bytes:
        """The raw bytes the token stands for (specials: their UTF-8 text)."""
        return self._bytes[self._check_id(i)]

    def token_type(self, i: int) -> int:
        return self._types[self._check_id(i)]

    def is_special(self, i: int) -> bool:
        return self._types[self._check_id(i)] in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)

    def id_of(self, piece: str) -> int:
        """The id of a vocabulary entry by its spelling ('<|im_end|>', 'Ġhello')."""
        i = self._text_to_id.get(piece)
        if i is None:
            raise TokenizerError(f"{piece!r} is not a token in the vocabulary")
        return i

    # -- text <-> ids ----------------------------------------------------------------------
    def encode(self, text: str, add_bos: bool | None = None, add_space_prefix: bool | None = None) -> list[int]:
        """Token ids of `text`; special-token texts in it become their single ids.

        add_bos=None follows the model (tokenizer.ggml.add_bos_token; absent, llama.cpp's
        default: SentencePiece and Llama 3's BPE add it, others not), except that a text
        which already begins with the BOS token (a chat template that writes bos_token)
        gets no second one, as llama.cpp's chat path strips it. add_space_prefix
        (SentencePiece only): None follows the model; False encodes the text as a
        continuation, with no ▁ put before its first piece.
        """
        if not isinstance(text, str):
            raise TokenizerError(f"text to encode must be a str, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise TokenizerError(f"text is not encodable as UTF-8 at character {e.start}: {e.reason}") from None
        if self.model == "llama" and add_space_prefix is not None:
            ids = self._encode_spm(text, bool(add_space_prefix))
        else:
            ids = self._encode_text(text)
        if self.add_bos if add_bos is None else add_bos:
            if self.bos_id is None:
                raise TokenizerError("add_bos requested but the model defines no BOS token")
            if not (add_bos is None and ids[:1] == [self.bos_id]):
                ids = [self.bos_id, *ids]
        return ids

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        table = self._bytes
        return b"".join(table[self._check_id(i)] for i in ids)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`, special tokens included; invalid UTF-8 becomes U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    # -- chat ------------------------------------------------------------------------------
    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The model's chat template (else ChatML; template=... overrides) applied to
        `messages` (see minfer.chat); bos_token / eos_token default to the model's."""
        template = kwargs.pop("template", None)
        if template is None:
            template = self.chat_template or None
        if self.bos_id is not None:
            kwargs.setdefault("bos_token", self.token_to_piece(self.bos_id))
        if self.eos_id is not None:
            kwargs.setdefault("eos_token", self.token_to_piece(self.eos_id))
        return _render_chat(messages, add_generation_prompt=add_generation_prompt, template=template, **kwargs)


class StreamDecoder:
    """Turns generated ids into text as they arrive, never emitting half a character.

    A multi-byte character (an emoji, a CJK ideograph) is often split across tokens; its
    leading bytes are held until the rest arrives. Bytes that can never become valid UTF-8
    are emitted as U+FFFD rather than stalling the stream.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._dec.decode(self._tok.token_bytes(token_id), final=False)

    def flush(self) -> str:
        """Whatever is still held (an incomplete character ends as U+FFFD); then reset."""
        out = self._dec.decode(b"", final=True)
        self._dec.reset()
        return out


def format_tokens(tokenizer: Tokenizer, ids: list[int], pieces: bool = False) -> str:
    """JSON for `minfer tokenize`: `[id, ...]`, or with pieces `[[id, piece], ...]`.

    A piece is the token's vocabulary spelling (token_to_piece): lossless and one string
    per id even when a token holds part of a UTF-8 character; a space shows as 'Ġ'.
    """
    if not pieces:
        return json.dumps([int(i) for i in ids])
    return json.dumps([[int(i), tokenizer.token_to_piece(i)] for i in ids], ensure_ascii=False)


def read_gguf_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The metadata of a GGUF file as a plain dict (minfer.io.gguf_file's checked parser)."""
    with GGUFFile.open(os.fspath(path)) as f:
        return dict(f.metadata)
