"""`minfer serve` over loopback: the official openai client (chat and completions,
streaming and not, usage with cached tokens), greedy output equal to `minfer generate
--chat --temp 0` bitwise, prefix routing and no leaks between slots, OpenAI-style
errors for bad requests, auth, disconnects, idle connections and backend faults."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from minfer.model import Model
from minfer.sampling import SamplingParams
from minfer.session import Session
from minfer.testing import write_model
from server_helpers import ServerProcess

CTX = 256
CHUNK = 16  # small, so most prompts are processed in several chunks riding with others' steps


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("serve") / "tiny.gguf"
    write_model(path, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, ctx=512, types={"ffn_down": "Q8_0"})
    return str(path)


@pytest.fixture(scope="module")
def server(model_path):
    srv = ServerProcess.custom(model_path, slots=4, ctx=CTX, max_queue=64, chunk=CHUNK)
    yield srv
    code, err = srv.terminate()
    assert code == 0, err


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(model_path) -> Model:
    return Model.open(model_path, n_threads=2)


def generate_cli(model_path: str, prompt: str, n: int) -> dict:
    r = subprocess.run([sys.executable, "-m", "minfer.cli", "generate", model_path, prompt, "--chat", "--temp", "0",
                        "-n", str(n), "--ctx", str(CTX), "--threads", "2", "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def reference_reply(model: Model, messages: list[dict], n: int) -> str:
    """A fresh one-sequence Session given the whole conversation (greedy)."""
    tok = model.tokenizer
    ids = tok.encode(tok.render_chat(messages, add_generation_prompt=True))
    return Session(model, n_ctx=CTX).generate(ids, n, SamplingParams(temperature=0.0)).text


def test_openai_chat_non_streaming_and_streaming_agree(client, server):
    msgs = [{"role": "user", "content": "hello there, how are you"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0)
    assert r.object == "chat.completion" and len(r.choices) == 1
    c = r.choices[0]
    assert c.message.role == "assistant" and c.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    stream = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            if ch.delta.content:
                pieces.append(ch.delta.content)
            finish = ch.finish_reason or finish
    assert "".join(pieces) == c.message.content and finish == c.finish_reason
    assert usage.completion_tokens == r.usage.completion_tokens and usage.prompt_tokens == r.usage.prompt_tokens
    # The same prompt again: everything but the last prompt token comes from the slot's KV.
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1


def test_openai_completions_non_streaming_and_streaming(client, model):
    r = client.completions.create(model="tiny", prompt="the cat is on the", max_tokens=6, temperature=0)
    assert r.object == "text_completion" and r.choices[0].finish_reason in ("stop", "length")
    tok = model.tokenizer
    ids = tok.encode("the cat is on the")
    ref = Session(model, n_ctx=CTX).generate(ids, 6, SamplingParams(temperature=0.0))
    assert r.choices[0].text == ref.text and r.usage.completion_tokens == len(ref.ids)
    assert r.usage.prompt_tokens == len(ids)
    chunks = list(client.completions.create(model="tiny", prompt="the cat is on the", max_tokens=6, temperature=0,
                                            stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == ref.text
    # Token ids as the prompt.
    r2 = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0)
    assert r2.choices[0].text == ref.text


def test_models_health_and_metrics(client, server):
    ms = client.models.list()
    assert [m.id for m in ms.data] == ["tiny.gguf"]
    h = httpx.get(server.url + "/health").json()
    assert h["status"] == "ok" and h["slots_idle"] + h["slots_busy"] == 4
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    text = httpx.get(server.url + "/metrics").text
    for name in ("requests_total", "generated_tokens_total", "queue_depth", "slots_busy", "tokens_per_second",
                 "graph_builds_total"):
        assert f"# TYPE minfer_{name} " in text
    assert 'minfer_requests_total{endpoint="/v1/chat/completions",status="200"}' in text


@pytest.mark.parametrize("prompt", ["hello there", "tell me a long story about " + "the cat and the dog " * 12])
def test_greedy_equals_generate_chat_bitwise(client, model_path, prompt):
    ref = generate_cli(model_path, prompt, 16)
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                       max_tokens=16, temperature=0)
    assert r.choices[0].message.content == ref["text"]
    assert r.usage.completion_tokens == len(ref["ids"])
    assert r.usage.prompt_tokens == len(ref["prompt_ids"])


def _log_softmax(x):
    import numpy as np

    x = x.astype(np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def test_openai_logprobs_chat_and_completions(client, model):
    """logprobs / top_logprobs (streamed too) are the row's log-softmax, as the CLI's."""
    import numpy as np

    msgs = [{"role": "user", "content": "count to three"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=5, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    tok = model.tokenizer
    ids = tok.encode(tok.render_chat(msgs, add_generation_prompt=True))
    ref = Session(model, n_ctx=CTX).generate(ids, 5, SamplingParams(temperature=0.0), logprobs=True)
    assert len(content) == len(ref.ids)
    ctx = list(ids)
    for entry, t in zip(content, ref.ids):
        lsm = _log_softmax(Session(model, n_ctx=CTX).forward(ctx)[-1])
        assert abs(entry.logprob - lsm[t]) < 1e-9 and bytes(entry.bytes) == tok.token_bytes(t)
        assert len(entry.top_logprobs) == 3 and abs(entry.top_logprobs[0].logprob - lsm.max()) < 1e-9
        ctx.append(t)
    stream = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=5, temperature=0,
                                            logprobs=True, top_logprobs=3, stream=True)
    streamed = [e.logprob for ch in stream for c in ch.choices if c.logprobs for e in c.logprobs.content]
    assert streamed == [e.logprob for e in content]
    c = client.completions.create(model="tiny", prompt="the cat", max_tokens=4, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == c.usage.completion_tokens
    # Keyed by token text (OpenAI's shape): two byte pieces may share one.
    assert all(1 <= len(t) <= 2 for t in lp.top_logprobs) and all(v <= 0 for v in lp.token_logprobs)
    assert "".join(lp.tokens) == c.choices[0].text and lp.text_offset[0] == 0
    assert np.all(np.diff(lp.text_offset) >= 0)


def test_openai_n_choices_and_penalties(client, model):
    """n choices (one prefill) and presence / frequency penalties and logit_bias, through
    the SDK: greedy choices agree; seeded sampled choices are choice i = seed + i alone."""
    msgs = [{"role": "user", "content": "say something"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) == 1
    one = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0)
    assert r.choices[0].message.content == one.choices[0].message.content
    assert r.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert r.usage.prompt_tokens == one.usage.prompt_tokens
    kw = dict(model="tiny", messages=msgs, max_tokens=6, temperature=1.0, seed=77)
    many = client.chat.completions.create(n=2, **kw)
    second = client.chat.completions.create(**{**kw, "seed": 78})
    assert many.choices[1].message.content == second.choices[0].message.content
    stream = client.chat.completions.create(n=2, stream=True, **kw)
    texts = ["", ""]
    for ch in stream:
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [c.message.content for c in many.choices]
    tok = model.tokenizer
    banned = tok.encode(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=1,
                                                       temperature=0).choices[0].message.content or "x")[0]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=0,
                                       logit_bias={str(banned): -100}, presence_penalty=1.5, frequency_penalty=0.5)
    assert r.choices[0].finish_reason in ("stop", "length")
    ids = tok.encode(tok.render_chat(msgs, add_generation_prompt=True))
    sp = SamplingParams(temperature=0.0, logit_bias=((banned, -100.0),), presence_penalty=1.5, frequency_penalty=0.5)
    assert r.choices[0].message.content == Session(model, n_ctx=CTX).generate(ids, 4, sp).text


def test_sampling_with_a_seed_repeats(client):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "pick some words"}], max_tokens=10,
              temperature=1.0, top_p=0.9, seed=1234, extra_body={"top_k": 20})
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    assert a == b


def test_stop_strings_are_cut(client, model):
    full = client.completions.create(model="tiny", prompt="abc", max_tokens=12, temperature=0).choices[0].text
    assert len(full) >= 4
    stop = full[2:4]
    r = client.completions.create(model="tiny", prompt="abc", max_tokens=12, temperature=0, stop=[stop])
    assert r.choices[0].text == full[: full.index(stop)] and r.choices[0].finish_reason == "stop"


def test_interleaved_conversations_route_to_their_slots_and_do_not_leak(client, model):
    """Four conversations, turns interleaved and concurrent: every reply equals a fresh
    session given that conversation alone; later turns reuse their own slot's KV."""
    convs = [[{"role": "user", "content": f"conversation {i}: " + "abc def " * (i + 1)}] for i in range(4)]
    n = 8

    def turn(i):
        r = client.chat.completions.create(model="tiny", messages=convs[i], max_tokens=n, temperature=0)
        return r.choices[0].message.content, r.usage

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as ex:
        for t in range(3):
            results = list(ex.map(turn, range(4)))
            for i, (text, usage) in enumerate(results):
                assert text == reference_reply(model, convs[i], n), (t, i)
                if t > 0:
                    # The previous turn's prompt (and reply) came from this conversation's slot.
                    assert usage.prompt_tokens_details.cached_tokens >= prev_prompt[i], (t, i)
                convs[i] = convs[i] + [{"role": "assistant", "content": text},
                                       {"role": "user", "content": f"turn {t} of {i}"}]
            prev_prompt = [u.prompt_tokens for _, u in results]


