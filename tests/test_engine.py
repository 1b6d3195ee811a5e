"""Engine behaviour on small random-weight models: stop conditions, streaming,
context limits, KV across the prefill -> decode rebuild, fusion identity, model
dispatch errors, and perplexity against the float64 reference."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from reference_forward import ReferenceModel  # noqa: E402

from minfer.session import Session  # noqa: E402
from minfer.errors import ContextError, UnsupportedModelError  # noqa: E402
from minfer.io.gguf_file import GGUFFile  # noqa: E402
from minfer.models import load_model  # noqa: E402
from minfer.tools.perplexity import run_perplexity  # noqa: E402
from minfer.sampling import SamplingParams  # noqa: E402
from minfer.testing.synth import write_model  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def engine(synth_model_path):
    return Session.open(synth_model_path, n_ctx=128, n_threads=2)


def test_stop_string_truncates_and_is_never_streamed(engine):
    prompt = engine.tokenizer.encode("hello")
    full = engine.generate(prompt, 24, GREEDY, stop_at_eog=False)
    text = full.text
    assert len(text) >= 6
    stop = text[3:5]
    first = text.find(stop)
    streamed = []
    res = engine.generate(prompt, 24, GREEDY, stop=[stop], on_text=streamed.append, stop_at_eog=False)
    assert res.stop_reason == "stop"
    assert res.text == text[:first]
    assert "".join(streamed) == res.text


def test_streamed_text_equals_result_text(engine):
    chunks = []
    res = engine.generate(engine.tokenizer.encode("abc"), 16, GREEDY, on_text=chunks.append, stop_at_eog=False)
    assert "".join(chunks) == res.text == engine.tokenizer.decode(res.ids)


def test_end_of_generation_token_stops(engine, monkeypatch):
    prompt = engine.tokenizer.encode("hello")
    first = engine.generate(prompt, 1, GREEDY, stop_at_eog=False).ids[0]
    monkeypatch.setattr(type(engine.tokenizer), "eot_ids", frozenset({first}), raising=False)
    monkeypatch.setattr(engine.tokenizer, "eot_ids", frozenset({first}), raising=False)
    res = engine.generate(prompt, 8, GREEDY)
    assert res.stop_reason == "eos" and res.ids == []


def test_context_limits_are_errors(engine):
    with pytest.raises(ContextError):
        engine.check_fits(100, 29)
    engine.reset()
    engine.forward(list(range(10, 130)))
    with pytest.raises(ContextError):
        engine.forward(list(range(10, 20)))


def test_token_ids_outside_the_vocabulary_are_refused_before_any_work(engine):
    """Ids are bounded on the fill side (a device cannot check its buffers): a lone
    decode id and a prompt's ids alike, before the KV or the graph is touched."""
    from minfer.errors import MinferError

    engine.reset()
    engine.forward([1, 2, 3], n_out=1)
    n = engine.model.hp.n_vocab
    for bad in ([-1], [n], [1, n, 2], [-5, 1]):
        with pytest.raises(MinferError, match=rf"token id out of range \[0, {n}\)"):
            engine.forward(bad)
        assert engine.n_past == 3
    assert engine.forward([n - 1], n_out=1).shape == (1, n)  # the last id is in range


def test_kv_survives_prefill_to_decode_rebuild(synth_model_path):
    eng = Session.open(synth_model_path, n_ctx=64, n_threads=2)
    ids = [5, 17, 42, 99, 3, 250, 7]
    whole = eng.forward(ids)[0]
    eng.reset()
    eng.forward(ids[:-1])
    builds = eng.builds
    step = eng.forward(ids[-1:])[0]
    assert eng.builds == builds + 1  # prefill -> decode is one rebuild
    # F32 weights: same arithmetic up to summation order inside attention tiles.
    np.testing.assert_allclose(step, whole, rtol=1e-4, atol=1e-4)
    # and decode reuses its graph from then on
    eng.forward([11])
    eng.forward([12])
    assert eng.builds == builds + 1


def test_fused_and_unfused_swiglu_are_bitwise_identical(tmp_path):
    path = tmp_path / "q.gguf"
    write_model(path, n_embd=256, n_head=4, n_head_kv=2, n_ff=512,
                types={"ffn_gate": "Q4_K", "ffn_up": "Q5_0", "ffn_down": "Q6_K", "attn_q": "Q8_0"})
    ids = [1, 2, 3, 4, 5, 6]
    outs = []
    for fuse in (True, False):
        eng = Session.open(path, n_ctx=32, n_threads=2, fuse=fuse)
        ops = {n.op.value for n in eng.model.defn.build_graph(eng.context.params(len(ids), 1)).nodes}
        assert "Mul" in ops  # the model emits silu * mul; only the pass rewrites it
        a = eng.forward(ids)
        b = eng.forward([7])
        live = {n.op.value for n in eng.context.cache.graph.nodes if n.id not in eng.context.cache.graph.dead}
        assert ("SwiGLU" in live) == fuse
        outs.append((a, b))
    assert np.array_equal(outs[0][0], outs[1][0]) and np.array_equal(outs[0][1], outs[1][1])


