"""Session files: a restored session continues bitwise as one that never stopped, skips
the prefill of what it saved, and every bad file (another model, KV type or context
size, truncated, corrupted, not a session file, a newer version) is one clean error;
saving is atomic; `minfer chat --session` resumes a conversation across processes."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from minfer import session_file
from minfer.errors import MinferError
from minfer.model import Model
from minfer.sampling import SamplingParams
from minfer.session import Context, Session
from minfer.session_file import SessionFileError
from minfer.testing import write_model

GREEDY = SamplingParams(temperature=0.0)
SHAPE = dict(n_layer=3, n_embd=128, n_head=4, n_head_kv=2, n_ff=256, types={"ffn_up": "Q5_0", "attn_v": "Q8_0"})


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Model:
    path = tmp_path_factory.mktemp("sf") / "m.gguf"
    write_model(path, seed=21, **SHAPE)
    return Model.open(path, n_threads=2)


def conversation(model, n_ctx=128, kv_type="f16"):
    rng = np.random.default_rng(0)
    p = [int(t) for t in rng.integers(3, 250, size=20)]
    s = Session(model, n_ctx=n_ctx, kv_type=kv_type)
    r = s.generate(p, 10, GREEDY, stop_at_eog=False, reuse_prefix=True)
    return s, p + r.ids + [17, 18, 19]


@pytest.mark.parametrize("kv_type", ["f16", "f32"])
def test_restored_session_continues_bitwise(model, tmp_path, kv_type):
    s, turn2 = conversation(model, kv_type=kv_type)
    f = tmp_path / "s.minfer"
    size = s.save(f, meta={"messages": [{"role": "user", "content": "hé"}]})
    assert size == f.stat().st_size
    r = Session.load(model, f)
    assert r.tokens == s.tokens and r.n_ctx == s.n_ctx and r.meta["messages"][0]["content"] == "hé"
    assert r.kv_type == kv_type
    # The KV rows are the saved ones, byte for byte.
    for layer in range(3):
        a = s.context.cache.alloc.read_kv_rows(layer, 0, s.n_past)
        b = r.context.cache.alloc.read_kv_rows(layer, 0, r.n_past)
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    # Both continue alike: same logits bitwise, same tokens; the restored one
    # processed only what follows the saved tokens.
    la, kept_a = s.prefill(turn2)
    lb, kept_b = r.prefill(turn2)
    assert kept_a == kept_b == len(turn2) - 4
    assert np.array_equal(la[-1], lb[-1])
    ga = s.generate(turn2 + [5], 12, GREEDY, stop_at_eog=False, reuse_prefix=True)
    gb = r.generate(turn2 + [5], 12, GREEDY, stop_at_eog=False, reuse_prefix=True)
    assert ga.ids == gb.ids and gb.timings.cached_tokens == len(turn2)
    # And both equal a session that processed everything from scratch.
    assert Session(model, n_ctx=128).generate(turn2 + [5], 12, GREEDY, stop_at_eog=False).ids == ga.ids


def test_sequence_of_a_shared_context_saves_its_own_rows(model, tmp_path):
    ctx = Context(model, n_ctx=64, n_seq=2)
    a, b = ctx.session(0), ctx.session(1)
    a.forward([5, 6, 7, 8])
    b.forward([9, 10, 11])
    b.save(tmp_path / "b")
    r = Session.load(model, tmp_path / "b")
    assert r.tokens == [9, 10, 11]
    assert np.array_equal(r.forward([12])[-1], Session(model, n_ctx=64).forward([9, 10, 11, 12])[-1])


def _rewrite_header(path, **changes):
    """A well-formed (re-checksummed) file whose header says something else."""
    data = path.read_bytes()
    magic, ver, hlen = struct.unpack_from("<8sII", data)
    header = json.loads(data[16:16 + hlen])
    payload = data[16 + hlen:-32]
    header.update(changes)
    hb = json.dumps(header).encode()
    body = struct.pack("<8sII", magic, ver, len(hb)) + hb + payload
    path.write_bytes(body + hashlib.sha256(body).digest())


def test_every_bad_file_is_one_clean_error(model, tmp_path):
    s, _ = conversation(model)
    good = tmp_path / "good"
    s.save(good)
    data = good.read_bytes()

    def refuse(path, match, **kw):
        with pytest.raises(SessionFileError, match=match) as e:
            Session.load(model, path, **kw)
        assert "\n" not in str(e.value)

    refuse(good, "context of 128", n_ctx=64)
    bad = tmp_path / "bad"
    for cut in (3, 12, 40, len(data) // 2, len(data) - 1):
        bad.write_bytes(data[:cut])
        refuse(bad, "truncated")
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x10
    bad.write_bytes(bytes(flipped))
    refuse(bad, "corrupted")
    bad.write_bytes(data + b"\0")
    refuse(bad, "corrupted")
    bad.write_bytes(b"GGUF" + data[4:])
    refuse(bad, "not a minfer session file")
    bad.write_bytes(data[:8] + struct.pack("<I", 99) + data[12:])
    refuse(bad, "version 99")
    s32, _ = conversation(model, kv_type="f32")
    s32.save(bad)
    refuse(bad, "f32 KV", kv_type="f16")
    bad.write_bytes(data)
    _rewrite_header(bad, n_tokens="many")
    refuse(bad, "bad header")
    refuse(tmp_path / "missing", "cannot read")
    # Another model: same shapes, other weights.
    write_model(tmp_path / "other.gguf", seed=22, **SHAPE)
    other = Model.open(tmp_path / "other.gguf", n_threads=2)
    with pytest.raises(SessionFileError, match="another model"):
        Session.load(other, good)


def test_save_is_atomic(model, tmp_path, monkeypatch):
    s, _ = conversation(model)
    f = tmp_path / "s"
    s.save(f)
    before = f.read_bytes()
    s.forward([3, 4])

    def crash(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(SessionFileError, match="No space left"):
        s.save(f)
    assert f.read_bytes() == before and os.listdir(tmp_path) == ["s"]
    monkeypatch.undo()
    s.save(f)
    assert Session.load(model, f).tokens == s.tokens


def _chat(*args, stdin: str):
    return subprocess.run([sys.executable, "-m", "minfer.cli", "chat", *args], input=stdin, capture_output=True,
                          text=True, timeout=180, env=dict(os.environ))


def test_chat_session_resumes_across_processes(model, tmp_path):
    f = tmp_path / "chat.session"
    common = [str(model.path), "--json", "--temp", "0", "-n", "5", "--ctx", "256", "--session", str(f)]
    r1 = _chat(*common, stdin="hello there\n")
    assert r1.returncode == 0, r1.stderr
    assert f.exists()
    r2 = _chat(*common, stdin="and again\n")
    assert r2.returncode == 0, r2.stderr
    t1, t2 = json.loads(r1.stdout), json.loads(r2.stdout)
    # The second process reused the first turn's KV and answered as one process would.
    assert t2["cached_tokens"] >= t1["prompt_tokens"]
    both = _chat(str(model.path), "--json", "--temp", "0", "-n", "5", "--ctx", "256",
                 stdin="hello there\nand again\n")
    assert [json.loads(x)["ids"] for x in both.stdout.splitlines()] == [t1["ids"], t2["ids"]]
    # A bad file is one line and exit 1, unless the user asked to start clean.
    f.write_bytes(f.read_bytes()[:100])
    r3 = _chat(*common, stdin="hello there\n")
    assert r3.returncode == 1 and r3.stderr.count("\n") == 1 and "truncated" in r3.stderr
    r4 = _chat(*common, "--session-reset", stdin="hello there\n")
    assert r4.returncode == 0, r4.stderr
    assert json.loads(r4.stdout)["ids"] == t1["ids"] and json.loads(r4.stdout)["cached_tokens"] == 0
    assert Session.load(model, f).n_past > 0
    r5 = _chat(*common[:-4], "--ctx", "128", "--session", str(f), stdin="x\n")
    assert r5.returncode == 1 and "context of 256" in r5.stderr