def _post(server, body: bytes | str, path="/v1/chat/completions", headers=None) -> httpx.Response:
    h = {"content-type": "application/json", **(headers or {})}
    return httpx.post(server.url + path, content=body, headers=h, timeout=30)


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize("body,param,status", [
    (b"{not json", None, 400),
    (b"[1, 2]", None, 400),
    (b'{"max_tokens": 1' + b"0" * 5000 + b"}", None, 400),
    (b"[" * 60000, None, 400),
    (b'{"messages": "hi"}', "messages", 400),
    (json.dumps({**CHAT, "max_tokens": "5"}).encode(), "max_tokens", 400),
    (json.dumps({**CHAT, "temperature": "hot"}).encode(), "temperature", 400),
    (json.dumps({**CHAT, "stream": "yes"}).encode(), "stream", 400),
    (json.dumps({**CHAT, "messages": [{"role": "user", "content": 5}]}).encode(), "messages[0].content", 400),
    (json.dumps({**CHAT, "messages": [{"role": "wizard", "content": "x"}]}).encode(), "messages[0].role", 400),
    (json.dumps({**CHAT, "frobnicate": True}).encode(), "frobnicate", 400),
    (json.dumps({**CHAT, "max_tokens": -1}).encode(), "max_tokens", 400),
    (json.dumps({**CHAT, "max_tokens": 10 ** 12}).encode(), "max_tokens", 400),
    (json.dumps({**CHAT, "max_tokens": CTX}).encode(), "max_tokens", 400),
    (json.dumps({**CHAT, "top_p": 1.5}).encode(), "top_p", 400),
    (json.dumps({**CHAT, "n": 0}).encode(), "n", 400),
    (json.dumps({**CHAT, "n": 99}).encode(), "n", 400),
    (json.dumps({**CHAT, "n": 5}).encode(), "n", 400),          # more choices than the 4 slots
    (json.dumps({**CHAT, "logit_bias": {"x": 1}}).encode(), "logit_bias", 400),
    (json.dumps({**CHAT, "logit_bias": {"1": 500}}).encode(), "logit_bias", 400),
    (json.dumps({**CHAT, "logit_bias": {"99999999": 1}}).encode(), "logit_bias", 400),
    (json.dumps({**CHAT, "top_logprobs": 3}).encode(), "top_logprobs", 400),
    (json.dumps({**CHAT, "logprobs": True, "top_logprobs": 30}).encode(), "top_logprobs", 400),
    (json.dumps({**CHAT, "presence_penalty": 3}).encode(), "presence_penalty", 400),
    (json.dumps({"max_tokens": 2}).encode(), "messages", 400),
    (b'{"messages": [{"role": "user", "content": "\xff\xfe bad utf-8"}], "max_tokens": 2}', None, 400),
    (b'{"messages": [{"role": "user", "content": "lone \\ud800 surrogate"}], "max_tokens": 2}', "messages", 400),
    (json.dumps({**CHAT, "messages": [{"role": "user", "content": "word " * 400}]}).encode(), "messages", 400),
    (json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * 70000}]}).encode(), None, 413),
])
def test_bad_requests_get_openai_errors(server, body, param, status):
    r = _post(server, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param
    # ...and the server keeps serving.
    assert _post(server, json.dumps(CHAT)).status_code == 200


def test_completion_bad_requests(server):
    for body, param in [({"prompt": 5}, "prompt"), ({"prompt": [1, "a"]}, "prompt"), ({"prompt": [10 ** 9]}, "prompt"),
                        ({"prompt": "x", "echo": True}, "echo"), ({"prompt": ""}, "prompt")]:
        r = _post(server, json.dumps(body), path="/v1/completions")
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_openai_client_sees_400_as_bad_request(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=-5)
    assert e.value.status_code == 400


def test_idle_and_half_open_connections_are_closed(server):
    # Never sends a request; then one that stops in the middle of its headers; then one
    # whose body never completes. The server drops the first two and answers the third
    # with 408, within its timeouts (2 s here).
    idle = socket.create_connection(("127.0.0.1", server.port))
    half = socket.create_connection(("127.0.0.1", server.port))
    half.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
    body = socket.create_connection(("127.0.0.1", server.port))
    body.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"messa")
    for s in (idle, half, body):
        s.settimeout(10)
    t0 = time.monotonic()
    assert idle.recv(100) == b""
    assert half.recv(100) == b""
    got = body.recv(4096)
    assert got.startswith(b"HTTP/1.1 408")
    assert time.monotonic() - t0 < 9
    for s in (idle, half, body):
        s.close()
    assert _post(server, json.dumps(CHAT)).status_code == 200


