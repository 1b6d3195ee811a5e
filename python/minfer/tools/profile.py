"""`minfer profile [MODEL] PROMPT [-n N] [--json]`: where the time goes, per node and op.

The profiler takes the runtime's tracer slot, so only a profiled run is timed; the
whole-plan call of a normal run is untouched.

- A host split (the CPU) runs its plan step by step through the scheduler's on_step
  path, and the host clock between consecutive steps is charged to the step's node. The
  first step of a forward also carries the wake-up of the worker threads, and per-step
  calls add the plan-call overhead (microseconds) that a whole-plan run amortises, so
  totals read somewhat higher than `minfer bench`.
- A device split (CUDA) runs the kernels a normal run runs, step merges included, each
  launched directly (a replay has no per-launch times) behind a gate that holds the
  device until all are queued, with a CUDA event after each; the times are read once
  after the forward. A row is a launch: a merged one (q|k|v, gate|up + SwiGLU, matvec +
  residual, ...) is one row named after all its nodes, and the per-op table groups rows
  by kernel. The events take the launches' PDL overlap away, so the total reads a little
  above a replayed step (`minfer bench`). A device backend without such launches is
  refused rather than timed with host clocks around asynchronous launches.

GB/s for a matmul is the bytes of its weight (the bulk of what it reads) over its time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Optional

from minfer.errors import MinferError
from minfer.graph.export import graph_json

PROFILE_FORMAT = "minfer-profile"
PROFILE_VERSION = 1
MATMUL_OPS = ("MatMul",)
HOST_CLOCK = "host clock"
DEVICE_EVENTS = "cuda events"


class Profiler:
    def __init__(self, model: str, weight_bytes: Callable[[str], int]) -> None:
        self.model = model
        self.weight_bytes = weight_bytes
        # [{kind, graph, steps, wall_ns, timers, rows: {key: {kernel, nodes, ns, calls}}}]: a host
        # row's key is its node id, a device launch's (kernel, node ids).
        self.phases: list = []
        self.n_threads = None
        self._uid = None

    def execute(self, cache) -> None:
        for ls in cache.lowered.splits:
            if ls.entry.memory != "host" and ls.launches is None:
                raise MinferError(f"profile: backend {ls.entry.name!r} has no device timing; run with --backend cpu")
        graph = cache.graph
        kind = cache.params.gtype.value if cache.params is not None else "prefill"
        if not self.phases or self._uid != graph.uid or self.phases[-1]["kind"] != kind:
            self.phases.append({"kind": kind, "graph": graph_json(graph, self.model, kind, cache.name_of),
                                "steps": 0, "wall_ns": 0, "timers": set(), "rows": {}})
            self._uid = graph.uid
        phase = self.phases[-1]
        rows = phase["rows"]
        clock = time.perf_counter_ns
        last = [clock()]

        def on_step(node, ls) -> None:
            now = clock()
            r = rows.setdefault(node.id, {"kernel": None, "nodes": (node.id,), "ns": 0, "calls": 0})
            r["ns"] += now - last[0]
            r["calls"] += 1
            last[0] = now
            phase["timers"].add(HOST_CLOCK)

        def on_launch(launch, ls) -> None:
            ids = tuple(n.id for n in launch.nodes)
            r = rows.setdefault((launch.kernel, ids), {"kernel": launch.kernel, "nodes": ids, "ns": 0, "calls": 0})
            r["ns"] += launch.ms * 1e6
            r["calls"] += 1
            phase["timers"].add(DEVICE_EVENTS)
            last[0] = clock()   # the device split's wall time is not the next host step's

        t0 = clock()
        cache.execute(on_step=on_step, on_launch=on_launch, timed=True)
        phase["wall_ns"] += clock() - t0
        phase["steps"] += 1

    def document(self, prompt: str = "") -> dict:
        phases = []
        for p in self.phases:
            nodes_by_id = {n["id"]: n for n in p["graph"]["nodes"]}
            total = sum(r["ns"] for r in p["rows"].values())
            steps = max(p["steps"], 1)
            rows = []
            for key, acc in p["rows"].items():
                nodes = [nodes_by_id[i] for i in acc["nodes"]]
                t = acc["ns"]
                b = sum(self._bytes(n) for n in nodes)
                row = {"id": nodes[-1]["id"] if nodes else None, "name": _row_name(nodes, acc["kernel"]),
                       "op": acc["kernel"] or nodes[-1]["op"], "layer": _row_layer(nodes),
                       "ms": t / 1e6 / steps, "share": t / total if total else 0.0,
                       "calls": -(-acc["calls"] // steps), "gbps": b / (t / steps) if b and t > 0 else None}
                if acc["kernel"] is not None:
                    row["kernel"] = acc["kernel"]
                    row["nodes"] = [n["name"] for n in nodes]
                row["_bytes"] = b
                rows.append(row)
            rows.sort(key=lambda r: (-r["ms"], r["id"] if r["id"] is not None else -1, r["name"]))
            ops: dict = {}
            for r in rows:
                o = ops.setdefault(r["op"], {"op": r["op"], "nodes": 0, "ms": 0.0, "share": 0.0, "bytes": 0})
                o["nodes"] += 1
                o["ms"] += r["ms"]
                o["share"] += r["share"]
                o["bytes"] += r.pop("_bytes")
            op_rows = sorted(ops.values(), key=lambda o: -o["ms"])
            for o in op_rows:
                b = o.pop("bytes")
                o["gbps"] = b / (o["ms"] / 1e3) / 1e9 if b and o["ms"] > 0 else None
            timers = [t for t in (HOST_CLOCK, DEVICE_EVENTS) if t in p["timers"]]
            phases.append({"kind": p["kind"], "graph": p["graph"], "steps": p["steps"], "timer": " + ".join(timers),
                           "ms_per_step": total / 1e6 / steps, "wall_ms_per_step": p["wall_ns"] / 1e6 / steps,
                           "nodes": rows, "ops": op_rows})
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


def _row_name(nodes: list, kernel: Optional[str]) -> str:
    """A node's name; a merged launch's nodes joined by '+', their shared 'blk.N.' once."""
    if not nodes:
        return f"({kernel})"
    names = [n["name"] for n in nodes]
    if len(names) == 1:
        return names[0]
    head = names[0].split(".")
    prefix = ".".join(head[:2]) + "." if len(head) > 2 and head[0] == "blk" else ""
    if prefix and all(x.startswith(prefix) for x in names):
        return prefix + "+".join(x[len(prefix):] for x in names)
    return "+".join(names)


def _row_layer(nodes: list) -> Optional[int]:
    layers = {n.get("layer") for n in nodes}
    return layers.pop() if len(layers) == 1 else None


def run_profile(engine, prompt_ids: list, n_predict: int, prompt: str = "") -> dict:
    """Greedy generation of n_predict tokens under the profiler; the document."""
    tensors = engine.model.defn.tensors

    def weight_bytes(name: str) -> int:
        t = tensors.get(name)
        return int(t.nbytes) if t is not None else 0

    # One untimed prefill and decode step first: page faults on first touch of weights and
    # buffers are a cold start, not where a step's time goes; on CUDA so is a kernel's
    # first load, which waits for the device and so for a timed run's gate (timeline.h).
    engine.reset()
    logits = engine.forward(prompt_ids)
    engine.forward([int(logits[-1].argmax())])
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


_TIMER_NOTE = {HOST_CLOCK: "host clock around each plan step",
               DEVICE_EVENTS: "CUDA events around each kernel, launched directly: no PDL overlap"}


def format_profile(doc: dict, top: int = 25) -> str:
    timers = {t for p in doc["phases"] for t in (p.get("timer") or HOST_CLOCK).split(" + ") if t}
    notes = "; ".join(_TIMER_NOTE.get(t, t) for t in (HOST_CLOCK, DEVICE_EVENTS) if t in timers)
    lines = [f"model {doc['model']}  ({notes}; ms are per forward step)"]
    if (doc.get("n_threads") or 1) > 1 and HOST_CLOCK in timers:
        # Each step is its own plan call, so the workers wake once per node: on a busy
        # machine that wake-up, not the kernel, can dominate (-t 1 avoids it).
        lines.append(f"{doc['n_threads']} threads: every plan step wakes the workers; on a loaded machine compare with -t 1")
    for p in doc["phases"]:
        device = DEVICE_EVENTS in (p.get("timer") or "")
        lines.append("")
        wall = f" (wall {p['wall_ms_per_step']:.3f} ms)" if "wall_ms_per_step" in p else ""
        lines.append(f"{p['kind']}: {p['steps']} step(s), {p['ms_per_step']:.3f} ms per step{wall}")
        what, rows_of = ("kernel", "runs") if device else ("op", "nodes")
        w_op = max([len(o["op"]) for o in p["ops"]] + [16])
        lines.append(f"  {what:<{w_op}} {rows_of:>5} {'ms':>9} {'share':>7} {'GB/s':>7}")
        for o in p["ops"]:
            lines.append(f"  {o['op']:<{w_op}} {o['nodes']:>5} {o['ms']:>9.3f} {o['share'] * 100:>6.1f}% "
                         f"{_fmt(o['gbps'], '7.1f'):>7}")
        lines.append("")
        shown = p["nodes"][:top] if top > 0 else p["nodes"]
        w = max([len(r["name"]) for r in shown] + [4])
        w_k = max([len(r["op"]) for r in shown] + [14])
        lines.append(f"  {'node':<{w}} {what:<{w_k}} {'ms':>9} {'share':>7} {'GB/s':>7}")
        for r in shown:
            lines.append(f"  {r['name']:<{w}} {r['op']:<{w_k}} {r['ms']:>9.3f} {r['share'] * 100:>6.1f}% "
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

