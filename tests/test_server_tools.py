"""Tool calls and constrained decoding without a server: each family's parser on
recorded model outputs (whole and streamed piece by piece), the family detected from
the chat template, the grammars of required / named calls (a recorded call passes, a
wrong one does not), and a random-weight model decoding under a grammar: its output
is valid JSON against the schema, or a valid call, by construction."""

from __future__ import annotations

import json

import jsonschema
import pytest

from minfer.engine import Engine, Sequence
from minfer.grammar import GrammarEngine, GrammarError, TokenMask
from minfer.model import Model
from minfer.sampling import SamplingParams
from minfer.server.tools import Hermes, Llama3, Mistral, ToolStream, detect, split_output
from minfer.session import Context
from minfer.tokenizer import Tokenizer

NAMES = ["get_weather", "search"]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 12},
                                                "unit": {"enum": ["c", "f"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"q": {"type": "string", "maxLength": 8}, "n": {"type": "integer", "minimum": 1,
                                                                                   "maximum": 9}},
    "required": ["q", "n"], "additionalProperties": False}}}

# (format, recorded output, expected text, expected calls [(name, args)])
RECORDED = [
    # Qwen2.5 (hermes): one call, the template's own spelling
    (Hermes(), '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "",
     [("get_weather", {"city": "Paris"})]),
    # Qwen2.5: two calls, text before them
    (Hermes(), 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "search", "arguments": {"q": "x", "n": 2}}\n</tool_call>', "Let me check.",
     [("get_weather", {"city": "Paris"}), ("search", {"q": "x", "n": 2})]),
    # Qwen3: thinking, then the call
    (Hermes(), '<think>\nThe user wants the weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
     '"arguments": {"city": "Oslo"}}\n</tool_call>', "<think>\nThe user wants the weather.\n</think>",
     [("get_weather", {"city": "Oslo"})]),
    # Hermes 2 Pro: arguments before the name
    (Hermes(), '<tool_call>\n{"arguments": {"q": "llm"}, "name": "search"}\n</tool_call>', "",
     [("search", {"q": "llm"})]),
    # Qwen2.5-Coder-0.5B often answers a call as fenced JSON
    (Hermes(), '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```', "",
     [("get_weather", {"city": "Paris"})]),
    # a JSON answer that is no call stays text, and so does a block that does not parse
    (Hermes(), '{"answer": 42}', '{"answer": 42}', []),
    (Hermes(), '{"name": "unknown_tool", "arguments": {}}', '{"name": "unknown_tool", "arguments": {}}', []),
    (Hermes(), 'x <tool_call>\n{"name": "search", "arguments": {"q": \n</tool_call> y',
     'x <tool_call>\n{"name": "search", "arguments": {"q": \n</tool_call> y', []),
    (Hermes(), "Plain answer, <b>bold</b> and a < sign.", "Plain answer, <b>bold</b> and a < sign.", []),
    # Llama 3.1 / 3.2: JSON as the whole answer, or after <|python_tag|>
    (Llama3(), '{"name": "get_weather", "parameters": {"city": "Rome"}}', "", [("get_weather", {"city": "Rome"})]),
    (Llama3(), '<|python_tag|>{"name": "search", "parameters": {"q": "a", "n": 1}}', "",
     [("search", {"q": "a", "n": 1})]),
    (Llama3(), '{"type": "function", "name": "search", "parameters": {"q": "b"}}', "", [("search", {"q": "b"})]),
    (Llama3(), 'The weather is {"sunny"}.', 'The weather is {"sunny"}.', []),
    # Mistral v3: a JSON array after [TOOL_CALLS]; v11: name[ARGS]{...}
    (Mistral(), '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Lyon"}, "id": "a1B2c3D4e"}]', "",
     [("get_weather", {"city": "Lyon"})]),
    (Mistral(), '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Lyon"}}, {"name": "search", '
     '"arguments": {"q": "c", "n": 3}}]', "", [("get_weather", {"city": "Lyon"}), ("search", {"q": "c", "n": 3})]),
    (Mistral(args_tag=True), '[TOOL_CALLS]get_weather[ARGS]{"city": "Nice"}[TOOL_CALLS]search[ARGS]{"q": "d"}', "",
     [("get_weather", {"city": "Nice"}), ("search", {"q": "d"})]),
    (Mistral(), "Sure: no tools needed.", "Sure: no tools needed.", []),
]


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("fmt,text,content,calls", RECORDED)
def test_recorded_outputs_parse(fmt, text, content, calls):
    got_text, got_calls = split_output(fmt, text, names=NAMES)
    assert _calls(got_calls) == calls
    assert got_text == content
    assert all(c.id for c in got_calls) and len({c.id for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize("fmt,text,content,calls", RECORDED)
@pytest.mark.parametrize("step", [1, 3, 7])
def test_streamed_pieces_give_the_same_split(fmt, text, content, calls, step):
    st = ToolStream(fmt, True, NAMES)
    items = []
    for i in range(0, len(text), step):
        items += st.feed(text[i:i + step])
    items += st.finish()
    assert _calls([v for k, v in items if k == "call"]) == calls
    streamed = "".join(v for k, v in items if k == "text")
    assert (streamed.strip() if calls else streamed) == content


def test_text_streams_at_once_unless_it_may_start_a_call():
    st = ToolStream(Hermes(), True, NAMES)
    assert st.feed("Hello") == [("text", "Hello")]
    assert st.feed(" wor") == [("text", " wor")]
    assert st.feed("ld <tool") == [("text", "ld ")]        # "<tool" may become <tool_call>
    assert st.feed("box>") == [("text", "<toolbox>")]


def test_parallel_false_keeps_the_first_call():
    text = ('<tool_call>\n{"name": "search", "arguments": {"q": "a"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "search", "arguments": {"q": "b"}}\n</tool_call>')
    _, calls = split_output(Hermes(), text, parallel=False, names=NAMES)
    assert _calls(calls) == [("search", {"q": "a"})]


def test_mistral_ids_are_nine_alphanumerics():
    _, calls = split_output(Mistral(), '[TOOL_CALLS][{"name": "search", "arguments": {}}]', names=NAMES)
    assert len(calls[0].id) == 9 and calls[0].id.isalnum()


def test_family_is_detected_from_the_template(real_model_path):
    qwen = Tokenizer.from_gguf_path(real_model_path).chat_template
    assert detect(qwen).name == "hermes"
    assert detect("{{- '<|python_tag|>' + tool_call.name }} ipython parameters").name == "llama3"
    assert detect("{{ '[TOOL_CALLS][' }}").name == "mistral" and not detect("[TOOL_CALLS][").args_tag
    assert detect("{{ '[TOOL_CALLS]' + name + '[ARGS]' }}").args_tag
    assert detect(None).name == "hermes"


# -- grammars ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def synth_model(tmp_path_factory):
    from minfer.testing import write_model

    path = tmp_path_factory.mktemp("tools") / "tiny.gguf"
    write_model(path, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, ctx=1024)
    return Model.open(path, n_threads=2)


@pytest.fixture(scope="module")
def engine(synth_model):
    return GrammarEngine(synth_model.tokenizer, n_vocab=synth_model.hp.n_vocab)


def _passes(engine, grammar, text: str) -> bool:
    tok = engine.tokenizer
    return grammar.matcher().valid(tok.encode(text, add_bos=False))


@pytest.mark.parametrize("fmt,good,bad", [
    (Hermes(), '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>',
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
    (Llama3(), '{"name": "search", "parameters": {"q": "x", "n": 3}}', '{"name": "search", "parameters": {"q": "x"}}'),
    (Mistral(), '[TOOL_CALLS][{"name": "search", "arguments": {"q": "x", "n": 3}}]',
     '[TOOL_CALLS][{"name": "nope", "arguments": {"q": "x", "n": 3}}]'),
    (Mistral(args_tag=True), '[TOOL_CALLS]search[ARGS]{"q": "x", "n": 3}', '[TOOL_CALLS]search[ARGS]{"q": 1, "n": 3}'),
])
def test_call_grammars_take_a_valid_call_and_refuse_a_wrong_one(engine, fmt, good, bad):
    g = engine.lark(fmt.grammar([WEATHER, SEARCH], True, engine.token_ref, lenient=False))
    assert _passes(engine, g, good)
    assert not _passes(engine, g, bad)
    named = engine.lark(fmt.grammar([SEARCH], False, engine.token_ref, lenient=False))
    assert not _passes(engine, named, good.replace("search", "get_weather")) or "get_weather" in good


def test_qwen_grammar_uses_the_tool_call_token(real_model_path):
    tok = Tokenizer.from_gguf_path(real_model_path)
    eng = GrammarEngine(tok)
    assert eng.token_ref("<tool_call>") == f"<[{tok.id_of('<tool_call>')}]>"
    assert eng.token_ref("hello") == '"hello"'
    g = eng.lark(Hermes().grammar([WEATHER], False, eng.token_ref, lenient=False))
    m = g.matcher()
    first = m.allowed()
    assert first.sum() == 1 and first[tok.id_of("<tool_call>")]


@pytest.mark.parametrize("schema", [
    {"type": "string", "pattern": "(?<=a)b"},          # look-behind: the regex engine has none
    {"type": "nonsense"},
    {"$ref": "#/$defs/missing"},
    {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},   # unimplemented, strict
])
def test_schemas_the_engine_cannot_compile_are_grammar_errors(engine, schema):
    with pytest.raises(GrammarError):
        engine.json_schema(schema, strict=True)


def test_an_unsatisfiable_schema_is_an_error_not_a_stuck_decode(engine):
    with pytest.raises(GrammarError):
        engine.json_schema({"type": "integer", "minimum": 5, "maximum": 1})


def test_unimplemented_keywords_are_ignored_when_not_strict(engine):
    g = engine.json_schema({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, strict=False)
    assert _passes(engine, g, "[1, 1]")


def test_bad_gbnf_and_lark_are_grammar_errors(engine):
    with pytest.raises(GrammarError):
        engine.gbnf('root ::= "a" undefined_rule')
    with pytest.raises(GrammarError):
        engine.lark("start: (\"a\"")
    g = engine.gbnf('root ::= "yes" | "no"')
    assert _passes(engine, g, "yes") and not _passes(engine, g, "maybe")


# -- a random model under a grammar ---------------------------------------------------------

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    "ok": {"type": "boolean"}},
    "required": ["name", "age", "tags", "ok"], "additionalProperties": False}


def _decode(model, grammar, n_seq: int, temperature: float, eager: bool, max_tokens: int = 400):
    from concurrent.futures import ThreadPoolExecutor

    ctx = Context(model, n_ctx=512, n_seq=n_seq)
    eng = Engine(ctx, [ctx.session(i) for i in range(n_seq)], chunk=64)
    ex = ThreadPoolExecutor(1) if eager else None
    masks, seqs = [], []
    prompt = model.tokenizer.encode("give me json")
    for i in range(n_seq):
        mask = TokenMask(grammar, 1, ex)
        masks.append(mask)

        def sink(ev, mask=mask):
            if not ev.done and ev.id is not None:
                mask.on_token(0, ev.id)
        seq = Sequence(prompt, max_tokens, SamplingParams(temperature=temperature, seed=i, top_k=0, top_p=1.0,
                                                          min_p=0.0), mask=mask, sink=sink)
        eng.add(seq, i)
        seqs.append(seq)
    eng.run()
    if ex:
        ex.shutdown()
    return seqs, masks


@pytest.mark.parametrize("eager", [True, False])
def test_random_model_output_is_schema_valid_json(synth_model, engine, eager):
    g = engine.json_schema(SCHEMA)
    seqs, masks = _decode(synth_model, g, 4, 1.0, eager)
    for s in seqs:
        assert s.finish_reason == "eos", s.finish_reason
        doc = json.loads(synth_model.tokenizer.decode(s.ids))
        jsonschema.validate(doc, SCHEMA)
    if eager:
        assert sum(m.eager_hits for m in masks) > 0


def test_random_model_required_call_is_a_valid_call(synth_model, engine):
    fmt = Hermes()
    g = engine.lark(fmt.grammar([WEATHER, SEARCH], False, engine.token_ref, lenient=False))
    seqs, _ = _decode(synth_model, g, 2, 1.0, True)
    for s in seqs:
        text = synth_model.tokenizer.decode(s.ids)
        content, calls = split_output(fmt, text, names=NAMES)
        assert content == "" and len(calls) == 1, text
        spec = {"get_weather": WEATHER, "search": SEARCH}[calls[0].name]["function"]["parameters"]
        jsonschema.validate(json.loads(calls[0].arguments), spec)


def test_a_template_without_tools_gets_them_in_the_system_message(synth_model):
    from types import SimpleNamespace

    from minfer.server.generation import render
    from minfer.server.protocol import parse_chat

    served = SimpleNamespace(tokenizer=synth_model.tokenizer, model=synth_model)
    req = parse_chat({"messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "cold"}], "tools": [WEATHER]})
    text = synth_model.tokenizer.decode(render(served, req))
    assert "<tools>" in text and '"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>' in text
    assert "<tool_response>\ncold\n</tool_response>" in text
    req.tool_choice = "none"
    assert "<tools>" not in synth_model.tokenizer.decode(render(served, req))


@pytest.mark.parametrize("schema", [
    {"type": 5}, {"properties": []}, {"anyOf": "x"}, {"enum": []}, {"$ref": 3}, {"type": "string", "pattern": "["},
    {"type": "string", "minLength": -1}, {"type": "object", "required": "a"}, {"type": "array", "minItems": 5,
                                                                                 "maxItems": 2},
    {"allOf": [{"type": "string"}, {"type": "integer"}]}, {"not": {"type": "string"}},
    {"type": "string", "format": "nonsense"}])
def test_malformed_schemas_are_grammar_errors_with_the_engines_reason(engine, schema):
    with pytest.raises(GrammarError, match="cannot be compiled: .+"):
        engine.json_schema(schema, strict=True)


# -- Qwen3-Coder's XML calls, and the real templates of each family ------------------------------

from minfer.server.tools import Qwen3Coder  # noqa: E402

WRITE = {"type": "function", "function": {"name": "write_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"},
                                     "mode": {"type": "integer"}, "tags": {"type": "array"}},
    "required": ["path", "content"]}}}
CODER_CALL = ('<tool_call>\n<function=write_file>\n<parameter=path>\na.py\n</parameter>\n<parameter=content>\n'
              'if a < b:\n    x = "<tag>"\n\n</parameter>\n<parameter=mode>\n644\n</parameter>\n'
              '<parameter=tags>\n["x", 1]\n</parameter>\n</function>\n</tool_call>')
CODER_ARGS = {"path": "a.py", "content": 'if a < b:\n    x = "<tag>"\n', "mode": 644, "tags": ["x", 1]}


def test_qwen3_coder_calls_are_typed_by_their_schema():
    schemas = {"write_file": WRITE["function"]["parameters"]}
    text, calls = split_output(Qwen3Coder(), "I will write it.\n" + CODER_CALL, names=["write_file"], schemas=schemas)
    assert text == "I will write it." and _calls(calls) == [("write_file", CODER_ARGS)]
    st = ToolStream(Qwen3Coder(), True, ["write_file"], schemas)
    items = [it for i in range(0, len(CODER_CALL), 5) for it in st.feed(CODER_CALL[i:i + 5])] + st.finish()
    assert _calls([v for k, v in items if k == "call"]) == [("write_file", CODER_ARGS)]
    # without <tool_call>, and a string parameter that looks like a number stays a string
    _, calls = split_output(Qwen3Coder(), "<function=write_file>\n<parameter=path>\n42\n</parameter>\n"
                                          "<parameter=content>\nx\n</parameter>\n</function>", schemas=schemas)
    assert _calls(calls) == [("write_file", {"path": "42", "content": "x"})]


def test_qwen3_coder_grammar(real_model_path):
    tok = Tokenizer.from_gguf_path(real_model_path)
    eng = GrammarEngine(tok)
    g = eng.lark(Qwen3Coder().grammar([WRITE, SEARCH], True, eng.token_ref, lenient=False))
    assert g.matcher().valid(tok.encode(CODER_CALL))
    assert not g.matcher().valid(tok.encode(CODER_CALL.replace("644", '"644"')))
    assert not g.matcher().valid(tok.encode(CODER_CALL.replace("<parameter=path>\na.py\n</parameter>\n", "")))


def test_mistral_small_calls_with_their_own_id():
    _, calls = split_output(Mistral(args_tag=True), '[TOOL_CALLS]search[CALL_ID]abcDEF123[ARGS]{"q": "x"}',
                            names=NAMES)
    assert _calls(calls) == [("search", {"q": "x"})]


REAL_TEMPLATES = [
    ("Qwen-Qwen2.5-7B-Instruct.jinja", "hermes"), ("Qwen-Qwen3-0.6B.jinja", "hermes"),
    ("Qwen3-Coder.jinja", "qwen3coder"), ("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja", "hermes"),
    ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", "hermes"),
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", "llama3"), ("meta-llama-Llama-3.2-3B-Instruct.jinja", "llama3"),
    ("meta-llama-Llama-3.3-70B-Instruct.jinja", "llama3"), ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "mistral"),
    ("Mistral-Small-3.2-24B-Instruct-2506.jinja", "mistral"), ("unsloth-mistral-Devstral-Small-2507.jinja", "mistral"),
]


