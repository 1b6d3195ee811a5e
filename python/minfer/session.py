"""Sessions: one conversation's graph cache, KV and positions over a shared Model.

A `Context` owns one graph cache whose KV arena holds `n_seq` sequences of `n_ctx`
cells each; sequence s owns cells [s*n_ctx, (s+1)*n_ctx). Several sequences run in
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
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from minfer.errors import ContextError, MinferError, NumericsError
from minfer.graph.cache import GraphCache
from minfer.graph.params import KV_TYPES, CParams, GraphParams, GraphType
from minfer.graph.trace import trace_enabled, trace_summary
from minfer.limits import check_context
from minfer.logits_check import check_logits_finite
from minfer.sampling import HostRow, Sampler, SamplingParams


def _cuda_fusions() -> frozenset:
    from minfer.backends.cuda import fusions_from_env
    return fusions_from_env()


def _cuda_row_exact_max() -> int:
    from minfer import _core
    return int(_core.CUDA_ROW_EXACT_MAX_TOKENS)


class Context:
    """One graph cache + KV arena shared by up to n_seq sequences run together."""

    def __init__(self, model, n_ctx: int | None = None, n_seq: int = 1, fuse: bool = True, reuse: bool = True,
                 kv_type: str = "f16"):
        if n_ctx is None or n_ctx == 0:
            n_ctx = model.hp.n_ctx_train
        if n_ctx < 0:
            raise MinferError(f"context size must be positive, got {n_ctx}")
        if n_seq < 1:
            raise MinferError(f"a context needs at least one sequence, got {n_seq}")
        if kv_type not in KV_TYPES:
            raise MinferError(f"KV type must be one of {', '.join(KV_TYPES)}, got {kv_type!r}")
        check_context(int(n_ctx) * int(n_seq))
        self.model = model
        self.n_ctx = int(n_ctx)        # cells per sequence
        self.n_seq = int(n_seq)
        self.reuse = reuse
        # The backends the model selected (the registry's choice); threads are the CPU device's setting.
        self.cache = GraphCache(model.entries, model.weights, {"threads": model.n_threads})
        # Everything that shapes the graph besides the batch shape; a new value is a new
        # object, so the memo below can never hand out params built from an old one.
        # With CUDA leading, the decode fusions (step merges in its executor) are on
        # unless fuse=False or MINFER_CUDA_FUSE says otherwise; they are in the reuse key.
        gpu = self.cache.scheduler.entries[0].name == "cuda"
        fz = _cuda_fusions() if gpu and fuse else frozenset()
        self.cparams = CParams(n_ctx=self.n_ctx * self.n_seq, explicit_span=self.n_seq > 1, fuse_swiglu=fuse,
                               gpu=gpu, fuse_qkv="qkv" in fz, fuse_ffn="ffn" in fz,
                               fuse_residual="residual" in fz, fuse_quant="quant" in fz,
                               fuse_rope="rope" in fz, fuse_norm="norm" in fz, kv_type=kv_type)
        # Up to how many token rows a forward gives each row's logits bitwise as a lone
        # step would (None: any number; the CPU kernels are row-independent). The CUDA
        # backend takes a GEMM path above its limit.
        self.row_exact_max = _cuda_row_exact_max() if gpu else None
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

    @contextlib.contextmanager
    def warming(self):
        """warm() on a thread for the length of the block, joined on leaving: for start-up
        work that does not touch this context (building the tokenizer, 0.9 s for a 152k
        vocabulary, beside the ~0.5 s weight repack). Only where every device can ready
        its weights apart from a run (the CPU). A failure is left to the first forward,
        which repeats the work and raises it. MINFER_WARM=0 turns it off (A/B runs)."""
        if os.environ.get("MINFER_WARM") == "0" or not all(
                hasattr(d, "prepare") for d in self.cache.alloc.devices.values()):
            yield
            return
        th = threading.Thread(target=_quietly, args=(self.warm,), name="minfer-warm")
        th.start()
        try:
            yield
        finally:
            th.join()

    def run(self, tokens: np.ndarray, positions: np.ndarray, cells: np.ndarray, span: np.ndarray | None,
            tail: np.ndarray | None, n_out: int, copy: bool | None = True) -> np.ndarray | None:
        """One forward over a batch of token rows; logits [n_out, n_vocab] of the rows
        `tail` names (the last n_out rows when tail is None). copy=None reads nothing
        back: a greedy pick follows through argmax_last, which on a device backend is
        then the step's only readback."""
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
        return alloc.copy_to_host(g.outputs[0]) if copy else alloc.host_view(g.outputs[0])

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
            base = s.seq * self.n_ctx
            p0 = len(s.tokens)
            for j in range(len(ids)):
                pos.append(p0 + j)
                cells.append(base + p0 + j)
                span += [base, base + p0 + j + 1]
            toks += ids
            tail.extend(range(len(toks) - k, len(toks)))
        arr = lambda x: np.asarray(x, dtype=np.int32)  # noqa: E731
        with self.lock:
            logits = self.run(arr(toks), arr(pos), arr(cells), arr(span), arr(tail), n_out=len(tail), copy=copy)
        for it in items:
            it[0].tokens.extend(int(t) for t in it[1])
        return logits

    def session(self, seq: int) -> "Session":
        return Session(self.model, context=self, seq=seq)

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
class Timings:
    prompt_tokens: int = 0      # tokens of the prompt as given
    cached_tokens: int = 0      # of those, reused from the session's KV (not processed)
    prompt_ms: float = 0.0      # processing the uncached prompt tokens (to the first pick)
    generated_tokens: int = 0
    gen_ms: float = 0.0         # from the first pick to the end
    drafted: int | None = None  # speculative streams: tokens drafted, and of those accepted
    accepted: int | None = None

    @property
    def prompt_tps(self) -> float:
        n = self.prompt_tokens - self.cached_tokens
        return n / (self.prompt_ms / 1000) if self.prompt_ms > 0 else 0.0

    @property
    def gen_tps(self) -> float:
        # The first generated token comes out of the prefill; the rest are decode steps.
        steps = max(self.generated_tokens - 1, 0)
        return steps / (self.gen_ms / 1000) if self.gen_ms > 0 and steps else 0.0

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
            "prompt_ms": round(self.prompt_ms, 2), "prompt_tps": round(self.prompt_tps, 2),
            "generated_tokens": self.generated_tokens, "gen_ms": round(self.gen_ms, 2),
            "gen_tps": round(self.gen_tps, 2),
            **({"drafted": self.drafted, "accepted": self.accepted} if self.drafted is not None else {}),
        }


