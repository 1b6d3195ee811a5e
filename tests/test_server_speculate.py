"""`minfer serve` with per-request speculation over loopback: the "speculate" /
"draft_max" extension fields and `serve --speculate ngram` as the default a request
overrides. Greedy text is the same with speculation on and off, streamed or not, alone
or among concurrent speculating and plain requests, at max_tokens boundaries and with
stop strings; usage and /metrics report drafted and accepted tokens; bad values are
OpenAI-style 400s, and the draft-model mode is refused by name."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from minfer.testing import write_model
from server_helpers import ServerProcess

CTX = 256

# Repetitive, code-like prompts: prompt lookup finds their stretches again.
PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(",
    "the cat and the dog " * 6,
    "x = 1\ny = 2\nz = 3\n" * 3 + "rewrite: x = 1\ny =",
    "hello there, how are you",
]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("serve_spec") / "tiny.gguf"
    write_model(path, n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, ctx=512, seed=3,
                types={"ffn_down": "Q8_0"})
    return str(path)


@pytest.fixture(scope="module")
def server(model_path):
    srv = ServerProcess.custom(model_path, slots=4, ctx=CTX, chunk=16)
    yield srv
    code, err = srv.terminate()
    assert code == 0, err


def chat(url: str, prompt: str, n: int = 40, **extra) -> dict:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": n, "temperature": 0,
            "ignore_eos": True, **extra}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def chat_stream(url: str, prompt: str, n: int = 40, **extra) -> tuple[str, str, dict]:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": n, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, **extra}
    pieces, finish, usage = [], None, None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            doc = json.loads(line[6:])
            assert "error" not in doc, doc
            if doc.get("usage"):
                usage = doc["usage"]
            for ch in doc["choices"]:
                pieces.append(ch["delta"].get("content") or "")
                finish = ch["finish_reason"] or finish
    return "".join(pieces), finish, usage


_PLAIN: dict = {}


def plain(url: str, prompt: str, n: int = 40, **extra) -> dict:
    key = (prompt, n, json.dumps(extra, sort_keys=True))
    if key not in _PLAIN:
        _PLAIN[key] = chat(url, prompt, n, **extra)
    return _PLAIN[key]


def text_of(r: dict) -> str:
    return r["choices"][0]["message"]["content"]


def test_same_text_with_speculation_on_and_off(server):
    accepted = 0
    for p in PROMPTS:
        off = plain(server.url, p)
        assert "speculation" not in off["usage"]  # this server does not speculate by default
        on = chat(server.url, p, speculate="ngram")
        assert text_of(on) == text_of(off) and on["choices"][0]["finish_reason"] == "length"
        assert on["usage"]["completion_tokens"] == off["usage"]["completion_tokens"] == 40
        sp = on["usage"]["speculation"]
        assert sp["mode"] == "ngram" and sp["draft_max"] == 8 and 0 <= sp["accepted"] <= sp["drafted"]
        details = on["usage"]["completion_tokens_details"]
        assert details["accepted_prediction_tokens"] == sp["accepted"]
        assert details["rejected_prediction_tokens"] == sp["drafted"] - sp["accepted"]
        accepted += sp["accepted"]
        # Streamed: the accepted tokens arrive as chunks, the text is the same.
        text, finish, usage = chat_stream(server.url, p, speculate="ngram", draft_max=3)
        assert text == text_of(off) and finish == "length" and usage["speculation"]["draft_max"] == 3
    assert accepted > 0  # drafts were verified and kept, not only proposed
    m = httpx.get(server.url + "/metrics").text
    counts = {line.split()[0]: float(line.split()[1]) for line in m.splitlines() if line.startswith("minfer_spec")}
    assert counts["minfer_speculative_accepted_tokens_total"] >= accepted > 0
    assert counts["minfer_speculative_drafted_tokens_total"] >= counts["minfer_speculative_accepted_tokens_total"]


def test_concurrent_mixed_requests_equal_each_alone(server):
    refs = {p: text_of(plain(server.url, p)) for p in PROMPTS}
    jobs = [(p, kind) for kind in ("ngram", "plain", "stream") for p in PROMPTS]

    def run(job):
        p, kind = job
        if kind == "stream":
            return chat_stream(server.url, p, speculate="ngram", draft_max=5)[0]
        return text_of(chat(server.url, p, **({"speculate": "ngram"} if kind == "ngram" else {})))

    with ThreadPoolExecutor(6) as ex:
        got = list(ex.map(run, jobs))
    for (p, kind), text in zip(jobs, got):
        assert text == refs[p], (p, kind)


def test_max_tokens_and_stop_strings_with_speculation(server):
    p = PROMPTS[0]
    full = text_of(plain(server.url, p))
    for n in (1, 3, 7, 12, 23):
        off = plain(server.url, p, n)
        on = chat(server.url, p, n, speculate="ngram", draft_max=6)
        assert text_of(on) == text_of(off) and on["usage"]["completion_tokens"] == n
        assert full.startswith(text_of(on))
    for at in (len(full) // 4, len(full) // 2, 3 * len(full) // 4):
        stop = full[at:at + 2]
        off = plain(server.url, p, stop=[stop])
        on = chat(server.url, p, speculate="ngram", stop=[stop])
        assert text_of(on) == text_of(off) == full[:full.index(stop)]
        assert on["choices"][0]["finish_reason"] == off["choices"][0]["finish_reason"] == "stop"
        assert on["usage"]["completion_tokens"] == off["usage"]["completion_tokens"]
        streamed, finish, _ = chat_stream(server.url, p, speculate="ngram", stop=[stop])
        assert streamed == text_of(off) and finish == "stop"


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize("extra,param,code", [
    ({"speculate": "draft"}, "speculate", "unsupported_parameter"),
    ({"speculate": "fast"}, "speculate", "invalid_value"),
    ({"speculate": True}, "speculate", "invalid_type"),
    ({"speculate": 8}, "speculate", "invalid_type"),
    ({"speculate": "ngram", "draft_max": 0}, "draft_max", "invalid_value"),
    ({"speculate": "ngram", "draft_max": 65}, "draft_max", "invalid_value"),
    ({"speculate": "ngram", "draft_max": "8"}, "draft_max", "invalid_type"),
    ({"speculate": "ngram", "draft_max": 2.5}, "draft_max", "invalid_type"),
    ({"speculate": "off", "draft_max": 4}, "draft_max", "invalid_value"),
    ({"draft_max": 4}, "draft_max", "invalid_value"),  # this server's default is off
])
def test_bad_speculation_fields_are_400(server, extra, param, code):
    for path, body in (("/v1/chat/completions", {**CHAT, **extra}),
                       ("/v1/completions", {"prompt": "hi", "max_tokens": 2, **extra})):
        r = httpx.post(server.url + path, json=body, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param and err["code"] == code
        if extra.get("speculate") == "draft":  # this server has no draft model: it says so
            assert "--draft-model" in err["message"] and "ngram" in err["message"]


def test_server_default_and_request_override(model_path):
    srv = ServerProcess.cli(model_path, "--ctx", str(CTX), "--slots", "2", "--speculate", "ngram", "--draft-max", "4")
    try:
        accepted = 0
        for p in PROMPTS[:3]:
            dflt = chat(srv.url, p)
            off = chat(srv.url, p, speculate="off")
            deeper = chat(srv.url, p, draft_max=8)  # the default mode, a request's own depth
            assert text_of(dflt) == text_of(off) == text_of(deeper)
            assert dflt["usage"]["speculation"]["draft_max"] == 4 and "speculation" not in off["usage"]
            assert deeper["usage"]["speculation"]["draft_max"] == 8
            accepted += dflt["usage"]["speculation"]["accepted"]
        assert accepted > 0
        # Completions take the fields too.
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 20, "temperature": 0,
                                                          "speculate": "off"}, timeout=60)
        assert r.status_code == 200 and "speculation" not in r.json()["usage"]
    finally:
        code, err = srv.terminate()
    assert code == 0, err


@pytest.mark.parametrize("args,needle", [(["--speculate", "draft"], "needs --draft-model"),
                                         (["--speculate", "lots"], "must be ngram, draft or off"),
                                         (["--speculate", "ngram", "--draft-max", "0"], "--draft-max")])
def test_serve_refuses_bad_speculation_options(model_path, args, needle):
    r = subprocess.run([sys.executable, "-m", "minfer.cli", "serve", model_path, "--port", "1", *args],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.fixture(scope="module")
def draft_path(tmp_path_factory) -> str:
    """The target's first layer, embedding and head (same seed, one layer): a draft that
    agrees with the target often but not always."""
    path = tmp_path_factory.mktemp("serve_spec") / "draft.gguf"
    write_model(path, n_layer=1, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, ctx=512, seed=3,
                types={"ffn_down": "Q8_0"})
    return str(path)


def test_draft_model_speculation_per_request(model_path, draft_path, server):
    srv = ServerProcess.cli(model_path, "--ctx", str(CTX), "--slots", "3", "--draft-model", draft_path)
    try:
        drafted = 0
        for p in PROMPTS:
            off = plain(server.url, p)  # the plain server's text (no drafts anywhere)
            on = chat(srv.url, p, speculate="draft", draft_max=4)
            assert text_of(on) == text_of(off)
            sp = on["usage"]["speculation"]
            assert sp["mode"] == "draft" and sp["draft_max"] == 4 and 0 <= sp["accepted"] <= sp["drafted"]
            drafted += sp["drafted"]
            text, _, usage = chat_stream(srv.url, p, speculate="draft")
            assert text == text_of(off) and usage["speculation"]["mode"] == "draft"
        assert drafted > 0
        # Draft-model, prompt-lookup and plain requests at once.
        jobs = [(p, mode) for mode in ("draft", "ngram", "off") for p in PROMPTS[:3]]
        with ThreadPoolExecutor(6) as ex:
            got = list(ex.map(lambda j: text_of(chat(srv.url, j[0], speculate=j[1])), jobs))
        for (p, mode), text in zip(jobs, got):
            assert text == text_of(plain(server.url, p)), (p, mode)
    finally:
        code, err = srv.terminate()
    assert code == 0, err


def test_serve_refuses_a_missing_draft_model(model_path, tmp_path):
    r = subprocess.run([sys.executable, "-m", "minfer.cli", "serve", model_path, "--port", "1", "--draft-model",
                        str(tmp_path / "nope.gguf")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "draft model file not found" in r.stderr and "Traceback" not in r.stderr
