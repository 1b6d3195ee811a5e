"""Seeing the GPU (GPU suite): MINFER_TRACE, `minfer trace diff`, `minfer profile` and the
viz page's live runs on CUDA. A traced or profiled CUDA split runs the kernels a normal
run runs, step merges included, launched one at a time (_core.cuda_launches): traced
logits are bitwise the untraced run's, every executed node has a record (a value that a
merged kernel keeps to itself is marked `merged` and carries none), a CPU trace and a
CUDA trace of one model line up node for node, and profile rows are CUDA event times.

If a test here fails, look first at run_launches (csrc/cuda/executor.cpp: the program
listing, the gate, the events), then at the scheduler's launch path
(graph/scheduler.py) and Tracer.execute / Profiler.execute (tools/)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

from minfer.backends import cuda as cuda_backend
from minfer.cli import main
from minfer.graph.ir import KV_BOUND
from minfer.sampling import SamplingParams
from minfer.session import Session
from minfer.testing import QWEN2_Q4_K_M_TYPES, write_model
from minfer.tools.trace import Tracer, load_trace
from minfer.tools.trace_diff import diff_traces, format_report
from server_helpers import free_port, sse_events

pytestmark = pytest.mark.cuda

# Head dim 32: the smallest the CUDA attention takes.
SMALL = dict(n_layer=2, n_embd=128, n_head=4, n_head_kv=2, n_ff=256, n_vocab=4096)
KV_OPS = {str(o) for o in KV_BOUND}
# Nodes a decode step's merged kernels keep to themselves (csrc/cuda/executor.cpp
# build_program): q, k, v inside the q|k|v launch with the rope and KV-store tail (and
# roped k inside the rope + store launch), gate and up inside gate|up + SwiGLU, the o and
# down projections inside their fused residual adds.
MERGED_AWAY = ("attn_q", "attn_k", "attn_v", "k_rope", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
# CPU vs CUDA on an all-F32 model, per value or stat, absolute: the two sum in different
# orders (f32, ~1e-6 relative) and each rounds its own K/V to f16 (a value near a rounding
# boundary may land one f16 step apart, ~5e-4 relative); activations and logits here are
# O(1), so 1e-2 leaves a wide margin for that and none for a wrong node.
CPU_CUDA_TOL = 1e-2


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    e = cuda_backend.ENTRY
    assert e.compiled and e.usable, f"pytest -m cuda needs the CUDA backend here: {e.unusable_reason}"
    d = tmp_path_factory.mktemp("cuda-trace")
    quant = d / "quant.gguf"
    # The real Qwen2.5 Q4_K_M file's mix of types (ffn_down Q6_K: rows of n_ff = 256).
    write_model(quant, types=QWEN2_Q4_K_M_TYPES, seed=5, **SMALL)
    f32 = d / "f32.gguf"
    write_model(f32, seed=6, **SMALL)
    return {"quant": quant, "f32": f32}


def prompt(n: int, seed: int = 1) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 4000, size=n)]


def greedy_rows(sess, ids: list[int], steps: int) -> list[np.ndarray]:
    sess.reset()
    rows = [sess.forward(ids)[-1].copy()]
    for _ in range(steps):
        rows.append(sess.forward([int(np.argmax(rows[-1]))])[-1].copy())
    return rows


@pytest.fixture(scope="module", params=[6, 24], ids=["prefill6", "prefill24"])
def traced(request, models):
    """A greedy run untraced and traced on CUDA. 6 prompt tokens take the row-exact
    matvec path; 24 take the prefill GEMMs, their weights dequantized ahead on the side
    stream in the traced run as in the untraced one."""
    ids = prompt(request.param)
    plain = Session.open(models["quant"], n_ctx=64, backends=["cuda"])
    want = greedy_rows(plain, ids, 4)
    sess = Session.open(models["quant"], n_ctx=64, backends=["cuda"])
    tracer = Tracer(sess.model_name, prompt="p", max_values=16)
    sess.context.tracer = tracer
    got = greedy_rows(sess, ids, 4)
    sess.context.tracer = None
    return want, got, tracer, sess


def test_traced_logits_equal_untraced_bitwise(traced):
    want, got, tracer, sess = traced
    assert len(got) == len(want) == 5
    for k, (a, b) in enumerate(zip(want, got)):
        assert a.tobytes() == b.tobytes(), f"forward {k}: traced logits differ from the untraced run"
    assert len(sess.context.cache.splits) == 1, "the model is one CUDA split"
    assert [(p["kind"], len(p["steps"])) for p in tracer.phases] == [("prefill", 1), ("decode", 4)]


def test_trace_has_a_record_per_executed_node(traced):
    want, _, tracer, _ = traced
    doc = json.loads(json.dumps(tracer.document()))
    for phase, first_row in zip(doc["phases"], (want[0], want[1])):
        nodes = {n["id"]: n for n in phase["graph"]["nodes"]}
        executed = {i for i, n in nodes.items() if not n["dead"] and n["op"] not in KV_OPS}
        launches = phase["launches"]
        launched = [i for L in launches for i in L["nodes"]]
        assert sorted(launched) == sorted(i for i, n in nodes.items()
                                          if not n["dead"] and n["op"] not in ("Input", "KvcacheLoad"))
        merged_kernels = {L["kernel"] for L in launches if len(L["nodes"]) > 1}
        for step in phase["steps"]:
            recs = {r["id"]: r for r in step["nodes"]}
            assert set(recs) == executed
            for i, r in recs.items():
                if r.get("merged"):
                    assert r["stats"] is None and r["kernel"] in merged_kernels, (nodes[i]["name"], r)
                    continue
                s = r["stats"]
                assert s is not None and s["nan"] == 0 and s["inf"] == 0 and r["n"] > 0, (nodes[i]["name"], r)
                assert all(np.isfinite(s[k]) for k in ("min", "max", "mean", "std"))
                assert (i in phase["graph"]["inputs"]) == ("kernel" not in r)
        out = phase["graph"]["outputs"][0]
        rec = next(r for r in phase["steps"][0]["nodes"] if r["id"] == out)
        x = first_row.astype(np.float64)
        assert rec["stats"]["max"] == x.max() and rec["stats"]["min"] == x.min()
        assert rec["values"] == x[::rec["stride"]][:16].tolist()
    decode = doc["phases"][1]
    names = {n["id"]: n["name"] for n in decode["graph"]["nodes"]}
    merged = {names[r["id"]]: r["kernel"] for r in decode["steps"][0]["nodes"] if r.get("merged")}
    assert merged.get("blk.0.ffn_gate") == merged.get("blk.0.ffn_up") == "fused_ffn_swiglu", merged
    assert all(n.endswith(MERGED_AWAY) for n in merged), merged
    kernels = {L["kernel"] for L in decode["launches"]}
    assert {"fused_ffn_swiglu", "matvec_residual"} <= kernels, kernels


def _generate_traced(capsys, monkeypatch, model, path, backend):
    monkeypatch.setenv("MINFER_TRACE", str(path))
    rc = main(["generate", str(model), "the cat sat on", "-n", "4", "--temp", "0", "--json", "--backend", backend])
    err = capsys.readouterr()
    assert rc == 0, err.err
    monkeypatch.delenv("MINFER_TRACE")
    return load_trace(str(path)), json.loads(err.out)["ids"]


def _upto(doc: dict, n_steps: int) -> dict:
    """The trace's first n_steps forward steps (phases in order)."""
    out, left = dict(doc, phases=[]), n_steps
    for p in doc["phases"]:
        if left <= 0:
            break
        out["phases"].append(dict(p, steps=p["steps"][:left]))
        left -= len(p["steps"])
    return out