@dataclass
class TokenEvent:
    """One step of a stream. `text` is the text released by this event: stop strings
    never appear, and text that could still grow into one is held back. The last event
    has done=True, id None, the final text flush, the stop reason and the timings."""

    id: int | None
    text: str
    logprob: float | None = None
    done: bool = False
    stop_reason: str | None = None
    timings: Timings | None = None


@dataclass
class GenerationResult:
    ids: list[int] = field(default_factory=list)
    text: str = ""
    stop_reason: str = "length"
    timings: Timings = field(default_factory=Timings)

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
        self.tokens.clear()

    def truncate(self, n: int) -> None:
        """Keep the first n tokens of the KV: cells beyond are overwritten later."""
        del self.tokens[max(0, n):]

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
                logits = ctx.run_one(tok, p0, p0 + self.seq * ctx.n_ctx, copy)
            self.tokens.append(tok)
            return logits
        ids = np.asarray(tokens, dtype=np.int32)
        p0 = self.n_past
        pos = np.arange(p0, p0 + nt, dtype=np.int32)
        base = self.seq * ctx.n_ctx
        cells = pos + base if base else pos
        span = None
        if ctx.cparams.explicit_span:
            span = np.empty((nt, 2), dtype=np.int32)
            span[:, 0] = base
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
               stop: list[str] | None = None, stop_at_eog: bool = True, logprobs: bool = False,
               reuse_prefix: bool = True, speculate=None) -> Iterator[TokenEvent]:
        """Generate up to n_predict tokens after prompt_ids. Closing the generator (or
        cancel()) stops it between steps; the KV then holds what was processed.
        speculate: a minfer.speculate.Speculation; the picks then come from verified
        draft blocks (speculate.py), everything else here is unchanged."""
        sampling = sampling or SamplingParams(temperature=0.0)
        sampler = Sampler(sampling)
        prompt_ids = [int(t) for t in prompt_ids]
        if not reuse_prefix:
            self.reset()
        # The KV ends up holding the prompt and the generated tokens: check before work.
        self.check_fits(len(prompt_ids), n_predict)
        self._cancel.clear()
        for t in prompt_ids:
            sampler.accept(t)
        tm = Timings(prompt_tokens=len(prompt_ids))
        if n_predict == 0:
            yield TokenEvent(None, "", done=True, stop_reason="length", timings=tm)
            return
        text = TextState(self.tokenizer, stop=stop, stop_at_eog=stop_at_eog)
        # Greedy without penalties needs only the argmax, which the backend holding the
        # logits takes in place (checking them for NaN/Inf as it goes): nothing else is
        # read back, so forwards pass copy=None and pick(None) asks the context.
        greedy = sampling.temperature <= 0.0 and sampling.repeat_penalty == 1.0 and not logprobs
        # Sampling on a GPU likewise: the device selects the candidates (last_row), so a
        # step reads back those, not the 600 KB row.
        on_device = not greedy and not logprobs and self.context.cparams.gpu
        copy = None if greedy or on_device else False

        step = 0  # 0 = the prompt, then one per decode step

        def pick(logits) -> tuple[int, float | None]:
            nonlocal step
            if logits is None:
                if greedy:
                    t = self.context.argmax_last(step)  # never the argmax of NaNs
                else:
                    t = sampler.sample(self.context.last_row(step))  # never from NaNs either
                step += 1
                return t, None
            check_logits_finite(logits[-1], step)  # never the argmax of NaNs
            step += 1
            if greedy:
                return self.context.argmax_last(), None
            return pick_token(logits[-1], sampler, logprobs)

        t0 = time.perf_counter()
        logits, tm.cached_tokens = self.prefill(prompt_ids, copy=copy)
        nxt, lp = pick(logits)
        tm.prompt_ms = (time.perf_counter() - t0) * 1000
        t1 = time.perf_counter()
        reason = "length"
        picks = 1
        source = None
        if speculate is not None:
            from minfer.speculate import Runner

            source = Runner(speculate, self, sampler, pick, prompt_ids, n_predict, logprobs, tm)
        # The forward of a token goes out before its text work and its consumer (the
        # yield): a device runs the step meanwhile, and a greedy step reads nothing back
        # until the next pick. Not for a token that ends the output by itself (an
        # end-of-generation id, the last of n_predict, a cancelled stream); a stop string
        # or a consumer that stops the stream take the token back. `ahead`: the context's
        # run count after that forward, until its pick.
        ahead = None
        try:
            while True:
                sampler.accept(nxt)
                out = None
                if (source is None and nxt not in text.eog and len(text.ids) + 1 < n_predict
                        and not self._cancel.is_set()):
                    out = self.forward([nxt], n_out=1, copy=copy)
                    ahead = self.context.runs
                piece, end = text.push(nxt)
                if end is not None:
                    reason = end
                    break
                yield TokenEvent(nxt, piece, lp)
                if len(text.ids) >= n_predict:
                    break
                if self._cancel.is_set():
                    reason = "cancelled"
                    break
                if source:
                    nxt, lp = source.next(nxt)
                else:  # the forward went ahead: every other case has left the loop
                    stale, ahead = self.context.runs != ahead, None
                    if stale:
                        # Another sequence of this context ran meanwhile: its logits
                        # replaced ours. The KV row is ours; the same step again.
                        self.truncate(len(self.tokens) - 1)
                        out = self.forward([nxt], n_out=1, copy=copy)
                    nxt, lp = pick(out)
                picks += 1
            rest, reason = text.finish(reason)
        finally:
            if ahead is not None:
                self.truncate(len(self.tokens) - 1)  # its output ended before it
            if source:
                source.finish(picks)  # drop verified cells a plain stream would not hold
            tm.generated_tokens = len(text.ids)
            tm.gen_ms = (time.perf_counter() - t1) * 1000
            self.last_timings = tm
        yield TokenEvent(None, rest, done=True, stop_reason=reason, timings=tm)

    def generate(self, prompt_ids: list[int], n_predict: int, sampling: SamplingParams | None = None,
                 stop: list[str] | None = None, on_text=None, stop_at_eog: bool = True,
                 reuse_prefix: bool = False, speculate=None) -> GenerationResult:
        """The whole stream as one result; on_text gets each released text piece."""
        res = GenerationResult()
        parts = []
        for ev in self.stream(prompt_ids, n_predict, sampling, stop=stop, stop_at_eog=stop_at_eog,
                              reuse_prefix=reuse_prefix, speculate=speculate):
            if ev.text:
                parts.append(ev.text)
                if on_text:
                    on_text(ev.text)
            if ev.done:
                res.stop_reason, res.timings = ev.stop_reason, ev.timings
            else:
                res.ids.append(ev.id)
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


