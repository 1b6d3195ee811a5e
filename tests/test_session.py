"""Model/Session: prefix reuse across turns, streaming and cancellation, several
sequences in one graph (positions and cells apart), and `minfer chat`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from minfer.errors import ContextError, MinferError
from minfer.model import Model
from minfer.sampling import SamplingParams
from minfer.session import Context, Session
from minfer.testing import write_model

TYPES = {"ffn_gate": "Q4_K", "ffn_up": "Q5_0", "ffn_down": "Q6_K", "attn_q": "Q8_0", "attn_v": "Q4_0"}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Model:
    path = tmp_path_factory.mktemp("session") / "q.gguf"
    write_model(path, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, types=TYPES)
    return Model.open(path, n_threads=2)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, 250, size=int(rng.integers(3, 30)))] for _ in range(n)]


def test_sessions_share_the_model_and_keep_their_own_kv(model):
    a, b = Session(model, n_ctx=64), Session(model, n_ctx=64)
    assert a.model.weights is b.model.weights
    pa, pb = prompts(2, seed=1)
    la = a.forward(pa)[-1].copy()
    b.forward(pb)
    # a's KV is untouched by b: its next step equals a fresh session's.
    ref = Session(model, n_ctx=64)
    ref.forward(pa)
    assert np.array_equal(a.forward([9])[-1], ref.forward([9])[-1])
    assert np.array_equal(la, Session(model, n_ctx=64).forward(pa)[-1])


def test_reused_prefix_gives_a_fresh_sessions_logits_bitwise(model):
    p = prompts(1, seed=2)[0]
    s = Session(model, n_ctx=128)
    turn1 = list(p) + [5, 6, 7]
    out1 = s.generate(turn1, 6, SamplingParams(temperature=0.0), stop_at_eog=False, reuse_prefix=True)
    assert s.tokens == turn1 + out1.ids[:-1]  # the last pick was never fed back
    turn2 = turn1 + out1.ids + [11, 12, 13, 14]
    logits, kept = s.prefill(turn2)
    assert kept == len(turn1) + len(out1.ids) - 1
    fresh = Session(model, n_ctx=128).forward(turn2)[-1]
    assert np.array_equal(logits[-1], fresh)
    # A diverging prompt truncates to the common prefix and still matches a fresh run.
    turn3 = turn1[:4] + [99, 98]
    logits, kept = s.prefill(turn3)
    assert kept == 4
    assert np.array_equal(logits[-1], Session(model, n_ctx=128).forward(turn3)[-1])


def test_stream_reports_cached_tokens_and_matches_generate(model):
    p = prompts(1, seed=3)[0]
    s = Session(model, n_ctx=128)
    first = s.generate(p, 5, SamplingParams(temperature=0.0), stop_at_eog=False, reuse_prefix=True)
    evs = list(s.stream(p + first.ids + [3, 4], 5, SamplingParams(temperature=0.0), stop_at_eog=False))
    done = evs[-1]
    assert done.done and done.id is None and done.stop_reason == "length"
    assert done.timings.prompt_tokens == len(p) + len(first.ids) + 2
    assert done.timings.cached_tokens == len(p) + len(first.ids) - 1
    fresh = Session(model, n_ctx=128).generate(p + first.ids + [3, 4], 5, SamplingParams(temperature=0.0),
                                               stop_at_eog=False)
    assert [e.id for e in evs[:-1]] == fresh.ids


def test_stream_logprobs_are_log_softmax_of_the_pick(model):
    p = prompts(1, seed=4)[0]
    s = Session(model, n_ctx=64)
    evs = list(s.stream(p, 3, SamplingParams(temperature=0.0), stop_at_eog=False, logprobs=True))
    ref = Session(model, n_ctx=64).forward(p)[-1].astype(np.float64)
    lse = ref.max() + np.log(np.exp(ref - ref.max()).sum())
    assert evs[0].id == int(np.argmax(ref))
    assert evs[0].logprob == pytest.approx(ref[evs[0].id] - lse, abs=1e-9)
    assert all(e.logprob <= 0 for e in evs[:-1])


def test_closing_or_cancelling_a_stream_stops_between_steps(model):
    p = prompts(1, seed=5)[0]
    s = Session(model, n_ctx=128)
    gen = s.stream(p, 50, SamplingParams(temperature=0.0), stop_at_eog=False)
    got = [next(gen) for _ in range(3)]
    gen.close()
    assert len(s.tokens) == len(p) + 2  # prompt + the two picks fed back before the close
    assert all(not e.done for e in got)
    s2 = Session(model, n_ctx=128)
    evs = []
    for ev in s2.stream(p, 50, SamplingParams(temperature=0.0), stop_at_eog=False):
        evs.append(ev)
        if len(evs) == 4:
            s2.cancel()
    assert evs[-1].done and evs[-1].stop_reason == "cancelled"
    assert len(evs) == 5 and evs[-1].timings.generated_tokens == 4


def test_every_end_of_a_stream_leaves_the_kv_holding_what_was_fed_back(model, monkeypatch):
    """A stream sends each token's forward before that token's text work and its
    consumer: whatever ends the output (length, an end-of-generation id, a stop string,
    a close, a cancel), the KV holds the prompt and exactly the picks fed back, and the
    next forward gives a fresh session's logits bitwise."""
    g = SamplingParams(temperature=0.0)
    p = prompts(1, seed=6)[0]
    full = Session(model, n_ctx=128).generate(p, 12, g, stop_at_eog=False)

    def check(s, fed):
        assert s.tokens == p + fed
        ref = Session(model, n_ctx=128).forward(p + fed + [17])[-1]
        assert np.array_equal(s.forward([17])[-1], ref)

    s = Session(model, n_ctx=128)
    res = s.generate(p, 12, g, stop_at_eog=False)
    assert res.ids == full.ids and res.stop_reason == "length"
    check(s, full.ids[:-1])  # the last pick is never fed back

    eog = full.ids[5]
    monkeypatch.setattr(model.tokenizer, "eot_ids", frozenset({eog}), raising=False)
    s = Session(model, n_ctx=128)
    res = s.generate(p, 12, g)
    k = full.ids.index(eog)
    assert res.stop_reason == "eos" and res.ids == full.ids[:k]
    check(s, full.ids[:k])
    monkeypatch.undo()

    # A stop string completed by pick k: the k picks before it were fed back. The stop is
    # the piece of the first pick after the third whose text first occurs where it ends.
    tok = model.tokenizer

    def first_completed_by(i):
        piece, text = tok.decode([full.ids[i]]), tok.decode(full.ids[:i + 1])
        return piece and "\ufffd" not in piece and text.find(piece) == len(text) - len(piece)

    k = next(i for i in range(3, 12) if first_completed_by(i))
    s = Session(model, n_ctx=128)
    res = s.generate(p, 12, g, stop=[tok.decode([full.ids[k]])], stop_at_eog=False)
    assert res.stop_reason == "stop" and res.ids == full.ids[:k]
    check(s, full.ids[:k])

    for end in ("close", "cancel"):
        s = Session(model, n_ctx=128)
        gen = s.stream(p, 12, g, stop_at_eog=False)
        got = [next(gen) for _ in range(4)]
        if end == "close":
            gen.close()
        else:
            s.cancel()
            assert [e.stop_reason for e in gen] == ["cancelled"]
        assert [e.id for e in got] == full.ids[:4]
        check(s, full.ids[:3])