def test_cpu_and_cuda_traces_diff_node_for_node(models, tmp_path, capsys, monkeypatch):
    """A CPU and a CUDA trace of one F32 model and prompt: the same graph on both sides
    (no node only on one), every record compared except the values CUDA's merged kernels
    keep to themselves, and no difference beyond CPU_CUDA_TOL."""
    a, ids_a = _generate_traced(capsys, monkeypatch, models["f32"], tmp_path / "cpu.json", "cpu")
    b, ids_b = _generate_traced(capsys, monkeypatch, models["f32"], tmp_path / "cuda.json", "cuda")
    # Step k produced ids[k]; past a differing pick the two runs read different tokens.
    same = next((k for k, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y), min(len(ids_a), len(ids_b)))
    n = min(same + 1, len(ids_a), len(ids_b))
    rep = diff_traces(_upto(a, n), _upto(b, n), tol=CPU_CUDA_TOL)
    text = format_report(rep, "cpu.json", "cuda.json")
    print("\n" + text)
    assert rep.only_a == [] and rep.only_b == [], text
    assert rep.merged_a == [] and rep.merged_b, text
    assert all(m.split(":", 1)[1].split(" ")[0].endswith(MERGED_AWAY) for m in rep.merged_b), rep.merged_b
    assert rep.compared > 0 and rep.first is None, text
    for doc, backend in ((a, "cpu"), (b, "cuda")):
        assert {n["backend"] for p in doc["phases"] for n in p["graph"]["nodes"]} == {backend}
    rc = main(["trace", "diff", str(tmp_path / "cpu.json"), str(tmp_path / "cuda.json"), "--tol", "1"])
    out = capsys.readouterr().out
    assert rc == 0 and "nodes stay inside merged kernels in cuda.json" in out


