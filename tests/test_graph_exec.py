"""Small synthetic f32 graphs executed through the whole pipeline (assign -> fuse ->
allocate -> lower -> one _core.run per split), checked against plain NumPy."""

from __future__ import annotations

import numpy as np
import pytest

from minfer.backends import cpu, default_registry, select_backends
from minfer.graph.builder import GraphBuilder
from minfer.graph.cache import GraphCache
from minfer.graph.fusion import FusionPass
from minfer.graph.ir import DType, Op
from minfer.graph.params import CParams, GraphParams, GraphType
from minfer.graph.weights import WeightRegistry

RNG = np.random.default_rng(1234)


def params(nt: int = 1) -> GraphParams:
    return GraphParams(nt, nt, GraphType.Prefill if nt > 1 else GraphType.Decode, CParams(n_ctx=32))


def run(graph, weights, feeds: dict, backends=("cpu",), registry=None):
    cache = GraphCache(select_backends(list(backends), registry), weights, {"threads": 2})
    cache.install(graph, params())
    for name, arr in feeds.items():
        cache.alloc.fill_input(graph, name, arr)
    cache.execute()
    return cache


def silu(x):
    return x / (1.0 + np.exp(-x))


def rms(x, w, eps):
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(axis=1, keepdims=True) + eps) * w


def close(got, ref, tol=1e-4):
    scale = max(1.0, float(np.abs(ref).max()))
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol * scale)


def test_elementwise_and_norm_chain_matches_numpy():
    d, nt = 40, 3
    w = WeightRegistry()
    nw = RNG.standard_normal(d).astype(np.float32)
    w.add_f32("nw", nw)
    b = GraphBuilder()
    x = b.input("x", (d, nt))
    y = b.input("y", (d, nt))
    a = b.add(x, y)
    m = b.mul(a, x)
    s = b.silu(m)
    r = b.rms_norm(s, "nw", 1e-5)
    r2 = b.rms_norm(a, None, 1e-5)
    o = b.swiglu(r, r2)
    b.output(o)
    b.output(a)
    g = b.build()
    X = RNG.standard_normal((nt, d)).astype(np.float32)
    Y = RNG.standard_normal((nt, d)).astype(np.float32)
    c = run(g, w, {"x": X, "y": Y})
    A = X.astype(np.float64) + Y
    R = rms(silu(A * X), nw, 1e-5)
    ref = silu(R) * rms(A, 1.0, 1e-5)
    close(c.alloc.copy_to_host(o), ref)
    np.testing.assert_array_equal(c.alloc.copy_to_host(a), X + Y)


def test_f32_matmul_with_bias_is_token_major():
    d, od, nt = 64, 24, 5
    W = RNG.standard_normal((od, d)).astype(np.float32)
    bias = RNG.standard_normal(od).astype(np.float32)
    w = WeightRegistry()
    w.add_f32("W", W)
    w.add_f32("bias", bias)
    b = GraphBuilder()
    x = b.input("x", (d, nt))
    y = b.matmul(x, "W", 0, d, od, bias_name="bias")
    b.output(y)
    g = b.build()
    assert g.nodes[y].out_shape == (od, nt, 1, 1)
    X = RNG.standard_normal((nt, d)).astype(np.float32)
    c = run(g, w, {"x": X})
    got = c.alloc.copy_to_host(y)
    assert got.shape == (nt, od)
    close(got, X.astype(np.float64) @ W.T + bias)


def test_embedding_and_get_rows_match_numpy():
    d, vocab, nt = 32, 50, 4
    table = RNG.standard_normal((vocab, d)).astype(np.float32)
    w = WeightRegistry()
    w.add_f32("tok", table)
    b = GraphBuilder()
    ids = b.input("ids", (nt,), DType.I32)
    tail = b.input("tail", (2,), DType.I32)
    e = b.embedding(ids, "tok", 0, d, vocab)
    h = b.add(e, e)
    t = b.get_rows(h, tail, (d, 2))
    b.output(t)
    g = b.build()
    IDS = np.array([7, 0, 49, 7])
    c = run(g, w, {"ids": IDS, "tail": [3, 1]})
    np.testing.assert_array_equal(c.alloc.copy_to_host(t), (table[IDS] * 2)[[3, 1]])


def test_bad_token_id_is_an_error_not_a_crash():
    table = np.zeros((10, 8), np.float32)
    w = WeightRegistry()
    w.add_f32("tok", table)
    b = GraphBuilder()
    ids = b.input("ids", (2,), DType.I32)
    b.output(b.embedding(ids, "tok", 0, 8, 10))
    g = b.build()
    with pytest.raises(Exception, match="vocabulary"):
        run(g, w, {"ids": [1, 10]})


