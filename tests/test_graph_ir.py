"""IR and builder: shape rules, metadata identity, ordering checks."""

from __future__ import annotations

import pytest

from minfer.graph.builder import GraphBuilder
from minfer.graph.ir import AttnMeta, DType, GraphError, MatMulMeta, Op


def test_vocabulary_is_complete():
    # What the models build (python/minfer/models), plus SwiGLU, which FusionPass makes.
    names = {"Input", "Add", "Mul", "Silu", "RmsNorm", "QkNorm", "MatMul", "GetRows", "RoPE",
             "Attn", "KvcacheStore", "KvcacheLoad", "SwiGLU"}
    names |= {"Sigmoid", "MoeTopK", "MoeWeights", "MatMulId", "MoeSum"}  # mixture of experts (models/moe.py)
    names |= {"Scale", "Gelu", "GeGLU", "Softcap", "Slice"}  # llama / gemma / phi3 (models/blocks.py); GeGLU by FusionPass
    assert {o.name for o in Op} == names


def test_meta_equality_covers_payload():
    a = MatMulMeta("w", 8, 4, None, 12)
    assert a == MatMulMeta("w", 8, 4, None, 12) and hash(a) == hash(MatMulMeta("w", 8, 4, None, 12))
    assert a != MatMulMeta("w", 8, 4, "b", 12) and a != MatMulMeta("w", 8, 4, None, 14)
    with pytest.raises(Exception):
        a.in_dim = 9


def test_shape_rules():
    b = GraphBuilder()
    nt = 3
    x = b.input("x", (896, nt))
    pos = b.input("pos", (nt,), DType.I32)
    m = b.matmul(x, "w", 12, 896, 128)
    assert b._nodes[m].out_shape == (128, nt, 1, 1)
    qkv = b.matmul(x, "qkv", 12, 896, 14 * 64 + 2 * 128)
    kv = b.kvcache_load(0, 128, 32)
    a = b.attn(qkv, kv, pos, AttnMeta(0, 14, 2, 64, 0.125, 32))
    assert b._nodes[a].out_shape == (14 * 64, nt, 1, 1)          # from the meta, not from q's width
    e = b.embedding(pos, "tok", 12, 896, 151936)
    assert b._nodes[e].out_shape == (896, nt, 1, 1)


def test_builder_rejects_bad_graphs():
    b = GraphBuilder()
    x = b.input("x", (8, 2))
    y = b.input("y", (8, 3))
    with pytest.raises(GraphError, match="differ"):
        b.add(x, y)
    with pytest.raises(GraphError, match="in_dim"):
        b.matmul(x, "w", 0, 16, 4)
    with pytest.raises(GraphError, match="duplicate"):
        b.input("x", (8, 2))
    with pytest.raises(GraphError, match="earlier node"):
        b.node("bad", Op.Add, [x, 99], (8, 2))
    with pytest.raises(GraphError, match="i32"):
        b.get_rows(x, y, (8, 1))
    with pytest.raises(GraphError, match="no outputs"):
        GraphBuilder().build()


def test_topo_order_detects_cycles_and_build_order_checks_sources():
    b = GraphBuilder()
    x = b.input("x", (4, 1))
    a = b.add(x, x)
    s = b.silu(a)
    b.output(s)
    g = b.build()
    assert g.topo_order() == [0, 1, 2]
    g.nodes[a].src = [s, x]        # a <-> s
    with pytest.raises(GraphError, match="cycle"):
        g.topo_order()
    with pytest.raises(GraphError, match="built after"):
        g.check_build_order()


def test_capture_nt_hint():
    b = GraphBuilder()
    x = b.input("x", (8, 5))
    b.output(b.silu(x))
    assert b.build().capture_nt_hint() is None
    b = GraphBuilder()
    x = b.input("x", (8, 5))
    b.output(b.matmul(x, "w", 0, 8, 4))
    assert b.build().capture_nt_hint() == 5
