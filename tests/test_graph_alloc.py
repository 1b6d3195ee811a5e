"""GraphAllocator regressions: the hazards the design of record records, KV
persistence across rebuilds, and host access checks."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from minfer.errors import MinferError
from minfer.graph.alloc import liveness, plan_buffers
from minfer.graph.builder import GraphBuilder
from minfer.backends import select_backends
from minfer.graph.cache import GraphCache
from minfer.graph.ir import AttnMeta, DType, GraphError
from minfer.graph.params import CParams, GraphParams, GraphType
from minfer.graph.weights import WeightRegistry

RNG = np.random.default_rng(99)


def cache_for(weights=None) -> GraphCache:
    return GraphCache(select_backends(["cpu"]), weights or WeightRegistry(), {"threads": 2})


def p(nt: int, n_ctx: int = 16) -> GraphParams:
    return GraphParams(nt, nt, GraphType.Prefill if nt > 1 else GraphType.Decode, CParams(n_ctx))


def overlapping_sharers(graph, slot_of) -> list:
    """Pairs of nodes that share a buffer while both are live in build (= execution) order."""
    order = range(len(graph.nodes))
    last = liveness(graph, order)
    by_slot: dict = {}
    for nid, s in slot_of.items():
        by_slot.setdefault(s, []).append(nid)
    bad = []
    for nids in by_slot.values():
        for i in nids:
            for j in nids:
                aliased = graph.nodes[j].src[:1] == [i] and last[i] == j
                if i < j and not aliased and last[i] >= j:
                    bad.append((i, j))
    return bad


def two_chains():
    """Two independent chains: Kahn order interleaves them level by level, build order doesn't."""
    b = GraphBuilder()
    x = b.input("x", (16, 1))
    y = b.input("y", (16, 1))
    a1 = b.add(x, x)
    a2 = b.add(a1, a1)
    a3 = b.add(a2, a2)
    b1 = b.add(y, y)
    b2 = b.add(b1, b1)
    out = b.add(a3, b2)
    b.output(out)
    return b.build(), out


def test_liveness_uses_build_order_not_topological_order():
    g, out = two_chains()
    topo = g.topo_order()
    assert topo != list(range(len(g.nodes)))
    c = cache_for()
    c.scheduler.assign_backends(g)
    # The hazard is real for this graph: buffers planned on Kahn order get clobbered
    # when execution follows build order ...
    slot_topo, _ = plan_buffers(g, topo)
    assert overlapping_sharers(g, slot_topo)
    # ... and the allocator's plan has no such pair, and computes the right value.
    c.install(g, p(1))
    slot_build = {n: (r.backend, r.id) for n, r in c.alloc.node_to_buf.items()}
    assert not overlapping_sharers(g, slot_build)
    X = RNG.standard_normal(16).astype(np.float32)
    Y = RNG.standard_normal(16).astype(np.float32)
    c.alloc.fill_input(g, "x", X)
    c.alloc.fill_input(g, "y", Y)
    c.execute()
    np.testing.assert_array_equal(c.alloc.copy_to_host(out)[0], 8 * X + 4 * Y)


def test_inputs_never_share_a_buffer():
    """A late input must not take the buffer of an earlier input (or any node) that is dead
    by then: inputs are all filled before anything runs."""
    b = GraphBuilder()
    x1 = b.input("x1", (8, 1))
    a = b.add(x1, x1)
    t = b.add(a, a)               # a and x1 are dead after this in build order
    x2 = b.input("x2", (8, 1))    # same size, declared late
    o = b.add(t, x2)
    b.output(o)
    g = b.build()
    c = cache_for()
    c.install(g, p(1))
    bufs = c.alloc.node_to_buf
    for inp in (x1, x2):
        others = [n for n in bufs if n != inp]
        assert all(bufs[n] != bufs[inp] for n in others), f"input {inp} shares a buffer"
    c.alloc.fill_input(g, "x1", np.full(8, 1.0))
    c.alloc.fill_input(g, "x2", np.full(8, 10.0))
    c.execute()
    np.testing.assert_array_equal(c.alloc.copy_to_host(o)[0], np.full(8, 14.0))


