"""Every family through the commands beyond those tests/test_families.py and
tests/test_moe.py already run it through: `minfer serve` (one server holding every
family's file), `minfer viz` (its live run over the family's graph), speculative
decoding with a draft model of the same vocabulary, and for the mixture-of-experts
families also `chat`, `perplexity` and `--dump-graph`.

The reference for what a command returns is the plain greedy stream of the same file
(`Session.generate`), itself checked against transformers in those two modules: a
server request, a speculated stream and a live viz run must each give exactly its ids."""

from __future__ import annotations

import io
import time

import openai
import pytest
from server_helpers import ServerProcess

import families
import moe_models
from minfer.cli import main
from minfer.sampling import SamplingParams
from minfer.session import Session
from minfer.speculate import Speculation
from test_families import check_perplexity_and_graphs

GREEDY = SamplingParams(temperature=0.0)
DENSE = list(families.VARIANTS)
MOE = list(moe_models.FAMILIES)
ALL = DENSE + MOE
N = 10


def _paths(name: str) -> dict:
    """{type: path} of the family's target (Q8_0) and draft (Q4_K_M) files."""
    if name in families.VARIANTS:
        got = families.ensure(name, types=("F32", "Q8_0", "Q4_K_M"))
        return {"Q8_0": got["Q8_0"], "Q4_K_M": got["Q4_K_M"]}
    return {t: moe_models.gguf_path(name, t) for t in ("Q8_0", "Q4_K_M")}


def _prompt(session: Session) -> list[int]:
    ids = session.tokenizer.encode("The quick brown fox jumps over the lazy dog, and then")
    assert len(ids) > 4
    return ids


def _run(capsys, *args) -> tuple[int, str, str]:
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


# ---- speculative decoding within a family ---------------------------------------------------

@pytest.mark.parametrize("name", ALL)
def test_a_draft_of_the_same_family_speculates_the_plain_greedy_stream(name):
    """The family's Q4_K_M drafts for its Q8_0 (same vocabulary): the speculated greedy
    ids are the plain ones, drafts were made and some were accepted."""
    p = _paths(name)
    target = Session.open(p["Q8_0"], n_ctx=128, n_threads=2, backends=["cpu"])
    ids = _prompt(target)
    plain = target.generate(ids, 24, GREEDY, stop_at_eog=False)
    # Not adaptive: a first miss would otherwise stop the drafts of a random-weight pair.
    spec = Speculation.open("draft", draft_max=4, draft_model_path=p["Q4_K_M"], target=target.model,
                            adaptive=False)
    fresh = Session(target.model, n_ctx=128)
    got = fresh.generate(ids, 24, GREEDY, stop_at_eog=False, speculate=spec)
    assert got.ids == plain.ids
    assert got.timings.drafted > 0 and got.timings.accepted > 0, (got.timings.drafted, got.timings.accepted)


def test_a_draft_of_another_vocabulary_is_refused_by_name():
    llama = _paths("llama3")
    gemma = _paths("gemma3")
    target = Session.open(llama["Q8_0"], n_ctx=64, n_threads=2, backends=["cpu"])
    with pytest.raises(Exception, match="vocabular"):
        Speculation.open("draft", draft_max=4, draft_model_path=gemma["Q8_0"], target=target.model)


# ---- minfer serve -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One `minfer serve` over every family's Q8_0 (a directory of links named after the
    families), models loaded on their first request, one at a time."""
    d = tmp_path_factory.mktemp("served")
    for name in ALL:
        (d / f"{name}.gguf").symlink_to(_paths(name)["Q8_0"])
    srv = ServerProcess.cli(str(d / f"{ALL[0]}.gguf"), "--models-dir", str(d), "--models-max", "1",
                            "--slots", "2", "--ctx", "256")
    yield srv
    code, err = srv.terminate()
    assert code == 0, err
    assert "Traceback" not in err, err


@pytest.mark.parametrize("name", ALL)
def test_serve_answers_with_the_plain_greedy_stream(served, name):
    """/v1/completions gives the ids `Session.generate` gives for the same text; a chat
    completion of the family's template is answered and counted."""
    c = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    assert f"{name}.gguf" in {m.id for m in c.models.list().data}
    local = Session.open(_paths(name)["Q8_0"], n_ctx=256, n_threads=2, backends=["cpu"])
    text = "The quick brown fox jumps over the lazy dog, and then"
    want = local.generate(local.tokenizer.encode(text), N, GREEDY, stop_at_eog=False)
    r = c.completions.create(model=f"{name}.gguf", prompt=text, max_tokens=N, temperature=0.0,
                             extra_body={"ignore_eos": True})
    assert r.choices[0].text == want.text
    assert r.usage.completion_tokens == N and r.usage.prompt_tokens == len(local.tokenizer.encode(text))
    chat = c.chat.completions.create(model=f"{name}.gguf", messages=[{"role": "user", "content": "Hi there!"}],
                                     max_tokens=6, temperature=0.0)
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert 0 < chat.usage.completion_tokens <= 6 and chat.usage.prompt_tokens > 3


# ---- minfer viz ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", ALL)
def test_viz_runs_the_family_live(name):
    """The viz app over the family's session: its graph, and a live run whose per-node
    records cover the executed nodes and whose ids are the plain greedy ones."""
    from starlette.testclient import TestClient

    from minfer.tools.viz.server import VizState, create_app

    path = _paths(name)["Q8_0"]
    session = Session.open(path, n_ctx=128, n_threads=2, backends=["cpu"])
    with TestClient(create_app(VizState(session, None, None))) as c:
        g = c.get("/viz/graph?kind=decode").json()
        assert g["nodes"] and any(n["op"] == "Attn" or "attn" in n["name"] for n in g["nodes"])
        r = c.post("/viz/run", json={"prompt": "The quick brown fox", "n": 3})
        assert r.status_code == 202, r.text
        deadline = time.monotonic() + 120
        while c.get("/viz/info").json()["running"]:
            assert time.monotonic() < deadline, "the live run did not finish"
            time.sleep(0.05)
        live = c.get("/viz/live").json()
        node = c.get("/viz/node/3?kind=decode").json()
        assert node["record"]["stats"] is not None
    assert live["format"] == "minfer-trace"
    got = [s["token"] for ph in live["phases"] for s in ph["steps"] if "token" in s]
    fresh = Session.open(path, n_ctx=128, n_threads=2, backends=["cpu"])
    want = fresh.generate(fresh.tokenizer.encode("The quick brown fox"), 3, GREEDY, stop_at_eog=False)
    assert got == want.ids


# ---- the MoE families through chat, perplexity and --dump-graph ---------------------------

@pytest.mark.parametrize("name", MOE)
def test_moe_family_runs_chat_perplexity_and_dump_graph(name, capsys, tmp_path, monkeypatch):
    path = _paths(name)["Q4_K_M"]
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi!\nAnd again?\n"))
    rc, out, err = _run(capsys, "chat", path, "-n", "6", "--temp", "0", "-c", "128", "-t", "2")
    assert rc == 0, err
    dot = check_perplexity_and_graphs(capsys, path, tmp_path)
    assert "MatMulId" in dot and "MoeTopK" in dot
