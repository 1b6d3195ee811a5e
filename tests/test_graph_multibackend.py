"""Multi-backend machinery without a GPU: a second CPU-backed backend with its own
pool and a restricted capability matrix (no Silu, no fused kernels) forces splits,
cross-backend staging, two-phase boundaries and the mismatch error."""

from __future__ import annotations

import math

import numpy as np
import pytest

from minfer.backends import CPU_ID, cpu, default_registry, select_backends
from minfer.errors import BackendError
from minfer.graph.builder import GraphBuilder
from minfer.graph.cache import GraphCache
from minfer.graph.ir import AttnMeta, DType, GraphError, Op
from minfer.graph.params import CParams, GraphParams, GraphType
from minfer.graph.weights import WeightRegistry

RNG = np.random.default_rng(7)
CPU2 = 3
D, F = 32, 16
PARAMS = GraphParams(2, 2, GraphType.Prefill, CParams(16))


def restricted(node) -> bool:
    return node.op is not Op.Silu and cpu.supports_op(node)


@pytest.fixture()
def reg():
    r = default_registry().copy()
    r.register(cpu.make_entry("cpu2", id=CPU2, priority=150, supports_op_fn=restricted,
                              supports_fused_fn=lambda f: False))
    return r


@pytest.fixture(scope="module")
def weights():
    W = RNG.standard_normal((F, D)).astype(np.float32)
    nw = RNG.standard_normal(D).astype(np.float32)
    w = WeightRegistry()
    w.add_f32("W", W)
    w.add_f32("nw", nw)
    return w, W, nw


def graph():
    b = GraphBuilder()
    x = b.input("x", (D, 2))
    a = b.add(x, x, name="a")          # cpu2
    s = b.silu(a, name="s")            # cpu (cpu2 has no silu)
    r = b.rms_norm(s, "nw", 1e-6, name="r")  # cpu2 again
    m = b.mul(r, a, name="m")          # reads a from its own backend's canonical buffer
    o = b.matmul(m, "W", 0, D, F, name="o")
    b.output(o)
    return b.build(), o


def reference(X, W, nw):
    A = 2.0 * X.astype(np.float64)
    S = A / (1 + np.exp(-A))
    R = S / np.sqrt((S * S).mean(1, keepdims=True) + 1e-6) * nw
    return (R * A) @ W.T


def installed(reg, weights, backends):
    w = weights[0]
    c = GraphCache(select_backends(backends, reg), w, {"threads": 2})
    g, o = graph()
    c.install(g, PARAMS)
    return c, g, o


def test_splits_and_staging(reg, weights):
    w, W, nw = weights
    c, g, o = installed(reg, weights, ["cpu", "cpu2"])
    ids = {n.name: n.id for n in g.nodes}
    assert [n.backend for n in g.nodes] == [CPU2, CPU2, CPU_ID, CPU2, CPU2, CPU2]
    sp = c.splits
    assert [(s.backend, s.node_range) for s in sp] == [(CPU2, (0, 2)), (CPU_ID, (2, 3)), (CPU2, (3, 6))]
    assert sp[1].inputs == [ids["a"]] and sp[2].inputs == [ids["s"]]
    assert sp[0].outputs == [ids["a"]] and sp[1].outputs == [ids["s"]]
    assert set(c.alloc.cross) == {(ids["a"], CPU_ID), (ids["s"], CPU2)}
    X = RNG.standard_normal((2, D)).astype(np.float32)
    c.alloc.fill_input(g, "x", X)
    c.execute()
    got = c.alloc.copy_to_host(o)
    np.testing.assert_allclose(got, reference(X, W, nw), rtol=1e-4, atol=1e-4)
    assert c.alloc.stats == {"copies": 2, "waits": 2}   # one wait per copy

    # Split execution is bitwise identical to running everything on one backend.
    c1, g1, o1 = installed(reg, weights, ["cpu"])
    assert len(c1.splits) == 1
    c1.alloc.fill_input(g1, "x", X)
    c1.execute()
    assert c1.alloc.copy_to_host(o1).tobytes() == got.tobytes()


