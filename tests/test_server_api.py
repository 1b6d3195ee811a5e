"""The agent-facing API over loopback with random-weight models (whose text means
nothing, so what is checked is the protocol, and structure made by construction):

structured output (response_format json_schema / json_object, llama.cpp's grammar and
json_schema fields) valid against its schema even from a random model, streamed and
not, n > 1; required and named tool calls (chat, responses, messages) that parse and
validate; the Responses API (items, previous_response_id, events); Anthropic's
Messages API (blocks, streaming events, errors in its format); embeddings; several
models behind one endpoint; and every malformed tool, schema or history a 400 in the
API's own error format, never a 500 or a hang."""

from __future__ import annotations

import base64
import json
import sys
import time

import anthropic
import httpx
import jsonschema
import numpy as np
import openai
import pytest

from minfer.testing import write_model
from server_helpers import ServerProcess, free_port

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 3},
    "ok": {"type": "boolean"}},
    "required": ["name", "age", "pets", "ok"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"q": {"type": "string", "maxLength": 8}}, "required": ["q"],
    "additionalProperties": False}}}
TOOLS = [WEATHER, SEARCH]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MSG = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("api") / "tiny.gguf"
    write_model(path, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, ctx=4096)
    return str(path)


@pytest.fixture(scope="module")
def server(model_path):
    # Character-level tokens: the tools' description alone is ~700 of them.
    srv = ServerProcess.custom(model_path, slots=4, ctx=2048, chunk=256, timeout=30)
    yield srv
    code, err = srv.terminate()
    assert code == 0, err
    assert "Traceback" not in err, err


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def aclient(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


# -- structured output ----------------------------------------------------------------------

RF = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


def test_json_schema_output_is_valid_from_a_random_model(client):
    r = client.chat.completions.create(model="tiny", messages=MSG, response_format=RF, temperature=1.0, seed=3,
                                       max_tokens=400, n=2)
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    stream = client.chat.completions.create(model="tiny", messages=MSG, response_format=RF, temperature=1.0, seed=4,
                                            max_tokens=400, stream=True)
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_greedy_constrained_output_is_the_same_streamed_or_not(client):
    kw = dict(model="tiny", messages=MSG, response_format=RF, temperature=0, max_tokens=400)
    whole = client.chat.completions.create(**kw).choices[0].message.content
    streamed = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(**kw, stream=True)
                       if ch.choices)
    assert whole == streamed
    jsonschema.validate(json.loads(whole), SCHEMA)


def test_json_object_and_llama_cpp_fields(client, server):
    r = client.chat.completions.create(model="tiny", messages=MSG, response_format={"type": "json_object"},
                                       temperature=1.0, seed=1, max_tokens=600)
    if r.choices[0].finish_reason == "stop":      # a random object may run past the budget
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = post(server, "/v1/completions", {"prompt": "answer:", "grammar": 'root ::= "yes" | "no"', "max_tokens": 8,
                                         "temperature": 1.0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("yes", "no")
    r = post(server, "/v1/chat/completions", {"messages": MSG, "json_schema": SCHEMA, "max_tokens": 400})
    assert r.status_code == 200
    jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), SCHEMA)


def test_pydantic_parse_with_a_random_model(client):
    from typing import Literal

    from pydantic import BaseModel, Field

    class Pet(BaseModel):
        kind: Literal["cat", "dog"]
        age: int = Field(ge=0, le=30)

    class Owner(BaseModel):
        name: str = Field(max_length=10)
        pets: list[Pet] = Field(max_length=2)

    r = client.chat.completions.parse(model="tiny", messages=MSG, response_format=Owner, temperature=0.7, seed=2,
                                      max_tokens=400)
    assert isinstance(r.choices[0].message.parsed, Owner)


# -- tool calls -----------------------------------------------------------------------------


def _check_calls(calls, names=("get_weather", "search")):
    assert calls
    for c in calls:
        assert c.type == "function" and c.id and c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), PARAMS[c.function.name])


def test_required_tool_call_from_a_random_model(client):
    r = client.chat.completions.create(model="tiny", messages=MSG, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, temperature=1.0, seed=5, max_tokens=300)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    _check_calls(c.message.tool_calls)
    assert len(c.message.tool_calls) == 1


