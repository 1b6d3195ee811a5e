"""MINFER_TRACE: per-node capture is faithful (traced logits == untraced, bitwise; the
recorded stats are the values' stats) and complete (every executed non-KV node)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from minfer.cli import main
from minfer.session import Session
from minfer.errors import MinferError
from minfer.graph.ir import KV_BOUND
from minfer.tools.trace import Tracer, load_trace, node_record

PROMPT = [3, 14, 15, 92, 65, 35]


def _run(engine, steps: int) -> list:
    """Prefill PROMPT, then greedy decode `steps` tokens; every logits row, copied."""
    engine.reset()
    rows = [engine.forward(PROMPT)[-1].copy()]
    for _ in range(steps):
        rows.append(engine.forward([int(np.argmax(rows[-1]))])[-1].copy())
    return rows


@pytest.fixture(scope="module")
def traced(synth_model_path):
    plain = Session.open(synth_model_path, n_ctx=64, n_threads=2)
    want = _run(plain, 3)
    eng = Session.open(synth_model_path, n_ctx=64, n_threads=2)
    tracer = Tracer(eng.model_name, prompt="p", max_values=16)
    eng.context.tracer = tracer
    got = _run(eng, 3)
    return want, got, tracer, eng


def test_traced_logits_equal_untraced_bitwise(traced):
    want, got, _, _ = traced
    assert len(want) == len(got) == 4
    for a, b in zip(want, got):
        assert a.tobytes() == b.tobytes()


def test_trace_records_every_executed_node(traced):
    want, _, tracer, eng = traced
    doc = json.loads(json.dumps(tracer.document()))
    assert doc["format"] == "minfer-trace" and doc["version"] == 1
    assert [(p["kind"], len(p["steps"])) for p in doc["phases"]] == [("prefill", 1), ("decode", 3)]
    for phase, first_row in zip(doc["phases"], (want[0], want[1])):
        nodes = phase["graph"]["nodes"]
        executed = {n["id"] for n in nodes if not n["dead"] and n["op"] not in {str(o) for o in KV_BOUND}}
        step = phase["steps"][0]
        assert {r["id"] for r in step["nodes"]} == executed
        # The logits node's recorded stats are the stats of the logits the run returned.
        out = phase["graph"]["outputs"][0]
        rec = next(r for r in step["nodes"] if r["id"] == out)
        x = first_row.astype(np.float64)
        assert rec["n"] == x.size and rec["stride"] == -(-x.size // 16) and len(rec["values"]) == 16
        assert rec["stats"]["max"] == x.max() and rec["stats"]["min"] == x.min()
        assert rec["stats"]["mean"] == pytest.approx(x.mean(), rel=1e-12)
        assert rec["values"] == x[::rec["stride"]][:16].tolist()
        assert step["logits_top"][0]["id"] == int(np.argmax(first_row))


def test_node_record_counts_non_finite():
    r = node_record(7, "f32", np.array([1.0, np.nan, np.inf, -3.0, -np.inf], dtype=np.float32), 8)
    assert r["stats"] == {"min": -3.0, "max": 1.0, "mean": -1.0, "std": 2.0, "nan": 1, "inf": 2}
    assert r["values"] == [1.0, None, None, -3.0, None] and r["stride"] == 1 and r["n"] == 5
    empty = node_record(1, "f32", np.array([np.nan], dtype=np.float32), 4)
    assert empty["stats"]["min"] is None and empty["stats"]["nan"] == 1


def test_minfer_trace_env_on_generate(synth_model_path, tmp_path, monkeypatch, capsys):
    path = tmp_path / "t.json"
    monkeypatch.setenv("MINFER_TRACE", str(path))
    rc = main(["generate", str(synth_model_path), "the cat", "-n", "3", "--temp", "0", "--json"])
    assert rc == 0, capsys.readouterr().err
    out = json.loads(capsys.readouterr().out)
    doc = load_trace(str(path))
    steps = [s for p in doc["phases"] for s in p["steps"]]
    assert doc["prompt"] == "the cat" and doc["model"] == synth_model_path.name
    assert [s["token"] for s in steps] == out["ids"] and all(isinstance(s["text"], str) for s in steps)
    monkeypatch.setenv("MINFER_TRACE", str(tmp_path / "missing" / "t.json"))
    rc = main(["generate", str(synth_model_path), "the cat", "-n", "1", "--temp", "0", "--json"])
    err = capsys.readouterr().err
    assert rc == 1 and "cannot write trace" in err and "Traceback" not in err


def test_load_trace_refuses_other_files(tmp_path):
    p = tmp_path / "x.json"
    p.write_text('{"format": "minfer-graph", "version": 1}')
    with pytest.raises(MinferError, match="not a minfer-trace"):
        load_trace(str(p))
    p.write_text("{not json")
    with pytest.raises(MinferError, match="not JSON"):
        load_trace(str(p))


def test_trace_across_backend_splits():
    """Two host backends (a CPU-backed second backend that lacks Silu) cut the graph into
    splits with staged inputs; capture reads every node in each split, and the output
    is the same bits as an untraced run."""
    from minfer.backends import cpu
    from minfer.graph.builder import GraphBuilder
    from minfer.graph.cache import GraphCache
    from minfer.graph.ir import Op
    from minfer.graph.params import CParams, GraphParams, GraphType
    from minfer.backends import default_registry, select_backends
    from minfer.graph.weights import WeightRegistry

    reg = default_registry().copy()
    reg.register(cpu.make_entry("cpu2", id=3, priority=150, supports_op_fn=lambda n: n.op is not Op.Silu
                                and cpu.supports_op(n), supports_fused_fn=lambda f: False))
    rng = np.random.default_rng(3)
    w = WeightRegistry()
    w.add_f32("W", rng.standard_normal((8, 16)).astype(np.float32))
    X = rng.standard_normal((2, 16)).astype(np.float32)
    outs = []
    for traced in (False, True):
        b = GraphBuilder()
        x = b.input("x", (16, 2))
        a = b.add(x, x, name="a")
        s = b.silu(a, name="s")
        m = b.mul(s, a, name="m")
        b.output(b.matmul(m, "W", 0, 16, 8, name="o"))
        g = b.build()
        c = GraphCache(select_backends(["cpu", "cpu2"], reg), w, {"threads": 1})
        c.install(g, GraphParams(2, 2, GraphType.Prefill, CParams(16)))
        assert len(c.splits) == 3
        c.alloc.fill_input(g, "x", X)
        if traced:
            tr = Tracer("m", max_values=64)
            tr.execute(c)
            recs = {r["id"]: r for r in tr.phases[0]["steps"][0]["nodes"]}
            assert set(recs) == {n.id for n in g.nodes}
            A = 2.0 * X.astype(np.float64)
            assert recs[g.node_by_name("a").id]["values"] == A.reshape(-1).tolist()
            assert [n["backend"] for n in tr.phases[0]["graph"]["nodes"]] == ["cpu2", "cpu2", "cpu", "cpu2", "cpu2"]
        else:
            c.execute()
        outs.append(c.alloc.copy_to_host(g.outputs[0]).tobytes())
    assert outs[0] == outs[1]


def test_trace_refuses_a_device_pool():
    """A pool with no host view (a GPU's) is refused up front, never read per node."""
    from types import SimpleNamespace

    split = SimpleNamespace(device=object(), entry=SimpleNamespace(name="cuda", memory="cuda"))
    cache = SimpleNamespace(lowered=SimpleNamespace(splits=[split]), graph=None, alloc=None)
    with pytest.raises(MinferError, match="'cuda'.*--backend cpu"):
        Tracer("m").execute(cache)
