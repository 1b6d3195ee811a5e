"""The slot scheduler: one background thread owns the Context and runs every forward.

Each slot is one sequence of a shared Context (its KV cells, its token history). A
request (a Job) waits in a bounded queue until a slot is free; it is routed to the free
slot whose held tokens share the longest prefix with its prompt, so a conversation's
next turn reuses its KV. Every step runs ONE forward over all active slots (continuous
batching): decoding slots contribute their last token, a newcomer contributes a chunk
of its prompt (at most `chunk` prompt tokens per step in all), so a long prompt never
stalls the others for more than a step. Jobs join between steps and leave when done.

A job may speculate (speculate.py): by prompt lookup, or with a draft model when the
server has one (each slot then also owns a sequence of the draft model's context, and
the drafts of all such slots come from batched draft forwards before the step). Its
slot contributes its last pick plus up to d drafted tokens, and gets back the logits of
all d + 1 rows; the
verified picks (the kept drafts and one of the target's own) are handed out one at a
time, exactly as single steps would hand them out, and the slot's KV forgets the
rejected cells (bookkeeping only: they are overwritten later). Rows are independent in
the forward, so what a slot generates does not depend on what the others contribute.

On a device that picks in place (CUDA: argmax_rows, top_k_rows), a step without drafts
leaves its logits there and reads back only what the picks need (session.DeviceRows),
not a row of n_vocab floats per slot; the picks are the same.

The HTTP side never touches the Context: it submits Jobs and receives Events through
the job's `emit` callback (called on this thread; the app hops them onto its loop).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from minfer.errors import MinferError, NumericsError
from minfer.logits_check import check_logits_finite
from minfer.sampling import Sampler, SamplingParams, sample_rows
from minfer.session import BatchedRow, Context, DeviceRows, TextState
from minfer.speculate import NgramDrafter, Policy, check_same_vocab, verify

log = logging.getLogger("minfer.server")


class QueueFull(Exception):
    """The wait queue is at its bound (the server answers 503)."""


class ShuttingDown(Exception):
    """The scheduler no longer takes jobs."""


@dataclass
class Event:
    kind: str                    # "token" | "done" | "error"
    text: str = ""
    id: int | None = None
    reason: str | None = None    # done: "eos" | "stop" | "length" | "cancelled"
    usage: dict | None = None    # done: prompt/completion/cached tokens
    status: int = 500            # error: the HTTP status to answer with
    message: str = ""            # error


@dataclass
class Job:
    prompt_ids: list[int]
    n_predict: int
    sampling: SamplingParams
    emit: Callable[[Event], None]
    stop: list[str] = field(default_factory=list)
    stop_at_eog: bool = True
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    client_gone: bool = False    # set by the app when the client disconnected
    speculate: "SpecRequest | None" = None  # how this job speculates (None: plain steps)

    def cancel(self) -> None:
        """Thread-safe: the job leaves its slot at the next step boundary."""
        self.cancelled.set()


@dataclass(frozen=True)
class SpecRequest:
    """A job's speculation: the drafter ("ngram": prompt lookup; "draft": the server's
    draft model) and the most tokens drafted per verify (the depth adapts below it)."""

    mode: str = "ngram"
    draft_max: int = 8


class SlotSpec:
    """One speculating job's drafter and depth policy. The depth is chosen from the
    acceptance estimates and the cost priors only, never from the clock: a batched
    step's time says little about one slot's block, and this keeps a seeded sampled
    request's output independent of the machine's load."""

    mode = "ngram"

    def __init__(self, req: SpecRequest, prompt_ids: list[int]):
        self.draft_max = req.draft_max
        self.drafter = NgramDrafter()  # also the log of the context: prompt, then every pick
        self.drafter.extend(prompt_ids)
        self.policy = Policy(adaptive=True)
        self.drafted = 0
        self.accepted = 0

    def propose(self, limit: int) -> tuple[list[int], int]:
        if limit <= 0:
            return [], 0
        draft, bucket = self.drafter.propose(min(limit, self.draft_max))
        return (draft[:self.policy.depth(bucket, len(draft), measured=False)] if draft else []), bucket


class ModelSlotSpec(SlotSpec):
    """Drafting with the server's draft model: the depth is chosen before drafting (each
    drafted token costs a draft forward), from the acceptance and the weight-bytes ratio
    of the two models as the draft's cost per token."""

    mode = "draft"

    def __init__(self, req: SpecRequest, prompt_ids: list[int], q0: float):
        super().__init__(req, prompt_ids)
        self.policy.q0 = q0

    def depth(self, limit: int) -> int:
        return self.policy.depth(1, min(limit, self.draft_max), measured=False) if limit > 0 else 0