def test_disconnect_mid_stream_frees_the_slot(model_path):
    # Far more tokens asked than any machine makes before the close is noticed.
    srv = ServerProcess.custom(model_path, slots=1, ctx=65536, max_queue=4)
    try:
        body = {"messages": [{"role": "user", "content": "go on"}], "max_tokens": 60000, "temperature": 0,
                "stream": True, "ignore_eos": True}
        with httpx.Client(timeout=30) as c:
            with c.stream("POST", srv.url + "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                got = [next(lines) for _ in range(6)]
                assert any(line.startswith("data: ") for line in got)
        # The connection is closed: the slot is free within a step or so.
        end = time.monotonic() + 10
        while httpx.get(srv.url + "/health").json()["slots_busy"] and time.monotonic() < end:
            time.sleep(0.05)
        assert httpx.get(srv.url + "/health").json()["slots_busy"] == 0
        metrics = httpx.get(srv.url + "/metrics").text
        gen = int(next(line.split()[1] for line in metrics.splitlines()
                       if line.startswith("minfer_generated_tokens_total")))
        assert gen < 30000  # cancelled, not run to the end
        r = httpx.post(srv.url + "/v1/chat/completions", json=CHAT, timeout=30)
        assert r.status_code == 200
    finally:
        code, err = srv.terminate()
    assert code == 0, err


def test_api_key(model_path):
    srv = ServerProcess.cli(model_path, "--ctx", "128", "--slots", "1", "--api-key", "sekrit")
    try:
        r = httpx.post(srv.url + "/v1/chat/completions", json=CHAT)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(srv.url + "/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        ok = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekrit", max_retries=0)
        assert ok.chat.completions.create(model="m", messages=CHAT["messages"], max_tokens=2).choices
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="nope", max_retries=0).models.list()
        assert httpx.get(srv.url + "/health").status_code == 200
    finally:
        code, err = srv.terminate()
    assert code == 0, err


