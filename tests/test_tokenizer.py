"""Tokenizer, streaming decode and chat template.

The reference is transformers' own GGUF tokenizer conversion (AutoTokenizer with
gguf_file=...), built independently from the same file. transformers is the `reference`
extra (`bash .ci/run` installs it); without it these tests fail, they never skip.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from minfer.chat import CHATML_TEMPLATE, ChatTemplateError
from minfer.errors import GGUFError, MinferError, UnsupportedModelError
from minfer.tokenizer import (
    StreamDecoder,
    Tokenizer,
    TokenizerError,
    bytes_to_unicode,
    format_tokens,
)

CORPUS_FILE = Path(__file__).parent / "data" / "tokenizer_corpus.txt"


# ---- corpus -----------------------------------------------------------------------------


def _generated_corpus() -> list[str]:
    out: list[str] = []
    for n in range(1, 21):
        digits = "".join(str((i * 7 + n) % 10) for i in range(n))
        out += [digits, f"x{digits}y", f" {digits} "]
    for lead in ("", " ", "  ", "\t", "\n", " \n", "\r\n  "):
        for word in ("hello", "Hello", "HELLO", "éclair", "日本", "😀", "'s", "123"):
            out.append(f"{lead}{word}{lead[::-1]}")
    pools = [
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
        "0123456789", " \t\n\r", "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
        "日本語中文한국어", "Привет", "مرحبا", "नमस्ते", "😀👍🏽🇯🇵👨‍👩‍👧🎉❤️",
        "\u0301\u200d\u00a0\u3000", "éàüß",
    ]
    specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>"]
    rng = random.Random(20240601)
    for _ in range(80):
        parts = []
        for _ in range(rng.randint(1, 12)):
            if rng.random() < 0.05:
                parts.append(rng.choice(specials))
            else:
                pool = rng.choice(pools)
                parts.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 6))))
        out.append("".join(parts))
    return out


def load_corpus() -> list[str]:
    # split("\n"), not splitlines(): the file holds raw U+2028 and friends inside strings.
    lines = CORPUS_FILE.read_text(encoding="utf-8").split("\n")
    handwritten = [json.loads(line) for line in lines if line.strip() and not line.startswith("#")]
    return handwritten + _generated_corpus()


CORPUS = load_corpus()


def test_corpus_is_large_and_varied():
    assert len(CORPUS) >= 200
    assert "" in CORPUS
    assert any("\r\n" in s for s in CORPUS)
    assert any("\u200d" in s for s in CORPUS)  # ZWJ emoji sequences
    assert any("<|im_start|>" in s for s in CORPUS)


# ---- fixtures ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok(real_model_path) -> Tokenizer:
    return Tokenizer.from_gguf_path(real_model_path)


@pytest.fixture(scope="module")
def ref(real_model_path, tmp_path_factory):
    import torch  # noqa: F401  (the [reference] extra; missing is a failure, never a skip)
    import transformers  # noqa: F401
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name

    # The class AutoTokenizer picks for a qwen2 GGUF, looked up the same way it does.
    # Calling it directly skips AutoTokenizer's parse of the whole GGUF for the model
    # config (~30 s on 2 cores); the tokenizer itself is still transformers' own
    # conversion of the file's metadata.
    name = TOKENIZER_MAPPING_NAMES["qwen2"]
    if isinstance(name, tuple):  # transformers 4.x: (slow, fast)
        name = name[-1] or name[0]
    cls = tokenizer_class_from_name(name)
    # from_pretrained wants a directory plus a file name inside it.
    d = tmp_path_factory.mktemp("ref-tok")
    (d / "model.gguf").symlink_to(Path(real_model_path).resolve())
    return cls.from_pretrained(str(d), gguf_file="model.gguf")


def _tiny_metadata(**over) -> dict:
    """A byte-level vocab small enough to build in milliseconds: 256 byte tokens, a few
    merges and their results, three control tokens."""
    table = bytes_to_unicode()
    tokens = [table[b] for b in range(256)]
    merges = ["h e", "l l", "he ll", "Ġ w", "o r"]
    tokens += ["he", "ll", "hell", "Ġw", "or"]
    types = [1] * len(tokens)
    tokens += ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types += [3, 3, 3]
    md = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": len(tokens) - 3,
        "tokenizer.ggml.eos_token_id": len(tokens) - 1,
    }
    md.update(over)
    return {k: v for k, v in md.items() if v is not None}


@pytest.fixture(scope="module")
def tiny() -> Tokenizer:
    return Tokenizer.from_metadata(_tiny_metadata())


# ---- tests against transformers --------------------------------------------------------


def test_ids_match_transformers_on_corpus(tok, ref):
    mismatches = []
    for s in CORPUS:
        ours = tok.encode(s)
        theirs = ref.encode(s, add_special_tokens=False)
        if ours != theirs:
            mismatches.append((s, ours, theirs))
    assert not mismatches, f"{len(mismatches)} of {len(CORPUS)} differ; first: {mismatches[:3]!r}"


def test_decode_matches_transformers_on_corpus(tok, ref):
    for s in CORPUS:
        ids = ref.encode(s, add_special_tokens=False)
        assert tok.decode(ids) == ref.decode(ids) == s, repr(s)


def test_vocabulary_matches_transformers(tok, ref):
    theirs = ref.get_vocab()
    assert len(theirs) == tok.n_vocab
    ours = {tok.token_to_piece(i): i for i in range(tok.n_vocab)}
    assert ours == theirs


def test_special_token_ids_match_transformers(tok, ref):
    assert tok.eos_id == ref.eos_token_id
    assert tok.bos_id == ref.convert_tokens_to_ids(ref.bos_token)
    for text in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "<|fim_middle|>"):
        assert tok.id_of(text) == ref.convert_tokens_to_ids(text)


CONVERSATIONS = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Write hello world in C."}],
    [{"role": "user", "content": "日本語で答えて 😀"}, {"role": "assistant", "content": "はい。"}],
    [{"role": "user", "content": "hi"}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["system+user", "user+assistant", "user-only"])
def test_chat_template_matches_transformers(tok, ref, messages):
    theirs = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.render_chat(messages, add_generation_prompt=True) == theirs
    theirs_nogen = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert tok.render_chat(messages, add_generation_prompt=False) == theirs_nogen


def test_chat_template_with_tools_matches_transformers(tok, ref):
    tools = [{
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city (°C)",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }]
    messages = [
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
        {"role": "tool", "content": "21"},
    ]
    theirs = ref.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    ours = tok.render_chat(messages, add_generation_prompt=True, tools=tools)
    assert ours == theirs
    assert "Zürich" in ours  # tojson keeps non-ASCII as transformers does


# ---- real model, no transformers needed -------------------------------------------------


def test_roundtrip_on_corpus(tok):
    for s in CORPUS:
        assert tok.decode(tok.encode(s)) == s, repr(s)


def test_stream_decoder_reassembles_corpus(tok):
    for s in CORPUS:
        dec = StreamDecoder(tok)
        chunks = [dec.push(i) for i in tok.encode(s)]
        chunks.append(dec.flush())
        for c in chunks:
            assert "\ufffd" not in c, (s, chunks)
            c.encode("utf-8")  # a half surrogate or similar would raise here
        assert "".join(chunks) == s


def test_known_qwen2_ids(tok):
    # Published Qwen2.5 tokenizer outputs, pinned so a regression shows without transformers.
    assert tok.encode("Hello world") == [9707, 1879]
    assert tok.encode("<|im_start|>user\nhi<|im_end|>") == [151644, 872, 198, 6023, 151645]
    assert tok.n_vocab == 151936
    assert tok.token_to_piece(1879) == "Ġworld"


def test_control_tokens_are_single_ids(tok):
    for text in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_prefix|>", "<tool_call>", "</tool_call>"):
        i = tok.id_of(text)
        assert tok.encode(text) == [i]
        assert tok.encode(f"a{text}b")[1:-1] == [i]
        assert tok.decode([i]) == text
    # Only the exact spelling is special.
    assert len(tok.encode("<|IM_START|>")) > 1
    assert len(tok.encode("<|im_start")) > 1


def test_eot_ids(tok):
    assert tok.eos_id == tok.id_of("<|im_end|>")
    assert {tok.id_of("<|im_end|>"), tok.id_of("<|endoftext|>")} <= tok.eot_ids
    assert tok.id_of("<|im_start|>") not in tok.eot_ids
    assert tok.encode("Hello")[0] not in tok.eot_ids


def test_add_bos(tok):
    assert tok.add_bos is False
    assert tok.encode("hi")[0] != tok.bos_id
    assert tok.encode("hi", add_bos=True) == [tok.bos_id, *tok.encode("hi")]


def test_stream_decoder_holds_split_emoji(tok):
    # 😀 is F0 9F 98 80; feed it as four single-byte tokens.
    table = bytes_to_unicode()
    ids = [tok.id_of(table[b]) for b in "😀".encode("utf-8")]
    dec = StreamDecoder(tok)
    assert [dec.push(i) for i in ids] == ["", "", "", "😀"]
    assert dec.flush() == ""


def test_stream_decoder_zwj_sequence_from_bpe(tok):
    s = "👨‍👩‍👧"
    ids = tok.encode(s)
    # BPE cuts the 3-byte ZWJ into two tokens; one of them is not valid UTF-8 alone.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    dec = StreamDecoder(tok)
    out = [dec.push(i) for i in ids]
    assert all("\ufffd" not in c for c in out)
    assert "".join(out) + dec.flush() == s


def test_stream_decoder_invalid_and_truncated_bytes(tok):
    table = bytes_to_unicode()
    dec = StreamDecoder(tok)
    # A lone continuation byte can never become valid: emit U+FFFD instead of stalling.
    assert dec.push(tok.id_of(table[0x80])) + dec.push(tok.id_of("a")) == "\ufffda"
    # A truncated sequence at the end of the stream is flushed as U+FFFD.
    assert dec.push(tok.id_of(table[0xF0])) == ""
    assert dec.flush() == "\ufffd"
    assert dec.push(tok.id_of("b")) == "b"


def test_stream_decoder_special_tokens(tok):
    dec = StreamDecoder(tok)
    ids = tok.encode("ok<|im_end|>")
    assert "".join(dec.push(i) for i in ids) == "ok<|im_end|>"


def test_format_tokens(tok):
    text = "Hi 😀<|im_end|>"
    ids = tok.encode(text)
    assert json.loads(format_tokens(tok, ids, pieces=False)) == ids
    pairs = json.loads(format_tokens(tok, ids, pieces=True))
    assert [p[0] for p in pairs] == ids
    assert [p[1] for p in pairs] == [tok.token_to_piece(i) for i in ids]
    assert pairs[0] == [ids[0], "Hi"]
    assert pairs[-1] == [tok.id_of("<|im_end|>"), "<|im_end|>"]


def test_chat_template_renders_qwen_chatml(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tok.render_chat(messages) == expected
    assert tok.render_chat(messages, add_generation_prompt=False) == expected[: -len("<|im_start|>assistant\n")]
    ids = tok.encode(tok.render_chat(messages))
    assert ids[0] == tok.id_of("<|im_start|>") and ids.count(tok.id_of("<|im_end|>")) == 2


def test_bad_ids_and_text_raise(tok):
    for bad in (-1, tok.n_vocab, 10**12):
        with pytest.raises(TokenizerError):
            tok.decode([bad])
        with pytest.raises(MinferError):
            tok.token_to_piece(bad)
        with pytest.raises(TokenizerError):
            StreamDecoder(tok).push(bad)
    with pytest.raises(TokenizerError):
        tok.decode(["1"])
    with pytest.raises(TokenizerError):
        tok.encode(b"bytes")
    with pytest.raises(TokenizerError):
        tok.encode("lone \ud800 surrogate")
    with pytest.raises(TokenizerError):
        tok.id_of("definitely not a token ∅∅∅")


# ---- small synthetic vocab: construction and errors -------------------------------------


def test_tiny_vocab_merges_and_specials(tiny):
    assert tiny.encode("hell") == [tiny.id_of("hell")]
    assert tiny.encode(" w") == [tiny.id_of("Ġw")]
    assert tiny.encode("<|im_start|>hell") == [tiny.id_of("<|im_start|>"), tiny.id_of("hell")]
    assert tiny.eot_ids == {tiny.id_of("<|im_end|>"), tiny.id_of("<|endoftext|>")}
    for s in ("hello world", "ünï 😀\r\n", ""):
        assert tiny.decode(tiny.encode(s)) == s


def test_tiny_accepts_numpy_token_types():
    import numpy as np
    md = _tiny_metadata()
    md["tokenizer.ggml.token_type"] = np.asarray(md["tokenizer.ggml.token_type"], dtype=np.int32)
    t = Tokenizer.from_metadata(md)
    assert t.encode("<|im_end|>") == [t.eos_id]


def test_add_bos_from_metadata():
    t = Tokenizer.from_metadata(_tiny_metadata(**{"tokenizer.ggml.add_bos_token": True}))
    assert t.encode("he") == [t.bos_id, t.id_of("he")]
    assert t.encode("he", add_bos=False) == [t.id_of("he")]


def test_fallback_chatml_when_no_template(tiny):
    assert tiny.chat_template is None
    out = tiny.render_chat([{"role": "user", "content": "hi"}])
    assert out == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert "im_start" in CHATML_TEMPLATE


def test_template_helpers_and_errors():
    template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
        "{% for m in messages %}  {{ m | tojson }}\n{% endfor %}"
    )
    t = Tokenizer.from_metadata(_tiny_metadata(**{"tokenizer.chat_template": template}))
    # lstrip_blocks/trim_blocks as in transformers; tojson keeps non-ASCII unescaped.
    assert t.render_chat([{"role": "user", "content": "é<b>"}]) == '  {"role": "user", "content": "é<b>"}\n'
    with pytest.raises(ChatTemplateError, match="first must be user"):
        t.render_chat([{"role": "assistant", "content": "x"}])
    for bad in ("not a list", [1], [{"content": "no role"}], [{"role": "user", "content": 5}]):
        with pytest.raises(ChatTemplateError):
            t.render_chat(bad)
    broken = Tokenizer.from_metadata(_tiny_metadata(**{"tokenizer.chat_template": "{% for %}"}))
    with pytest.raises(ChatTemplateError):
        broken.render_chat([{"role": "user", "content": "x"}])


def test_template_sandbox_blocks_python_internals():
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    t = Tokenizer.from_metadata(_tiny_metadata(**{"tokenizer.chat_template": evil}))
    with pytest.raises(MinferError):
        t.render_chat([{"role": "user", "content": "x"}])


@pytest.mark.parametrize(
    "over, exc, match",
    [
        ({"tokenizer.ggml.pre": "command-r"}, UnsupportedModelError, "command-r"),
        ({"tokenizer.ggml.pre": None}, UnsupportedModelError, "pre"),
        ({"tokenizer.ggml.model": "bert"}, UnsupportedModelError, "bert"),
        ({"tokenizer.ggml.model": None}, GGUFError, "tokenizer.ggml.model"),
        ({"tokenizer.ggml.tokens": None}, GGUFError, "tokens"),
        ({"tokenizer.ggml.tokens": "abc"}, GGUFError, "array of strings"),
        ({"tokenizer.ggml.merges": ["h e", "nospace"]}, GGUFError, "merges\\[1\\]"),
        ({"tokenizer.ggml.token_type": [1, 1]}, GGUFError, "token_type"),
        ({"tokenizer.ggml.eos_token_id": 10**6}, GGUFError, "eos_token_id"),
        ({"tokenizer.chat_template": 7}, GGUFError, "chat_template"),
    ],
)
def test_bad_metadata_raises(over, exc, match):
    with pytest.raises(exc, match=match):
        Tokenizer.from_metadata(_tiny_metadata(**over))


def test_from_gguf_path_missing_file(tmp_path):
    with pytest.raises(GGUFError):
        Tokenizer.from_gguf_path(tmp_path / "nope.gguf")


def test_from_gguf_path_synthetic_model(synth_model_path):
    t = Tokenizer.from_gguf_path(synth_model_path)
    assert t.decode(t.encode("the cat sat<|im_end|>")) == "the cat sat<|im_end|>"
    assert t.encode("<|im_end|>") == [t.eos_id]