def test_named_tool_call_streams_as_openai_does(client):
    stream = client.chat.completions.create(model="tiny", messages=MSG, tools=TOOLS, temperature=1.0, seed=6,
                                            tool_choice={"type": "function", "function": {"name": "search"}},
                                            max_tokens=300, stream=True)
    calls, finish = {}, None
    for ch in stream:
        for d in ch.choices:
            for tc in d.delta.tool_calls or []:
                e = calls.setdefault(tc.index, {"id": None, "name": "", "args": ""})
                e["id"] = tc.id or e["id"]
                e["name"] += (tc.function.name or "") if tc.function else ""
                e["args"] += (tc.function.arguments or "") if tc.function else ""
            finish = d.finish_reason or finish
    assert finish == "tool_calls" and len(calls) >= 1
    for e in calls.values():
        assert e["id"] and e["name"] == "search"
        jsonschema.validate(json.loads(e["args"]), PARAMS["search"])


def test_a_full_tool_loop_renders_the_history(client):
    r = client.chat.completions.create(model="tiny", messages=MSG, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, temperature=0, max_tokens=300)
    call = r.choices[0].message.tool_calls[0]
    msgs = MSG + [r.choices[0].message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 20}'}]
    r2 = client.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, max_tokens=5, temperature=0)
    assert r2.choices[0].finish_reason in ("stop", "length")
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens + 40        # the call and its result are in the prompt
    r3 = client.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, tool_choice="none", max_tokens=5,
                                        temperature=0)
    assert r3.choices[0].message.tool_calls is None and r3.usage.prompt_tokens < r2.usage.prompt_tokens


def test_max_completion_tokens_user_stream_options_and_ignored_fields(client):
    stream = client.chat.completions.create(model="tiny", messages=MSG, max_completion_tokens=3, user="u-1",
                                            temperature=0, stream=True, stream_options={"include_usage": True},
                                            tools=TOOLS, metadata={"k": "v"}, store=False, service_tier="auto")
    chunks = list(stream)
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1 and usage[0].completion_tokens <= 3
    assert chunks[-1].choices == [] and chunks[0].choices[0].delta.role == "assistant"
    r = client.chat.completions.create(model="tiny", messages=MSG, max_completion_tokens=2, max_tokens=50)
    assert r.usage.completion_tokens <= 2


# -- bad requests: 400s ----------------------------------------------------------------------