def test_unsupported_architecture_is_named(tmp_path):
    path = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(str(path), "falcon")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match=r"'falcon'.*qwen2, qwen3, llama"):
        load_model(GGUFFile.open(path))


def test_unsupported_tensor_type_is_named(tmp_path):
    path = tmp_path / "bf16.gguf"
    write_model(path, types={"ffn_up": "BF16"})
    with pytest.raises(UnsupportedModelError, match=r"ffn_up.*BF16"):
        Session.open(path, n_ctx=32)


def test_a_vocabulary_shorter_than_the_token_rows_is_refused_in_one_line(tmp_path):
    """Every id the output can pick must name a token (llama.cpp refuses such a file
    too): the model's 16 padding entries dropped, opening its tokenizer fails, and
    `minfer generate` says so in one line with a nonzero exit, before any output."""
    import subprocess

    src, bad = tmp_path / "m.gguf", tmp_path / "short.gguf"
    write_model(src, n_embd=64, n_head=4, n_head_kv=2, n_ff=128)
    from minfer.testing.gguf_io import fields, write

    r = gguf.GGUFReader(str(src))
    cut = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type")
    write(bad, r.fields["general.architecture"].contents(),
          [(n, v[:-16] if n in cut else v, vt, sub) for n, v, vt, sub in fields(r)], r.tensors)
    s = Session.open(bad, n_ctx=32)
    rows = s.model.hp.n_vocab
    with pytest.raises(UnsupportedModelError, match=f"names {rows - 16} tokens but the model has {rows} token rows"):
        s.tokenizer
    p = subprocess.run([sys.executable, "-m", "minfer.cli", "generate", str(bad), "hi", "-n", "2"],
                       capture_output=True, text=True)
    assert p.returncode != 0 and p.stdout == "" and p.stderr.strip().count("\n") == 0, p
    assert f"{rows} token rows" in p.stderr


def test_perplexity_matches_reference(synth_model_path):
    eng = Session.open(synth_model_path, n_ctx=32, n_threads=2)
    text = "the quick brown fox jumps over the lazy dog " * 8
    lines = []
    res = run_perplexity(eng, text, 32, out=lines.append)
    tokens = eng.tokenizer.encode(text)
    ref = ReferenceModel(str(synth_model_path))
    nll = []
    for c in range(len(tokens) // 32):
        chunk = tokens[c * 32:(c + 1) * 32]
        lg = ref.logits(chunk)
        for j in range(16, 31):
            row = lg[j] - lg[j].max()
            nll.append(-(row[chunk[j + 1]] - math.log(np.exp(row).sum())))
    assert res.n_scored == len(nll)
    assert res.ppl == pytest.approx(math.exp(np.mean(nll)), rel=1e-4)
    assert lines[-1].startswith("Final estimate: PPL =")


def test_barrier_elision_is_bitwise_neutral(monkeypatch, tmp_path):
    # The executor skips the barrier between steps that share no data (q/k/v matmuls,
    # the two RoPEs); MINFER_ALL_BARRIERS=1 restores one after every step. A missed
    # hazard would show up as a race: different bits, or different bits run to run.
    path = tmp_path / "mix.gguf"
    write_model(path, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_layer=3,
                types={"attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": "Q8_0", "ffn_gate": "Q4_K",
                       "ffn_up": "Q4_K", "ffn_down": "Q6_K", "attn_output": "Q4_0"})
    ids = list(range(3, 40))

    def run_once():
        eng = Session.open(path, n_ctx=64, n_threads=2)
        out = [eng.forward(ids, n_out=len(ids))]
        for t in (5, 9, 11, 2):
            out.append(eng.forward([t]))
        return out

    elided = [run_once() for _ in range(3)]
    monkeypatch.setenv("MINFER_ALL_BARRIERS", "1")
    full = run_once()
    for e in elided:
        for a, b in zip(e, full):
            assert np.array_equal(a, b)


def test_greedy_argmax_in_core_matches_numpy(engine):
    engine.reset()
    engine.forward([3, 4, 5])
    for t in (6, 7, 8, 9):
        logits = engine.forward([t])[0]
        assert engine.argmax_last() == int(np.argmax(logits))
