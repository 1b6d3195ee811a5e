"""DOT export and the trace summary."""

from __future__ import annotations

import io
import re
import shutil
import subprocess

from minfer.backends import select_backends
from minfer.graph.builder import GraphBuilder
from minfer.graph.cache import GraphCache
from minfer.graph.export import write_dot
from minfer.graph.trace import trace_enabled, trace_summary
from minfer.graph.weights import WeightRegistry


def small_graph():
    b = GraphBuilder()
    x = b.input("x", (8, 2))
    g = b.add(x, x, name='gate "g"')
    u = b.add(g, x, name="up")
    b.output(b.mul(b.silu(g, name="silu"), u, name="act"))
    return b.build()


def test_dot_structure(tmp_path):
    g = small_graph()
    unassigned = io.StringIO()
    write_dot(g, unassigned)
    assert unassigned.getvalue().count('fillcolor="white"') == len(g.nodes)
    c = GraphCache(select_backends(["cpu"]), WeightRegistry(), {"threads": 1})
    c.preview(g)
    path = tmp_path / "g.dot"
    write_dot(g, str(path))
    text = path.read_text()
    assert text.startswith("digraph") and text.rstrip().endswith("}")
    nodes = re.findall(r"^  n(\d+) \[(.*)\];$", text, re.M)
    edges = re.findall(r"^  n(\d+) -> n(\d+);$", text, re.M)
    assert [int(i) for i, _ in nodes] == list(range(len(g.nodes)))
    assert sorted((int(a), int(b)) for a, b in edges) == sorted((s, n.id) for n in g.nodes for s in n.src)
    for (i, attrs), n in zip(nodes, g.nodes):
        assert 'fillcolor="lightyellow"' in attrs
        assert ("shape=doublecircle" in attrs) == (n.id in g.inputs or n.id in g.outputs)
        assert str(n.op) in attrs
    assert r'gate \"g\"' in text                     # quotes escaped
    assert "SwiGLU" in text and "dashed" in text     # the fused-away silu is still drawn


def test_dot_renders_with_graphviz(tmp_path):
    if shutil.which("dot") is None:
        import pytest
        pytest.fail("graphviz `dot` is not installed (apt-get install graphviz)")
    g = small_graph()
    GraphCache(select_backends(["cpu"]), WeightRegistry(), {"threads": 1}).preview(g)
    path = tmp_path / "g.dot"
    write_dot(g, str(path))
    r = subprocess.run(["dot", "-Tsvg", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "<svg" in r.stdout


def test_trace_summary(monkeypatch):
    g = small_graph()
    c = GraphCache(select_backends(["cpu"]), WeightRegistry(), {"threads": 1})
    c.install(g, None)
    text = trace_summary(g, c.splits)
    assert "1 splits" in text and "split 0: cpu nodes [0, 5)" in text
    rows = dict(re.findall(r"^  (\w+)\s+(\d+)$", text, re.M))
    assert rows == {"Add": "2", "Input": "1", "SwiGLU": "1"}
    monkeypatch.setenv("MINFER_GRAPH_TRACE", "1")
    assert trace_enabled()
    monkeypatch.setenv("MINFER_GRAPH_TRACE", "0")
    assert not trace_enabled()
