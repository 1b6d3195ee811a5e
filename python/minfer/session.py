"""Sessions: one conversation's graph cache, KV and positions over a shared Model.

A `Context` owns one graph cache whose KV arena holds `n_seq` sequences of up to `n_ctx`
cells each: sequence s owns cells [s*n_ctx, (s+1)*n_ctx), or, in a smaller arena
(`n_cells`), a range placed by kv_pool.py (Session.base / cap). Several sequences run in
one graph (one row per token, each with its own position and cell); with more than
one sequence the attention reads an explicit [lo, hi) cell span per token, since a
position alone cannot say where a sequence's cells start.

A `Session` is one sequence of a context. On its own (`Session(model)`) it gets a
private one-sequence context, the shape `minfer generate` and `minfer chat` use. It
keeps the tokens its KV holds, so a later call processes only what follows the
longest common prefix (multi-turn reuse). `stream()` is the generation loop; it
yields a TokenEvent per token and can be stopped between steps.

The per-step path is the reuse kernel of §11.1 of the design of record: look the
GraphParams up (memoised per shape), reuse or build the graph, fill the inputs, run
the plans, read the logits.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from minfer.engine import Engine, SeqSpec, Sequence, TextState, Timings, TokenEvent, run_one
from minfer.errors import ContextError, MinferError, NumericsError
from minfer.graph.cache import GraphCache
from minfer.graph.ir import SPAN_INTS
from minfer.graph.params import KV_TYPES, CParams, GraphParams, GraphType
from minfer.graph.trace import trace_enabled, trace_summary
from minfer.limits import check_context
from minfer.logits_check import check_logits_finite
from minfer.rows import BatchedRow, DeviceRow, DeviceRows
from minfer.sampling import HostRow, SamplingParams

# Re-exported: callers name these through the session module.
__all__ = ["BatchedRow", "Context", "DeviceRow", "DeviceRows", "GenerationResult", "Session", "TextState",
           "Timings", "TokenEvent"]


def _cuda_row_exact_max() -> int:
    from minfer import _core
    return int(_core.CUDA_ROW_EXACT_MAX_TOKENS)


class Context:
    """One graph cache + KV arena shared by up to n_seq sequences run together."""

    # Batched steps of more than PAD_FROM rows, up to PAD_MAX, run in buckets (_bucketed):
    # rows and logits rows up to multiples of PAD_STEP, so a server whose mix of decode
    # rows and prompt chunks moves reuses a few kept graphs (captured once) instead of
    # building, lowering and capturing one for every mix. The padding rows write KV into
    # PAD_MAX cells of their own past the sequences' and read only themselves; every row
    # is computed on its own (the matvec's columns, its own attention span), so padding
    # changes no real row's bits.
    PAD_FROM = 8
    PAD_STEP = 8
    PAD_MAX = 64

    def __init__(self, model, n_ctx: int | None = None, n_seq: int = 1, fuse: bool = True, reuse: bool = True,
                 kv_type: str = "f16", n_cells: int | None = None, pad_batches: bool | None = None):
        if n_ctx is None or n_ctx == 0:
            n_ctx = model.hp.n_ctx_train
        if n_ctx < 0:
            raise MinferError(f"context size must be positive, got {n_ctx}")
        if n_seq < 1:
            raise MinferError(f"a context needs at least one sequence, got {n_seq}")
        if kv_type not in KV_TYPES:
            raise MinferError(f"KV type must be one of {', '.join(KV_TYPES)}, got {kv_type!r}")
        n_cells = int(n_ctx) * int(n_seq) if n_cells is None else int(n_cells)
        if not int(n_ctx) <= n_cells <= int(n_ctx) * int(n_seq):
            raise MinferError(f"a KV pool of {n_cells} cells must hold one context of {n_ctx} and at most "
                              f"{n_seq} x {n_ctx}")
        check_context(n_cells)
        self.model = model
        self.n_ctx = int(n_ctx)        # cells one sequence may use at most
        self.n_seq = int(n_seq)
        self.n_cells = n_cells
        # Each sequence's cells [base, base + cap) (kv_pool.py): fixed slices, or, with
        # fewer cells than n_seq full contexts, ranges taken as sequences start.
        self.pooled = n_cells < self.n_ctx * self.n_seq
        self.ranges = [(0, 0)] * self.n_seq if self.pooled else [(i * self.n_ctx, self.n_ctx) for i in range(self.n_seq)]
        # Shared prefixes read in place: borrowed[s] = (lender, n) when sequence s reads
        # the KV of its first n positions from the lender's cells (kv_pool.py's top).
        self.borrowed: list[tuple[int, int] | None] = [None] * self.n_seq
        self.reuse = reuse
        # The backends the model selected (the registry's choice); threads are the CPU
        # device's setting, fuse=False turns the backends' step merges (CUDA's fused
        # decode launches) off as well as the graph's SwiGLU fusion.
        self.cache = GraphCache(model.entries, model.weights, {"threads": model.n_threads, "fuse": fuse})
        gpu = self.cache.scheduler.entries[0].name == "cuda"
        # Up to how many token rows a forward gives each row's logits bitwise as a lone
        # step would (None: any number; the CPU kernels are row-independent). The CUDA
        # backend takes a GEMM path above its limit.
        self.row_exact_max = _cuda_row_exact_max() if gpu else None
        # A GPU pads (its rebuild is a lowering and a capture); a CPU rebuild is small
        # beside a batched step.
        pad = gpu if pad_batches is None else pad_batches
        self.pad_from = self.PAD_FROM if pad and self.n_seq > 1 else None
        # Everything that shapes the graph besides the batch shape; a new value is a new
        # object, so the memo below can never hand out params built from an old one.
        self.cparams = CParams(n_ctx=self.n_cells + (self.PAD_MAX if self.pad_from else 0),
                               explicit_span=self.n_seq > 1, fuse_swiglu=fuse, seq_ctx=self.n_ctx,
                               gpu=gpu, kv_type=kv_type)
        self._params: dict = {}        # (n_tokens, n_out) -> GraphParams for self.cparams
        self._installed = None         # the params of the graph whose plans are current
        self._out = None               # (device, buffer id, n_vocab, rows) of the logits
        self._picked = None            # the _out a device was told greedy picks read
        # A one-token step of the installed (1, 1) graph in one call where its lone
        # device has one (CUDA: the three inputs written and the replay enqueued), and
        # the graph it was bound for: Python's fills and dispatch were ~half of the
        # idle gap between two replays (bench/host_gap.py).
        self._step = None
        self._step_graph = None
        self._step_view = None         # host_view of that graph's logits, bound
        self.builds = 0                # graph builds so far (reuse is observable in tests)
        self.runs = 0                  # forwards so far: a stream's logits are its own while unchanged
        self.lock = threading.Lock()   # one forward at a time per context
        self.tracer = None             # a tools.trace.Tracer (or Profiler) replaces execute() when set

    @property
    def backend_names(self) -> list[str]:
        return [e.name.upper() for e in self.cache.entries]

    def params(self, n_tokens: int, n_out: int) -> GraphParams:
        p = self._params.get((n_tokens, n_out))
        if p is None or p.cparams is not self.cparams:
            gtype = GraphType.Decode if n_tokens == 1 else GraphType.Prefill
            p = GraphParams(n_tokens=n_tokens, n_out=n_out, gtype=gtype, cparams=self.cparams)
            self._params[(n_tokens, n_out)] = p
        return p

    def ensure_graph(self, params: GraphParams) -> None:
        """Make the graph for `params` the installed one (reused when params match)."""
        cache = self.cache
        if self.reuse and params is self._installed and cache.graph is not None:
            return
        if not (self.reuse and cache.try_reuse(params)):
            graph = cache.install(self.model.defn.build_graph(params), params)
            self.builds += 1
            if trace_enabled():
                sys.stderr.write(trace_summary(graph, cache.splits, cache.entries) + "\n")
        self._installed = params
        g = cache.graph
        out = g.nodes[g.outputs[0]]
        ref = cache.alloc.buffer(out.id)
        self._out = (cache.alloc.devices[ref.backend], ref.id, out.out_shape[0], out.n_rows)
        if g is not self._step_graph:
            self._step, self._step_graph = self._bind_step(params), g
            self._step_view = cache.alloc.viewer(g.outputs[0]) if self._step is not None else None

    _STEP_INPUTS = ("token_ids", "positions", "cells")

    def _bind_step(self, params: GraphParams):
        """step(token, position, cell) for a one-token graph of one split without staged
        copies whose device binds one, else None (the general path)."""
        lowered = self.cache.lowered
        if params.n_tokens != 1 or params.n_out != 1 or lowered is None or len(lowered.splits) != 1:
            return None
        ls = lowered.splits[0]
        if ls.step is None or ls.staged:
            return None
        inputs = self.cache.alloc.input_buffers()
        if sorted(inputs) != sorted(self._STEP_INPUTS):
            return None
        ins = [inputs[name] for name in self._STEP_INPUTS]
        if any(dev is not ls.device or node.n_elements != 1 for node, dev, _ in ins):
            return None
        return functools.partial(ls.step, *(bid for _, _, bid in ins))

    def warm(self) -> None:
        """What a first forward would do before computing, done now: the decode graph
        built and lowered, its devices' weights made ready (the CPU repacks them). The
        compiled part releases the GIL, so a caller can run this on a thread beside other
        start-up work; no forward of this context may run until it returns."""
        self.ensure_graph(self.params(1, 1))
        for ls in self.cache.lowered.splits:
            if ls.prepare is not None:
                ls.prepare()

    def warm_buckets(self) -> int:
        """The graphs of the batched steps a server takes, built (and captured, where the
        device captures on a plan's second run) before its first request, so no request
        waits on a build: every bucket (rows and logits rows in multiples of PAD_STEP up
        to PAD_MAX) and the decode steps of up to PAD_FROM rows. Each runs twice on the
        padding cells, which only padding rows use, so no sequence's KV changes. Returns
        the shapes warmed; none where steps are not bucketed (the CPU rebuilds cheaply)."""
        if self.pad_from is None:
            return 0
        shapes = [(r, r) for r in range(1, min(self.pad_from, self.n_seq) + 1)]
        shapes += [(r, k) for r in range(self.pad_from + self.PAD_STEP, self.PAD_MAX + 1, self.PAD_STEP)
                   for k in range(self.PAD_STEP, r + 1, self.PAD_STEP)]
        arr = lambda x: np.asarray(x, dtype=np.int32)  # noqa: E731
        with self.lock:
            for rows, n_out in shapes:
                toks, pos, cells, span = self._padding(rows)
                for _ in range(2):
                    self.run(arr(toks), arr(pos), arr(cells), arr(span), arr(range(n_out)), n_out, copy=None)
        return len(shapes)

    def _padding(self, n: int) -> tuple[list, list, list, list]:
        """n padding rows (tokens, positions, cells, spans): token 0 at position 0, each in
        a cell of its own past the sequences' (PAD_MAX of them), attending to itself only."""
        cells = list(range(self.n_cells, self.n_cells + n))
        return [0] * n, [0] * n, cells, [v for c in cells for v in (c, c + 1, 0, 0)]

    @contextlib.contextmanager
    def warming(self):
        """warm() on a thread for the length of the block, joined on leaving: for start-up
        work that does not touch this context (building the tokenizer, 0.9 s for a 152k
        vocabulary, beside the ~0.5 s weight repack). Only where every device can ready
        its weights apart from a run (the CPU). A failure is left to the first forward,
        which repeats the work and raises it."""
        if not all(hasattr(d, "prepare") for d in self.cache.alloc.devices.values()):
            yield
            return
        th = threading.Thread(target=_quietly, args=(self.warm,), name="minfer-warm")
        th.start()
        try:
            yield
        finally:
            th.join()

    def run(self, tokens: np.ndarray, positions: np.ndarray, cells: np.ndarray, span: np.ndarray | None,
            tail: np.ndarray | None, n_out: int, copy: bool | None = True,
            keep: int | None = None) -> np.ndarray | None:
        """One forward over a batch of token rows; logits [n_out, n_vocab] of the rows
        `tail` names (the last n_out rows when tail is None), or only the first `keep` of
        them. copy=None reads nothing back: a greedy pick follows through argmax_last,
        which on a device backend is then the step's only readback."""
        nt = int(tokens.size)
        self.model.check_tokens(tokens)
        self.runs += 1
        params = self.params(nt, n_out)
        self.ensure_graph(params)
        cache = self.cache
        g, alloc = cache.graph, cache.alloc
        inputs = {"token_ids": tokens, "positions": positions, "cells": cells}
        if self.cparams.explicit_span:
            inputs["kv_span"] = span
        if n_out < nt:
            inputs["tail_ids"] = tail if tail is not None else np.arange(nt - n_out, nt, dtype=np.int32)
        alloc.fill_inputs(g, inputs)  # one H2D on a device whose pool groups the inputs
        if self.tracer is None:
            cache.execute()
        else:
            self.tracer.execute(cache)  # MINFER_TRACE / profile / viz: step by step, reading each node
        if copy is None:
            return None
        if copy:
            return alloc.copy_to_host(g.outputs[0], rows=keep)
        return alloc.host_view(g.outputs[0], rows=keep)

    def run_one(self, token: int, pos: int, cell: int, copy: bool | None = True) -> np.ndarray | None:
        """run() of one token with logits for it, through the bound step where the
        installed graph is the reused (1, 1) one (same checks, same effect)."""
        step = self._step
        # ensure_graph's reuse test: the (1, 1) params (remade when cparams change) installed.
        if (step is None or self.tracer is not None or not self.reuse or self.cache.graph is not self._step_graph
                or self.params(1, 1) is not self._installed):
            return self.run(np.array([token], dtype=np.int32), np.array([pos], dtype=np.int32),
                            np.array([cell], dtype=np.int32), None, None, 1, copy)
        self.model.check_token(token)
        self.runs += 1
        step(token, pos, cell)
        if copy is None:
            return None
        return self.cache.alloc.copy_to_host(self.cache.graph.outputs[0]) if copy else self._step_view()

    def argmax_rows(self, step: int) -> list[int]:
        """Greedy picks of every logits row of the last forward (a verified speculative
        block), each checked for NaN/Inf: by a device that takes them in place (one
        launch, one readback of the picks), else from the rows read back. NumericsError
        names `step` (the first row's decode step) plus the row."""
        dev, buf, n, rows = self._out
        out = self.cache.graph.outputs[0]
        fn = getattr(dev, "argmax_rows", None)
        if fn is not None:
            picks = [int(t) for t in fn(buf, n, rows)]
            if min(picks) >= 0:
                return picks
            logits = self.cache.alloc.copy_to_host(out)
            for i in range(rows):
                check_logits_finite(logits[i], step + i)
            raise NumericsError(f"the device flagged non-finite logits (step {step}) that read back finite")
        logits = self.cache.alloc.host_view(out)
        picks = []
        for i in range(rows):
            check_logits_finite(logits[i], step + i)
            picks.append(int(np.argmax(logits[i])))
        return picks

    def mask_rows(self, which: list[int], masks: list[np.ndarray]) -> None:
        """Token masks (bool[n_vocab] each) applied in place to rows `which` of the last
        forward's logits, by a device that has mask_rows (Engine._masks_on_device):
        disallowed ids drop below every logit, so the picks that follow choose allowed
        ids only."""
        dev, buf, n, rows = self._out
        words = np.packbits(np.asarray(masks, dtype=bool), axis=1, bitorder="little")
        pad = (-words.shape[1]) % 4
        if pad:
            words = np.pad(words, ((0, 0), (0, pad)))
        dev.mask_rows(buf, n, rows, np.asarray(which, dtype=np.int32), words.view(np.int32))
        self._picked = None   # the device forgot its in-graph argmax: the next greedy pick re-arms it

    def argmax_last(self, step: int | None = None) -> int:
        """Greedy pick from the last logits row, taken by the backend that holds it (the
        CPU scans it in C++ with the threads that wrote it). Never the argmax of NaNs:
        with `step` given the row is checked first (NumericsError naming the step), on
        the host, or on the device by a backend whose argmax flags NaN/Inf itself (then
        the 4-byte pick is the step's only readback; the row is read only to word the
        error). A device's flag raises even without `step`."""
        dev, buf, n, rows = self._out
        out = self.cache.graph.outputs[0]
        if rows != 1:
            row = self.cache.alloc.copy_to_host(out)[-1]
            if step is not None:
                check_logits_finite(row, step)
            return int(np.argmax(row))
        if step is not None and not getattr(dev, "argmax_checks_finite", False):
            check_logits_finite(self.cache.alloc.host_view(out)[-1], step)
        if self._picked is not self._out:
            # Greedy picks read these logits: a device that can takes the argmax inside
            # the run that writes them (from the next run on), so argmax below is then
            # only the readback. Not before the first pick: a loop that reads whole
            # rows (bench, sampling) never pays for it.
            self._picked = self._out
            target = getattr(dev, "pick_target", None)
            if target is not None:
                target(buf, n)
        t = int(dev.argmax(buf, n))
        if t < 0:  # a device argmax's answer for a row holding NaN or Inf
            check_logits_finite(self.cache.alloc.copy_to_host(out)[-1], step)
            raise NumericsError(f"the device flagged non-finite logits (step {step}) that read back finite")
        return t

    def last_row(self, step: int | None = None):
        """The last logits row of the last forward for `Sampler.distribution`: on a device
        that selects candidates itself (DeviceRow), nothing is read back but them; else
        the row read back (HostRow), checked for NaN/Inf first. `step` names the decode
        step in a NumericsError."""
        dev, buf, n, rows = self._out
        if rows == 1 and hasattr(dev, "top_k_rows"):
            return DeviceRow(self, step)
        row = self.cache.alloc.host_view(self.cache.graph.outputs[0])[-1]
        check_logits_finite(row, step)
        return HostRow(row)

    def decode_batch(self, items: list, copy: bool = True) -> np.ndarray:
        """Append each item's tokens to its session's sequence in one forward. An item is
        (session, ids) or (session, ids, k): it gets the logits rows of its last k tokens
        (k = 1 when left out; a speculative verify asks for all of its block). Returns
        the rows of all items concatenated in item order. Sessions must belong to this
        context."""
        toks, pos, cells, span, tail = [], [], [], [], []
        for it in items:
            s, ids = it[0], it[1]
            k = it[2] if len(it) > 2 else 1
            if s.context is not self:
                raise MinferError("decode_batch: a session of another context")
            if not ids:
                raise MinferError("decode_batch: an item with no tokens")
            if not 1 <= k <= len(ids):
                raise MinferError(f"decode_batch: an item of {len(ids)} tokens cannot return {k} rows")
            s._check_room(len(ids))
            base = s.base
            p0 = len(s.tokens)
            lo, plo, phi = self.span_head(s.seq)
            for j in range(len(ids)):
                pos.append(p0 + j)
                cells.append(base + p0 + j)
                span += [lo, base + p0 + j + 1, plo, phi]
            toks += ids
            tail.extend(range(len(toks) - k, len(toks)))
        rows, n_out = len(toks), len(tail)
        if self.pad_from is not None and self.pad_from < rows <= self.PAD_MAX:
            toks, pos, cells, span, tail = self._bucketed(toks, pos, cells, span, tail)
        arr = lambda x: np.asarray(x, dtype=np.int32)  # noqa: E731
        with self.lock:
            logits = self.run(arr(toks), arr(pos), arr(cells), arr(span), arr(tail), n_out=len(tail), copy=copy,
                              keep=n_out)
        for it in items:
            it[0].tokens.extend(int(t) for t in it[1])
        return logits

    def _bucketed(self, toks, pos, cells, span, tail):
        """A batch as a bucket's shape: rows up to a multiple of PAD_STEP, logits rows up
        to a multiple of PAD_STEP too, so a server's steps (decode rows beside prompt
        chunks of every length) reuse a few kept graphs. The rows whose logits are wanted
        go first, in `tail` order, then the others, then the padding rows (own cells past
        the sequences', reading only themselves): the graph's first n_out logits rows are
        then the wanted ones, whatever rows the bucket adds after them. Rows are
        independent of their order and of each other (each has its position, cell and
        span; KV is stored before any row attends), so no real row's bits change."""
        rows, step = len(toks), self.PAD_STEP
        want = set(tail)
        order = list(tail) + [r for r in range(rows) if r not in want]
        pick = lambda xs: [xs[r] for r in order]  # noqa: E731
        toks, pos, cells = pick(toks), pick(pos), pick(cells)
        span = [v for r in order for v in span[SPAN_INTS * r:SPAN_INTS * (r + 1)]]
        n_rows = -(-rows // step) * step
        pad = self._padding(n_rows - rows)
        toks, pos, cells, span = toks + pad[0], pos + pad[1], cells + pad[2], span + pad[3]
        n_out = min(n_rows, -(-len(tail) // step) * step)
        return toks, pos, cells, span, list(range(n_out))

    def copy_cells(self, src: int, dst: int, n: int) -> None:
        """Copy KV cells [src, src + n) to [dst, dst + n) in every layer (a prompt's
        cells shared by the sequences of an n > 1 request: no second prefill)."""
        alloc = self.cache.alloc
        with self.lock:
            for layer in sorted(alloc.kv):
                alloc.copy_kv_rows(layer, src, dst, n)

    def session(self, seq: int) -> "Session":
        return Session(self.model, context=self, seq=seq)

    # -- shared prefixes (kv_pool.py) ---------------------------------------------------
    def lend(self, lender: int, seq: int, n: int) -> None:
        """Sequence seq reads the KV of its first n positions from the lender's cells
        (which hold the same n tokens, written) instead of cells of its own: no copy and
        no prefill. Only a sequence that borrows nothing lends (its own cells are written)."""
        if self.borrowed[lender] is not None or lender == seq or n <= 0:
            raise MinferError(f"sequence {lender} cannot lend {n} cells to sequence {seq}")
        self.borrowed[seq] = (lender, int(n))

    def lendable(self, seq: int, n: int) -> tuple[int, int]:
        """(lender, m): the sequence whose own cells hold the first m of sequence seq's
        first n positions, m as large as one lender allows (seq itself where it borrows
        nothing, else its lender, up to what it borrows)."""
        b = self.borrowed[seq]
        return (seq, n) if b is None else (b[0], min(n, b[1]))

    def span_head(self, seq: int) -> tuple[int, int, int]:
        """(own lo, prefix lo, prefix hi) of sequence seq's attention span: its own cells
        from its first position it does not borrow, after the lender's cells it borrows."""
        base = self.ranges[seq][0]
        b = self.borrowed[seq]
        if b is None:
            return base, 0, 0
        lb = self.ranges[b[0]][0]
        return base + b[1], lb, lb + b[1]

    def keep_kv(self, seq: int, n: int) -> None:
        """Sequence seq keeps only its first n positions (it is about to write from n
        on, move, or forget its KV): a borrower of more than n of its cells gets the rest
        copied into its own (they are reserved for it), and seq's own borrow shrinks to n."""
        for i, b in enumerate(self.borrowed):
            if b is not None and b[0] == seq and b[1] > n:
                self.copy_cells(self.ranges[seq][0] + n, self.ranges[i][0] + n, b[1] - n)
                self.borrowed[i] = (seq, n) if n > 0 else None
        b = self.borrowed[seq]
        if b is not None and b[1] > n:
            self.borrowed[seq] = (b[0], n) if n > 0 else None

    def own_kv(self, seq: int) -> None:
        """Sequence seq's borrowed cells copied into its own, the borrow ended (a saved
        session reads its KV from its own cells)."""
        b = self.borrowed[seq]
        if b is not None:
            self.copy_positions(seq, seq, 0, b[1])
            self.borrowed[seq] = None

    def copy_positions(self, src: int, dst: int, a: int, b: int) -> None:
        """The KV of positions [a, b) of sequence src, from its lender's cells or its own,
        into sequence dst's own cells of those positions."""
        lent = self.borrowed[src]
        if lent is not None and a < lent[1]:
            m = min(b, lent[1])
            self.copy_cells(self.ranges[lent[0]][0] + a, self.ranges[dst][0] + a, m - a)
            a = m
        if b > a and src != dst:
            self.copy_cells(self.ranges[src][0] + a, self.ranges[dst][0] + a, b - a)

    def preview_graph(self, n_tokens: int):
        """The graph a forward of this shape would run, assigned and fused, not installed:
        built through self.params and cache.preview, the very calls a forward uses, so an
        export shows the live fusion and backend assignment (tests pin it)."""
        params = self.params(n_tokens, 1)
        graph = self.model.defn.build_graph(params)
        self.cache.preview(graph, fuse=params.cparams.fuse_swiglu)
        return graph

    def dump_graph(self, path: str | Path, n_tokens: int) -> None:
        from minfer.graph.export import write_dot

        write_dot(self.preview_graph(n_tokens), str(path), self.cache.entries)


@dataclass
class GenerationResult:
    ids: list[int] = field(default_factory=list)
    text: str = ""
    stop_reason: str = "length"
    timings: Timings = field(default_factory=Timings)
    logprobs: list = field(default_factory=list)

    # Kept for callers that read the flat fields.
    @property
    def n_prompt(self) -> int:
        return self.timings.prompt_tokens

    @property
    def prompt_ms(self) -> float:
        return self.timings.prompt_ms

    @property
    def gen_ms(self) -> float:
        return self.timings.gen_ms

    @property
    def prompt_tps(self) -> float:
        return self.timings.prompt_tps

    @property
    def gen_tps(self) -> float:
        return self.timings.gen_tps


def _quietly(fn) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - the first forward repeats the work and raises it
        pass


class Session:
    def __init__(self, model, n_ctx: int | None = None, *, fuse: bool = True, reuse: bool = True,
                 context: Context | None = None, seq: int = 0, kv_type: str = "f16"):
        if context is None:
            context = Context(model, n_ctx=n_ctx, n_seq=1, fuse=fuse, reuse=reuse, kv_type=kv_type)
        elif not 0 <= seq < context.n_seq:
            raise MinferError(f"sequence {seq} is outside the context's {context.n_seq} sequences")
        self.model = model
        self.context = context
        self.seq = seq
        self.tokens: list[int] = []     # what the KV of this sequence holds, in order
        self._cancel = threading.Event()

    @classmethod
    def open(cls, path: str | Path, n_ctx: int | None = None, n_threads: int | None = None,
             backends: list[str] | None = None, **kw) -> "Session":
        from minfer.model import Model

        return cls(Model.open(path, backends=backends, n_threads=n_threads), n_ctx=n_ctx, **kw)

    # -- facts ---------------------------------------------------------------------
    @property
    def n_ctx(self) -> int:
        return self.context.n_ctx

    @property
    def base(self) -> int:
        """The first KV cell of this sequence's range in the context's arena."""
        return self.context.ranges[self.seq][0]

    @property
    def cap(self) -> int:
        """How many cells its range holds (n_ctx, unless the context pools its cells)."""
        return self.context.ranges[self.seq][1]

    @property
    def kv_type(self) -> str:
        return self.context.cparams.kv_type

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    @property
    def tokenizer(self):
        return self.model.tokenizer

    @property
    def hp(self):
        return self.model.hp

    @property
    def builds(self) -> int:
        return self.context.builds

    @property
    def backend_names(self) -> list[str]:
        return self.context.backend_names

    @property
    def model_info(self) -> dict:
        return self.model.info

    @property
    def model_name(self) -> str:
        return self.model.path.name

    def check_fits(self, n_prompt: int, n_predict: int) -> None:
        self.model.check_fits(n_prompt, n_predict, self.n_ctx)

    # -- KV ------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the conversation (the KV rows are simply overwritten later)."""
        self.truncate(0)

    def truncate(self, n: int) -> None:
        """Keep the first n tokens of the KV: cells beyond are overwritten later (so
        sequences that read more of them in place get their own copies first)."""
        n = max(0, n)
        if n < len(self.tokens) and self.context.n_seq > 1:
            self.context.keep_kv(self.seq, n)
        del self.tokens[n:]

    def common_prefix(self, ids: list[int]) -> int:
        n = 0
        for a, b in zip(self.tokens, ids):
            if a != b:
                break
            n += 1
        return n

    # -- state that outlives the process (session_file.py) ----------------------------
    def save(self, path: str | Path, meta: dict | None = None) -> int:
        """Write token ids and the KV rows in use to path (atomically); returns its size."""
        from minfer import session_file

        return session_file.save(self, path, meta)

    def restore(self, path: str | Path) -> dict:
        """Replace this conversation with a saved one (no prefill); returns its meta."""
        from minfer import session_file

        self.meta = session_file.restore(self, path)
        return self.meta

    @classmethod
    def load(cls, model, path: str | Path, n_ctx: int | None = None, **kw) -> "Session":
        """A new session holding a saved conversation; n_ctx and kv_type default to the file's."""
        from minfer import session_file

        if n_ctx is None or "kv_type" not in kw:
            header = session_file.read(path)[0]
            n_ctx = int(header["n_ctx"]) if n_ctx is None else n_ctx
            kw.setdefault("kv_type", header["kv_type"])
        s = cls(model, n_ctx=n_ctx, **kw)
        s.restore(path)
        return s

    def _check_room(self, nt: int) -> None:
        if self.n_past + nt > self.n_ctx:
            raise ContextError(f"{self.n_past} + {nt} tokens exceed the context of {self.n_ctx}")
        if self.n_past + nt > self.cap:   # a pooled context's range: what the engine reserved
            raise ContextError(f"{self.n_past} + {nt} tokens exceed the {self.cap} KV cells reserved for "
                               f"sequence {self.seq}")

    # -- forward -------------------------------------------------------------------
    def forward(self, tokens, n_out: int = 1, copy: bool | None = True) -> np.ndarray | None:
        """Append tokens to this sequence; logits [n_out, n_vocab] of the last n_out.
        copy=False: a read-only view, valid until the next forward of the context;
        copy=None: nothing read back (a greedy pick follows through argmax_last)."""
        nt = len(tokens)
        if nt == 0:
            raise MinferError("forward needs at least one token")
        if not 1 <= n_out <= nt:
            raise MinferError(f"n_out must be in [1, {nt}], got {n_out}")
        self._check_room(nt)
        ctx = self.context
        if nt == 1 and n_out == 1 and not ctx.cparams.explicit_span and isinstance(tokens[0], (int, np.integer)):
            tok = int(tokens[0])
            p0 = self.n_past
            with ctx.lock:
                logits = ctx.run_one(tok, p0, p0 + self.base, copy)
            self.tokens.append(tok)
            return logits
        ids = np.asarray(tokens, dtype=np.int32)
        p0 = self.n_past
        pos = np.arange(p0, p0 + nt, dtype=np.int32)
        base = self.base
        cells = pos + base if base else pos
        span = None
        if ctx.cparams.explicit_span:
            span = np.empty((nt, SPAN_INTS), dtype=np.int32)
            span[:, 0], span[:, 2], span[:, 3] = ctx.span_head(self.seq)
            span[:, 1] = cells + 1
        with ctx.lock:
            logits = ctx.run(ids, pos, cells, span, None, n_out=n_out, copy=copy)
        self.tokens.extend(ids.tolist())
        return logits

    def argmax_last(self, step: int | None = None) -> int:
        return self.context.argmax_last(step)

    def prefill(self, prompt_ids: list[int], copy: bool | None = False) -> tuple[np.ndarray | None, int]:
        """Process what follows the longest prefix the KV already holds; returns the
        last logits row and how many prompt tokens were reused. At least one token is
        processed so there are logits to pick from."""
        if not prompt_ids:
            raise ContextError("the prompt is empty after tokenization")
        keep = min(self.common_prefix(prompt_ids), len(prompt_ids) - 1)
        self.truncate(keep)
        return self.forward(prompt_ids[keep:], n_out=1, copy=copy), keep

    def cancel(self) -> None:
        """Ask a running stream to stop before its next step (thread-safe)."""
        self._cancel.set()

    # -- generation ----------------------------------------------------------------
    def stream(self, prompt_ids: list[int], n_predict: int, sampling: SamplingParams | None = None,
               stop: list[str] | None = None, stop_at_eog: bool = True, logprobs: bool | int = False,
               reuse_prefix: bool = True, speculate=None, mask=None) -> Iterator[TokenEvent]:
        """Generate up to n_predict tokens after prompt_ids, one TokenEvent a token and a
        final one (done=True). Drives the engine (engine.py) over this session alone.
        Closing the generator (or cancel()) stops it between steps; the KV then holds
        the prompt and every token but the last. logprobs: True (the pick's) or N (and
        the N most likely alternatives). speculate: a minfer.speculate.Speculation.
        mask: a token-mask hook (engine.Sequence)."""
        lp = None if logprobs is False or logprobs is None else (0 if logprobs is True else int(logprobs))
        seq = Sequence(prompt_ids, n_predict, sampling, stop=stop, stop_at_eog=stop_at_eog, logprobs=lp,
                       mask=mask, one_at_a_time=True)
        if speculate is not None:
            seq.spec = self._seq_spec(speculate, seq.sampling)
        self._cancel.clear()
        engine = self._engine()
        gen = run_one(engine, seq, 0, reuse_prefix=reuse_prefix)
        try:
            for ev in gen:
                yield ev
                if ev.done:
                    break
                if self._cancel.is_set():
                    engine.abort(seq)
        finally:
            gen.close()
            self.last_timings = seq.timings

    def _engine(self) -> Engine:
        """This session's engine (itself its only slot), kept for the next stream."""
        eng = getattr(self, "_own_engine", None)
        if eng is None:
            eng = self._own_engine = Engine(self.context, [self])
        return eng

    def _seq_spec(self, spec, sampling: SamplingParams) -> SeqSpec:
        # A greedy stream's output does not depend on the depth: it may follow the clock.
        measured = sampling.temperature <= 0.0
        if spec.mode == "draft":
            return SeqSpec("draft", spec.draft_max, spec.policy, draft_session=spec.draft_session(self),
                           measured=measured)
        return SeqSpec("ngram", spec.draft_max, spec.policy, drafter=spec.drafter(self), measured=measured)

    def generate(self, prompt_ids: list[int], n_predict: int, sampling: SamplingParams | None = None,
                 stop: list[str] | None = None, on_text=None, stop_at_eog: bool = True,
                 reuse_prefix: bool = False, speculate=None, logprobs: bool | int = False) -> GenerationResult:
        """The whole stream as one result; on_text gets each released text piece."""
        res = GenerationResult()
        parts = []
        for ev in self.stream(prompt_ids, n_predict, sampling, stop=stop, stop_at_eog=stop_at_eog,
                              reuse_prefix=reuse_prefix, speculate=speculate, logprobs=logprobs):
            if ev.text:
                parts.append(ev.text)
                if on_text:
                    on_text(ev.text)
            if ev.done:
                res.stop_reason, res.timings = ev.stop_reason, ev.timings
            else:
                res.ids.append(ev.id)
                res.logprobs.append(ev.logprob)
        res.text = "".join(parts)
        return res

    def generate_ids(self, prompt_ids: list[int], n: int, temperature: float = 0.0, seed: int | None = None) -> list[int]:
        sp = SamplingParams(temperature=temperature, seed=seed)
        return self.generate(prompt_ids, n, sp, stop=[], stop_at_eog=False).ids

    def dump_graph(self, path: str | Path, n_tokens: int, decode: bool) -> None:
        self.context.dump_graph(path, 1 if decode else n_tokens)

    def graph_json(self, n_tokens: int, decode: bool) -> dict:
        """The minfer-graph JSON document of the prefill (n_tokens) or decode graph."""
        from minfer.graph.export import graph_json

        g = self.context.preview_graph(1 if decode else n_tokens)
        return graph_json(g, self.model_name, "decode" if decode else "prefill", self.context.cache.name_of)


