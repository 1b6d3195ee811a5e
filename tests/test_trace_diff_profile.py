"""`minfer trace diff` on runs that differ by construction, and `minfer profile` (host
clocks on the CPU; per launch where a split runs its own kernels, as CUDA does)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from minfer.cli import main
from minfer.session import Session
from minfer.tools.profile import run_profile
from minfer.tools.trace import load_trace
from minfer.tools.trace_diff import diff_traces, format_report

sys.path.insert(0, str(Path(__file__).parent))


def _trace(capsys, monkeypatch, model, path, *extra):
    monkeypatch.setenv("MINFER_TRACE", str(path))
    rc = main(["generate", str(model), "the cat sat on", "-n", "3", "--temp", "0", "--json", *extra])
    assert rc == 0, capsys.readouterr().err
    capsys.readouterr()
    monkeypatch.delenv("MINFER_TRACE")
    return load_trace(str(path))


@pytest.fixture(scope="module")
def perturbed_model(synth_model_path, tmp_path_factory):
    """The synth model with one weight of blk.1.ffn_up changed: layer 0 and every node
    of layer 1 before ffn_up compute the same bits, ffn_up is the first to differ."""
    path = tmp_path_factory.mktemp("perturbed") / "qwen2-tiny-perturbed.gguf"
    shutil.copy(synth_model_path, path)
    r = gguf.GGUFReader(path, "r+")
    t = next(t for t in r.tensors if t.name == "blk.1.ffn_up.weight")
    assert t.tensor_type == gguf.GGMLQuantizationType.F32
    t.data.reshape(-1)[:64] += np.float32(0.5)
    r.data.flush()
    del r
    return path


def test_diff_finds_the_perturbed_node(synth_model_path, perturbed_model, tmp_path, capsys, monkeypatch):
    a = _trace(capsys, monkeypatch, synth_model_path, tmp_path / "a.json")
    b = _trace(capsys, monkeypatch, perturbed_model, tmp_path / "b.json")
    rep = diff_traces(a, b, tol=0.0)
    d = rep.first
    assert d is not None and (d.phase, d.step, d.name, d.op, d.layer) == ("prefill", 0, "blk.1.ffn_up", "MatMul", 1)
    assert d.gap > 0 and d.stats_a != d.stats_b
    assert rep.layers[0].diverged == 0 and rep.layers[0].compared > 0 and rep.layers[0].max_gap == 0.0
    assert rep.layers[1].diverged > 0 and rep.layers[1].first == "prefill step 0: blk.1.ffn_up"
    # A tolerance above every gap reports no divergence.
    big = max(r.max_gap for r in rep.layers.values())
    assert diff_traces(a, b, tol=big).first is None
    rc = main(["trace", "diff", str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    out = capsys.readouterr().out
    assert rc == 0 and "first divergence: prefill step 0, node blk.1.ffn_up (MatMul, layer 1)" in out
    assert format_report(rep, "a.json", "b.json") in out


def test_diff_f32_against_f16_kv(synth_model_path, tmp_path, capsys, monkeypatch):
    """Same weights, KV stored as f32 vs f16: everything before the first read of the
    cache is the same bits; layer 0's attention is the first node that differs."""
    a = _trace(capsys, monkeypatch, synth_model_path, tmp_path / "f32.json", "--kv-type", "f32")
    b = _trace(capsys, monkeypatch, synth_model_path, tmp_path / "f16.json", "--kv-type", "f16")
    rep = diff_traces(a, b, tol=0.0)
    d = rep.first
    assert d is not None and (d.phase, d.step, d.name, d.op, d.layer) == ("prefill", 0, "blk.0.attn", "Attn", 0)
    assert 0 < d.gap < 1e-2          # f16 rounding, not a different computation
    assert rep.layers[0].first == "prefill step 0: blk.0.attn"


def test_fused_and_unfused_traces_match_by_name(synth_model_path, tmp_path):
    docs = []
    for fuse in (True, False):
        from minfer.tools.trace import Tracer

        eng = Session.open(synth_model_path, n_ctx=64, n_threads=1, fuse=fuse)
        tr = Tracer(eng.model_name, max_values=32)
        eng.context.tracer = tr
        eng.forward([5, 6, 7])
        eng.forward([8])
        docs.append(tr.document())
    rep = diff_traces(docs[0], docs[1])
    # SwiGLU equals silu*mul bitwise; the folded silu exists on the unfused side only.
    assert rep.first is None and rep.compared > 0
    assert rep.only_a == [] and all(x.endswith("ffn_silu") for x in rep.only_b) and rep.only_b


def test_diff_bad_input(tmp_path, capsys):
    p = tmp_path / "x.json"
    p.write_text("[]")
    assert main(["trace", "diff", str(p), str(p)]) == 1
    assert "not a minfer-trace" in capsys.readouterr().err
    assert main(["trace", "diff", str(p), str(p), "--tol", "-1"]) == 2


