"""`minfer trace diff A.json B.json [--tol T]`: where do two runs part ways?

Nodes are matched by name, not id, so traces of differently fused graphs of one model
compare (a fused SwiGLU keeps the name of the Mul it replaced; a node recorded on one
side only is listed, never compared). The walk is in execution order: phase by phase,
step by step, node by node in A's order. A node diverges when the largest absolute
difference over its sampled values or its stats (min, max, mean, std) exceeds the
tolerance, when its NaN/Inf counts differ, or when its sizes differ. The report is the
first diverging node with both sides' stats, then a per-layer summary over all steps.

A CPU trace and a CUDA trace of one model and prompt line up node for node: the graph
does not depend on the backend, so ids and names are the same. What CUDA cannot show is
a value one of its merged kernels keeps to itself (gate and up inside the fused SwiGLU,
a matvec inside its fused residual add, q, k and v inside the fused rope and KV store):
such a record is marked `merged` and is listed, not compared (MINFER_CUDA_FUSE=none
traces every node).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from minfer.errors import MinferError

STAT_KEYS = ("min", "max", "mean", "std")


def _gap(a, b) -> float:
    if a is None and b is None:
        return 0.0
    if a is None or b is None:
        return math.inf
    return abs(a - b)


def node_gap(ra: dict, rb: dict) -> tuple:
    """(largest difference, reason) between two node records of one step."""
    if ra.get("n") != rb.get("n") or ra.get("stride") != rb.get("stride"):
        return math.inf, f"sizes differ (n {ra.get('n')} vs {rb.get('n')})"
    sa, sb = ra.get("stats"), rb.get("stats")
    if (sa is None) != (sb is None):
        return math.inf, "stats on one side only"
    worst, why = 0.0, "values"
    if sa is not None:
        if sa.get("nan") != sb.get("nan") or sa.get("inf") != sb.get("inf"):
            return math.inf, f"non-finite counts differ (nan {sa.get('nan')} vs {sb.get('nan')}, " \
                             f"inf {sa.get('inf')} vs {sb.get('inf')})"
        for k in STAT_KEYS:
            g = _gap(sa.get(k), sb.get(k))
            if g > worst:
                worst, why = g, k
    for x, y in zip(ra.get("values") or [], rb.get("values") or []):
        g = _gap(x, y)
        if g > worst:
            worst, why = g, "values"
    return worst, why


@dataclass
class Divergence:
    phase: str
    step: int
    name: str
    op: str
    layer: Optional[int]
    gap: float
    why: str
    stats_a: Optional[dict]
    stats_b: Optional[dict]


@dataclass
class LayerRow:
    layer: Optional[int]
    compared: int = 0
    diverged: int = 0
    max_gap: float = 0.0
    first: Optional[str] = None      # "phase step k: node" of its first divergence


@dataclass
class DiffReport:
    tol: float
    compared: int = 0
    first: Optional[Divergence] = None
    layers: dict = field(default_factory=dict)
    only_a: list = field(default_factory=list)
    only_b: list = field(default_factory=list)
    merged_a: list = field(default_factory=list)   # "phase:name (kernel)": kept inside a merged kernel on A
    merged_b: list = field(default_factory=list)
    notes: list = field(default_factory=list)


def _named(phase: dict) -> dict:
    return {n["name"]: n for n in phase["graph"]["nodes"]}


def diff_traces(a: dict, b: dict, tol: float = 0.0) -> DiffReport:
    if tol < 0 or math.isnan(tol):
        raise MinferError(f"--tol must be >= 0, got {tol}")
    rep = DiffReport(tol=tol)
    kinds_a = [p["kind"] for p in a["phases"]]
    kinds_b = [p["kind"] for p in b["phases"]]
    if kinds_a != kinds_b:
        rep.notes.append(f"phases differ: {kinds_a} vs {kinds_b}; comparing the common prefix")
    for pa, pb in zip(a["phases"], b["phases"]):
        if pa["kind"] != pb["kind"]:
            break
        na, nb = _named(pa), _named(pb)
        if not set(na) & set(nb):
            raise MinferError(f"the {pa['kind']} graphs share no node names: not traces of one model")
        by_id_a = {n["id"]: n for n in pa["graph"]["nodes"]}
        by_id_b = {n["id"]: n for n in pb["graph"]["nodes"]}
        id_b = {name: n["id"] for name, n in nb.items()}
        # Recorded on one side only: absent from the other graph, or not executed there
        # (a Silu that FusionPass folded away is in the graph but never runs).
        ran_a = {by_id_a[r["id"]]["name"] for r in pa["steps"][0]["nodes"]} if pa["steps"] else set()
        ran_b = {by_id_b[r["id"]]["name"] for r in pb["steps"][0]["nodes"]} if pb["steps"] else set()
        for name in sorted(ran_a - ran_b, key=lambda s: na[s]["id"]):
            rep.only_a.append(f"{pa['kind']}:{name}")
        for name in sorted(ran_b - ran_a, key=lambda s: nb[s]["id"]):
            rep.only_b.append(f"{pb['kind']}:{name}")
        if len(pa["steps"]) != len(pb["steps"]):
            rep.notes.append(f"{pa['kind']}: {len(pa['steps'])} vs {len(pb['steps'])} steps; comparing "
                             f"{min(len(pa['steps']), len(pb['steps']))}")
        merged = ({}, {})
        for k, (sa, sb) in enumerate(zip(pa["steps"], pb["steps"])):
            recs_b = {r["id"]: r for r in sb["nodes"]}
            for ra in sa["nodes"]:
                node = by_id_a[ra["id"]]
                rb = recs_b.get(id_b.get(node["name"], -1))
                if rb is None:
                    continue
                if ra.get("merged") or rb.get("merged"):
                    for side, r in zip(merged, (ra, rb)):
                        if r.get("merged"):
                            side.setdefault(node["name"], (node["id"], r.get("kernel")))
                    continue
                gap, why = node_gap(ra, rb)
                row = rep.layers.setdefault(node.get("layer"), LayerRow(node.get("layer")))
                row.compared += 1
                rep.compared += 1
                row.max_gap = max(row.max_gap, gap)
                if gap > tol:
                    row.diverged += 1
                    if row.first is None:
                        row.first = f"{pa['kind']} step {k}: {node['name']}"
                    if rep.first is None:
                        rep.first = Divergence(pa["kind"], k, node["name"], node["op"], node.get("layer"), gap, why,
                                               ra.get("stats"), rb.get("stats"))
        for side, out in zip(merged, (rep.merged_a, rep.merged_b)):
            for name, (_, kernel) in sorted(side.items(), key=lambda kv: kv[1][0]):
                out.append(f"{pa['kind']}:{name} ({kernel})")
    return rep


def _merged_summary(merged: list, shown: int = 3) -> str:
    by_kernel: dict = {}
    for entry in merged:
        name, _, kernel = entry.rpartition(" (")
        by_kernel.setdefault(kernel.rstrip(")"), []).append(name)
    parts = []
    for kernel, names in by_kernel.items():
        more = f" +{len(names) - shown} more" if len(names) > shown else ""
        parts.append(f"{kernel}: {', '.join(names[:shown])}{more}")
    return "; ".join(parts)


def _fmt_stats(s: Optional[dict]) -> str:
    if s is None:
        return "no stats"
    parts = [f"{k}={s[k]:.6g}" if s.get(k) is not None else f"{k}=-" for k in STAT_KEYS]
    return " ".join(parts) + f" nan={s.get('nan')} inf={s.get('inf')}"


def _layer_label(layer) -> str:
    return "-" if layer is None else str(layer)


def format_report(rep: DiffReport, name_a: str = "A", name_b: str = "B") -> str:
    lines = [f"compared {rep.compared} node records (tolerance {rep.tol:g})"]
    lines += [f"note: {n}" for n in rep.notes]
    if rep.only_a or rep.only_b:
        lines.append(f"nodes only in {name_a}: {', '.join(rep.only_a) or '-'}")
        lines.append(f"nodes only in {name_b}: {', '.join(rep.only_b) or '-'}")
    for name, merged in ((name_a, rep.merged_a), (name_b, rep.merged_b)):
        if merged:
            lines.append(f"not compared: {len(merged)} nodes stay inside merged kernels in {name} "
                         f"(MINFER_CUDA_FUSE=none traces them): {_merged_summary(merged)}")
    d = rep.first
    if d is None:
        lines.append("no node differs beyond the tolerance")
    else:
        lines.append(f"first divergence: {d.phase} step {d.step}, node {d.name} ({d.op}, layer "
                     f"{_layer_label(d.layer)}): max |a-b| = {d.gap:.6g} in {d.why}")
        lines.append(f"  {name_a}: {_fmt_stats(d.stats_a)}")
        lines.append(f"  {name_b}: {_fmt_stats(d.stats_b)}")
    lines.append("")
    lines.append(f"{'layer':>5} {'nodes':>6} {'diverged':>8} {'max |a-b|':>11}  first divergence")
    order = sorted(rep.layers.values(), key=lambda r: (r.layer is None, r.layer if r.layer is not None else 0))
    for r in order:
        lines.append(f"{_layer_label(r.layer):>5} {r.compared:>6} {r.diverged:>8} {r.max_gap:>11.4g}  {r.first or '-'}")
    return "\n".join(lines)