@pytest.mark.parametrize("name,family", REAL_TEMPLATES)
def test_real_templates_detect_their_family_and_render_a_tool_loop(name, family):
    """llama.cpp's copies of real models' chat templates: the family is detected, and a
    conversation with tools, a call (its arguments as the object the templates want)
    and its result renders (Mistral's templates insist on 9-character ids)."""
    from families import template

    from minfer.chat import render_chat
    from minfer.server.protocol import parse_chat

    text = template(name)
    fmt = detect(text)
    assert fmt.name == family
    cid = fmt.new_id() if family == "mistral" else "call_1"
    req = parse_chat({"messages": [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": cid, "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": cid, "content": "sunny"}], "tools": [WEATHER]})
    out = render_chat(req.messages, add_generation_prompt=True, template=text, tools=req.tools, bos_token="<s>",
                      eos_token="</s>")
    assert all(x in out for x in ("get_weather", "Paris", "sunny", "maxLength"))     # the tool and the loop


def test_sentencepiece_vocabulary_under_a_schema():
    """A SentencePiece vocabulary (Mistral's kind): the grammar engine's encoder gives a
    piece of output as a continuation (no ▁ before it), and a decode under a schema
    gives valid JSON."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import families
    from minfer.grammar import _Vocab

    model = Model.open(families.ensure("mistral", ("Q8_0",))["Q8_0"], n_threads=2)
    tok = model.tokenizer
    vocab = _Vocab(tok, model.hp.n_vocab)
    for text in ('{"name": "x"}', "abc", " a"):
        assert vocab(text) == tok.encode(text, add_bos=False, add_space_prefix=False)
        assert tok.decode(vocab(text)) == text
    assert vocab("abc") != tok.encode("abc", add_bos=False)   # the model's own prefix puts a ▁ first
    g = GrammarEngine(tok, n_vocab=model.hp.n_vocab).json_schema(SCHEMA)
    seqs, _ = _decode(model, g, 2, 1.0, True, max_tokens=300)
    for s in seqs:
        assert s.finish_reason == "eos", s.finish_reason
        jsonschema.validate(json.loads(tok.decode(s.ids)), SCHEMA)