def test_profile(synth_model_path, capsys):
    eng = Session.open(synth_model_path, n_ctx=64, n_threads=1)
    doc = run_profile(eng, [5, 6, 7, 8], 3)
    assert eng.context.tracer is None
    assert [(p["kind"], p["steps"]) for p in doc["phases"]] == [("prefill", 1), ("decode", 2)]
    for p in doc["phases"]:
        nodes = {n["id"]: n for n in p["graph"]["nodes"]}
        stepped = {n["id"] for n in p["graph"]["nodes"]
                   if not n["dead"] and n["op"] not in ("Input", "KvcacheLoad")}
        assert {r["id"] for r in p["nodes"]} == stepped
        assert sum(r["share"] for r in p["nodes"]) == pytest.approx(1.0)
        assert sum(r["ms"] for r in p["nodes"]) == pytest.approx(p["ms_per_step"])
        assert [r["ms"] for r in p["nodes"]] == sorted((r["ms"] for r in p["nodes"]), reverse=True)
        for r in p["nodes"]:
            if r["op"] == "MatMul":
                w = eng.model.defn.tensors[nodes[r["id"]]["meta"]["weight_name"]].nbytes
                assert r["gbps"] == pytest.approx(w / (r["ms"] * 1e6))
            else:
                assert r["gbps"] is None
        assert {o["op"] for o in p["ops"]} == {r["op"] for r in p["nodes"]}
    rc = main(["profile", str(synth_model_path), "the cat", "-n", "2", "--json"])
    assert rc == 0
    cli_doc = json.loads(capsys.readouterr().out)
    assert cli_doc["format"] == "minfer-profile" and len(cli_doc["phases"]) == 2
    rc = main(["profile", str(synth_model_path), "the cat", "-n", "2", "--top", "3"])
    out = capsys.readouterr().out
    assert rc == 0 and "prefill: 1 step(s)" in out and "MatMul" in out and "GB/s" in out
    assert main(["profile", str(synth_model_path), "x", "-n", "0"]) == 2


def test_profile_of_launches_times_each_kernel(synth_model_path):
    """A split that runs its own launches (CUDA's path, emulated over the CPU plan) is
    profiled per launch from the times the launches report: a merged launch is one row
    over its nodes, named after them, the op table groups by kernel, and the rows add
    up to the step (the wall clock around the forward holds them)."""
    from test_trace import with_launches

    from minfer.tools.profile import Profiler, format_profile

    class LaunchProfiler(Profiler):
        def execute(self, cache):
            with_launches(cache, calls)
            super().execute(cache)

    calls: list = []
    eng = Session.open(synth_model_path, n_ctx=64, n_threads=1)
    prof = LaunchProfiler(eng.model_name, lambda name: int(eng.model.defn.tensors[name].nbytes))
    eng.context.tracer = prof
    t = int(np.argmax(eng.forward([5, 6, 7, 8])[-1]))
    for _ in range(2):
        t = int(np.argmax(eng.forward([t])[-1]))
    eng.context.tracer = None
    assert calls == [True] * 3
    doc = json.loads(json.dumps(prof.document("p")))
    assert [(p["kind"], p["steps"], p["timer"]) for p in doc["phases"]] == [("prefill", 1, "cuda events"),
                                                                           ("decode", 2, "cuda events")]
    for p in doc["phases"]:
        nodes = {n["name"]: n for n in p["graph"]["nodes"]}
        launched = sorted(nodes[x]["id"] for r in p["nodes"] for x in r["nodes"])
        assert launched == sorted(n["id"] for n in nodes.values() if not n["dead"] and n["op"] not in
                                  ("Input", "KvcacheLoad"))
        assert sum(r["ms"] for r in p["nodes"]) == pytest.approx(p["ms_per_step"])
        assert 0 < p["ms_per_step"] <= p["wall_ms_per_step"]
        assert sum(r["share"] for r in p["nodes"]) == pytest.approx(1.0)
        assert {o["op"] for o in p["ops"]} == {r["kernel"] for r in p["nodes"]}
        ffn = next(r for r in p["nodes"] if r["name"] == "blk.0.ffn_gate+ffn_up+ffn_act")
        assert ffn["op"] == ffn["kernel"] == "fused_ffn_swiglu" and ffn["layer"] == 0
        assert ffn["nodes"] == ["blk.0.ffn_gate", "blk.0.ffn_up", "blk.0.ffn_act"]
        w = sum(eng.model.defn.tensors[f"blk.0.{x}.weight"].nbytes for x in ("ffn_gate", "ffn_up"))
        assert ffn["gbps"] == pytest.approx(w / (ffn["ms"] * 1e6))
        assert ffn["id"] == nodes["blk.0.ffn_act"]["id"]
    text = format_profile(doc)
    assert "CUDA events around each kernel" in text and "fused_ffn_swiglu" in text
    assert "kernel" in text and "blk.0.ffn_gate+ffn_up+ffn_act" in text


def test_profile_refuses_a_device_split_without_launches():
    """Host clocks around asynchronous launches would time the launches, not the kernels."""
    from types import SimpleNamespace

    from minfer.errors import MinferError
    from minfer.tools.profile import Profiler

    split = SimpleNamespace(launches=None, entry=SimpleNamespace(name="metal", memory="metal"))
    cache = SimpleNamespace(lowered=SimpleNamespace(splits=[split]))
    with pytest.raises(MinferError, match="'metal' has no device timing.*--backend cpu"):
        Profiler("m", lambda name: 0).execute(cache)