class Slot:
    def __init__(self, session, draft_session=None):
        self.session = session
        self.draft_session = draft_session  # this slot's sequence of the draft model (or None)
        self.job: Job | None = None
        self.last_used = 0.0
        self._clear()

    def _clear(self) -> None:
        self.pending: list[int] = []     # prompt tokens still to process
        self.next_tok: int | None = None  # the last pick, fed back at the next step
        self.sampler: Sampler | None = None
        self.text: TextState | None = None
        self.cached = 0
        self.first_token_at: float | None = None
        self.picks = 0                    # tokens picked so far (each handed to self.text)
        self.spec: SlotSpec | None = None
        self.draft: list[int] = []        # the drafts riding with next_tok in this step
        self.bucket = 0

    @property
    def busy(self) -> bool:
        return self.job is not None


def default_max_batch(model) -> int:
    """Sequences per forward. MINFER_BATCH overrides. On every device we have measured
    here batching pays: a batched step reads each weight once for all sequences (on CPU
    a decode step is bound by reading the weights), so the default is all slots."""
    env = os.environ.get("MINFER_BATCH", "").strip()
    if env:
        try:
            n = int(env)
        except ValueError:
            raise MinferError(f"MINFER_BATCH must be an integer, got {env!r}") from None
        if n < 1:
            raise MinferError(f"MINFER_BATCH must be >= 1, got {n}")
        return n
    return 1 << 30


