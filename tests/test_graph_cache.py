"""Graph reuse: params-only identity, uid, the structural debug check, and that a
reused graph computes exactly what a freshly built one does."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from minfer.backends import select_backends
from minfer.graph.builder import GraphBuilder
from minfer.graph.cache import GraphCache, verify_structural
from minfer.graph.ir import DType
from minfer.graph.params import KV_TYPES, CParams, GraphParams, GraphType
from minfer.graph.weights import WeightRegistry

RNG = np.random.default_rng(5)
D, F = 16, 24


@pytest.fixture(scope="module")
def weights():
    w = WeightRegistry()
    w.add_f32("W", RNG.standard_normal((F, D)).astype(np.float32))
    w.add_f32("nw", RNG.standard_normal(D).astype(np.float32))
    return w


def build(params: GraphParams, eps: float = 1e-6):
    nt = params.n_tokens
    b = GraphBuilder()
    x = b.input("x", (D, nt))
    tail = b.input("tail", (params.n_out,), DType.I32) if params.n_out < nt else None
    h = b.rms_norm(x, "nw", eps, name="norm")
    if tail is not None:
        h = b.get_rows(h, tail, (D, params.n_out), name="tail_rows")
    g = b.matmul(h, "W", 0, D, F, name="up")
    b.output(b.mul(b.silu(g, name="silu"), g, name="act"))
    return b.build()


BASE = GraphParams(4, 1, GraphType.Prefill, CParams(n_ctx=64))


def changed_params():
    out = []
    for f, v in (("n_tokens", 5), ("n_out", 2), ("gtype", GraphType.Decode), ("weights_version", 2)):
        out.append(dataclasses.replace(BASE, **{f: v}))
    # Every CParams field, so a switch added later is covered without listing it here.
    for f in (fd.name for fd in dataclasses.fields(CParams)):
        cur = getattr(BASE.cparams, f)
        if isinstance(cur, bool):
            new = not cur
        elif isinstance(cur, int):
            new = cur * 2 or 1
        else:
            new = next(k for k in KV_TYPES if k != cur) if f == "kv_type" else pytest.fail(f"no change for {f}")
        out.append(dataclasses.replace(BASE, cparams=dataclasses.replace(BASE.cparams, **{f: new})))
    return out


def test_equal_params_reuse_and_any_change_rebuilds(weights):
    c = GraphCache(select_backends(["cpu"]), weights, {"threads": 1})
    assert not c.try_reuse(BASE)
    c.install(build(BASE), BASE)
    assert c.try_reuse(GraphParams(4, 1, GraphType.Prefill, CParams(n_ctx=64)))
    changes = changed_params()
    assert len(changes) == 4 + len(dataclasses.fields(CParams))
    for p in changes:
        assert not c.try_reuse(p), p


@pytest.mark.parametrize("flag", ["fuse_swiglu", "explicit_span"])
def test_graph_switches_are_part_of_the_identity(weights, flag):
    c = GraphCache(select_backends(["cpu"]), weights, {"threads": 1})
    on = dataclasses.replace(BASE, cparams=dataclasses.replace(BASE.cparams, **{flag: not getattr(BASE.cparams, flag)}))
    gb = c.install(build(BASE), BASE)
    assert not c.try_reuse(on)
    go = c.install(build(on), on)
    # BASE's graph is kept aside (small graphs are): reuse hands back that graph, never on's.
    assert c.try_reuse(BASE) and c.graph is gb and c.params == BASE
    assert c.try_reuse(on) and c.graph is go


def test_small_graphs_are_kept_ready_and_big_ones_released(weights):
    """Speculative decoding alternates block sizes: each small graph is built once and
    switched to without a rebuild; the oldest beyond KEEP and any big one are freed."""
    c = GraphCache(select_backends(["cpu"]), weights, {"threads": 1})
    ps = [dataclasses.replace(BASE, n_tokens=n) for n in (1, 2, 3)]
    graphs = [c.install(build(p), p) for p in ps]
    for _ in range(2):
        for p, g in zip(ps, graphs):
            assert c.try_reuse(p) and c.graph is g
    big = dataclasses.replace(BASE, n_tokens=c.KEEP_MAX_TOKENS + 1)
    c.install(build(big), big)
    assert c.try_reuse(ps[0])            # the big one is set aside as freed, not kept
    assert not c.try_reuse(big)
    # A bucketed server step (up to KEEP_MAX_TOKENS rows) is kept too.
    dec = dataclasses.replace(BASE, n_tokens=24, n_out=24)
    gd = c.install(build(dec), dec)
    c.install(build(ps[1]), ps[1])
    assert c.try_reuse(dec) and c.graph is gd
    c.KEEP = 2
    c.install(build(big), big)           # keeps dec; the others kept before: all but two are evicted
    assert len(c._kept) <= 2


def test_uid_is_monotonic_and_kept_on_reuse(weights):
    c = GraphCache(select_backends(["cpu"]), weights, {"threads": 1})
    g1 = c.install(build(BASE), BASE)
    assert g1.uid >= 1
    assert c.try_reuse(BASE) and c.current() is g1 and g1.uid == c.graph.uid
    g2 = c.install(build(BASE), BASE)
    assert g2.uid > g1.uid


def test_reused_graph_output_is_bitwise_a_fresh_build(weights):
    xs = [RNG.standard_normal((4, D)).astype(np.float32) for _ in range(3)]
    c = GraphCache(select_backends(["cpu"]), weights, {"threads": 2})
    c.install(build(BASE), BASE)
    plans = [ls.plan for ls in c.lowered.splits]
    for x in xs:
        assert c.try_reuse(BASE)
        c.alloc.fill_input(c.graph, "x", x)
        c.alloc.fill_input(c.graph, "tail", [3])
        c.execute()
    reused = c.alloc.copy_to_host(c.graph.outputs[0])
    assert [ls.plan for ls in c.lowered.splits] == plans         # re-run, not re-lowered
    fresh = GraphCache(select_backends(["cpu"]), weights, {"threads": 2})
    g = fresh.install(build(BASE), BASE)
    fresh.alloc.fill_input(g, "x", xs[-1])
    fresh.alloc.fill_input(g, "tail", [3])
    fresh.execute()
    assert fresh.alloc.copy_to_host(g.outputs[0]).tobytes() == reused.tobytes()


def test_structural_check(weights):
    a, b = build(BASE), build(BASE)
    assert verify_structural(a, b)
    assert not verify_structural(a, build(BASE, eps=1e-5))      # a payload changed
    bigger = GraphBuilder()
    x = bigger.input("x", (D, 4))
    bigger.output(bigger.add(x, x))
    assert not verify_structural(a, bigger.build())
    # Both sides prepared (assigned + fused) stay equal.
    for g in (a, b):
        GraphCache(select_backends(["cpu"]), weights, {"threads": 1}).preview(g)
    assert a.dead and verify_structural(a, b)
