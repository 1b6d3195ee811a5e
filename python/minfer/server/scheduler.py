"""The slot scheduler: one background thread owns the engine and runs every forward.

Each slot is one sequence of a shared Context (its KV cells, its token history). A
request (a Job) waits in a bounded queue until a slot is free (n slots for a request
of n choices); it is routed to the free slot whose held tokens share the longest
prefix with its prompt, so a conversation's next turn reuses its KV. The engine
(engine.py) does the rest: every step runs ONE forward over all active sequences
(continuous batching: decode rows, drafted rows, prompt chunks of at most `chunk`
tokens per step in all), picks, verifies drafts and emits events. What stays here is
admission, routing, cancellation and turning the engine's events into the HTTP side's.

A device that stops answering is contained: a step that has not returned after
`step_timeout` seconds (a hung kernel), or a device error that leaves the device
unusable (a CUDA fault), fails every request with a 500 and one log line and calls
`on_fatal`, which ends the server with a non-zero exit for a supervisor to restart.

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

from minfer.engine import Engine, SeqSpec, Sequence, TokenEvent
from minfer.errors import MinferError
from minfer.sampling import SamplingParams
from minfer.session import Context
from minfer.speculate import Policy, check_same_vocab

log = logging.getLogger("minfer.server")


# CUDA errors after which the context is unusable ("sticky"): every later call fails too.
_STICKY = ("cudaErrorIllegalAddress", "cudaErrorLaunchFailure", "cudaErrorIllegalInstruction",
           "cudaErrorMisalignedAddress", "cudaErrorInvalidAddressSpace", "cudaErrorInvalidPc",
           "cudaErrorHardwareStackError", "cudaErrorAssert", "cudaErrorLaunchTimeout", "cudaErrorECCUncorrectable",
           "cudaErrorUnknown", "cudaErrorDevicesUnavailable")


def device_lost(e: BaseException) -> bool:
    """Whether an error leaves the device unusable (so the process must restart)."""
    return any(name in str(e) for name in _STICKY)


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
    index: int = 0               # the choice (n > 1)
    logprob: float | None = None           # token: when the job asked for logprobs
    top_logprobs: list | None = None       # token: [(id, logprob)] best first


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
    n: int = 1                   # choices: n sequences sharing the prompt's KV
    logprobs: int | None = None  # None: off; N: each token's logprob and N alternatives
    mask: Callable | None = None  # a token-mask hook per sequence (engine.Sequence.mask)

    def cancel(self) -> None:
        """Thread-safe: the job leaves its slot at the next step boundary."""
        self.cancelled.set()


@dataclass(frozen=True)
class SpecRequest:
    """A job's speculation: the drafter ("ngram": prompt lookup; "draft": the server's
    draft model) and the most tokens drafted per verify (the depth adapts below it)."""

    mode: str = "ngram"
    draft_max: int = 8


class Slot:
    def __init__(self, session, draft_session=None):
        self.session = session
        self.draft_session = draft_session  # this slot's sequence of the draft model (or None)
        self.job: Job | None = None
        self.seq: Sequence | None = None
        self.last_used = 0.0

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
                 speculate: SpecRequest | None = None, draft_model=None, kv_cells: int | None = None,
                 step_timeout: float = 120.0, on_fatal: Callable[[str], None] | None = None):
        if n_slots < 1:
            raise MinferError(f"--slots must be >= 1, got {n_slots}")
        if speculate is not None and (speculate.mode not in ("ngram", "draft") or not 1 <= speculate.draft_max <= 64):
            raise MinferError(f"the server speculates with ngram or draft and a draft_max in [1, 64], got {speculate}")
        if speculate is not None and speculate.mode == "draft" and draft_model is None:
            raise MinferError("speculating with a draft model needs the draft model (--draft-model PATH)")
        self.model = model
        self.tokenizer = model.tokenizer
        # kv_cells: the KV cells all slots share (kv_pool.py); None: a full context each.
        self.ctx = Context(model, n_ctx=n_ctx, n_seq=n_slots, n_cells=kv_cells)
        self.n_ctx = self.ctx.n_ctx
        self.draft_model = draft_model
        self.dctx = None                 # the draft model's context: one sequence per slot
        if draft_model is not None:
            check_same_vocab(model, draft_model)
            self.dctx = Context(draft_model, n_ctx=self.n_ctx, n_seq=n_slots)
            # A decode step reads every weight once: the bytes' ratio is a draft token's
            # cost relative to a target step.
            self.draft_cost = (draft_model.defn.weight_bytes_per_token()
                               / max(1, model.defn.weight_bytes_per_token()))
        self.slots = [Slot(self.ctx.session(i), self.dctx.session(i) if self.dctx else None)
                      for i in range(n_slots)]
        self.max_queue = max_queue
        self.chunk = max(1, chunk)
        self.max_batch = max(1, min(max_batch or default_max_batch(model), n_slots))
        self.metrics = metrics
        self.engine = Engine(self.ctx, [s.session for s in self.slots], chunk=self.chunk, max_batch=self.max_batch,
                             draft_slots=[s.draft_session for s in self.slots] if self.dctx else None,
                             metrics=metrics)
        self.speculate = speculate       # the default of a request that does not say
        self._waiting: collections.deque[Job] = collections.deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._draining = False
        self._thread = threading.Thread(target=self._loop, name="minfer-scheduler", daemon=True)
        self.step_timeout = step_timeout
        self.on_fatal = on_fatal
        self.fatal: str | None = None    # why the device is given up on
        self._step_since: float | None = None
        self._watchdog = threading.Thread(target=self._watch, name="minfer-watchdog", daemon=True)

    @property
    def steps(self) -> int:
        return self.engine.steps

    # -- the HTTP side ---------------------------------------------------------------
    def start(self) -> None:
        # A GPU's batched steps run in a few bucket shapes: their graphs are built and
        # captured now rather than inside the first requests that take them.
        self.ctx.warm_buckets()
        self._thread.start()
        self._watchdog.start()

    def submit(self, job: Job) -> None:
        if job.speculate is not None and job.speculate.mode == "draft" and self.dctx is None:
            raise MinferError("this server has no draft model to speculate with")
        if not 1 <= job.n <= len(self.slots):
            raise MinferError(f"n = {job.n} choices need as many slots; this server has {len(self.slots)}")
        with self._cv:
            if self.fatal is not None:
                raise ShuttingDown(f"the server is restarting: {self.fatal}")
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
                while not self._stopping and not self._waiting and not self._working():
                    self._cv.wait()
                if self._stopping:
                    break
                self._admit()
            if self.fatal is not None:
                break
            try:
                self._drop_cancelled()
                if self._working():
                    self._step_since = time.monotonic()
                    self._step()
                    self._step_since = None
            except Exception as e:  # noqa: BLE001 - a bug in one step must not stop the server
                self._step_since = None
                if self.fatal is not None:
                    break
                lost = device_lost(e)
                if not lost:   # a lost device is said in one line below, not a traceback
                    log.exception("scheduler step failed")
                self.engine._launch = None
                for s in self.slots:
                    if s.busy and s.seq is not None:
                        self.engine._fail(s.seq, e)
                if lost:
                    self._give_up(f"the device failed: {str(e).splitlines()[0]}")
                    break
        for s in self.slots:
            if s.busy and s.seq is not None:
                self.engine.abort(s.seq)
        with self._cv:
            waiting, self._waiting = list(self._waiting), collections.deque()
        for job in waiting:
            _send(job, Event("error", status=503, message="the server is shutting down"))

    def _watch(self) -> None:
        """The watchdog: a step that has not returned in step_timeout seconds (a kernel
        that hangs, a wait that never ends) gives the device up."""
        tick = min(1.0, self.step_timeout / 4)
        while self._thread.is_alive() and self.fatal is None:
            time.sleep(tick)
            since = self._step_since
            if since is not None and time.monotonic() - since > self.step_timeout:
                self._give_up(f"a step has not returned in {self.step_timeout:g} s (a hung kernel?)")

    def _give_up(self, why: str) -> None:
        """Fail every running and waiting request with a 500 (from whichever thread
        sees it first: the loop may be stuck in the device), then on_fatal."""
        with self._cv:
            if self.fatal is not None:
                return
            self.fatal = why
            waiting, self._waiting = list(self._waiting), collections.deque()
            self._cv.notify()
        log.error("minfer serve: %s; failing every request and exiting for a restart", why)
        jobs = {id(j): j for j in [s.job for s in self.slots if s.job is not None] + waiting}
        for job in jobs.values():     # a job of n choices holds n slots: told once
            _send(job, Event("error", status=500, message=f"the server is restarting: {why}"))
        if self.metrics:
            self.metrics.on_error()
        if self.on_fatal is not None:
            self.on_fatal(why)

    def _working(self) -> bool:
        return self.engine.busy or self.engine._launch is not None

    def _step(self) -> None:
        self.engine.step()

    def _admit(self) -> None:
        """Move waiting jobs (FIFO) into free slots (see _route_key for which one)."""
        while self._waiting:
            free = [s for s in self.slots if not s.busy]
            job = self._waiting[0]
            if job.cancelled.is_set():
                self._waiting.popleft()
                _send(job, Event("done", reason="cancelled", usage=_usage(len(job.prompt_ids), 0, 0)))
                continue
            if len(free) < job.n:
                return
            first = max(free, key=lambda s: _route_key(s, job.prompt_ids))
            others = [s for s in free if s is not first][:job.n - 1]
            # A pooled KV: the job waits (first in line) until the running sequences
            # leave room for all its choices; it never takes cells they hold.
            if not all(self.engine.reserve(self.slots.index(s), job.prompt_ids, job.n_predict, keep_prefix=s is first)
                       for s in [first] + others):
                return
            self._waiting.popleft()
            self._start(job, [first] + others)

    def _start(self, job: Job, slots: list[Slot]) -> None:
        job._left = len(slots)
        job._usage = []
        leader = None
        for i, slot in enumerate(slots):
            seq = Sequence(job.prompt_ids, job.n_predict, job.sampling, stop=job.stop, stop_at_eog=job.stop_at_eog,
                           logprobs=job.logprobs, speculate=self._seq_spec(job), mask=job.mask, index=i, tag=job,
                           cancelled=job.cancelled.is_set)
            if i > 0 and job.sampling.seed is not None:
                # Each choice draws from its own generator: seed, seed + 1, ...
                seq.sampler.rng = type(seq.sampler.rng)(type(seq.sampler.rng.bit_generator)(job.sampling.seed + i))
            seq.sink = self._sink(slot, seq)
            slot.job, slot.seq = job, seq
            try:
                self.engine.add(seq, self.slots.index(slot), share=leader)
            except Exception as e:  # noqa: BLE001 - a request the engine refuses
                slot.job = slot.seq = None
                seq.done = True
                self._job_error(job, 400 if isinstance(e, MinferError) else 500, str(e))
                for other in slots[:i]:
                    if other.seq is not None:
                        self.engine.abort(other.seq)
                return
            leader = leader or seq
        if self.metrics:
            self.metrics.on_start(time.perf_counter() - job.submitted)

    def _seq_spec(self, job: Job) -> SeqSpec | None:
        req = job.speculate
        if req is None:
            return None
        policy = Policy(adaptive=True)
        if req.mode == "draft":
            policy.q0 = self.draft_cost
        return SeqSpec(req.mode, req.draft_max, policy)

    def _sink(self, slot: Slot, seq: Sequence):
        job = seq.tag

        def sink(ev: TokenEvent) -> None:
            if not ev.done:
                _send(job, Event("token", text=ev.text, id=ev.id, index=ev.index, logprob=ev.logprob,
                                 top_logprobs=ev.top_logprobs))
                return
            slot.job = slot.seq = None
            slot.last_used = time.perf_counter()
            if ev.error is not None:
                if self.metrics:
                    self.metrics.on_error()
                job._left = -1           # one failed choice fails the request
                _send(job, Event("error", status=500, message=f"inference failed: {ev.error}", index=ev.index))
                return
            tm = ev.timings
            usage = _usage(len(job.prompt_ids), tm.generated_tokens, tm.cached_tokens)
            if seq.spec is not None:
                usage["completion_tokens_details"] = {"accepted_prediction_tokens": seq.spec.accepted,
                                                      "rejected_prediction_tokens": seq.spec.drafted - seq.spec.accepted}
                usage["speculation"] = {"mode": seq.spec.mode, "draft_max": seq.spec.draft_max,
                                        "drafted": seq.spec.drafted, "accepted": seq.spec.accepted}
            if self.metrics:
                self.metrics.on_finish(usage)
            _send(job, Event("done", text=ev.text, reason=ev.stop_reason, usage=usage, index=ev.index))

        return sink

    def _job_error(self, job: Job, status: int, message: str) -> None:
        if self.metrics:
            self.metrics.on_error()
        _send(job, Event("error", status=status, message=message))

    def _drop_cancelled(self) -> None:
        for s in self.slots:
            if s.busy and s.job.cancelled.is_set() and s.seq is not None:
                self.engine.abort(s.seq)
        # Waiting jobs whose clients left must not hold queue places until a slot frees.
        with self._cv:
            gone = [j for j in self._waiting if j.cancelled.is_set()]
            if gone:
                self._waiting = collections.deque(j for j in self._waiting if not j.cancelled.is_set())
        for job in gone:
            _send(job, Event("done", reason="cancelled", usage=_usage(len(job.prompt_ids), 0, 0)))


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