def test_in_place_alias_only_for_a_sole_consumer():
    b = GraphBuilder()
    x = b.input("x", (8, 2))
    a = b.add(x, x)
    s1 = b.silu(a)                # a has a second consumer below: no alias
    u = b.add(a, s1)
    c2 = b.add(u, u)
    s2 = b.silu(c2)               # sole consumer: aliased
    o = b.add(s2, x)
    b.output(o)
    g = b.build()
    c = cache_for()
    c.install(g, p(2))
    bufs = c.alloc.node_to_buf
    assert bufs[s1] != bufs[a]
    assert bufs[s2] == bufs[c2]
    X = RNG.standard_normal((2, 8)).astype(np.float32)
    c.alloc.fill_input(g, "x", X)
    c.execute()
    A = 2.0 * X.astype(np.float64)
    U = A + A / (1 + np.exp(-A))
    ref = 2 * U / (1 + np.exp(-2 * U)) + X
    np.testing.assert_allclose(c.alloc.copy_to_host(o), ref, rtol=1e-5, atol=1e-5)


def test_input_and_output_are_never_aliased():
    b = GraphBuilder()
    x = b.input("x", (8, 1))
    s = b.silu(x)                 # x is an input: silu must not overwrite it
    b.output(s)
    b.output(x)
    g = b.build()
    c = cache_for()
    c.install(g, p(1))
    assert c.alloc.node_to_buf[s] != c.alloc.node_to_buf[x]
    c.alloc.fill_input(g, "x", np.arange(8))
    c.execute()
    c.execute()
    np.testing.assert_array_equal(c.alloc.copy_to_host(x)[0], np.arange(8, dtype=np.float32))


# ---- KV regions across a prefill -> decode rebuild ----

D, NH, NKV, HD, NCTX = 32, 4, 2, 8, 16
KVD = NKV * HD


@pytest.fixture(scope="module")
def attn_weights():
    ws = {"wq": RNG.standard_normal((NH * HD, D)), "wk": RNG.standard_normal((KVD, D)),
          "wv": RNG.standard_normal((KVD, D))}
    ws = {k: (v / math.sqrt(D)).astype(np.float32) for k, v in ws.items()}
    w = WeightRegistry()
    for k, v in ws.items():
        w.add_f32(k, v)
    return w, ws


def attn_graph(nt: int, kv_type: DType = DType.F32):
    b = GraphBuilder()
    x = b.input("x", (D, nt))
    pos = b.input("positions", (nt,), DType.I32)
    q = b.matmul(x, "wq", 0, D, NH * HD, name="q")
    k = b.matmul(x, "wk", 0, D, KVD, name="k")
    v = b.matmul(x, "wv", 0, D, KVD, name="v")
    b.kvcache_store(0, k, v, pos, KVD, NCTX, name="kv_store", kv_type=kv_type)
    kv = b.kvcache_load(0, KVD, NCTX, name="kv_load", kv_type=kv_type)
    a = b.attn(q, kv, pos, AttnMeta(0, NH, NKV, HD, 1 / math.sqrt(HD), NCTX, kv_type=kv_type), name="attn")
    b.output(a)
    return b.build(), a


def ref_attention(Q, K, V, positions):
    out = np.zeros((len(positions), NH * HD))
    for t, pt in enumerate(positions):
        for h in range(NH):
            kh = h // (NH // NKV)
            q = Q[t, h * HD:(h + 1) * HD]
            ks = K[:pt + 1, kh * HD:(kh + 1) * HD]
            vs = V[:pt + 1, kh * HD:(kh + 1) * HD]
            s = ks @ q / math.sqrt(HD)
            e = np.exp(s - s.max())
            out[t, h * HD:(h + 1) * HD] = (e / e.sum()) @ vs
    return out