@pytest.mark.parametrize("temp", [0.0, 0.9])
def test_interleaved_streams_of_one_context_each_give_their_own_output(model, temp):
    """Two sequences of one context streamed in turns: each token's forward went out
    before the other sequence ran, so its pick must not read the other's logits."""
    pa, pb = prompts(2, seed=7)
    sp = SamplingParams(temperature=temp, seed=11)
    alone = [Session(model, n_ctx=64).generate(q, 10, sp, stop_at_eog=False).ids for q in (pa, pb)]
    ctx = Context(model, n_ctx=64, n_seq=2)
    ga, gb = (ctx.session(i).stream(q, 10, sp, stop_at_eog=False) for i, q in enumerate((pa, pb)))
    got: list[list[int]] = [[], []]
    for _ in range(10):
        got[0].append(next(ga).id)
        got[1].append(next(gb).id)
    assert got == alone


def test_context_limits_are_errors_before_work(model):
    s = Session(model, n_ctx=16)
    with pytest.raises(ContextError):
        list(s.stream(list(range(3, 15)), 10, SamplingParams(temperature=0.0)))
    assert s.tokens == []
    with pytest.raises(MinferError):
        Session(model, n_ctx=-3)


def test_graph_has_positions_and_cells_apart(model):
    s = Session(model, n_ctx=32)
    g = model.defn.build_graph(s.context.params(4, 1))
    names = {g.nodes[i].name for i in g.inputs}
    assert {"token_ids", "positions", "cells"} <= names and "kv_span" not in names
    ctx = Context(model, n_ctx=32, n_seq=3)
    g = model.defn.build_graph(ctx.params(4, 2))
    assert "kv_span" in {g.nodes[i].name for i in g.inputs}