def test_staging_is_reused_by_a_re_executed_graph(reg, weights):
    w, W, nw = weights
    c, g, o = installed(reg, weights, ["cpu", "cpu2"])
    staged = {k: v.dst for k, v in c.alloc.cross.items()}
    counts = {b: pool.count() for b, pool in c.alloc.devices.items()}
    for step in range(3):
        X = RNG.standard_normal((2, D)).astype(np.float32)
        assert c.try_reuse(PARAMS)
        c.alloc.fill_input(g, "x", X)
        c.execute()
        np.testing.assert_allclose(c.alloc.copy_to_host(o), reference(X, W, nw), rtol=1e-4, atol=1e-4)
    assert {k: v.dst for k, v in c.alloc.cross.items()} == staged
    assert {b: pool.count() for b, pool in c.alloc.devices.items()} == counts
    assert c.alloc.stats == {"copies": 6, "waits": 6}


def test_staged_read_before_its_wait_is_refused(reg, weights):
    c, g, o = installed(reg, weights, ["cpu", "cpu2"])
    key = next(iter(c.alloc.cross))
    c.alloc.begin_execute()
    with pytest.raises(GraphError, match="awaited"):
        c.alloc.cross_input(key)
    c.alloc.enqueue_cross(key)
    c.alloc.enqueue_cross(key)           # already in flight: same transfer, no second copy
    with pytest.raises(GraphError, match="awaited"):
        c.alloc.cross_input(key)
    c.alloc.await_cross(key)
    assert c.alloc.cross_input(key) == c.alloc.cross[key].dst
    assert c.alloc.stats == {"copies": 1, "waits": 1}


def test_per_node_path_waits_at_first_read(reg, weights):
    c, g, o = installed(reg, weights, ["cpu", "cpu2"])
    X = RNG.standard_normal((2, D)).astype(np.float32)
    c.alloc.fill_input(g, "x", X)
    c.execute()
    whole = c.alloc.copy_to_host(o).copy()
    states = []
    s_id = g.node_by_name("s").id

    def on_step(node, ls):
        if node.name == "s":   # s reads the staged a: its wait has happened, s's own copy has not started
            states.append((c.alloc.cross[(g.node_by_name("a").id, CPU_ID)].state, c.alloc.cross[(s_id, CPU2)].state))

    c.execute(on_step=on_step)
    assert states == [("ready", "idle")]
    assert c.alloc.copy_to_host(o).tobytes() == whole.tobytes()


def test_no_backend_for_a_node_is_an_error_naming_it(reg, weights):
    w = weights[0]
    c = GraphCache(select_backends(["cpu2"], reg), w, {"threads": 2})
    g, _ = graph()
    with pytest.raises(BackendError, match=r"node 2 \(s\).*Silu"):
        c.install(g, PARAMS)


def test_node_on_another_backend_than_its_kv_is_an_error_naming_both(reg):
    nh, nkv, hd, n_ctx = 2, 1, 8, 8
    b = GraphBuilder()
    x = b.input("x", (nh * hd, 1))
    k = b.input("k", (nkv * hd, 1))
    pos = b.input("pos", (1,), DType.I32)
    b.kvcache_store(0, k, k, pos, nkv * hd, n_ctx, name="kv_store")
    kv = b.kvcache_load(0, nkv * hd, n_ctx, name="kv_load")
    b.output(b.attn(x, kv, pos, AttnMeta(0, nh, nkv, hd, 1 / math.sqrt(hd), n_ctx), name="attn"))
    g = b.build()
    g.node_by_name("kv_store").backend = CPU2       # creates layer 0's KV on cpu2
    for name in ("kv_load", "attn"):
        g.node_by_name(name).backend = CPU_ID
    c = GraphCache(select_backends(["cpu", "cpu2"], reg), WeightRegistry(), {"threads": 2})
    with pytest.raises(BackendError, match=r"node 4 \(kv_load\) runs in a cpu split but its buffer lives on backend cpu2"):
        c.install(g, PARAMS)


def test_assignment_is_deterministic_by_priority_then_id():
    from minfer.graph.scheduler import BackendScheduler
    r1, r2 = default_registry().copy(), default_registry().copy()
    e7 = cpu.make_entry("e7", id=7, priority=120)
    e6 = cpu.make_entry("e6", id=6, priority=120)
    r1.register(e7)
    r1.register(e6)
    r2.register(e6)
    r2.register(e7)
    for r in (r1, r2):
        g, _ = graph()
        BackendScheduler(r.select_backends(["e7", "cpu", "e6"])).assign_backends(g)
        assert {n.backend for n in g.nodes} == {6}
