"""MINFER_GRAPH_TRACE=1 diagnostics: the split list and per-op, per-backend node
counts, as text (the engine prints it to stderr)."""

from __future__ import annotations

import os
from collections import Counter
from typing import Optional

from minfer.graph.ir import ComputeGraph
from minfer.graph.backend import name_of


def trace_enabled() -> bool:
    return os.environ.get("MINFER_GRAPH_TRACE", "") not in ("", "0")


def trace_summary(graph: ComputeGraph, splits: list, entries: Optional[list] = None) -> str:
    by_id = {e.id: e for e in entries or ()}
    live = [n for n in graph.nodes if n.id not in graph.dead]
    lines = [f"graph uid={graph.uid}: {len(graph.nodes)} nodes ({len(graph.dead)} fused away), {len(splits)} splits"]
    for k, sp in enumerate(splits):
        a, b = sp.node_range
        lines.append(f"  split {k}: {name_of(sp.backend, by_id)} nodes [{a}, {b}) "
                     f"inputs={list(sp.inputs)} outputs={list(sp.outputs)}")
    counts = Counter((str(n.op), name_of(n.backend, by_id)) for n in live)
    backends = sorted({b for _, b in counts})
    ops = sorted({o for o, _ in counts})
    w = max([len(o) for o in ops] + [2])
    lines.append("  " + "op".ljust(w) + "".join(f" {b:>10}" for b in backends))
    for o in ops:
        lines.append("  " + o.ljust(w) + "".join(f" {counts.get((o, b), 0):>10}" for b in backends))
    return "\n".join(lines) + "\n"