class TextState:
    """The text side of one generating sequence: ids in, released text out.

    Stop strings never appear in the released text, text that could still grow into
    one is held back, and a character split across tokens waits for its last byte.
    Session.stream and the server's scheduler both drive one of these per sequence."""

    def __init__(self, tokenizer, stop: list[str] | None = None, stop_at_eog: bool = True):
        from minfer.tokenizer import StreamDecoder

        self.eog = tokenizer.eot_ids if stop_at_eog else frozenset()
        self.decoder = StreamDecoder(tokenizer)
        self.stops = [s for s in (stop or []) if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.emitted = 0
        self.ids: list[int] = []

    def push(self, tid: int) -> tuple[str, str | None]:
        """Take one generated id; returns the text it releases and, when it ends the
        generation, the reason ("eos" or "stop"; the id is then not part of the output)."""
        if tid in self.eog:
            return "", "eos"
        self.ids.append(tid)
        self.text += self.decoder.push(tid)
        hit = _find_stop(self.text, self.stops)
        if hit is not None:
            self.text = self.text[:hit]
            return "", "stop"
        upto = max(self.emitted, len(self.text) - self.hold)
        out = self.text[self.emitted:upto]
        self.emitted = upto
        return out, None

    def finish(self, reason: str) -> tuple[str, str]:
        """The last text (what was held back) and the final stop reason."""
        if reason != "stop":
            self.text += self.decoder.flush()
            hit = _find_stop(self.text, self.stops)
            if hit is not None:
                self.text, reason = self.text[:hit], "stop"
        out = self.text[self.emitted:]
        self.emitted = len(self.text)
        return out, reason


class DeviceRow:
    """The one logits row of a context's last forward, left on the device that wrote it:
    the sampler's candidates (the best k, the penalized ids' values) come back from the
    device's selection in one call; a filter that needs the whole row (no top-k) reads it
    back. Same ids and values as HostRow on that row, so the same picks."""

    def __init__(self, ctx: Context, step: int | None):
        self.ctx, self.step = ctx, step
        self.dev, self.buf, self.n, _ = ctx._out

    def argmax(self) -> int:
        return self.ctx.argmax_last(self.step)

    def takes(self, k: int) -> bool:
        return k <= getattr(self.dev, "top_k_max", 0)

    def best(self, k: int, ids: np.ndarray | None):
        gather = np.zeros((1, 0), dtype=np.int32) if ids is None else np.asarray(ids, dtype=np.int32).reshape(1, -1)
        got = self.dev.top_k_rows(self.buf, self.n, 1, k, gather)[0]
        if got is None:  # NaN or Inf in the row: the row words the error
            self.row()
            raise NumericsError(f"the device flagged non-finite logits (step {self.step}) that read back finite")
        top, vals, at = got
        return top, vals.astype(np.float64), None if ids is None else at.astype(np.float64)

    def row(self) -> np.ndarray:
        row = self.ctx.cache.alloc.host_view(self.ctx.cache.graph.outputs[0])[-1]
        check_logits_finite(row, self.step)
        return row


class DeviceRows:
    """Every logits row of a context's last forward (a batched step, one row per
    sequence), left on the device that wrote them, for the picks of all rows at once.
    Reading the rows back costs n_vocab * 4 bytes each (600 KB for a 152k vocabulary,
    per sequence per step) where a pick needs an int, or a sampler's few hundred
    candidates: the greedy rows' picks come from ONE argmax_rows call and the sampled
    rows' candidates from ONE top_k_rows call over the rows, each call made only when a
    row first asks for it. A device takes at most MAX_ROWS rows per call; the caller
    keeps to that (`usable`).

    One top_k_rows call serves every row, so what the sampled rows will ask is planned
    (`plan`) before any asks: k is the most candidates a planned row takes, and each
    row gathers its penalized ids. A request outside the plan, a filter that needs the
    whole row (no top-k) or a device without the calls reads the rows back (once a
    step), so the plan only decides what is read back, never what is picked: each row
    (`source`) answers as HostRow on that row would."""

    MAX_ROWS = 64  # rows one argmax_rows / top_k_rows call takes (kArgmaxMaxRows in csrc/cuda)

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.dev, self.buf, self.n, self.rows = ctx._out
        self.on_device = self.rows <= self.MAX_ROWS and self.usable_device(self.dev)
        self.k_max = min(getattr(self.dev, "top_k_max", 0), self.n) if self.on_device else 0
        self.k = 0                     # candidates the one top_k_rows call selects per row
        self.gather: dict[int, np.ndarray] = {}  # row -> its penalized ids (int64)
        self._argmax = None            # argmax_rows' answers, once a row asked
        self._top = None               # top_k_rows' answers, once a row asked
        self._host = None              # the rows read back, once a row needed them

    @staticmethod
    def usable_device(dev) -> bool:
        return hasattr(dev, "argmax_rows") and hasattr(dev, "top_k_rows")

    @classmethod
    def usable(cls, ctx: Context, rows: int) -> bool:
        """Whether a forward of `rows` logits rows can leave them on the device: its
        device (the last forward's; none before the first) picks in place."""
        return rows <= cls.MAX_ROWS and ctx._out is not None and cls.usable_device(ctx._out[0])

    def plan(self, r: int, sampler: Sampler) -> None:
        """Row r will be picked from by `sampler`: note the candidates its distribution
        will ask for (Sampler.distribution's rule). Before any row asks for candidates."""
        if not self.on_device:
            return
        k, pen = sampler.needs(self.n)
        if k <= 0:
            return                     # the argmax, or the whole row (read back)
        want = min(k + (0 if pen is None else pen.size), self.n)
        if want > self.k_max:
            return                     # more than one call selects: read back
        self.k = max(self.k, want)
        if pen is not None:
            self.gather[r] = pen

    def source(self, r: int, step: int | None) -> "BatchedRow":
        return BatchedRow(self, r, step)

    def argmax(self, r: int, step: int | None) -> int:
        if not self.on_device:
            return int(np.argmax(self.host_row(r, step)))
        if self._argmax is None:
            self._argmax = [int(t) for t in self.dev.argmax_rows(self.buf, self.n, self.rows)]
        t = self._argmax[r]
        if t < 0:
            self._broken(r, step)
        return t

    def takes(self, k: int) -> bool:
        return 0 < k <= self.k

    def best(self, r: int, k: int, ids: np.ndarray | None, step: int | None):
        if not self.takes(k):
            return HostRow(self.host_row(r, step)).best(k, ids)
        if self._top is None:
            g = max((v.size for v in self.gather.values()), default=0)
            gather = np.full((self.rows, g), -1, dtype=np.int32)
            for i, v in self.gather.items():
                gather[i, :v.size] = v
            self._top = self.dev.top_k_rows(self.buf, self.n, self.rows, self.k, gather)
        got = self._top[r]
        if got is None:
            self._broken(r, step)
        top, vals, at = got
        if k > top.size:               # planned after the call: more than it selected
            return HostRow(self.host_row(r, step)).best(k, ids)
        if ids is None:
            return top[:k], vals[:k].astype(np.float64), None
        # By id, not by position: the ids come as the sampler's set iterates them.
        mine = self.gather.get(r)
        where = {} if mine is None else {int(i): j for j, i in enumerate(mine)}
        pos = [where.get(int(i), -1) for i in ids]
        if min(pos, default=0) < 0:    # an id the plan did not gather
            return HostRow(self.host_row(r, step)).best(k, ids)
        return top[:k], vals[:k].astype(np.float64), at[pos].astype(np.float64)

    def host_row(self, r: int, step: int | None) -> np.ndarray:
        """Row r read back (all rows are, once), checked for NaN/Inf."""
        if self._host is None:
            self._host = self.ctx.cache.alloc.host_view(self.ctx.cache.graph.outputs[0])
        row = self._host[r]
        check_logits_finite(row, step)
        return row

    def _broken(self, r: int, step: int | None):
        """The device flagged NaN/Inf in row r: the row read back words the error."""
        self.host_row(r, step)
        raise NumericsError(f"the device flagged non-finite logits (step {step}) that read back finite")


class BatchedRow:
    """Row r of a DeviceRows, as Sampler.distribution reads a row (see HostRow); `step`
    names the decode step in a NumericsError."""

    def __init__(self, rows: DeviceRows, r: int, step: int | None):
        self.rows, self.r, self.step = rows, r, step
        self.n = rows.n

    def argmax(self) -> int:
        return self.rows.argmax(self.r, self.step)

    def takes(self, k: int) -> bool:
        return self.rows.takes(k)

    def best(self, k: int, ids: np.ndarray | None):
        return self.rows.best(self.r, k, ids, self.step)

    def row(self) -> np.ndarray:
        return self.rows.host_row(self.r, self.step)


def pick_token(row: np.ndarray, sampler: Sampler, logprobs: bool = False) -> tuple[int, float | None]:
    """The next id from one logits row (argmax when greedy without penalties)."""
    sp = sampler.params
    t = int(np.argmax(row)) if sp.temperature <= 0.0 and sp.repeat_penalty == 1.0 else sampler.sample(row)
    return t, (_logprob(row, t) if logprobs else None)


def _logprob(row: np.ndarray, t: int) -> float:
    x = row.astype(np.float64)
    m = x.max()
    return float(x[t] - m - np.log(np.exp(x - m).sum()))


def _find_stop(text: str, stops: list[str]) -> int | None:
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or i < best):
            best = i
    return best
