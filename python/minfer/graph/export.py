"""Graph export: Graphviz DOT (--dump-graph: one node per CNode labelled with its name
and op, filled by backend, double circles on inputs and outputs, edges from sources) and
the minfer-graph JSON document (--dump-graph-json, the viz page, trace phases)."""

from __future__ import annotations

import dataclasses
import enum
import io
import json
from typing import Callable, Optional, TextIO, Union

from minfer.graph.backend import CPU_ID, CUDA_ID, METAL_ID
from minfer.graph.backend import name_of as backend_name
from minfer.graph.ir import CNode, ComputeGraph, EmbedMeta, GraphError, Op, node_layer

COLORS = {CPU_ID: "lightyellow", CUDA_ID: "lightgreen", METAL_ID: "lightblue"}
# Backends registered later (tests, future devices) still get a distinct fill.
_EXTRA = ("lavender", "mistyrose", "honeydew", "wheat")


def backend_color(backend: Optional[int]) -> str:
    if backend is None:
        return "white"
    return COLORS.get(backend, _EXTRA[backend % len(_EXTRA)])


def _q(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def dot_text(graph: ComputeGraph, entries: Optional[list] = None) -> str:
    by_id = {e.id: e for e in entries or ()}
    ends = set(graph.inputs) | set(graph.outputs)
    out = io.StringIO()
    out.write("digraph minfer {\n  rankdir=TB;\n")
    # The positions input feeds every layer: with dot's default crossing minimisation a
    # 24-layer graph takes minutes to lay out; bounded passes take about a second.
    out.write("  graph [mclimit=0.1, nslimit=1, nslimit1=1, searchsize=10];\n")
    out.write("  node [style=filled, fontname=\"Helvetica\", fontsize=10];\n")
    for n in graph.nodes:
        label = f"{n.name}\n{n.op} [{backend_name(n.backend, by_id)}]"
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


def write_dot(graph: ComputeGraph, path_or_file: Union[str, TextIO], entries: Optional[list] = None) -> None:
    text = dot_text(graph, entries)
    if hasattr(path_or_file, "write"):
        path_or_file.write(text)
    else:
        with open(path_or_file, "w", encoding="utf-8") as f:
            f.write(text)


# ---- JSON for the visualizer and the trace files (--dump-graph-json) ----

GRAPH_FORMAT = "minfer-graph"
GRAPH_VERSION = 1


def _wtype_name(wtype: int) -> str:
    try:
        from gguf import GGMLQuantizationType
        return GGMLQuantizationType(int(wtype)).name.lower()
    except (ImportError, ValueError):
        return f"type{wtype}"


def _rope(m) -> str:
    extra = (f" scale={m.freq_scale:g}" if m.freq_scale != 1.0 else "") + \
        (f" attn_factor={m.attn_factor:g}" if m.attn_factor != 1.0 else "") + (f" factors={m.factors}" if m.factors else "")
    return f"rope {m.style.value} n_rot={m.n_rot} base={m.freq_base:g} hd={m.hd} nh={m.nh}{extra}"


def _bias(name) -> str:
    return " +bias" if name else ""


# One line per op saying what the node does with its payload. A table, not a fallback:
# a new Op without an entry fails test_graph_json (every variant is covered).
_DETAIL = {
    Op.Input: lambda n: f"input {n.out_dtype.value}",
    Op.Add: lambda n: "a + b",
    Op.Mul: lambda n: "a * b",
    Op.Silu: lambda n: "silu(x)",
    Op.RmsNorm: lambda n: f"rms_norm eps={n.meta.eps:g}" + (f" * {n.meta.weight_name}" if n.meta.weight_name else ""),
    Op.QkNorm: lambda n: f"per-head rms_norm hd={n.meta.hd} nh={n.meta.nh} eps={n.meta.eps:g}",
    Op.MatMul: lambda n: (f"{n.meta.weight_name} [{_wtype_name(n.meta.wtype)}] {n.meta.in_dim}->{n.meta.out_dim}"
                          f"{_bias(n.meta.bias_name)}{' ^T' if n.meta.transpose_b else ''}"),
    Op.GetRows: lambda n: (f"embedding {n.meta.weight_name} [{_wtype_name(n.meta.wtype)}] vocab={n.meta.n_vocab}"
                           if isinstance(n.meta, EmbedMeta) else "gather rows"),
    Op.RoPE: lambda n: _rope(n.meta),
    Op.Attn: lambda n: (f"{n.meta.mode.value} attention layer {n.meta.layer} heads {n.meta.n_head}/{n.meta.n_head_kv} "
                        f"hd={n.meta.hd} ctx={n.meta.n_ctx}{' span' if n.meta.explicit_span else ''}"
                        f"{f' window={n.meta.window}' if n.meta.window else ''}"
                        f"{f' softcap={n.meta.softcap:g}' if n.meta.softcap else ''}"),
    Op.KvcacheStore: lambda n: f"store K,V of layer {n.meta.layer} (kv_dim={n.meta.kv_dim})",
    Op.KvcacheLoad: lambda n: f"K/V region of layer {n.meta.layer} (n_ctx={n.meta.n_ctx})",
    Op.SwiGLU: lambda n: "silu(gate) * up (fused)",
    Op.Scale: lambda n: f"x * {n.meta.value:g}",
    Op.Gelu: lambda n: "gelu(x) (tanh approximation)",
    Op.GeGLU: lambda n: "gelu(gate) * up (fused)",
    Op.Softcap: lambda n: f"{n.meta.value:g} * tanh(x / {n.meta.value:g})",
    Op.Slice: lambda n: f"columns [{n.meta.offset}, {n.meta.offset + n.out_shape[0]})",
    Op.Sigmoid: lambda n: "sigmoid(x)",
    Op.MoeTopK: lambda n: f"top {n.meta.k} of {n.meta.n_expert} experts",
    Op.MoeWeights: lambda n: (f"{n.meta.gating.name.lower()} weights of the top {n.meta.k} of {n.meta.n_expert}"
                              f"{' normalised' if n.meta.norm else ''}"
                              f"{f' x{n.meta.scale:g}' if n.meta.scale not in (0.0, 1.0) else ''}"),
    Op.MatMulId: lambda n: (f"{n.meta.weight_name} [{_wtype_name(n.meta.wtype)}] {n.meta.n_expert} experts "
                            f"{n.meta.in_dim}->{n.meta.out_dim}, k={n.out_shape[1]}"),
    Op.MoeSum: lambda n: "weighted sum over the k experts' rows",
}

# Ops that stand for several unfused ones (rewritten by FusionPass).
FUSED_OPS = frozenset({Op.SwiGLU, Op.GeGLU})


def op_detail(node: CNode) -> str:
    return _DETAIL[node.op](node)


def _plain(v):
    if isinstance(v, enum.Enum):
        return v.value
    if dataclasses.is_dataclass(v):
        return meta_json(v)
    if isinstance(v, (tuple, list)):
        return [_plain(x) for x in v]
    return v


def meta_json(meta) -> Optional[dict]:
    """A node's meta as a JSON object tagged with its variant name; None stays None."""
    if meta is None:
        return None
    out = {"type": type(meta).__name__}
    for f in dataclasses.fields(meta):
        out[f.name] = _plain(getattr(meta, f.name))
    return out


def node_layer_index(node: CNode) -> Optional[int]:
    """The transformer layer a node belongs to: its meta's layer, else its blk.N. name."""
    lay = node_layer(node)
    if lay is not None:
        return lay
    if node.name.startswith("blk."):
        head = node.name[4:].split(".", 1)[0]
        if head.isdigit():
            return int(head)
    return None


def graph_json(graph: ComputeGraph, model: str, kind: str, name_of: Optional[Callable[[int], str]] = None) -> dict:
    """The minfer-graph document: the nodes as built, assigned and fused (dead nodes
    included, flagged), for the page and as the `graph` of each trace phase."""
    if kind not in ("prefill", "decode"):
        raise ValueError(f"kind must be 'prefill' or 'decode', got {kind!r}")
    if name_of is None:
        name_of = backend_name
    nodes = []
    for n in graph.nodes:
        nodes.append({
            "id": n.id, "name": n.name, "op": str(n.op), "detail": op_detail(n),
            "shape": list(n.out_shape), "dtype": n.out_dtype.value,
            "backend": None if n.backend is None else name_of(n.backend),
            "src": list(n.src), "meta": meta_json(n.meta),
            "layer": node_layer_index(n), "fused": n.op in FUSED_OPS, "dead": n.id in graph.dead,
        })
    return {"format": GRAPH_FORMAT, "version": GRAPH_VERSION, "model": model, "kind": kind,
            "inputs": list(graph.inputs), "outputs": list(graph.outputs), "nodes": nodes}


def write_graph_json(doc: dict, path: str) -> None:
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
    except OSError as e:
        raise GraphError(f"cannot write {path}: {e.strerror or e}") from None
