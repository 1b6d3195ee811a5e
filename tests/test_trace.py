"""MINFER_TRACE: per-node capture is faithful (traced logits == untraced, bitwise; the
recorded stats are the values' stats) and complete (every executed non-KV node), step by
step on the CPU and launch by launch where a split runs its own kernels (the CUDA path,
emulated here over the CPU's plan; tests/test_cuda_trace.py runs it on a GPU)."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from minfer.cli import main
from minfer.session import Session
from minfer.errors import MinferError
from minfer.graph.ir import KV_BOUND, Op
from minfer.tools.trace import Tracer, load_trace, node_record
from minfer.tools.trace_diff import diff_traces, format_report

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
    for traced in (False, True, "launches"):
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
            # "launches": every split runs as a device's launches would (fake_launches),
            # its staged inputs all read before its first launch.
            tr = Tracer("m", max_values=64) if traced is True else LaunchTracer("m", max_values=64)
            tr.execute(c)
            recs = {r["id"]: r for r in tr.phases[0]["steps"][0]["nodes"]}
            assert set(recs) == {n.id for n in g.nodes}
            A = 2.0 * X.astype(np.float64)
            assert recs[g.node_by_name("a").id]["values"] == A.reshape(-1).tolist()
            assert [n["backend"] for n in tr.phases[0]["graph"]["nodes"]] == ["cpu2", "cpu2", "cpu", "cpu2", "cpu2"]
            if traced != "launches":
                assert "launches" not in tr.phases[0]
            else:
                assert [L["nodes"] for L in tr.phases[0]["launches"]] == [[1], [2], [3], [4]]
        else:
            c.execute()
        outs.append(c.alloc.copy_to_host(g.outputs[0]).tobytes())
    assert outs[0] == outs[1] == outs[2]


# -- the launch path (a device split's kernels, step merges included), emulated on the CPU --

def merge_groups(graph, ls) -> list:
    """CUDA's decode step merges, drawn on a CPU plan: q|k|v in one launch; rope q, rope k
    and the KV store in one; gate|up + SwiGLU in one; a MatMul + the Add of its output in
    one; every other step alone. [(kernel, plan step indices)]."""
    nodes = [graph.nodes[i] for i in ls.step_nodes]
    ops = [n.op for n in nodes]
    groups, j = [], 0
    while j < len(nodes):
        if ops[j:j + 3] == [Op.MatMul] * 3 and len({n.src[0] for n in nodes[j:j + 3]}) == 1:
            groups.append(("fused_matvec", [j, j + 1, j + 2]))
        elif ops[j:j + 3] == [Op.RoPE, Op.RoPE, Op.KvcacheStore]:
            groups.append(("fused_rope_kv_store", [j, j + 1, j + 2]))
        elif ops[j:j + 3] == [Op.MatMul, Op.MatMul, Op.SwiGLU]:
            groups.append(("fused_ffn_swiglu", [j, j + 1, j + 2]))
        elif ops[j:j + 2] == [Op.MatMul, Op.Add] and nodes[j].id in nodes[j + 1].src:
            groups.append(("matvec_residual", [j, j + 1]))
        else:
            groups.append((ops[j].value, [j]))
        j += len(groups[-1][1])
    return groups


def fake_launches(ls, groups, calls: list):
    """ls.launches as a device gives it (tools see kernels, not steps), over the CPU plan."""
    def launches(after=None, timed=False):
        assert not (after is not None and timed)
        out = []
        for k, (kernel, steps) in enumerate(groups):
            t0 = time.perf_counter_ns()
            ls.run(steps[0], steps[-1] + 1)
            ms = (time.perf_counter_ns() - t0) / 1e6 if timed else None
            if after is not None:
                after(k, kernel, steps)
            out.append((kernel, list(steps), ms))
        calls.append(timed)
        return out
    return launches


def with_launches(cache, calls: list) -> None:
    for ls in cache.lowered.splits:
        if ls.launches is None:
            ls.launches = fake_launches(ls, merge_groups(cache.graph, ls), calls)


class LaunchTracer(Tracer):
    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.calls: list = []   # per forward: whether its launches were timed

    def execute(self, cache) -> None:
        with_launches(cache, self.calls)
        super().execute(cache)


MERGED_AWAY = ("k_rope", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@pytest.fixture(scope="module")
def launch_traced(synth_model_path):
    plain = Session.open(synth_model_path, n_ctx=64, n_threads=1)
    tp = Tracer(plain.model_name, max_values=16)
    plain.context.tracer = tp
    want = _run(plain, 2)
    eng = Session.open(synth_model_path, n_ctx=64, n_threads=1)
    tracer = LaunchTracer(eng.model_name, max_values=16)
    eng.context.tracer = tracer
    got = _run(eng, 2)
    return want, got, tracer, tp


def test_launch_trace_equals_step_trace_bitwise(launch_traced):
    want, got, tracer, _ = launch_traced
    assert tracer.calls == [False] * 3   # one untimed launch run per forward
    for a, b in zip(want, got):
        assert a.tobytes() == b.tobytes()


def test_launch_trace_records_where_values_leave_the_kernel(launch_traced):
    """Every executed node has a record naming its kernel; a node whose value no node
    outside its merged launch reads is marked merged and carries no data, every other
    one has the stats of its value."""
    _, _, tracer, _ = launch_traced
    doc = json.loads(json.dumps(tracer.document()))
    for phase in doc["phases"]:
        nodes = {n["id"]: n for n in phase["graph"]["nodes"]}
        executed = {i for i, n in nodes.items() if not n["dead"] and n["op"] not in {str(o) for o in KV_BOUND}}
        launched = [i for L in phase["launches"] for i in L["nodes"]]
        assert sorted(launched) == sorted(i for i, n in nodes.items() if not n["dead"] and n["op"] not in
                                          ("Input", "KvcacheLoad"))
        kernels = {L["kernel"] for L in phase["launches"]}
        assert {"fused_matvec", "fused_rope_kv_store", "fused_ffn_swiglu", "matvec_residual"} <= kernels
        for step in phase["steps"]:
            recs = {r["id"]: r for r in step["nodes"]}
            assert set(recs) == executed
            for i, r in recs.items():
                name = nodes[i]["name"]
                if i in phase["graph"]["inputs"]:
                    assert "kernel" not in r and r["stats"] is not None
                    continue
                assert r["kernel"] in kernels
                # The last layer's attn_output also feeds the tail rows in a prefill.
                away = name.endswith(MERGED_AWAY) and not (phase["kind"] == "prefill" and name == "blk.1.attn_output")
                assert bool(r.get("merged")) == away, name
                assert (r["stats"] is None) == away, name


def test_launch_trace_diffs_clean_against_a_step_trace(launch_traced):
    _, _, tracer, plain = launch_traced
    rep = diff_traces(plain.document(), tracer.document(), tol=0.0)
    assert rep.first is None and rep.compared > 0 and not rep.only_a and not rep.only_b
    assert rep.merged_a == [] and rep.merged_b
    assert all(m.split(":", 1)[1].split(" ")[0].endswith(MERGED_AWAY) for m in rep.merged_b)
    assert "decode:blk.0.ffn_gate (fused_ffn_swiglu)" in rep.merged_b
    text = format_report(rep, "cpu.json", "dev.json")
    assert f"not compared: {len(rep.merged_b)} nodes stay inside merged kernels in dev.json" in text
    assert "fused_ffn_swiglu: " in text


def test_step_hook_alone_keeps_running_plan_steps(synth_model_path):
    """cache.execute(on_step=...) steps through the plan even where a split has launches
    (the identity tests' step-by-step runs); only on_launch takes the launch path."""
    eng = Session.open(synth_model_path, n_ctx=64, n_threads=1)
    eng.forward([5, 6, 7])
    cache = eng.context.cache
    calls: list = []
    with_launches(cache, calls)
    seen = []
    cache.execute(on_step=lambda node, ls: seen.append(node.id))
    assert calls == [] and seen == cache.lowered.splits[0].step_nodes
    launched = []
    cache.execute(on_step=lambda node, ls: seen.append(node.id), on_launch=lambda L, ls: launched.append(L))
    assert calls == [False] and len(seen) == len(cache.lowered.splits[0].step_nodes)
    assert [n.id for L in launched for n in L.nodes] == cache.lowered.splits[0].step_nodes
    assert all(L.ms is None for L in launched)
    launched.clear()
    cache.execute(on_launch=lambda L, ls: launched.append(L), timed=True)
    assert calls == [False, True] and all(L.ms is not None and L.ms >= 0 for L in launched)