BAD = [
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "bogus": 1}}]}, "tools[0].function.bogus"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "nope"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "strict": True, "schema": {"type": "string", "pattern": "(?<=a)b"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "strict": True, "schema": {"type": "array", "uniqueItems": True}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "integer", "minimum": 9, "maximum": 1}}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_object"}, "grammar": "root ::= \"a\""}, "grammar"),
    ({"grammar": "root ::= undefined_rule"}, "grammar"),
    ({"json_schema": {"$ref": "#/nowhere"}}, "json_schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "wrong"}}}}}], "tool_choice": "required"}, "tools"),
    ({"response_format": {"type": "json_object"}, "speculate": "ngram"}, "speculate"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "f", "arguments": "{not json"}}]}]}, "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "f", "arguments": "[1, 2]"}}]}]}, "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "zz", "content": "r"}]},
     "messages[1].tool_call_id"),
    ({"messages": [{"role": "tool", "content": "r"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
    ({"messages": [{"role": "assistant"}]}, "messages[0].content"),
]


@pytest.mark.parametrize("extra,param", BAD)
def test_bad_tools_schemas_and_histories_are_400s(server, extra, param):
    body = {"messages": MSG, "max_tokens": 4, **extra}
    t0 = time.monotonic()
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert time.monotonic() - t0 < 30


def test_the_server_is_fine_after_the_bad_requests(client):
    r = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=3)
    assert r.choices[0].finish_reason in ("stop", "length")


# -- the Responses API -------------------------------------------------------------------------

RTOOLS = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
          for t in TOOLS]


def test_responses_text_items_and_previous_response(client):
    r = client.responses.create(model="tiny", input="hello there", max_output_tokens=6, temperature=0)
    assert r.object == "response" and r.status in ("completed", "incomplete")
    assert r.usage.output_tokens <= 6 and r.usage.input_tokens > 0
    r2 = client.responses.create(model="tiny", previous_response_id=r.id, input="and again", max_output_tokens=4,
                                 instructions="be brief", temperature=0)
    assert r2.previous_response_id == r.id and r2.usage.input_tokens > r.usage.input_tokens
    got = client.responses.retrieve(r2.id)
    assert got.id == r2.id and got.output_text == r2.output_text
    items = [{"role": "user", "content": [{"type": "input_text", "text": "hello there"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": r.output_text}]},
             {"role": "user", "content": "and again"}]
    r3 = client.responses.create(model="tiny", input=items, max_output_tokens=4, instructions="be brief",
                                 temperature=0)
    assert r3.output_text == r2.output_text        # the same conversation, sent whole


def test_responses_function_call_and_output(client):
    r = client.responses.create(model="tiny", input="weather?", tools=RTOOLS, tool_choice="required",
                                parallel_tool_calls=False, temperature=1.0, max_output_tokens=300)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and r.status == "completed"
    jsonschema.validate(json.loads(calls[0].arguments), PARAMS[calls[0].name])
    r2 = client.responses.create(model="tiny", previous_response_id=r.id, tools=RTOOLS, max_output_tokens=4,
                                 input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                         "output": "sunny"}], temperature=0)
    assert r2.status in ("completed", "incomplete")


def test_responses_stream_events(client):
    # Cut by max_output_tokens, a stream ends with response.incomplete, as OpenAI's does
    # (the SDK's stream helper only finishes on response.completed: read the events).
    events = list(client.responses.create(model="tiny", input="hi", max_output_tokens=5, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[1] == "response.in_progress"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    last = events[-1].response
    assert kinds[-1] == "response.incomplete" and last.status == "incomplete"
    assert last.incomplete_details.reason == "max_output_tokens" and last.usage.output_tokens == 5
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == last.output_text
    if text:
        assert "response.output_item.done" in kinds and "response.content_part.done" in kinds
    kinds = []
    with client.responses.stream(model="tiny", input="hi", tools=RTOOLS, temperature=1.0, max_output_tokens=300,
                                 tool_choice={"type": "function", "name": "get_weather"}) as st:
        for ev in st:
            kinds.append(ev.type)
        final = st.get_final_response()
    assert "response.function_call_arguments.done" in kinds
    call = [o for o in final.output if o.type == "function_call"][0]
    jsonschema.validate(json.loads(call.arguments), PARAMS["get_weather"])


def test_responses_json_schema_and_errors(client, server):
    r = client.responses.create(model="tiny", input="a person", temperature=1.0, max_output_tokens=400,
                                text={"format": {"type": "json_schema", "name": "p", "schema": SCHEMA,
                                                 "strict": True}})
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    for body, param in [({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id"),
                        ({"input": [{"type": "web_search_call"}]}, "input[0].type"),
                        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
                        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
                         "input[0].arguments"),
                        ({}, "input")]:
        resp = post(server, "/v1/responses", body)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


# -- the Messages API (Anthropic) ------------------------------------------------------------

ATOOLS = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]


def test_messages_text_and_stream(aclient):
    greedy = {"temperature": 0}     # the SDK no longer has a temperature argument; the API still takes it
    m = aclient.messages.create(model="tiny", max_tokens=6, system="be brief", extra_body=greedy,
                                messages=[{"role": "user", "content": "hello"}])
    assert m.type == "message" and m.role == "assistant" and m.stop_reason in ("end_turn", "max_tokens")
    assert m.usage.output_tokens <= 6
    with aclient.messages.stream(model="tiny", max_tokens=6, system="be brief", extra_body=greedy,
                                 messages=[{"role": "user", "content": "hello"}]) as st:
        text = "".join(st.text_stream)
        final = st.get_final_message()
    assert final.stop_reason == m.stop_reason
    assert text == "".join(b.text for b in m.content if b.type == "text")


def test_messages_tool_use_round_trip(aclient):
    m = aclient.messages.create(model="tiny", max_tokens=300, tools=ATOOLS,
                                tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                messages=[{"role": "user", "content": "weather?"}])
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and len(uses) == 1 and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, PARAMS[uses[0].name])
    m2 = aclient.messages.create(model="tiny", max_tokens=4, tools=ATOOLS, messages=[
        {"role": "user", "content": "weather?"}, {"role": "assistant", "content": m.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "sunny"}]}])
    assert m2.stop_reason in ("end_turn", "max_tokens", "tool_use")
    with aclient.messages.stream(model="tiny", max_tokens=300, tools=ATOOLS,
                                 tool_choice={"type": "tool", "name": "search"},
                                 messages=[{"role": "user", "content": "find"}]) as st:
        final = st.get_final_message()
    uses = [b for b in final.content if b.type == "tool_use"]
    assert uses and all(u.name == "search" for u in uses)
    jsonschema.validate(uses[0].input, PARAMS["search"])


def test_messages_errors_are_anthropic_shaped(aclient, server):
    with pytest.raises(anthropic.BadRequestError) as e:
        aclient.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    r = post(server, "/v1/messages", {"messages": [{"role": "user", "content": "x"}]})   # no max_tokens
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = post(server, "/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
                                      "tools": [{"name": "f", "input_schema": {"type": "object"}}],
                                      "tool_choice": {"type": "tool", "name": "g"}})
    assert r.status_code == 400 and r.json()["type"] == "error"
    n = aclient.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": "hello"}])
    assert n.input_tokens > 0