def test_batch_of_eight_decodes_like_each_sequence_alone(model):
    """Several sequences in one graph (own positions, cells and spans): every greedy
    token equals the sequence decoded alone, bitwise; a newcomer's prefill chunk rides
    along with the others' decode steps."""
    ps = prompts(8, seed=6)
    steps = 6
    alone = []
    for p in ps:
        s = Session(model, n_ctx=64)
        alone.append(s.generate(p, steps, SamplingParams(temperature=0.0), stop_at_eog=False).ids)
    ctx = Context(model, n_ctx=64, n_seq=8)
    seqs = [ctx.session(i) for i in range(8)]
    # Seven start together (prefill in one batch), the eighth joins a step later.
    rows = ctx.decode_batch([(s, p) for s, p in zip(seqs[:7], ps[:7])])
    got = [[int(np.argmax(r))] for r in rows] + [[]]
    rows = ctx.decode_batch([(s, [g[-1]]) for s, g in zip(seqs[:7], got[:7])] + [(seqs[7], ps[7])])
    for i in range(7):
        got[i].append(int(np.argmax(rows[i])))
    got[7].append(int(np.argmax(rows[7])))
    while min(len(g) for g in got) < steps:
        live = [i for i in range(8) if len(got[i]) < steps]
        rows = ctx.decode_batch([(seqs[i], [got[i][-1]]) for i in live])
        for r, i in zip(rows, live):
            got[i].append(int(np.argmax(r)))
    assert got == alone
    assert ctx.builds <= 4  # one graph per batch shape, reused


def test_sequence_of_another_context_is_refused(model):
    a, b = Context(model, n_ctx=16, n_seq=2), Context(model, n_ctx=16, n_seq=2)
    with pytest.raises(MinferError):
        a.decode_batch([(b.session(0), [3])])
    with pytest.raises(MinferError):
        a.session(2)