def _ffn(gate_first: bool, direct: bool = False, extra_silu_use: bool = False):
    d, f, nt = 32, 48, 3
    b = GraphBuilder()
    x = b.input("x", (d, nt))
    gt = b.matmul(x, "wg", 0, d, f, name="gate")
    up = b.matmul(x, "wu", 0, d, f, name="up")
    if direct:
        act = b.swiglu(gt, up, name="act")
    else:
        s = b.silu(gt, name="silu")
        act = b.mul(s, up, name="act") if gate_first else b.mul(up, s, name="act")
        if extra_silu_use:
            b.output(b.add(s, up, name="extra"))
    out = b.matmul(act, "wd", 0, f, d, name="down")
    b.output(out)
    return b.build(), out


@pytest.fixture(scope="module")
def ffn_weights():
    d, f = 32, 48
    ws = {k: RNG.standard_normal(s).astype(np.float32) for k, s in
          (("wg", (f, d)), ("wu", (f, d)), ("wd", (d, f)))}
    w = WeightRegistry()
    for k, v in ws.items():
        w.add_f32(k, v)
    X = RNG.standard_normal((3, d)).astype(np.float32)
    ref = (silu(X.astype(np.float64) @ ws["wg"].T) * (X @ ws["wu"].T)) @ ws["wd"].T
    return w, X, ref


@pytest.mark.parametrize("gate_first", [True, False])
def test_fusion_rewrites_silu_on_either_side(ffn_weights, gate_first):
    w, X, ref = ffn_weights
    g, out = _ffn(gate_first)
    cache = GraphCache(select_backends(["cpu"]), w, {"threads": 2})
    cache.scheduler.assign_backends(g)
    assert FusionPass().run(g, cache.scheduler.by_id) == 1
    act, silu_node = g.node_by_name("act"), g.node_by_name("silu")
    assert act.op is Op.SwiGLU
    assert act.src == [g.node_by_name("gate").id, g.node_by_name("up").id]   # gate first, whatever the mul order
    assert silu_node.id in g.dead
    cache.install(g, params())
    assert silu_node.id not in cache.alloc.node_to_buf                       # fused away: no buffer
    assert all(silu_node.id not in ls.step_nodes for ls in cache.lowered.splits)
    cache.alloc.fill_input(g, "x", X)
    cache.execute()
    close(cache.alloc.copy_to_host(out), ref)


def test_fusion_leaves_a_silu_with_another_consumer(ffn_weights):
    w, X, ref = ffn_weights
    g, out = _ffn(True, extra_silu_use=True)
    c = run(g, w, {"x": X})
    assert g.node_by_name("act").op is Op.Mul and not g.dead
    close(c.alloc.copy_to_host(out), ref)


def test_fusion_only_where_the_backend_supports_it(ffn_weights):
    w, X, ref = ffn_weights
    reg = default_registry().copy()
    reg.register(cpu.make_entry("nofuse", id=5, priority=150, supports_fused_fn=lambda f: False))
    g, out = _ffn(True)
    c = run(g, w, {"x": X}, backends=["nofuse"], registry=reg)
    assert g.node_by_name("act").op is Op.Mul and not g.dead
    close(c.alloc.copy_to_host(out), ref)


def test_fused_and_unfused_swiglu_are_bitwise_identical(ffn_weights):
    """The pass runs on both sides (§5.2): a graph the pass rewrote vs one built with swiglu."""
    w, X, _ = ffn_weights
    g1, o1 = _ffn(True)
    g2, o2 = _ffn(True, direct=True)
    c1 = run(g1, w, {"x": X})
    c2 = run(g2, w, {"x": X})
    assert g1.node_by_name("act").op is Op.SwiGLU and g2.node_by_name("act").op is Op.SwiGLU
    assert c1.alloc.copy_to_host(o1).tobytes() == c2.alloc.copy_to_host(o2).tobytes()


def test_per_node_path_matches_plan_path(ffn_weights):
    w, X, _ = ffn_weights
    g, out = _ffn(True)
    c = run(g, w, {"x": X})
    whole = c.alloc.copy_to_host(out).copy()
    seen = []
    c.execute(on_step=lambda node, ls: seen.append(node.id))
    assert seen == [n for ls in c.lowered.splits for n in ls.step_nodes] and len(seen) == 4
    assert c.alloc.copy_to_host(out).tobytes() == whole.tobytes()


def test_unregistered_weight_is_a_clear_error():
    from minfer.graph.ir import GraphError
    b = GraphBuilder()
    x = b.input("x", (8, 1))
    b.output(b.matmul(x, "missing.weight", 0, 8, 4))
    with pytest.raises(GraphError, match="missing.weight"):
        run(b.build(), WeightRegistry(), {})