def test_messages_output_config_json_schema(aclient):
    m = aclient.messages.create(model="tiny", max_tokens=400, messages=[{"role": "user", "content": "a person"}],
                                extra_body={"output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}})
    assert m.stop_reason == "end_turn"
    jsonschema.validate(json.loads(m.content[0].text), SCHEMA)


# -- embeddings --------------------------------------------------------------------------------


def test_embeddings_on_a_generation_model_is_a_clear_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="tiny", input="hello")
    assert e.value.body["code"] == "model_not_embedding" and "not an embedding model" in e.value.body["message"]


@pytest.fixture(scope="module")
def embed_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("emb") / "embed.gguf"
    write_model(path, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, ctx=512, metadata={"qwen2.pooling_type": 3})
    srv = ServerProcess.custom(str(path), slots=2, ctx=256, timeout=30)
    yield srv, str(path)
    code, err = srv.terminate()
    assert code == 0, err
    assert "Traceback" not in err, err


def test_embeddings_batched_normalized_and_the_last_hidden_state(embed_server):
    from minfer.model import Model
    from minfer.session import Session

    srv, path = embed_server
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    texts = ["the cat sat", "on the mat, where it is warm", "x"]
    r = c.embeddings.create(model="embed", input=texts)          # the SDK asks for base64
    vecs = np.array([d.embedding for d in r.data])
    assert vecs.shape == (3, 64) and np.allclose(np.linalg.norm(vecs, axis=1), 1, atol=1e-5)
    assert r.usage.prompt_tokens > 0
    one = c.embeddings.create(model="embed", input=texts[1], encoding_format="float").data[0].embedding
    assert np.allclose(vecs[1], one, atol=1e-6)                    # alone = in a batch
    # Last-token pooling: the normalized final hidden state, whose lm-head product is the logits row.
    m = Model.open(path, n_threads=2)
    ids = m.tokenizer.encode(texts[1])
    logits = Session(m, n_ctx=64).forward(ids, n_out=1)[-1]
    w = np.asarray(m.gguf.tensor_data("output.weight")).view(np.float32).reshape(m.hp.n_vocab, m.hp.n_embd)
    wv = w @ vecs[1]
    assert np.allclose(wv * (wv @ logits) / (wv @ wv), logits, atol=1e-3)
    d = c.embeddings.create(model="embed", input="the cat sat", dimensions=16, encoding_format="float")
    assert len(d.data[0].embedding) == 16 and abs(np.linalg.norm(d.data[0].embedding) - 1) < 1e-5
    raw = httpx.post(srv.url + "/v1/embeddings", json={"input": [[1, 2, 3], "abc"], "encoding_format": "base64"}).json()
    assert len(np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")) == 64
    for body, param in [({"input": ""}, "input"), ({"input": []}, "input"), ({"input": "x", "dimensions": 65},
                                                                             "dimensions"),
                        ({"input": [[10 ** 6]]}, "input"), ({"input": "x", "encoding_format": "hex"},
                                                            "encoding_format")]:
        resp = httpx.post(srv.url + "/v1/embeddings", json=body)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
    resp = httpx.post(srv.url + "/v1/chat/completions", json={"messages": MSG, "max_tokens": 2})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "model_is_embedding"


# -- several models behind one endpoint ---------------------------------------------------------


def test_models_dir_loads_on_demand_and_unloads_the_least_recent(tmp_path):
    d = tmp_path / "models"
    d.mkdir()
    write_model(d / "alpha.gguf", n_embd=64, n_head=4, n_head_kv=2, n_ff=128, seed=1)
    write_model(d / "beta.gguf", n_embd=64, n_head=4, n_head_kv=2, n_ff=128, seed=2)
    write_model(d / "gamma.gguf", n_embd=64, n_head=4, n_head_kv=2, n_ff=128, seed=3, metadata={"qwen2.pooling_type": 1})
    port = free_port()
    srv = ServerProcess([sys.executable, "-m", "minfer.cli", "serve", "--models-dir", str(d), "--models-max", "2",
                         "--port", str(port), "--threads", "2", "--ctx", "128", "--slots", "2"], port)
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert sorted(m.id for m in c.models.list().data) == ["alpha.gguf", "beta.gguf", "gamma.gguf"]
        assert httpx.get(srv.url + "/health").json()["models_loaded"] == []
        kw = dict(messages=MSG, max_tokens=4, temperature=0)
        a = c.chat.completions.create(model="alpha", **kw)
        b = c.chat.completions.create(model="beta.gguf", **kw)
        assert a.model == "alpha.gguf" and b.model == "beta.gguf"
        assert a.choices[0].message.content != b.choices[0].message.content or a.usage == b.usage
        assert sorted(httpx.get(srv.url + "/health").json()["models_loaded"]) == ["alpha.gguf", "beta.gguf"]
        e = c.embeddings.create(model="gamma", input="hi", encoding_format="float")
        assert len(e.data[0].embedding) == 64
        loaded = httpx.get(srv.url + "/health").json()["models_loaded"]
        assert sorted(loaded) == ["beta.gguf", "gamma.gguf"]         # alpha was the least recent
        again = c.chat.completions.create(model="alpha", **kw)
        assert again.choices[0].message.content == a.choices[0].message.content
        with pytest.raises(openai.NotFoundError):
            c.chat.completions.create(model="delta", **kw)
        r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": MSG, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    finally:
        code, err = srv.terminate()
    assert code == 0, err
    assert "Traceback" not in err, err
    assert "Traceback" not in err, err


def test_one_file_named_twice_is_served_once_and_two_files_of_one_name_are_refused(tmp_path):
    """A MODEL that --models-dir also lists is one model; two files of one name are two
    models a request could not tell apart: refused by name before serving."""
    from minfer.errors import MinferError
    from minfer.server.runner import ServeConfig, build

    d = tmp_path / "models"
    d.mkdir()
    write_model(d / "alpha.gguf", n_embd=64, n_head=4, n_head_kv=2, n_ff=128, seed=1)
    _, pool, _ = build(None, ServeConfig(models=[d / "alpha.gguf", d / ".." / "models" / "alpha.gguf"]))
    assert pool.names() == ["alpha.gguf"]
    (tmp_path / "other").mkdir()
    write_model(tmp_path / "other" / "alpha.gguf", n_embd=64, n_head=4, n_head_kv=2, n_ff=128, seed=2)
    with pytest.raises(MinferError, match="two models are named alpha.gguf"):
        build(None, ServeConfig(models=[d / "alpha.gguf", tmp_path / "other" / "alpha.gguf"]))


# -- another family end to end: a Llama 3 model (llama3 tool format) ------------------------------


def test_a_llama3_model_makes_required_calls_in_its_own_format():
    """tests/families.py's tiny random-weight Llama 3 (Llama 3.1's chat template, its
    byte-level vocabulary): a required call is decoded under the llama3 grammar (a bare
    {"name", "parameters"} object), parsed into tool_calls, streamed and not."""
    import families

    path = families.ensure("llama3", types=("Q8_0",))["Q8_0"]
    srv = ServerProcess.custom(str(path), slots=2, ctx=2048, chunk=256, timeout=30)
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        assert c.models.list().data[0].meta["tool_format"] == "llama3"
        r = c.chat.completions.create(model="llama3", messages=MSG, tools=TOOLS, tool_choice="required",
                                      temperature=1.0, seed=7, max_tokens=300)
        assert r.choices[0].finish_reason == "tool_calls"
        _check_calls(r.choices[0].message.tool_calls)
        stream = c.chat.completions.create(model="llama3", messages=MSG, tools=TOOLS, temperature=1.0, seed=8,
                                           tool_choice={"type": "function", "function": {"name": "search"}},
                                           max_tokens=300, stream=True)
        args = "".join(tc.function.arguments or "" for ch in stream for d in ch.choices
                       for tc in d.delta.tool_calls or [] if tc.function)
        jsonschema.validate(json.loads(args), PARAMS["search"])
    finally:
        code, err = srv.terminate()
    assert code == 0, err
    assert "Traceback" not in err, err
