"""Per-node data capture (MINFER_TRACE=PATH, the viz page's live runs).

A Tracer attached to an engine makes each forward run step by step and records, after
every executed node, its output stats (min, max, mean, std over the finite values,
NaN/Inf counts) and a strided sample of its values. A host split (the CPU) runs its plan
through the scheduler's on_step hook and is read in place between steps (a view, no
copy). A device split (CUDA) runs the kernels a normal run runs, step merges included,
launched directly one at a time (never a graph replay, which has no per-node steps),
and each launch's outputs are read back (D2H + wait) before the next: a node computed
by a merged launch is recorded where its value leaves the kernel, that is where a node
outside the launch (or the host, for the graph's output) reads it; one that stays
inside (gate and up in gate|up + SwiGLU, a matvec in its fused residual add, q, k and v
in the q|k|v launch that ropes and stores them) gets a record with no data and
`merged: true`. Every device record
names its `kernel`, and each device phase lists its `launches` ({kernel, nodes}) in
order. MINFER_CUDA_FUSE=none traces every node as its own launch.
KV-bound nodes (the layer's K/V regions) are skipped: a full region per layer would
dominate the trace, so the page shows them as "no data". Nodes a step does not execute
(fused away) have no entry either.

Capture only reads buffers between launches or plan steps; the values computed are the
same bits (tests/test_trace.py compares traced and untraced logits bitwise on the CPU,
tests/test_cuda_trace.py on CUDA).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from typing import Optional

import numpy as np

from minfer.errors import MinferError
from minfer.graph.export import graph_json
from minfer.graph.ir import KV_BOUND, DType

TRACE_FORMAT = "minfer-trace"
TRACE_VERSION = 1
ENV_TRACE = "MINFER_TRACE"
ENV_VALUES = "MINFER_TRACE_VALUES"
DEFAULT_VALUES = 64
LOGITS_TOP = 5


def _num(x: float):
    return float(x) if math.isfinite(x) else None


def node_record(node_id: int, dtype: str, arr: np.ndarray, max_values: int) -> dict:
    """Stats and a strided sample of one node's output (flattened, token-major)."""
    flat = arr.reshape(-1)
    n = int(flat.size)
    x = flat.astype(np.float64)
    finite = np.isfinite(x)
    n_nan = int(np.isnan(x).sum())
    n_inf = int(n - n_nan - finite.sum())
    xf = x if n_nan + n_inf == 0 else x[finite]
    if xf.size:
        stats = {"min": float(xf.min()), "max": float(xf.max()), "mean": float(xf.mean()), "std": float(xf.std()),
                 "nan": n_nan, "inf": n_inf}
    else:
        stats = {"min": None, "max": None, "mean": None, "std": None, "nan": n_nan, "inf": n_inf}
    stride = max(1, -(-n // max_values)) if max_values > 0 else max(n, 1)
    sample = x[::stride][:max_values] if max_values > 0 else x[:0]
    return {"id": node_id, "dtype": dtype, "stats": stats, "values": [_num(v) for v in sample.tolist()],
            "stride": stride, "n": n}


# A node's value leaves a merged launch only where something outside the launch reads
# it; the graph's outputs are read by the host.
_HOST = -1


def _read_outside(graph) -> list:
    """Per node, the ids of its live readers, plus _HOST for the graph's outputs."""
    out = [set(c) for c in graph.consumers()]
    for o in graph.outputs:
        out[o].add(_HOST)
    return out


def _merged_record(node) -> dict:
    """A node a merged launch computes and keeps to itself (no buffer holds its value)."""
    return {"id": node.id, "dtype": node.out_dtype.value, "stats": None, "values": [], "stride": 1, "n": 0,
            "merged": True}


class Tracer:
    """Attach with session.context.tracer = Tracer(...); every forward becomes one step."""

    def __init__(self, model: str, prompt: str = "", max_values: Optional[int] = None,
                 name_of: Optional[Callable[[int], str]] = None,
                 on_step_done: Optional[Callable[[dict, dict], None]] = None) -> None:
        if max_values is None:
            raw = os.environ.get(ENV_VALUES, "")
            try:
                max_values = int(raw) if raw else DEFAULT_VALUES
            except ValueError:
                raise MinferError(f"{ENV_VALUES} must be an integer, got {raw!r}") from None
        if max_values < 0:
            raise MinferError(f"{ENV_VALUES} must be >= 0, got {max_values}")
        self.model = model
        self.prompt = prompt
        self.max_values = max_values
        self.name_of = name_of
        self.on_step_done = on_step_done   # (phase, step) after each forward: the viz stream
        self.phases: list = []
        self._uid = None
        self._outside: list = []

    # -- the runtime hook: called instead of cache.execute() -------------------------
    def execute(self, cache) -> None:
        graph, alloc = cache.graph, cache.alloc
        kind = cache.params.gtype.value if cache.params is not None else "prefill"
        if not self.phases or self._uid != graph.uid or self.phases[-1]["kind"] != kind:
            name_of = self.name_of or cache.name_of
            self.phases.append({"kind": kind, "graph": graph_json(graph, self.model, kind, name_of), "steps": []})
            self._uid = graph.uid
            self._outside = _read_outside(graph)
        records: dict = {}
        launches: list = []
        # Inputs are host-filled before the run and never written by it.
        for nid in graph.inputs:
            records[nid] = self._read(alloc, graph.nodes[nid])

        def on_step(node, ls) -> None:
            # A node lowered to several steps is read again after each; the last read wins.
            if node.op not in KV_BOUND:
                records[node.id] = self._read(alloc, node)

        def on_launch(launch, ls) -> None:
            ids = [n.id for n in launch.nodes]
            launches.append({"kernel": launch.kernel, "nodes": ids})
            ids = set(ids)
            for node in launch.nodes:
                if node.op in KV_BOUND:
                    continue
                if len(ids) == 1 or self._outside[node.id] - ids:
                    rec = self._read(alloc, node)
                else:
                    rec = _merged_record(node)
                rec["kernel"] = launch.kernel
                records[node.id] = rec

        cache.execute(on_step=on_step, on_launch=on_launch)
        out = graph.outputs[0]
        logits = alloc.host_view(out)[-1]
        top = np.argsort(-logits, kind="stable")[:LOGITS_TOP]
        step = {"token": None, "text": None,
                "logits_top": [{"id": int(i), "logit": _num(float(logits[i]))} for i in top],
                "nodes": [records[i] for i in sorted(records)]}
        phase = self.phases[-1]
        if launches:
            phase["launches"] = launches
        phase["steps"].append(step)
        if self.on_step_done is not None:
            self.on_step_done(phase, step)

    def _read(self, alloc, node) -> dict:
        if node.out_dtype not in (DType.F32, DType.I32):
            return {"id": node.id, "dtype": node.out_dtype.value, "stats": None, "values": [], "stride": 1, "n": 0}
        return node_record(node.id, node.out_dtype.value, alloc.host_view(node.id), self.max_values)

    # -- after generation ------------------------------------------------------------
    def steps(self) -> list:
        return [s for p in self.phases for s in p["steps"]]

    def finish(self, ids: list, decode: Optional[Callable[[list], str]] = None) -> None:
        """Fill each step's sampled token (step k produced ids[k]); a step whose token
        ended generation (end of text) keeps token None."""
        for k, step in enumerate(self.steps()):
            if k < len(ids):
                step["token"] = int(ids[k])
                step["text"] = decode([int(ids[k])]) if decode else None

    def document(self) -> dict:
        return {"format": TRACE_FORMAT, "version": TRACE_VERSION, "model": self.model, "prompt": self.prompt,
                "phases": self.phases}

    def write(self, path: str) -> None:
        try:
            with open(path, "w", encoding="utf-8") as f:
                json.dump(self.document(), f, separators=(",", ":"))
                f.write("\n")
        except OSError as e:
            raise MinferError(f"cannot write trace {path}: {e.strerror or e}") from None


def load_trace(path: str) -> dict:
    """A minfer-trace document, checked enough that a wrong file is one clear error."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as e:
        raise MinferError(f"cannot read trace {path}: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MinferError(f"{path} is not JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != TRACE_FORMAT:
        raise MinferError(f"{path} is not a {TRACE_FORMAT} file")
    if doc.get("version") != TRACE_VERSION:
        raise MinferError(f"{path}: unsupported {TRACE_FORMAT} version {doc.get('version')!r} (this minfer reads "
                          f"{TRACE_VERSION})")
    if not isinstance(doc.get("phases"), list):
        raise MinferError(f"{path}: no phases list")
    return doc