def test_kv_regions_survive_a_prefill_to_decode_rebuild(attn_weights):
    w, ws = attn_weights
    X = RNG.standard_normal((4, D)).astype(np.float32)
    c = cache_for(w)
    g1, _ = attn_graph(3)
    c.install(g1, p(3))
    c.alloc.fill_input(g1, "x", X[:3])
    c.alloc.fill_input(g1, "positions", [0, 1, 2])
    c.execute()
    region = (c.alloc.kv[0].k, c.alloc.kv[0].v)
    k_pre, v_pre = (a.copy() for a in c.alloc.copy_kv_to_host(0))
    assert np.abs(k_pre[:3]).sum() > 0 and not k_pre[3:].any()

    p_dec = p(1)
    assert not c.try_reuse(p_dec)
    g2, a2 = attn_graph(1)
    c.install(g2, p_dec)
    assert (c.alloc.kv[0].k, c.alloc.kv[0].v) == region
    k_mid, v_mid = c.alloc.copy_kv_to_host(0)
    assert k_mid.tobytes() == k_pre.tobytes() and v_mid.tobytes() == v_pre.tobytes()
    c.alloc.fill_input(g2, "x", X[3:])
    c.alloc.fill_input(g2, "positions", [3])
    c.execute()
    k_post, v_post = c.alloc.copy_kv_to_host(0)
    assert k_post[:3].tobytes() == k_pre[:3].tobytes()
    X64 = X.astype(np.float64)
    K, V, Q = X64 @ ws["wk"].T, X64 @ ws["wv"].T, X64 @ ws["wq"].T
    np.testing.assert_allclose(k_post[:4], K, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(v_post[:4], V, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(c.alloc.copy_to_host(a2), ref_attention(Q[3:], K, V, [3]), rtol=1e-4, atol=1e-4)


def test_kv_with_a_different_context_is_refused(attn_weights):
    w, _ = attn_weights
    c = cache_for(w)
    g1, _ = attn_graph(2)
    c.install(g1, p(2))
    global NCTX
    saved, NCTX = NCTX, 32
    try:
        g2, _ = attn_graph(1)
    finally:
        NCTX = saved
    with pytest.raises(GraphError, match="reset_kv"):
        c.install(g2, p(1, 32))
    c.reset_kv()
    assert not c.alloc.kv
    c.install(g2, p(1, 32))
    assert c.alloc.kv[0].n_ctx == 32


def test_f16_kv_regions_are_half_size_and_read_back_as_f32(attn_weights):
    """An f16 KV graph: regions sized 2 bytes per element, K/V stored rounded to f16,
    read back as float32, attention over the rounded values."""
    w, ws = attn_weights
    X = RNG.standard_normal((3, D)).astype(np.float32)
    c = cache_for(w)
    g, a = attn_graph(3, DType.F16)
    c.install(g, p(3))
    r = c.alloc.kv[0]
    assert r.kv_type is DType.F16
    assert c.alloc.devices[r.backend].size(r.k) == NCTX * KVD * 2
    c.alloc.fill_input(g, "x", X)
    c.alloc.fill_input(g, "positions", [0, 1, 2])
    c.execute()
    k, v = c.alloc.copy_kv_to_host(0)
    assert k.dtype == np.float32 and k.shape == (NCTX, KVD)
    X64 = X.astype(np.float64)
    K, V, Q = X64 @ ws["wk"].T, X64 @ ws["wv"].T, X64 @ ws["wq"].T
    K16, V16 = K.astype(np.float16).astype(np.float64), V.astype(np.float16).astype(np.float64)
    np.testing.assert_allclose(k[:3], K16, rtol=2e-3, atol=1e-4)
    assert np.array_equal(k[:3], k[:3].astype(np.float16).astype(np.float32))  # really f16 values
    np.testing.assert_allclose(v[:3], V16, rtol=2e-3, atol=1e-4)
    np.testing.assert_allclose(c.alloc.copy_to_host(a), ref_attention(Q, K16, V16, [0, 1, 2]), rtol=1e-3, atol=1e-3)


def test_kv_type_change_and_unsupported_kv_type_are_refused(attn_weights):
    from minfer.backends import cpu
    from minfer.backends import default_registry

    w, _ = attn_weights
    c = cache_for(w)
    c.install(attn_graph(2)[0], p(2))
    with pytest.raises(GraphError, match="f32 and a graph now asks for .* f16"):
        c.install(attn_graph(1, DType.F16)[0], p(1))
    reg = default_registry().copy()
    reg.register(dataclasses.replace(cpu.make_entry("cpu32", id=5, priority=150), kv_types=("f32",)))
    c2 = GraphCache(select_backends(["cpu32"], reg), w, {"threads": 2})
    with pytest.raises(GraphError, match="backend 'cpu32' cannot hold f16 KV .supports: f32."):
        c2.install(attn_graph(2, DType.F16)[0], p(2))
    assert not c2.alloc.kv


# ---- host access ----

def test_fill_input_checks():
    b = GraphBuilder()
    x = b.input("x", (4, 2))
    ids = b.input("ids", (2,), DType.I32)
    b.output(b.get_rows(x, ids, (4, 2)))
    g = b.build()
    c = cache_for()
    c.install(g, p(2))
    with pytest.raises(MinferError, match="exactly 8"):
        c.alloc.fill_input(g, "x", np.zeros(7))
    with pytest.raises(MinferError, match="integer"):
        c.alloc.fill_input(g, "ids", np.array([0.0, 1.0]))
    with pytest.raises(MinferError, match="no input named"):
        c.alloc.fill_input(g, "nope", [1])
    # Arrays already in the input's dtype take the short path: their size is still checked.
    with pytest.raises(MinferError, match="exactly 2"):
        c.alloc.fill_input(g, "ids", np.array([1, 0, 1], dtype=np.int32))
    with pytest.raises(MinferError, match="exactly 8"):
        c.alloc.fill_input(g, "x", np.zeros(9, dtype=np.float32))
    c.alloc.fill_input(g, "ids", np.arange(4, dtype=np.int32)[::-2])  # strided: copied contiguous
    ref = c.alloc.buffer(ids)
    assert c.alloc.devices[ref.backend].read(ref.id, "int32", 2).tolist() == [3, 1]
    c.alloc.fill_input(g, "ids", np.array([1, 0], dtype=np.int64))
    ref = c.alloc.buffer(ids)
    assert c.alloc.devices[ref.backend].read(ref.id, "int32", 2).tolist() == [1, 0]   # real int32, not f32 bits
    with pytest.raises(MinferError, match="no buffer"):
        c.alloc.buffer(999)



def test_inputs_form_one_group_and_a_step_fills_them_in_one_write(tmp_path):
    """A device with alloc_group/write_many (the CUDA pool has them) gets a graph's
    inputs as one group and a forward's inputs in one write_many (one H2D there), all
    checked before any is written; the logits stay those of the plain path (the CPU's)."""
    from minfer.session import Session
    from minfer.testing.synth import write_model

    path = write_model(tmp_path / "m.gguf").path
    plain = Session.open(path, n_ctx=32, backends=["cpu"])
    eng = Session.open(path, n_ctx=32, backends=["cpu"])
    (dev,) = eng.context.cache.alloc.devices.values()
    groups, writes = [], []

    def alloc_group(sizes):
        ids = [dev.pool.alloc_fresh(n) for n in sizes]
        groups.append((list(sizes), ids))
        return ids

    def write_many(ids, arrays):
        writes.append(list(ids))
        for i, a in zip(ids, arrays):
            dev.pool.write(i, a)

    dev.alloc_group, dev.write_many = alloc_group, write_many
    dev.bind_step = None  # the fills under test, not the decode step's one call (test_decode_step.py)
    for toks, n_out in (([1, 2, 3], 1), ([4], 1), ([5], 1)):
        got = eng.forward(toks, n_out=n_out)
        assert np.array_equal(got, plain.forward(toks, n_out=n_out))
    # prefill: token ids, positions, cells (3 x i32) and the tail row; decode: 3 x one i32
    assert [g[0] for g in groups] == [[12, 12, 12, 4], [4, 4, 4]]
    assert [sorted(w) for w in writes] == [sorted(groups[0][1]), sorted(groups[1][1]), sorted(groups[1][1])]
    with pytest.raises(MinferError, match="exactly 1"):
        eng.context.cache.alloc.fill_inputs(eng.context.cache.graph, {"token_ids": [7], "positions": [1, 2]})
    assert len(writes) == 3, "a bad input stops the fill before anything is written"
