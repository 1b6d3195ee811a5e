"""`minfer profile [MODEL] PROMPT [-n N] [--json]`: where the time goes, per node and op.

The profiler takes the runtime's tracer slot, so only a profiled run is timed: each
split's plan runs step by step through the scheduler's on_step path and the time
between consecutive steps is charged to the step's node (CPU: the host clock around
each plan step; the whole-plan call of a normal run is untouched). The first step of a
forward also carries the wake-up of the worker threads. Per-step calls add
the plan-call overhead (microseconds) that a whole-plan run amortises, so totals read
somewhat higher than `minfer bench`. A device backend would need its own events; it is
refused rather than timed with host clocks around asynchronous launches.

GB/s for a matmul is the bytes of its weight (the bulk of what it reads) over its time.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Optional

from minfer.errors import MinferError
from minfer.graph.export import graph_json

PROFILE_FORMAT = "minfer-profile"
PROFILE_VERSION = 1
MATMUL_OPS = ("MatMul",)


class Profiler:
    def __init__(self, model: str, weight_bytes: Callable[[str], int]) -> None:
        self.model = model
        self.weight_bytes = weight_bytes
        self.phases: list = []     # [{kind, graph, steps, ns: {id: ns}, calls: {id: n}}]
        self.n_threads = None
        self._uid = None

    def execute(self, cache) -> None:
        for ls in cache.lowered.splits:
            if ls.entry.memory != "host":   # no host view of a device buffer between steps
                raise MinferError(f"profile: backend {ls.entry.name!r} has no host-clock timing; run with --backend cpu")
        graph = cache.graph
        kind = cache.params.gtype.value if cache.params is not None else "prefill"
        if not self.phases or self._uid != graph.uid or self.phases[-1]["kind"] != kind:
            self.phases.append({"kind": kind, "graph": graph_json(graph, self.model, kind, cache.name_of),
                                "steps": 0, "ns": defaultdict(int), "calls": defaultdict(int)})
            self._uid = graph.uid
        phase = self.phases[-1]
        ns, calls = phase["ns"], phase["calls"]
        clock = time.perf_counter_ns
        last = [clock()]

        def on_step(node, ls) -> None:
            now = clock()
            ns[node.id] += now - last[0]
            calls[node.id] += 1
            last[0] = now

        cache.execute(on_step=on_step)
        phase["steps"] += 1

    def document(self, prompt: str = "") -> dict:
        phases = []
        for p in self.phases:
            nodes_by_id = {n["id"]: n for n in p["graph"]["nodes"]}
            total = sum(p["ns"].values())
            steps = max(p["steps"], 1)
            rows = []
            for nid, t in p["ns"].items():
                n = nodes_by_id[nid]
                rows.append({"id": nid, "name": n["name"], "op": n["op"], "layer": n.get("layer"),
                             "ms": t / 1e6 / steps, "share": t / total if total else 0.0,
                             "calls": p["calls"][nid] // steps, "gbps": self._gbps(n, t / steps)})
            rows.sort(key=lambda r: (-r["ms"], r["id"]))
            ops: dict = {}
            for r in rows:
                o = ops.setdefault(r["op"], {"op": r["op"], "nodes": 0, "ms": 0.0, "share": 0.0, "bytes": 0})
                o["nodes"] += 1
                o["ms"] += r["ms"]
                o["share"] += r["share"]
                o["bytes"] += self._bytes(nodes_by_id[r["id"]])
            op_rows = sorted(ops.values(), key=lambda o: -o["ms"])
            for o in op_rows:
                b = o.pop("bytes")
                o["gbps"] = b / (o["ms"] / 1e3) / 1e9 if b and o["ms"] > 0 else None
            phases.append({"kind": p["kind"], "graph": p["graph"], "steps": p["steps"],
                           "ms_per_step": total / 1e6 / steps, "nodes": rows, "ops": op_rows})
        return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "model": self.model, "prompt": prompt,
                "n_threads": self.n_threads, "phases": phases}

    def _bytes(self, node: dict) -> int:
        meta = node.get("meta") or {}
        if node["op"] == "MatMulId" and "weight_name" in meta:
            # MoE experts: a step reads the picked experts' rows only, at most k per token.
            k, nt = node["shape"][1], node["shape"][2]
            ne = meta["n_expert"]
            return self.weight_bytes(meta["weight_name"]) * min(ne, k * nt) // ne
        if node["op"] not in MATMUL_OPS or "weight_name" not in meta:
            return 0
        return self.weight_bytes(meta["weight_name"])

    def _gbps(self, node: dict, ns_per_step: float) -> Optional[float]:
        b = self._bytes(node)
        return b / ns_per_step if b and ns_per_step > 0 else None     # bytes/ns == GB/s


def run_profile(engine, prompt_ids: list, n_predict: int, prompt: str = "") -> dict:
    """Greedy generation of n_predict tokens under the profiler; the document."""
    tensors = engine.model.defn.tensors

    def weight_bytes(name: str) -> int:
        t = tensors.get(name)
        return int(t.nbytes) if t is not None else 0

    # One untimed prefill first: page faults on first touch of weights and buffers are
    # a cold start, not where a step's time goes.
    engine.reset()
    engine.forward(prompt_ids)
    prof = Profiler(engine.model_name, weight_bytes)
    prof.n_threads = engine.model.n_threads
    engine.context.tracer = prof
    try:
        from minfer.sampling import SamplingParams

        engine.generate(prompt_ids, n_predict, SamplingParams(temperature=0.0), stop_at_eog=False)
    finally:
        engine.context.tracer = None
    return prof.document(prompt)


def _fmt(x: Optional[float], spec: str) -> str:
    return "-" if x is None else format(x, spec)


def format_profile(doc: dict, top: int = 25) -> str:
    lines = [f"model {doc['model']}  (host clock around each plan step; ms are per forward step)"]
    if (doc.get("n_threads") or 1) > 1:
        # Each step is its own plan call, so the workers wake once per node: on a busy
        # machine that wake-up, not the kernel, can dominate (-t 1 avoids it).
        lines.append(f"{doc['n_threads']} threads: every plan step wakes the workers; on a loaded machine compare with -t 1")
    for p in doc["phases"]:
        lines.append("")
        lines.append(f"{p['kind']}: {p['steps']} step(s), {p['ms_per_step']:.3f} ms per step")
        lines.append(f"  {'op':<16} {'nodes':>5} {'ms':>9} {'share':>7} {'GB/s':>7}")
        for o in p["ops"]:
            lines.append(f"  {o['op']:<16} {o['nodes']:>5} {o['ms']:>9.3f} {o['share'] * 100:>6.1f}% "
                         f"{_fmt(o['gbps'], '7.1f'):>7}")
        lines.append("")
        shown = p["nodes"][:top] if top > 0 else p["nodes"]
        w = max([len(r["name"]) for r in shown] + [4])
        lines.append(f"  {'node':<{w}} {'op':<14} {'ms':>9} {'share':>7} {'GB/s':>7}")
        for r in shown:
            lines.append(f"  {r['name']:<{w}} {r['op']:<14} {r['ms']:>9.3f} {r['share'] * 100:>6.1f}% "
                         f"{_fmt(r['gbps'], '7.1f'):>7}")
        if len(p["nodes"]) > len(shown):
            lines.append(f"  ... {len(p['nodes']) - len(shown)} more nodes (--top 0 shows all, --json for the page)")
    return "\n".join(lines)


def load_profile(path: str) -> dict:
    import json

    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as e:
        raise MinferError(f"cannot read profile {path}: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MinferError(f"{path} is not JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != PROFILE_FORMAT or not isinstance(doc.get("phases"), list):
        raise MinferError(f"{path} is not a {PROFILE_FORMAT} file (write one with `minfer profile --json`)")
    if doc.get("version") != PROFILE_VERSION:
        raise MinferError(f"{path}: unsupported {PROFILE_FORMAT} version {doc.get('version')!r}")
    return doc