def _minfer(*args, stdin: str = "", timeout: int = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    return subprocess.run([sys.executable, "-m", "minfer.cli", *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_chat_two_piped_turns_reuse_the_first(model):
    path = str(model.path)
    r = _minfer("chat", path, "--json", "--temp", "0", "-n", "6", "--ctx", "256", stdin="hello there\nand again\n")
    assert r.returncode == 0, r.stderr
    turns = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(turns) == 2
    t1, t2 = turns
    assert t1["cached_tokens"] == 0 and t2["cached_tokens"] > 0
    tok = model.tokenizer
    conv = [{"role": "user", "content": "hello there"}]
    assert t1["prompt_tokens"] == len(tok.encode(tok.render_chat(conv, add_generation_prompt=True)))
    conv += [{"role": "assistant", "content": t1["text"]}, {"role": "user", "content": "and again"}]
    ids2 = tok.encode(tok.render_chat(conv, add_generation_prompt=True))
    assert t2["prompt_tokens"] == len(ids2)
    # Turn 2 processed only what follows the first turn's tokens...
    assert t2["cached_tokens"] >= t1["prompt_tokens"]
    # ...and answers exactly as a fresh session given the whole conversation.
    fresh = Session(model, n_ctx=256).generate(ids2, 6, SamplingParams(temperature=0.0))
    assert t2["ids"] == fresh.ids and t2["text"] == fresh.text


def test_chat_reset_starts_over(model):
    r = _minfer("chat", str(model.path), "--json", "--temp", "0", "-n", "4", "--ctx", "256",
                stdin="hello there\n/reset\nhello there\n")
    assert r.returncode == 0, r.stderr
    t1, t2 = [json.loads(line) for line in r.stdout.splitlines()]
    assert t2["cached_tokens"] == 0 and t2["ids"] == t1["ids"] and t2["prompt_tokens"] == t1["prompt_tokens"]


def test_text_state_holds_back_stop_prefixes_and_split_characters(model):
    """The per-sequence text logic the server's scheduler drives: a possible stop-string
    prefix is held back, a stop string never appears, a split UTF-8 character waits."""
    from minfer.session import TextState

    tok = model.tokenizer
    byte_id = {tok.token_bytes(i): i for i in range(tok.n_vocab) if len(tok.token_bytes(i)) == 1}
    ids = [byte_id[bytes([b])] for b in "ab€cXYd".encode()]
    st = TextState(tok, stop=["XY"])
    got = [st.push(i) for i in ids[:8]]
    # One character is held (it could start "XY"); the three bytes of the euro sign wait
    # for the last one; "XY" ends the generation and never shows.
    assert got == [("", None), ("a", None), ("", None), ("", None), ("b", None), ("€", None), ("c", None),
                   ("", "stop")]
    assert st.finish("stop") == ("", "stop") and st.text == "ab€c"
    st = TextState(tok, stop=["XY"])
    for i in ids[:7]:
        st.push(i)
    assert st.finish("length") == ("X", "length")  # the held text is released at the end
    eog = next(iter(tok.eot_ids))
    st = TextState(tok)
    assert st.push(byte_id[b"q"]) == ("q", None) and st.push(eog) == ("", "eos") and st.ids == [byte_id[b"q"]]
    assert TextState(tok, stop_at_eog=False).push(eog)[1] is None


def test_warming_readies_the_weights_beside_other_work_and_changes_no_bits(model, monkeypatch):
    """Context.warming() runs warm() (decode graph built, the CPU's repacked weights made)
    on a thread for the block's length; the forwards after it give a fresh session's
    logits bitwise. A warm-up that fails is left to the first forward."""
    import threading

    p = prompts(1, seed=12)[0]
    s = Session(model, n_ctx=64)
    ran_in, warm = [], s.context.warm
    monkeypatch.setattr(s.context, "warm", lambda: (ran_in.append(threading.current_thread().name), warm()))
    with s.context.warming():
        pass
    assert ran_in == ["minfer-warm"]
    assert not any(t.name == "minfer-warm" for t in threading.enumerate())  # joined on leaving
    assert all(ls.prepare is not None for ls in s.context.cache.lowered.splits)
    assert s.builds == 1  # the decode graph, built by warm()
    ref = Session(model, n_ctx=64)
    assert np.array_equal(s.forward(p)[-1], ref.forward(p)[-1])
    assert np.array_equal(s.forward([5])[-1], ref.forward([5])[-1])

    def broken():
        raise MinferError("warm-up failed")

    s2 = Session(model, n_ctx=64)
    monkeypatch.setattr(s2.context, "warm", broken)
    with s2.context.warming():
        pass
    assert np.array_equal(s2.forward(p)[-1], Session(model, n_ctx=64).forward(p)[-1])  # nothing escaped
    # A context with a device that cannot prepare apart from a run starts no thread.
    s3 = Session(model, n_ctx=64)
    monkeypatch.setattr(s3.context, "warm", lambda: ran_in.append("s3"))
    (dev,) = s3.context.cache.alloc.devices.values()
    monkeypatch.delattr(type(dev), "prepare")
    with s3.context.warming():
        pass
    assert ran_in == ["minfer-warm"]
