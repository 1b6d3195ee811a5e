"""The backend seam: copies dispatched on the (source, destination) pair, weight types
decided by the backends' capabilities, per-backend weight stores with derived weights,
and the CPU's run settings living in its device."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants

from minfer.backends import CPU_ID, cpu, default_registry, default_threads, select_backends
from minfer.backends.host_weights import HostWeights
from minfer.errors import BackendError, UnsupportedModelError
from minfer.graph.backend import CopyRoute, copy_route
from minfer.graph.builder import GraphBuilder
from minfer.graph.cache import GraphCache
from minfer.graph.ir import Op
from minfer.graph.params import CParams, GraphParams, GraphType
from minfer.graph.weights import WeightRegistry

RNG = np.random.default_rng(11)
D, F = 32, 16
PARAMS = GraphParams(2, 2, GraphType.Prefill, CParams(16))
DEV = 9


class Routes:
    """Copy routes of a pretend device whose memory the CPU cannot address: they move
    the bytes with the host copy and log every start and wait."""

    def __init__(self) -> None:
        self.log: list = []

    def route(self, label: str) -> CopyRoute:
        def start(src_dev, src_buf, dst_dev, dst_buf, nbytes):
            self.log.append(("start", label))
            cpu.HOST_COPY.start(src_dev, src_buf, dst_dev, dst_buf, nbytes)
            return label

        def wait(ticket):
            self.log.append(("wait", ticket))

        return CopyRoute(label, start, wait)


def device_entry(routes: Routes | None, name: str = "dev"):
    """A CPU-backed backend posing as a device: own memory kind, no silu, no fusion."""
    e = cpu.make_entry(name, id=DEV, priority=150, supports_op_fn=lambda n: n.op is not Op.Silu and cpu.supports_op(n),
                       supports_fused_fn=lambda f: False,
                       copy_to=(lambda dst: routes.route("d2h") if dst.memory == "host" else None) if routes else None,
                       copy_from=(lambda src: routes.route("h2d") if src.memory == "host" else None) if routes else None)
    if routes is None:
        e = dataclasses.replace(e, copy_to=lambda other: None, copy_from=lambda other: None)
    return dataclasses.replace(e, memory="pretend-device")


def split_graph():
    b = GraphBuilder()
    x = b.input("x", (D, 2))
    a = b.add(x, x, name="a")          # dev
    s = b.silu(a, name="s")            # cpu (dev has no silu)
    o = b.add(s, a, name="o")          # dev
    b.output(o)
    return b.build(), o


def reg_with(entry):
    r = default_registry().copy()
    r.register(entry)
    return r


def test_copies_are_dispatched_on_the_source_destination_pair():
    routes = Routes()
    reg = reg_with(device_entry(routes))
    c = GraphCache(select_backends(["cpu", "dev"], reg), WeightRegistry(), {"threads": 2})
    g, o = split_graph()
    c.install(g, PARAMS)
    ids = {n.name: n.id for n in g.nodes}
    # dev -> cpu: the host cannot reach the device, so the device's copy_to drives it;
    # cpu -> dev: the CPU declines (not host memory), the device's copy_from takes it.
    assert {k: x.route.name for k, x in c.alloc.cross.items()} == {(ids["a"], CPU_ID): "d2h", (ids["s"], DEV): "h2d"}
    X = RNG.standard_normal((2, D)).astype(np.float32)
    for _ in range(2):
        routes.log.clear()
        c.alloc.fill_input(g, "x", X)
        c.execute()
        # one start and exactly one wait per copy, each wait before the consumer runs
        assert routes.log == [("start", "d2h"), ("wait", "d2h"), ("start", "h2d"), ("wait", "h2d")]
    A = 2.0 * X.astype(np.float64)
    np.testing.assert_allclose(c.alloc.copy_to_host(o), A / (1 + np.exp(-A)) + A, rtol=1e-5, atol=1e-5)
    assert c.alloc.stats == {"copies": 4, "waits": 4}


def test_host_to_host_copies_use_the_memcpy_route_and_the_source_is_asked_first():
    cpu2 = cpu.make_entry("cpu2", id=3, priority=150)
    assert copy_route(cpu.ENTRY, cpu2) is cpu.HOST_COPY and copy_route(cpu2, cpu.ENTRY) is cpu.HOST_COPY
    routes = Routes()
    both = dataclasses.replace(cpu.make_entry("both", id=4), copy_to=lambda d: routes.route("src"),
                               copy_from=lambda s: routes.route("dst"))
    assert copy_route(both, both).name == "src"


def test_a_pair_without_a_route_is_refused_naming_both():
    reg = reg_with(device_entry(None, name="island"))
    c = GraphCache(select_backends(["cpu", "island"], reg), WeightRegistry(), {"threads": 2})
    g, _ = split_graph()
    with pytest.raises(BackendError, match="no copy route from backend 'island' to backend 'cpu'"):
        c.install(g, PARAMS)


# -- weight types follow the backends' capabilities -----------------------------------------

def q8_weight(rows: int, cols: int):
    w = RNG.standard_normal((rows, cols)).astype(np.float32)
    raw = quants.quantize(w, Q.Q8_0)
    return raw, quants.dequantize(raw, Q.Q8_0)


def matmul_graph(wname: str, wtype: int, out_dim: int, in_dim: int = 64, nt: int = 2):
    b = GraphBuilder()
    x = b.input("x", (in_dim, nt))
    h = b.add(x, x, name="h")
    o = b.matmul(h, wname, int(wtype), in_dim, out_dim, name="mm")
    b.output(o)
    return b.build(), o


def test_a_type_no_selected_backend_runs_is_refused_up_front():
    raw, _ = q8_weight(8, 64)
    w = WeightRegistry()
    w.add("blk.0.ffn_up.weight", raw, Q.Q8_0, 64, 8)
    f32_only = cpu.make_entry("f32only", id=5, priority=150, weight_types=frozenset({int(Q.F32)}))
    with pytest.raises(UnsupportedModelError,
                       match=r"tensor blk\.0\.ffn_up\.weight has type Q8_0, which no selected backend \(f32only\) "
                             r"supports \(supported: F32\)"):
        GraphCache([f32_only], w, {"threads": 1})
    GraphCache(select_backends(["cpu"]), w, {"threads": 1})      # the CPU runs Q8_0


def test_assignment_follows_the_weight_types_each_backend_runs():
    raw, deq = q8_weight(8, 64)
    w = WeightRegistry()
    w.add("W", raw, Q.Q8_0, 64, 8)
    reg = reg_with(cpu.make_entry("f32only", id=5, priority=150, weight_types=frozenset({int(Q.F32)})))
    c = GraphCache(select_backends(["cpu", "f32only"], reg), w, {"threads": 2})
    g, o = matmul_graph("W", Q.Q8_0, 8)
    c.install(g, PARAMS)
    assert [(n.name, c.name_of(n.backend)) for n in g.nodes] == [("x", "f32only"), ("h", "f32only"), ("mm", "cpu")]
    assert "W" in w.on(cpu.ENTRY) and "W" not in w.on(reg.by_name("f32only"))   # registered only where used
    X = RNG.standard_normal((2, 64)).astype(np.float32)
    c.alloc.fill_input(g, "x", X)
    c.execute()
    np.testing.assert_allclose(c.alloc.copy_to_host(o), (2 * X.astype(np.float64)) @ deq.T.astype(np.float64),
                               rtol=0.05, atol=0.05 * np.abs(deq).sum(1).max())


def test_a_backend_store_refuses_a_type_it_does_not_run_naming_the_tensor():
    store = HostWeights("tiny", frozenset({int(Q.F32)}))
    with pytest.raises(UnsupportedModelError, match=r"tensor blk\.3\.attn_k\.weight has type Q8_0, which backend tiny"):
        store.add("blk.3.attn_k.weight", np.zeros(68, np.uint8), int(Q.Q8_0), 64, 1)


def test_cpu_weight_types_are_the_cores():
    from minfer import _core
    assert cpu.WEIGHT_TYPES == {int(t) for t in Q if _core.weight_type_supported(int(t))}
    assert {Q.F32, Q.F16, Q.Q8_0, Q.Q4_K, Q.Q6_K} <= cpu.WEIGHT_TYPES and Q.BF16 not in cpu.WEIGHT_TYPES


# -- derived weights -------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0])
def test_concat_rows_weight_equals_its_parts_bitwise_and_is_built_once_per_backend(qtype):
    parts = {"q": 8, "k": 4, "v": 4}
    w = WeightRegistry()
    for name, rows in parts.items():
        if qtype == Q.F32:
            w.add_f32(name, RNG.standard_normal((rows, 64)).astype(np.float32))
        else:
            w.add(name, q8_weight(rows, 64)[0], qtype, 64, rows)
    w.add_concat_rows("qkv", list(parts))
    assert w.info("qkv") == (int(qtype), 64, 16)
    X = RNG.standard_normal((2, 64)).astype(np.float32)

    def run(wname, rows):
        c = GraphCache(select_backends(["cpu"]), w, {"threads": 2})
        g, o = matmul_graph(wname, qtype, rows)
        c.install(g, PARAMS)
        c.alloc.fill_input(g, "x", X)
        c.execute()
        return c.alloc.copy_to_host(o)

    fused = run("qkv", 16)
    sep = np.concatenate([run(n, r) for n, r in parts.items()], axis=1)
    assert fused.tobytes() == sep.tobytes()
    bound = w.on(cpu.ENTRY)
    n = len(bound.store.core)
    run("qkv", 16)                                      # a second cache, same backend: not rebuilt
    assert len(bound.store.core) == n
    other = cpu.make_entry("cpu2", id=3, priority=150)
    assert "qkv" not in w.on(other)                     # each backend builds its own, on first use
    w.on(other).handle("qkv")
    assert "qkv" in w.on(other)


def test_concat_rows_refuses_mismatched_parts():
    from minfer.graph.ir import GraphError
    w = WeightRegistry()
    w.add_f32("a", np.zeros((2, 8), np.float32))
    w.add_f32("b", np.zeros((2, 4), np.float32))
    with pytest.raises(GraphError, match="one type and row width"):
        w.add_concat_rows("ab", ["a", "b"])
    with pytest.raises(GraphError, match=r"\['zz'\] are not registered"):
        w.add_concat_rows("az", ["a", "zz"])


# -- run settings are the backend's own -------------------------------------------------------

def test_threads_are_a_cpu_device_setting_with_one_default():
    from minfer import _core
    from minfer.tools import membw
    c = GraphCache(select_backends(["cpu"]), WeightRegistry(), {"threads": 3})
    assert c.alloc.devices[CPU_ID].n_threads == 3
    d = GraphCache(select_backends(["cpu"]), WeightRegistry())
    assert d.alloc.devices[CPU_ID].n_threads == default_threads()
    assert 1 <= default_threads() <= len(os.sched_getaffinity(0))
    # One answer: the bandwidth probe uses it, and the core has no default of its own.
    assert membw.default_threads is default_threads and not hasattr(_core, "default_threads")