class Scheduler:
    def __init__(self, model, n_slots: int = 4, n_ctx: int = 4096, max_queue: int = 64,
                 chunk: int = 128, max_batch: int | None = None, metrics=None,
                 speculate: SpecRequest | None = None, draft_model=None):
        if n_slots < 1:
            raise MinferError(f"--slots must be >= 1, got {n_slots}")
        if speculate is not None and (speculate.mode not in ("ngram", "draft") or not 1 <= speculate.draft_max <= 64):
            raise MinferError(f"the server speculates with ngram or draft and a draft_max in [1, 64], got {speculate}")
        if speculate is not None and speculate.mode == "draft" and draft_model is None:
            raise MinferError("speculating with a draft model needs the draft model (--draft-model PATH)")
        self.model = model
        self.tokenizer = model.tokenizer
        self.ctx = Context(model, n_ctx=n_ctx, n_seq=n_slots)
        self.n_ctx = self.ctx.n_ctx
        self.draft_model = draft_model
        self.dctx = None                 # the draft model's context: one sequence per slot
        if draft_model is not None:
            check_same_vocab(model, draft_model)
            self.dctx = Context(draft_model, n_ctx=self.n_ctx, n_seq=n_slots)
            # A decode step reads every weight once: the bytes' ratio is a draft token's
            # cost relative to a target step (speculate.Speculation.drafter does the same).
            self.draft_cost = (draft_model.defn.weight_bytes_per_token()
                               / max(1, model.defn.weight_bytes_per_token()))
        self.slots = [Slot(self.ctx.session(i), self.dctx.session(i) if self.dctx else None)
                      for i in range(n_slots)]
        self.max_queue = max_queue
        self.chunk = max(1, chunk)
        self.max_batch = max(1, min(max_batch or default_max_batch(model), n_slots))
        self.metrics = metrics
        self.speculate = speculate       # the default of a request that does not say
        self._waiting: collections.deque[Job] = collections.deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._draining = False
        self._rr = 0                     # round-robin start when the batch is smaller than the slots
        self._thread = threading.Thread(target=self._loop, name="minfer-scheduler", daemon=True)
        self.steps = 0

    # -- the HTTP side ---------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        if job.speculate is not None and job.speculate.mode == "draft" and self.dctx is None:
            raise MinferError("this server has no draft model to speculate with")
        with self._cv:
            if self._stopping or self._draining:
                raise ShuttingDown("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are already waiting")
            self._waiting.append(job)
            self._cv.notify()

    def drain(self) -> None:
        """Take no new jobs; the accepted ones carry on."""
        with self._cv:
            self._draining = True

    def stop(self, timeout: float = 10.0) -> bool:
        """Stop taking jobs, cancel the waiting and the running ones (each gets its
        final event), and join the thread. True when it ended within `timeout`."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def slots_busy(self) -> int:
        return sum(s.busy for s in self.slots)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # -- the loop ----------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and not self._waiting and not any(s.busy for s in self.slots):
                    self._cv.wait()
                if self._stopping:
                    break
                self._admit()
            try:
                self._drop_cancelled()
                if any(s.busy for s in self.slots):
                    self._step()
            except Exception as e:  # noqa: BLE001 - a bug in one step must not stop the server
                log.exception("scheduler step failed")
                for s in self.slots:
                    if s.busy:
                        self._fail(s, e)
        for s in self.slots:
            if s.busy:
                self._finish(s, "cancelled")
        with self._cv:
            waiting, self._waiting = list(self._waiting), collections.deque()
        for job in waiting:
            _send(job, Event("error", status=503, message="the server is shutting down"))

    def _admit(self) -> None:
        """Move waiting jobs (FIFO) into free slots (see _route_key for which one)."""
        while self._waiting:
            free = [s for s in self.slots if not s.busy]
            if not free:
                return
            job = self._waiting.popleft()
            if job.cancelled.is_set():
                _send(job, Event("done", reason="cancelled", usage=_usage(len(job.prompt_ids), 0, 0)))
                continue
            self._start(max(free, key=lambda s: _route_key(s, job.prompt_ids)), job)

    def _start(self, slot: Slot, job: Job) -> None:
        ses = slot.session
        keep = min(ses.common_prefix(job.prompt_ids), len(job.prompt_ids) - 1)
        ses.truncate(keep)
        slot._clear()
        slot.job = job
        slot.cached = keep
        slot.pending = list(job.prompt_ids[keep:])
        slot.sampler = Sampler(job.sampling)
        for t in job.prompt_ids:
            slot.sampler.accept(t)
        slot.text = TextState(self.tokenizer, stop=job.stop, stop_at_eog=job.stop_at_eog)
        if job.speculate is not None and job.speculate.mode == "draft":
            slot.spec = ModelSlotSpec(job.speculate, job.prompt_ids, self.draft_cost)
        elif job.speculate is not None:
            slot.spec = SlotSpec(job.speculate, job.prompt_ids)
        if self.metrics:
            self.metrics.on_start(time.perf_counter() - job.submitted)

    def _drop_cancelled(self) -> None:
        for s in self.slots:
            if s.busy and s.job.cancelled.is_set():
                self._finish(s, "cancelled")
        # Waiting jobs whose clients left must not hold queue places until a slot frees.
        with self._cv:
            gone = [j for j in self._waiting if j.cancelled.is_set()]
            if gone:
                self._waiting = collections.deque(j for j in self._waiting if not j.cancelled.is_set())
        for job in gone:
            _send(job, Event("done", reason="cancelled", usage=_usage(len(job.prompt_ids), 0, 0)))

    def _batch(self) -> list[tuple[Slot, list[int], int]]:
        """This step's items: (slot, tokens, logits rows wanted)."""
        active = [s for s in self.slots if s.busy]
        n = len(active)
        if n > self.max_batch:
            # Fewer sequences per step than slots: take turns so nobody starves.
            k = self._rr % n
            active = (active[k:] + active[:k])[: self.max_batch]
            self._rr += self.max_batch
        items = []
        budget = self.chunk
        # Drafted rows must not push the step past the rows the backend computes exactly
        # (row by row as a lone step would): on CUDA, drafts only while a decode-only
        # step stays within its limit. On the CPU any number of rows is exact.
        cap = self.ctx.row_exact_max
        spare = 1 << 30
        if cap is not None:
            decoding = sum(1 for s in active if not s.pending)
            spare = 0 if any(s.pending for s in active) else max(0, cap - decoding)
        decoding = [s for s in active if not s.pending]
        want = {}                        # draft-model slots -> tokens to draft
        for s in decoding:
            s.draft = []
            if s.spec is None:
                continue
            # Never draft past max_tokens or the context: the block's last row then
            # picks the job's last token at most.
            limit = min(s.job.n_predict - s.picks - 1, self.n_ctx - s.session.n_past - 1, spare)
            if s.spec.mode == "draft":
                d = s.spec.depth(limit)
                if d > 0:
                    want[s] = d
                    spare -= d
                s.bucket = 1
            else:
                s.draft, s.bucket = s.spec.propose(limit)
                spare -= len(s.draft)
        if want:
            self._model_drafts(want)
        # Decoding slots first; prompt chunks share the per-step prompt budget.
        for s in decoding:
            items.append((s, [s.next_tok] + s.draft, 1 + len(s.draft)))
        for s in active:
            if s.pending and budget > 0:
                take = s.pending[:budget]
                budget -= len(take)
                items.append((s, take, 1))
        return items

    def _model_drafts(self, want: dict) -> None:
        """Greedy drafts of the draft model for the slots in `want` (slot -> depth),
        batched across them: each slot's draft sequence first catches up with its
        context (the prompt and the picks so far; its KV keeps the longest common prefix,
        so that is the last pick and the previous block's correction), in chunks, then
        one-token forwards until every slot has its depth. A failure of the draft model
        costs only this step's drafts."""
        dctx = self.dctx
        try:
            feeds = {}
            for s in want:
                ctx, ds = s.spec.drafter.toks, s.draft_session
                keep = min(ds.common_prefix(ctx), len(ctx) - 1)
                ds.truncate(keep)
                feeds[s] = ctx[keep:]
            while feeds:
                order = list(feeds)
                rows = dctx.decode_batch([(s.draft_session, feeds[s][:self.chunk]) for s in order], copy=False)
                for i, s in enumerate(order):
                    rest = feeds.pop(s)[self.chunk:]
                    if rest:
                        feeds[s] = rest
                    else:
                        s.draft = [int(np.argmax(rows[i]))]
            going = [s for s in want if len(s.draft) < want[s]]
            while going:
                rows = dctx.decode_batch([(s.draft_session, [s.draft[-1]]) for s in going], copy=False)
                for i, s in enumerate(going):
                    s.draft.append(int(np.argmax(rows[i])))
                going = [s for s in going if len(s.draft) < want[s]]
        except Exception as e:  # noqa: BLE001 - the target's step goes on without drafts
            log.warning("the draft model failed (%s); this step verifies no drafts", e)
            for s in want:
                s.draft = []
                s.draft_session.reset()

    def _step(self) -> None:
        items = self._batch()
        if not items:
            return
        t0 = time.perf_counter()
        on_device = self._picks_on_device(items)
        try:
            rows = self.ctx.decode_batch([(s.session, toks, k) for s, toks, k in items],
                                         copy=None if on_device else False)
        except Exception as e:  # noqa: BLE001 - isolate the request whose forward fails
            results = self._isolate(items, e)
        else:  # past the forward: nothing here may send the items through _isolate again
            if on_device:
                results = self._device_picks(items)
            else:
                results, off = [], 0
                for s, toks, k in items:
                    results.append((s, toks, rows[off:off + k]))
                    off += k
        self.steps += 1
        n_tokens = sum(len(t) for _, t, _ in items)
        picks = self._picks(results)
        for s, toks, block in results:
            self._advance(s, toks, block, picks.get(s))
        if self.metrics:
            self.metrics.on_step(len(items), n_tokens, time.perf_counter() - t0)

    def _picks_on_device(self, items) -> bool:
        """Whether this step leaves its logits on the device and picks there (DeviceRows):
        every row read back costs n_vocab * 4 bytes, where a pick needs an int or a few
        hundred candidates. Not with drafts: verifying a block scores whole rows."""
        if any(s.draft for s, _, _ in items):
            return False
        return DeviceRows.usable(self.ctx, sum(k for _, _, k in items))

    def _device_picks(self, items) -> list:
        """(slot, tokens, row source) per item, the rows left on the device. The sampled
        picks' candidates are planned first: one device call then selects them all."""
        rows = DeviceRows(self.ctx)
        out = []
        for r, (s, toks, _) in enumerate(items):  # no drafts: one row per item
            if len(s.pending) <= len(toks):       # a pick (not a prompt chunk with more to go)
                rows.plan(r, s.sampler)
            out.append((s, toks, rows.source(r, s.picks)))
        return out

    def _picks(self, results) -> dict:
        """This step's picks (rows that end a prompt or continue a reply, without drafts)
        from one sample_rows call: slot -> id, or the NumericsError its row raised."""
        want, out = [], {}
        for s, toks, block in results:
            if s.job is None or s.draft or len(s.pending) > len(toks):
                continue
            if not isinstance(block, BatchedRow):
                # Never a pick from broken logits (the argmax of NaNs is a plausible
                # token): the job ends with the error naming its step.
                block = block[-1]
                try:
                    check_logits_finite(block, s.picks)
                except NumericsError as e:
                    out[s] = e
                    continue
            want.append((s, block))
        for (s, _), got in zip(want, sample_rows([s.sampler for s, _ in want], [row for _, row in want])):
            out[s] = got
        return out

    def _isolate(self, items, err: Exception):
        """A batched forward failed: run each item alone, so only the request whose own
        forward fails gets its error and the others carry on. A failed forward appends
        nothing to its sequence (decode_batch extends the tokens only after the run)."""
        log.warning("batched forward failed (%s); retrying each sequence alone", err)
        out = []
        for s, toks, k in items:
            try:
                rows = self.ctx.decode_batch([(s.session, toks, k)], copy=True)
                out.append((s, toks, rows))
            except Exception as e:  # noqa: BLE001
                log.error("forward failed for one request: %s", e)
                self._fail(s, e)
        return out

    def _fail(self, s: Slot, err: Exception) -> None:
        """End a slot's job with a 500; the slot forgets its KV (cells may hold a partial write)."""
        job = s.job
        s.session.reset()
        s.job = None
        s._clear()
        if self.metrics:
            self.metrics.on_error()
        _send(job, Event("error", status=500, message=f"inference failed: {err}"))

    def _advance(self, s: Slot, toks: list[int], block: np.ndarray | BatchedRow, pick) -> None:
        """Hand out this step's picks: `pick` (from _picks), or a verified block's."""
        if s.job is None:
            return
        if s.pending:
            s.pending = s.pending[len(toks):]
            if s.pending:
                return              # more prompt to go: this row is not a pick
        if isinstance(pick, NumericsError):
            self._fail(s, pick)     # the other slots carry on
            return
        if pick is not None:
            self._hand_out(s, pick)
            return
        try:
            for i, row in enumerate(block):
                check_logits_finite(row, s.picks + i)
        except NumericsError as e:
            self._fail(s, e)
            return
        draft, s.draft = s.draft, []
        picks, j = verify(block, draft, s.sampler)
        # The KV holds next_tok and every draft: forget the rejected ones.
        s.session.truncate(s.session.n_past - (len(draft) - j))
        s.spec.policy.record(s.bucket, len(draft), j)
        s.spec.drafted += len(draft)
        s.spec.accepted += j
        if self.metrics:
            self.metrics.on_verify(len(draft), j)
        for p in picks:
            if not self._hand_out(s, p.id):
                return

    def _hand_out(self, s: Slot, tok: int) -> bool:
        """One pick to the client, as a plain step would: False when the job ended."""
        job = s.job
        s.picks += 1
        if s.first_token_at is None:
            s.first_token_at = time.perf_counter()
        s.sampler.accept(tok)
        if s.spec is not None:
            s.spec.drafter.extend([tok])
        piece, end = s.text.push(tok)
        if end is not None:
            self._finish(s, end)
            return False
        _send(job, Event("token", text=piece, id=tok))
        if len(s.text.ids) >= job.n_predict:
            self._finish(s, "length")
            return False
        if job.cancelled.is_set():
            self._finish(s, "cancelled")
            return False
        s.next_tok = tok
        return True

    def _finish(self, s: Slot, reason: str) -> None:
        job = s.job
        rest, reason = s.text.finish(reason) if s.text is not None else ("", reason)
        n_gen = len(s.text.ids) if s.text is not None else 0
        usage = _usage(len(job.prompt_ids), n_gen, s.cached)
        if s.spec is not None:
            # Picks verified past the end are in the KV: keep what plain steps would
            # (the prompt and every pick but the last), so the next turn's prefix match
            # sees the same sequence either way.
            if s.picks:
                s.session.truncate(len(job.prompt_ids) + s.picks - 1)
            usage["completion_tokens_details"] = {"accepted_prediction_tokens": s.spec.accepted,
                                                  "rejected_prediction_tokens": s.spec.drafted - s.spec.accepted}
            usage["speculation"] = {"mode": job.speculate.mode, "draft_max": job.speculate.draft_max,
                                    "drafted": s.spec.drafted, "accepted": s.spec.accepted}
        s.job = None
        s.last_used = time.perf_counter()
        s._clear()
        if self.metrics:
            self.metrics.on_finish(usage)
        _send(job, Event("done", text=rest, reason=reason, usage=usage))


def _route_key(s: Slot, prompt: list[int]) -> tuple:
    """Which free slot a prompt goes to (the largest key). First a slot the prompt
    continues: the longest common prefix, when it covers at least half of what the slot
    holds (the next turn of its conversation). Otherwise an empty slot, so a new
    conversation does not evict another one's KV for the sake of a shared template
    prefix; then a slot sharing at least half of the prompt (a long shared system prompt
    is still reused), the longest such; then the least recently used. A short shared
    prefix (the chat template's first tokens) never outranks recency: otherwise a new
    conversation would evict the one that just finished, whose next turn is coming."""
    cp = s.session.common_prefix(prompt)
    held = len(s.session.tokens)
    continues = cp > 0 and 2 * cp >= held
    shares = cp > 0 and 2 * cp >= len(prompt)
    return (continues, cp if continues else 0, held == 0, shares, cp if shares else 0, -s.last_used)


def _usage(prompt: int, completion: int, cached: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _send(job: Job, ev: Event) -> None:
    try:
        job.emit(ev)
    except Exception as e:  # noqa: BLE001 - a gone client must not take the loop down
        log.debug("dropping an event for a finished request: %s", e)
