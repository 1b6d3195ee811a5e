"""Graphviz DOT export (--dump-graph): one node per CNode labelled with its name and
op, filled by backend, double circles on inputs and outputs, edges from sources."""

from __future__ import annotations

import io
from typing import Optional, TextIO, Union

from minfer.graph.ir import ComputeGraph
from minfer.graph.registry import CPU_ID, CUDA_ID, METAL_ID, Registry, default_registry

COLORS = {CPU_ID: "lightyellow", CUDA_ID: "lightgreen", METAL_ID: "lightblue"}
# Backends registered later (tests, future devices) still get a distinct fill.
_EXTRA = ("lavender", "mistyrose", "honeydew", "wheat")


def backend_color(backend: Optional[int]) -> str:
    if backend is None:
        return "white"
    return COLORS.get(backend, _EXTRA[backend % len(_EXTRA)])


def _q(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def dot_text(graph: ComputeGraph, registry: Optional[Registry] = None) -> str:
    reg = registry or default_registry()
    ends = set(graph.inputs) | set(graph.outputs)
    out = io.StringIO()
    out.write("digraph minfer {\n  rankdir=TB;\n")
    # The positions input feeds every layer: with dot's default crossing minimisation a
    # 24-layer graph takes minutes to lay out; bounded passes take about a second.
    out.write("  graph [mclimit=0.1, nslimit=1, nslimit1=1, searchsize=10];\n")
    out.write("  node [style=filled, fontname=\"Helvetica\", fontsize=10];\n")
    for n in graph.nodes:
        label = f"{n.name}\n{n.op} [{reg.name_of(n.backend)}]"
        attrs = [f"label={_q(label)}", f"fillcolor={_q(backend_color(n.backend))}",
                 "shape=doublecircle" if n.id in ends else "shape=box"]
        if n.id in graph.dead:
            attrs.append('style="filled,dashed"')
        out.write(f"  n{n.id} [{', '.join(attrs)}];\n")
    for n in graph.nodes:
        for s in n.src:
            out.write(f"  n{s} -> n{n.id};\n")
    out.write("}\n")
    return out.getvalue()


def write_dot(graph: ComputeGraph, path_or_file: Union[str, TextIO], registry: Optional[Registry] = None) -> None:
    text = dot_text(graph, registry)
    if hasattr(path_or_file, "write"):
        path_or_file.write(text)
    else:
        with open(path_or_file, "w", encoding="utf-8") as f:
            f.write(text)