def test_backend_fault_fails_only_its_request(model_path):
    """A forward that raises for one request's tokens: that request gets a 500, the
    others in the same batches finish normally and the server keeps serving."""

    from minfer.server import ServeConfig, build
    from minfer.server.runner import uvicorn_server
    from server_helpers import free_port

    m = Model.open(model_path, n_threads=2)
    cfg = ServeConfig(port=free_port(), slots=4, ctx=CTX, log_level="critical")
    app, pool, _ = build(m, cfg)
    sched = pool.single.scheduler
    poison = m.tokenizer.encode("POISON")[0]
    real_run = sched.ctx.run

    def run(tokens, *a, **kw):
        if poison in tokens.tolist():
            raise RuntimeError("injected backend fault")
        return real_run(tokens, *a, **kw)

    sched.ctx.run = run
    server = uvicorn_server(app, cfg, pool)
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    url = f"http://127.0.0.1:{cfg.port}"
    try:
        end = time.monotonic() + 30
        while not server.started and time.monotonic() < end:
            time.sleep(0.05)

        async def go():
            async with httpx.AsyncClient(timeout=60) as c:
                def req(text, stream=False):
                    return c.post(url + "/v1/chat/completions", json={
                        "messages": [{"role": "user", "content": text}], "max_tokens": 12, "temperature": 0,
                        "ignore_eos": True, "stream": stream})
                return await asyncio.gather(req("good one"), req("POISON here"), req("good two"),
                                            req("good three", stream=True))

        rs = asyncio.run(go())
        assert [r.status_code for r in rs] == [200, 500, 200, 200]
        assert rs[1].json()["error"]["type"] == "server_error"
        assert all(r.json()["usage"]["completion_tokens"] == 12 for r in rs[:3:2])
        assert rs[3].text.rstrip().endswith("data: [DONE]")
        r = httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=30)
        assert r.status_code == 200 and sched.alive
    finally:
        server.should_exit = True
        th.join(30)
        sched.stop()
    assert not th.is_alive()
