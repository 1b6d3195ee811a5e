"""--dump-graph-json: every Op and NodeMeta variant is exported, and the exported
graph is the one the live run installs (same fusion, same backend assignment)."""

from __future__ import annotations

import json
import typing

import pytest

from minfer.cli import main
from minfer.session import Session
from minfer.graph import ir
from minfer.graph.export import FUSED_OPS, graph_json, meta_json, op_detail
from minfer.graph.ir import (AttnMeta, CNode, ComputeGraph, DType, EmbedMeta, KvcacheMeta, MatMulMeta, NormMeta, Op,
                             RoPEMeta)

ROPE = RoPEMeta(n_rot=16, freq_base=1e6, hd=16, nh=4)
# One node per op, with the meta it carries (GetRows twice: gather rows and embedding).
CASES = [
    (Op.Input, None), (Op.Add, None), (Op.Mul, None), (Op.Silu, None),
    (Op.RmsNorm, NormMeta(1e-6, "blk.0.attn_norm.weight")),
    (Op.QkNorm, NormMeta(1e-6, "blk.0.attn_q_norm.weight", hd=16, nh=4)),
    (Op.MatMul, MatMulMeta("blk.0.attn_q.weight", 64, 64, "blk.0.attn_q.bias", wtype=8)),
    (Op.GetRows, None), (Op.GetRows, EmbedMeta("token_embd.weight", 300, wtype=12)), (Op.RoPE, ROPE),
    (Op.Attn, AttnMeta(layer=1, n_head=4, n_head_kv=2, hd=16, scale=0.25, n_ctx=64)),
    (Op.KvcacheStore, KvcacheMeta(1, 32, 64)), (Op.KvcacheLoad, KvcacheMeta(1, 32, 64)),
    (Op.SwiGLU, None),
    # mixture of experts
    (Op.Sigmoid, None), (Op.MoeTopK, ir.MoeRouteMeta(8, 2)),
    (Op.MoeWeights, ir.MoeRouteMeta(8, 2, ir.Gating.Softmax, norm=True)),
    (Op.MatMulId, ir.MatMulIdMeta("blk.0.ffn_gate_exps.weight", 64, 32, 8, wtype=12)), (Op.MoeSum, None),
    # the dense families beyond Qwen (llama, gemma2/3, phi3)
    (Op.Scale, ir.ScalarMeta(8.0)), (Op.Gelu, None), (Op.GeGLU, None), (Op.Softcap, ir.ScalarMeta(30.0)),
    (Op.Slice, ir.SliceMeta(16)),
]


def test_every_op_and_meta_variant_is_exported():
    assert {op for op, _ in CASES} == set(Op), "add the new op to CASES (and to export._DETAIL)"
    variants = {t for t in typing.get_args(ir.NodeMeta) if t is not type(None)}
    assert {type(m) for _, m in CASES if m is not None} == variants
    nodes = [CNode(i, f"blk.1.n{i}", op, [], (8, 1, 1, 1), DType.F32, backend=0, meta=m)
             for i, (op, m) in enumerate(CASES)]
    doc = json.loads(json.dumps(graph_json(ComputeGraph(nodes, [0], [len(nodes) - 1]), "m.gguf", "decode")))
    assert doc["format"] == "minfer-graph" and doc["version"] == 1 and doc["kind"] == "decode"
    for (op, m), n in zip(CASES, doc["nodes"]):
        assert n["op"] == str(op) and n["detail"] and n["backend"] == "cpu" and n["layer"] == 1
        assert n["fused"] == (op in FUSED_OPS)
        if m is None:
            assert n["meta"] is None
        else:
            assert n["meta"]["type"] == type(m).__name__
            # Every payload field is in the export (nested RoPE included).
            for f in m.__dataclass_fields__:
                assert f in n["meta"]
    rope = doc["nodes"][[op for op, _ in CASES].index(Op.RoPE)]
    assert rope["meta"]["type"] == "RoPEMeta" and rope["meta"]["style"] == "neox"
    mm = [op for op, _ in CASES].index(Op.MatMul)
    assert "q8_0" in op_detail(nodes[mm]) and "64->64" in op_detail(nodes[mm])
    assert meta_json(None) is None


@pytest.fixture(scope="module")
def engines(synth_model_path):
    return (Session.open(synth_model_path, n_ctx=64, n_threads=1),
            Session.open(synth_model_path, n_ctx=64, n_threads=1, fuse=False))


def _live(engine, ids):
    """Run a forward and export the graph the cache actually installed for it."""
    engine.forward(ids)
    g = engine.context.cache.graph
    return graph_json(g, engine.model_name, "decode" if len(ids) == 1 else "prefill",
                      engine.context.cache.name_of)


@pytest.mark.parametrize("fused", [True, False])
def test_export_is_the_graph_the_live_run_installs(engines, fused):
    engine = engines[0] if fused else engines[1]
    engine.reset()
    prompt = [1, 2, 3, 4, 5]
    live_prefill = _live(engine, prompt)
    live_decode = _live(engine, [6])
    assert engine.graph_json(len(prompt), decode=False) == live_prefill
    assert engine.graph_json(1, decode=True) == live_decode
    ops = [n["op"] for n in live_decode["nodes"]]
    dead = [n["name"] for n in live_decode["nodes"] if n["dead"]]
    if fused:
        assert "SwiGLU" in ops and dead and all(name.endswith("ffn_silu") for name in dead)
    else:
        assert "SwiGLU" not in ops and not dead


def test_dump_graph_json_cli(synth_model_path, tmp_path, capsys):
    out = tmp_path / "g.json"
    rc = main(["--dump-graph-json", str(out), str(synth_model_path), "hello there", "--decode"])
    assert rc == 0, capsys.readouterr().err
    doc = json.loads(out.read_text())
    assert doc["kind"] == "decode" and doc["model"] == synth_model_path.name
    assert [n["id"] for n in doc["nodes"]] == list(range(len(doc["nodes"])))
    assert all(set(n) >= {"id", "name", "op", "detail", "shape", "dtype", "backend", "src", "meta"} for n in doc["nodes"])
    assert doc["outputs"] == [len(doc["nodes"]) - 1]
    capsys.readouterr()
    rc = main(["--dump-graph-json", str(tmp_path / "no" / "dir" / "g.json"), str(synth_model_path), "hi"])
    err = capsys.readouterr().err
    # A target in a missing folder is a bad argument (exit 2), refused before any work.
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err and "does not exist" in err