def _profile(model, *extra) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "minfer.cli", "profile", str(model), "the cat sat on", "-n", "4",
                           "--backend", "cuda", *extra], capture_output=True, text=True, timeout=300)


def test_profile_cli_on_cuda(models):
    """Per launch CUDA event times: every one positive, their sum the phase's step time
    and within the host's wall time around the forward (the device runs inside it)."""
    r = _profile(models["quant"], "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert [p["kind"] for p in doc["phases"]] == ["prefill", "decode"]
    for p in doc["phases"]:
        assert p["timer"] == "cuda events"
        nodes = {n["name"]: n for n in p["graph"]["nodes"]}
        launched = sorted(nodes[x]["id"] for row in p["nodes"] for x in row["nodes"])
        assert launched == sorted(n["id"] for n in nodes.values() if not n["dead"] and n["op"] not in
                                  ("Input", "KvcacheLoad"))
        assert all(row["ms"] > 0 for row in p["nodes"]), [row for row in p["nodes"] if not row["ms"] > 0]
        total = sum(row["ms"] for row in p["nodes"])
        assert total == pytest.approx(p["ms_per_step"])
        assert 0 < total <= p["wall_ms_per_step"] * 1.05 + 0.05, (total, p["wall_ms_per_step"])
        assert {o["op"] for o in p["ops"]} == {row["kernel"] for row in p["nodes"]}
    kernels = {row["kernel"] for row in doc["phases"][1]["nodes"]}
    assert "fused_ffn_swiglu" in kernels, kernels
    ffn = next(row for row in doc["phases"][1]["nodes"] if row["kernel"] == "fused_ffn_swiglu")
    assert len(ffn["nodes"]) == 3 and ffn["gbps"] and ffn["gbps"] > 0
    text = _profile(models["quant"], "--top", "5")
    assert text.returncode == 0, text.stderr
    assert "CUDA events around each kernel" in text.stdout and "fused_ffn_swiglu" in text.stdout


def test_viz_live_run_on_cuda(models):
    """POST /viz/run on a CUDA session: the run streams a record for every executed node
    of every step and the kernels of each phase, and its tokens are the untraced greedy
    run's."""
    model = models["quant"]
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "minfer.cli", "viz", str(model), "--port", str(port),
                             "--backend", "cuda"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=dict(os.environ))
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(base + "/viz/info", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"minfer viz did not come up: {proc.stdout.read().decode(errors='replace')}")
            time.sleep(0.2)
        c = httpx.Client(base_url=base, timeout=60)
        assert c.get("/viz/info").json()["backends"][0] == "CUDA"
        with c.stream("GET", "/viz/events") as sse:
            lines = sse.iter_lines()
            assert next(lines) == "event: hello"
            r = c.post("/viz/run", json={"prompt": "the cat sat", "n": 4})
            assert r.status_code == 202, r.text
            events = sse_events(lines, 120)
        kinds = [e for e, _ in events]
        assert kinds[-1] == "done", events[-1]
        assert kinds.count("phase") == 2 and kinds.count("step") == 4
        phases = {d["kind"]: d for e, d in events if e == "phase"}
        for kind, d in phases.items():
            launched = [i for L in d["launches"] for i in L["nodes"]]
            assert sorted(launched) == sorted(n["id"] for n in d["graph"]["nodes"]
                                              if not n["dead"] and n["op"] not in ("Input", "KvcacheLoad"))
        merged = 0
        for e, d in events:
            if e == "step":
                g = phases[d["kind"]]["graph"]
                executed = {n["id"] for n in g["nodes"] if not n["dead"] and n["op"] not in KV_OPS}
                assert {r["id"] for r in d["nodes"]} == executed
                merged += sum(1 for r in d["nodes"] if r.get("merged"))
                assert all(r["stats"] is not None for r in d["nodes"] if not r.get("merged"))
        assert merged > 0, "decode steps run merged kernels"
        done = events[-1][1]
        sess = Session.open(model, n_ctx=512, backends=["cuda"])
        want = sess.generate(sess.tokenizer.encode("the cat sat"), 4, SamplingParams(temperature=0.0),
                             stop_at_eog=False).ids
        assert done["ids"] == want
        node = c.get("/viz/node/5?kind=decode").json()
        assert node["node"]["id"] == 5 and node["record"] is not None
        assert c.get("/viz/live").json()["format"] == "minfer-trace"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def test_mixed_splits_trace_each_backend_its_own_way(models):
    """With a node CUDA does not take (here: every RMSNorm, pinned to the CPU by a
    restricted CUDA entry), the graph is cut into CPU and CUDA splits: the CUDA splits run
    as launches (no merges across splits), the CPU ones step by step, and the traced
    logits are the untraced run's bits."""
    import dataclasses

    from minfer.backends import cpu as cpu_backend
    from minfer.graph.ir import Op
    from minfer.model import Model

    base = cuda_backend.ENTRY
    restricted = dataclasses.replace(base, supports_op=lambda n: n.op is not Op.RmsNorm and base.supports_op(n))
    entries = sorted([restricted, cpu_backend.ENTRY], key=lambda e: e.order_key)
    outs = []
    for traced in (False, True):
        m = Model.open(models["quant"], backends=["cuda", "cpu"])
        m.entries = entries
        sess = Session(m, n_ctx=64)
        tracer = Tracer(sess.model_name, max_values=8) if traced else None
        sess.context.tracer = tracer
        outs.append(greedy_rows(sess, prompt(5, seed=3), 2))
        if traced:
            cache = sess.context.cache
            assert len(cache.splits) > 2 and {ls.entry.name for ls in cache.lowered.splits} == {"cuda", "cpu"}
            for phase in tracer.phases:
                nodes = {n["id"]: n for n in phase["graph"]["nodes"]}
                recs = {r["id"]: r for r in phase["steps"][0]["nodes"]}
                assert all(r.get("kernel") is None for i, r in recs.items() if nodes[i]["backend"] == "cpu")
                assert all(r.get("kernel") for i, r in recs.items()
                           if nodes[i]["backend"] == "cuda" and i not in phase["graph"]["inputs"])
                assert not any(r.get("merged") for r in recs.values())
    for a, b in zip(*outs):
        assert a.tobytes() == b.tobytes()
