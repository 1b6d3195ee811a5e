"""The engine: the one generation loop under every caller.

A `Sequence` is one request: its prompt and generated ids, its sampler (parameters and
state), stop strings and the detokenizer's text state, its speculation (drafter and
depth policy), an optional token mask, its timings and where its events go. An `Engine`
owns the sequences of a Context's slots (each slot one KV sequence: a Session) and
advances all of them with `step()`:

1. collect: the forward launched by the previous step is picked from through one
   logits handle (`Launch`): greedy rows by the device's argmax, sampled rows from the
   candidates the device selects (or the rows read back when a feature needs them
   whole: logprobs, masks, n > 1), drafted blocks verified (speculate.verify), the KV
   cells of rejected drafts forgotten; every pick goes through the sequence's text
   state and out as an event.
2. launch: one batched forward over the sequences still going: each decoding sequence
   contributes its last pick plus its drafts, a newcomer a chunk of its prompt.

The forward of step N is picked from in step N + 1, so on a device that runs
asynchronously the caller's work on step N's events (printing, HTTP) overlaps the
device's work on the next token. A pick that ends its sequence (an end-of-generation
id, a stop string, the token budget) is known before the launch: nothing is computed
for a sequence that has ended.

`minfer generate` and `chat` (Session.stream), the Python API, `bench --speculate` and
the server's scheduler all drive this class; the server keeps admission, routing,
cancellation and HTTP.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from minfer.errors import ContextError, KvPoolFull, MinferError, NumericsError
from minfer.kv_pool import place
from minfer.logits_check import check_logits_finite
from minfer.rows import DeviceRows
from minfer.sampling import Sampler, SamplingParams, sample_rows, top_logprobs
from minfer.speculate import BatchGate, NgramDrafter, Policy, accept_picks, expected_accepted, verify

# ----------------------------------------------------------------------------- results


@dataclass
class Timings:
    prompt_tokens: int = 0      # tokens of the prompt as given
    cached_tokens: int = 0      # of those, reused from the KV (not processed)
    prompt_ms: float = 0.0      # processing the uncached prompt tokens (to the first pick)
    generated_tokens: int = 0
    gen_ms: float = 0.0         # from the first pick to the end
    drafted: int | None = None  # speculative sequences: tokens drafted, and of those accepted
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
    """One event of a sequence. `text` is the text released by this event: stop strings
    never appear, and text that could still grow into one is held back. The last event
    has done=True, id None, the final text flush, the stop reason and the timings; a
    sequence that failed ends with `error` set instead (done=True, stop_reason "error").
    `top_logprobs`: (id, logprob) of the most likely tokens at this step, best first,
    when the sequence asked for them."""

    id: int | None
    text: str
    logprob: float | None = None
    done: bool = False
    stop_reason: str | None = None
    timings: Timings | None = None
    top_logprobs: list | None = None
    error: Exception | None = None
    index: int = 0              # the sequence's index in its group (n > 1)


class TextState:
    """The text side of one generating sequence: ids in, released text out.

    Stop strings never appear in the released text, text that could still grow into
    one is held back, and a character split across tokens waits for its last byte."""

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


def _find_stop(text: str, stops: list[str]) -> int | None:
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or i < best):
            best = i
    return best


# ----------------------------------------------------------------------------- speculation


class SeqSpec:
    """One sequence's speculation: its drafter ("ngram": prompt lookup over the
    sequence's own tokens, or any `speculate.Drafter`; "draft": greedy drafts of a draft
    model's session, made batched by the engine) and the depth policy. `measured`: the
    depth may weigh the clock's block costs (a greedy sequence, whose output the depth
    cannot change); otherwise the priors and acceptance only, so a seeded sampled
    output never depends on the machine's load."""

    def __init__(self, mode: str, draft_max: int, policy: Policy | None = None, *, drafter=None,
                 draft_session=None, measured: bool = False):
        if mode not in ("ngram", "draft"):
            raise MinferError(f"speculation mode must be ngram or draft, got {mode!r}")
        if not 1 <= draft_max <= 64:
            raise MinferError(f"draft_max must be in [1, 64], got {draft_max}")
        self.mode = mode
        self.draft_max = int(draft_max)
        self.policy = policy if policy is not None else Policy(adaptive=True)
        self.drafter = drafter if drafter is not None else NgramDrafter()
        self.draft_session = draft_session
        self.measured = measured
        self.toks: list[int] = []         # the sequence: prompt, then every pick
        self.drafted = 0
        self.accepted = 0
        self.bucket = 0

    def extend(self, tokens) -> None:
        self.toks.extend(int(t) for t in tokens)
        if self.mode == "ngram":
            self.drafter.extend(tokens)

    def propose(self, limit: int) -> list[int]:
        """The drafts of an n-gram sequence for this step: look first (a dict read),
        then choose the depth for that match's bucket."""
        if limit <= 0:
            return []
        draft, self.bucket = self.drafter.propose(min(limit, self.draft_max))
        return draft[:self.policy.depth(self.bucket, len(draft), self.measured)] if draft else []

    def depth(self, limit: int) -> int:
        """How many tokens the draft model drafts this step (chosen before drafting: each
        costs a draft forward)."""
        self.bucket = 1
        return self.policy.depth(1, min(limit, self.draft_max), self.measured) if limit > 0 else 0


# ----------------------------------------------------------------------------- sequences

Mask = Callable[["Sequence"], "np.ndarray | None"]


class Sequence:
    """One request's state in the engine. `sink(event)` receives its events (on the
    thread that steps the engine); without one they queue in `events`.

    logprobs: None (off), or N >= 0: each token's logprob and its N most likely
    alternatives. mask: a hook called before each pick with the sequence; it returns
    a boolean array over the vocabulary (True = allowed) or None (no constraint)."""

    def __init__(self, prompt_ids: list[int], max_tokens: int, sampling: SamplingParams | None = None, *,
                 stop: list[str] | None = None, stop_at_eog: bool = True, logprobs: int | None = None,
                 speculate: SeqSpec | None = None, mask: Mask | None = None,
                 sink: Callable[[TokenEvent], None] | None = None, index: int = 0, tag=None,
                 one_at_a_time: bool = False, cancelled: Callable[[], bool] | None = None):
        self.prompt_ids = [int(t) for t in prompt_ids]
        if not self.prompt_ids:
            raise ContextError("the prompt is empty after tokenization")
        if max_tokens < 0:
            raise MinferError(f"max_tokens must be >= 0, got {max_tokens}")
        if logprobs is not None and not 0 <= logprobs <= 20:
            raise MinferError(f"logprobs must be in [0, 20], got {logprobs}")
        self.max_tokens = int(max_tokens)
        self.sampling = sampling or SamplingParams(temperature=0.0)
        self.sampler = Sampler(self.sampling)
        self.stop = list(stop or [])
        self.stop_at_eog = stop_at_eog
        self.logprobs = logprobs
        self.spec = speculate
        self.mask = mask
        self.sink = sink
        self.index = index
        self.tag = tag                        # the caller's (the server's job)
        # A verified block's picks handed out one per release() (a stream's consumer sees
        # each, and may stop, before the next is handed out), not all in its step.
        self.one_at_a_time = one_at_a_time
        self.queued: deque = deque()          # verified picks not yet handed out
        # Asked after each token is handed out: a request cancelled while a verified
        # block is handed out ends right after the token it was cancelled at.
        self.cancelled = cancelled
        self.events: deque[TokenEvent] = deque()
        # state, set by Engine.add
        self.slot = None                      # the KV sequence (a Session of the context)
        self.text: TextState | None = None
        self.pending: list[int] = []          # prompt tokens still to process
        self.next_tok: int | None = None      # the last pick, fed at the next launch
        self.draft: list[int] = []            # drafts riding with next_tok in the launch
        self.picks = 0                        # tokens picked (each handed to self.text)
        self.followers: list[Sequence] = []   # n > 1: sequences that share this prompt's KV
        self.leader: Sequence | None = None
        self.timings = Timings(prompt_tokens=len(self.prompt_ids))
        self.t_start = 0.0
        self.t_first: float | None = None
        self.done = False
        self.finish_reason: str | None = None
        self.error: Exception | None = None

    @property
    def ids(self) -> list[int]:
        """The generated ids so far (the output: no end-of-generation id)."""
        return self.text.ids if self.text is not None else []

    @property
    def plain_greedy(self) -> bool:
        """Picks are the argmax of the raw logits (nothing else to read)."""
        return self.sampling.plain_greedy and self.mask is None and self.logprobs is None

    @property
    def needs_rows(self) -> bool:
        """Its picks read whole logits rows (host memory): logprobs, or followers that
        pick from the same row. (A mask too, unless the device applies it: _copy_mode.)"""
        return self.logprobs is not None or bool(self.followers)

    def emit(self, ev: TokenEvent) -> None:
        ev.index = self.index
        if self.sink is not None:
            self.sink(ev)
        else:
            self.events.append(ev)


# ----------------------------------------------------------------------------- the engine


@dataclass
class Launch:
    """The forward in flight and how its logits are picked from (the one logits
    handle): items are (sequence, tokens fed, logits rows of it)."""

    items: list
    copy: bool | None           # None: rows left on the device; False: a host view
    runs: int                   # the context's run count right after this forward
    builds: int
    t0: float
    out: np.ndarray | None = None
    draft_ms: float = 0.0
    fwd_ms: float = 0.0
    timed: bool = False         # a lone greedy speculating sequence's decode block


class Engine:
    """Advances the sequences of a Context's slots, one batched forward per step.

    slots: the KV sequences (Sessions of `context`) sequences run in. chunk: the most
    prompt tokens per forward, over all newcomers (None: a whole prompt at once).
    max_batch: the most sequences per forward (the rest take turns). draft_slots: per
    slot, the draft model's sequence (draft speculation in a server)."""

    def __init__(self, context, slots: list, *, chunk: int | None = None, max_batch: int | None = None,
                 draft_slots: list | None = None, metrics=None):
        if not slots:
            raise MinferError("an engine needs at least one slot")
        for s in slots:
            if s.context is not context:
                raise MinferError("an engine's slots must be sequences of its context")
        self.ctx = context
        self.slots = list(slots)
        self.draft_slots = list(draft_slots) if draft_slots is not None else None
        self.chunk = chunk
        self.max_batch = max(1, min(max_batch or len(slots), len(slots)))
        self.metrics = metrics
        self.tokenizer = context.model.tokenizer
        self.n_vocab = context.model.hp.n_vocab
        self.seqs: list[Sequence] = []        # running, in slot order of admission
        self._owner: dict[int, Sequence] = {}  # slot index -> its running sequence
        self._launch: Launch | None = None
        self._rr = 0
        self._skip_rr = 0   # where the decode rows a waiting prompt displaces start (_batch)
        self.steps = 0
        self._used = [0.0] * len(self.slots)   # when each slot's sequence last ended (LRU of the KV pool)
        self.gate = BatchGate()   # whether a batched step's greedy drafts pay (measured)
        self._cycle: tuple | None = None   # the last batched decode launch: rows, start, builds

    # -- admission -----------------------------------------------------------------
    def free_slots(self) -> list[int]:
        return [i for i in range(len(self.slots)) if i not in self._owner]

    @property
    def busy(self) -> bool:
        return bool(self.seqs)

    def add(self, seq: Sequence, slot: int | None = None, *, reuse_prefix: bool = True,
            share: Sequence | None = None) -> None:
        """Start a sequence in a free slot (`slot`, else the first free one). Its KV
        keeps the longest prefix the slot already holds (reuse_prefix), so only the rest
        of the prompt is processed. share: a running sequence with the same prompt whose
        prompt KV this one copies once processed (n > 1: no second prefill)."""
        if seq.slot is not None:
            raise MinferError("a sequence runs once: make a new one")
        free = self.free_slots()
        if slot is None:
            if not free:
                raise MinferError("no free slot for a new sequence")
            slot = free[0]
        elif slot not in free:
            raise MinferError(f"slot {slot} is not free")
        ses = self.slots[slot]
        self._check(seq, ses)
        if not self.reserve(slot, seq.prompt_ids, seq.max_tokens, keep_prefix=share is None and reuse_prefix):
            raise KvPoolFull(f"no room for {len(seq.prompt_ids)} + {seq.max_tokens} tokens in the KV pool of "
                             f"{self.ctx.n_cells} cells while the running sequences hold theirs")
        seq.slot = ses
        seq.text = TextState(self.tokenizer, stop=seq.stop, stop_at_eog=seq.stop_at_eog)
        seq.sampler.accept_prompt(seq.prompt_ids)
        seq.t_start = time.perf_counter()
        if seq.spec is not None:
            seq.spec.extend(seq.prompt_ids)
            seq.timings.drafted = seq.timings.accepted = 0
            if seq.spec.mode == "draft" and seq.spec.draft_session is None:
                if self.draft_slots is None:
                    raise MinferError("speculating with a draft model needs the draft model's sequences")
                seq.spec.draft_session = self.draft_slots[slot]
        if share is not None:
            if share.prompt_ids != seq.prompt_ids or share.picks or share.done:
                raise MinferError("a shared prompt must be the same and not yet processed")
            seq.leader = share
            share.followers.append(seq)
            ses.reset()
            seq.pending = []
        else:
            if not reuse_prefix:
                ses.reset()
            keep = min(ses.common_prefix(seq.prompt_ids), len(seq.prompt_ids) - 1)
            ses.truncate(keep)
            if reuse_prefix:
                keep = self._seed_prefix(ses, seq.prompt_ids, keep)
            seq.timings.cached_tokens = keep
            seq.pending = seq.prompt_ids[keep:]
        self._owner[slot] = seq
        self.seqs.append(seq)
        if seq.max_tokens == 0:
            self._finish(seq, "length")

    def reserve(self, slot: int, prompt: list[int], max_tokens: int, keep_prefix: bool = True) -> bool:
        """Room in a pooled context (kv_pool.py) for a sequence of `prompt` and up to
        max_tokens more in `slot`, keeping the prefix of `prompt` the slot already
        holds; idle slots' KV is forgotten, least recently used first, when that is what
        makes room. False when the running sequences leave too little: nothing changed."""
        ctx = self.ctx
        if not ctx.pooled:
            return True
        ses = self.slots[slot]
        need = min(len(prompt) + max_tokens, ctx.n_ctx)
        if ses.cap >= need:   # its range already holds it (the caller trims its tokens)
            return True
        keep = min(ses.common_prefix(prompt), max(len(prompt) - 1, 0)) if keep_prefix else 0
        idle = sorted((i for i in range(len(self.slots)) if i not in self._owner and i != slot
                       and ctx.ranges[self.slots[i].seq][1] > 0), key=lambda i: self._used[i])
        seqs = [self.slots[i].seq for i in idle]
        got = place(ctx.ranges, ctx.n_cells, ses.seq, need, keep, seqs)
        if got is None:
            return False
        for j in got.evict:
            self.slots[idle[seqs.index(j)]].reset()   # before its cells go: borrowers copy theirs
            ctx.ranges[j] = (0, 0)
        if got.moved:
            ctx.copy_cells(ses.base, got.base, keep)
        ses.truncate(keep)
        ctx.ranges[ses.seq] = (got.base, got.cap)
        return True

    # A prefix another slot holds is shared when it saves at least this many tokens of
    # prefill (below it, a copy's per-layer calls cost about what they save).
    SEED_MIN = 16

    def _settled(self, ses) -> int:
        """How many of a slot's tokens have their KV written: all but those of the
        forward in flight (a device may still be writing them)."""
        n = ses.n_past
        if self._launch is not None:
            for s, toks, _ in self._launch.items:
                if s.slot is ses:
                    n -= len(toks)
        return max(0, n)

    def _seed_prefix(self, ses, prompt: list[int], keep: int) -> int:
        """A prompt whose prefix another slot holds beyond what this slot keeps (a shared
        system prompt, document or earlier turn) is not prefilled again. This slot reads
        the longest such prefix a slot holds in its own cells where they are (borrowed,
        no copy: Context.lend); what a borrowing slot holds past its lender's cells is
        copied after it. Returns the new keep."""
        ctx = self.ctx
        best, n = None, keep      # the longest prefix any slot holds
        root, nr = None, keep     # the longest one held in one sequence's own cells
        for other in self.slots:
            if other is ses or other.n_past <= keep or not other.tokens or other.tokens[0] != prompt[0]:
                continue
            cp = min(other.common_prefix(prompt), self._settled(other), len(prompt) - 1)
            if cp > n:
                best, n = other, cp
            lender, m = ctx.lendable(other.seq, cp)
            if m > nr and lender != ses.seq:
                root, nr = lender, m
        if best is None or n - keep < self.SEED_MIN:
            return keep
        got = keep
        if root is not None and nr - keep >= self.SEED_MIN:
            ses.truncate(0)           # its own cells of the kept prefix are not read any more
            ctx.lend(root, ses.seq, nr)
            got = nr
        if n > got:                   # what `best` holds past that: copied from where it lies
            ctx.copy_positions(best.seq, ses.seq, got, n)
        ses.tokens[:] = prompt[:n]
        return n

    def _check(self, seq: Sequence, ses) -> None:
        """Errors before any work: a prompt and budget that do not fit, ids outside the
        vocabulary, a logit bias on a token that does not exist."""
        ses.model.check_fits(len(seq.prompt_ids), seq.max_tokens, ses.n_ctx)
        ses.model.check_tokens(np.asarray(seq.prompt_ids, dtype=np.int64))
        for t, _ in seq.sampling.logit_bias:
            if not 0 <= t < self.n_vocab:
                raise MinferError(f"logit_bias names token {t}, outside the vocabulary of {self.n_vocab}")

    def abort(self, seq: Sequence, reason: str = "cancelled") -> None:
        """End a sequence now (between steps), with its final event. Its KV keeps the
        prompt and every pick but the last, as a plain stream's would."""
        if seq.done or seq not in self.seqs:
            return
        for f in list(seq.followers):
            if not f.done and f.slot.n_past == 0:
                self._finish(f, reason)
        seq.followers = []
        self._finish(seq, reason)

    # -- the step ------------------------------------------------------------------
    def step(self) -> bool:
        """Pick from the forward in flight, then launch the next one. True while some
        sequence is still running."""
        if self._launch is not None:
            launch, self._launch = self._launch, None
            self._collect(launch)
        if self.seqs and self._launch is None:   # (a lone sequence's may be out already)
            self._start_next()
        if self._launch is None:
            self._cycle = None   # idle until the next request: not a step's wall
        return bool(self.seqs) or self._launch is not None

    def run(self) -> None:
        """Step until every sequence has ended."""
        while self.step():
            pass

    def _start_next(self) -> None:
        items = self._batch()
        if items:
            self._launch_items(items)

    def _launch_items(self, items) -> None:
        launch = Launch(items=items, copy=self._copy_mode(items), runs=0, builds=self.ctx.builds,
                        t0=time.perf_counter())
        launch.draft_ms = self._draft_ms
        self._time_cycle(items, launch.t0)
        s0 = items[0][0]
        launch.timed = (len(items) == 1 and s0.spec is not None and s0.spec.measured
                        and items[0][1][0] == s0.next_tok and not s0.pending and s0.picks > 0)
        try:
            launch.out = self._forward(items, launch.copy)
        except Exception as e:  # noqa: BLE001 - isolate the sequence whose forward fails
            if not self._isolate(launch, e):
                return
        launch.fwd_ms = (time.perf_counter() - launch.t0) * 1000
        launch.runs = self.ctx.runs
        self._launch = launch
        self.steps += 1
        if self.metrics is not None:
            self.metrics.on_step(len(items), sum(len(t) for _, t, _ in items), time.perf_counter() - launch.t0)

    def _forward(self, items, copy):
        """The forward of one launch: a lone sequence through its Session (a one-token
        step takes the bound fast path there), several through decode_batch."""
        if len(items) == 1:
            seq, toks, k = items[0]
            return seq.slot.forward(toks, n_out=k, copy=copy)
        return self.ctx.decode_batch([(s.slot, toks, k) for s, toks, k in items], copy=copy)

    def _isolate(self, launch: Launch, err: Exception) -> bool:
        """A batched forward failed: each item again alone (rows come back on the host),
        so only the sequence whose own forward fails ends with the error. A failed
        forward appends nothing to its sequence. False when nothing is left to collect."""
        if len(launch.items) == 1:
            seq = launch.items[0][0]
            self._fail(seq, err)
            return False
        parts, kept = [], []
        for seq, toks, k in launch.items:
            try:
                parts.append(self.ctx.decode_batch([(seq.slot, toks, k)], copy=True))
                kept.append((seq, toks, k))
            except Exception as e:  # noqa: BLE001
                self._fail(seq, e)
        if not kept:
            return False
        launch.items, launch.copy = kept, False
        launch.out = np.concatenate(parts, axis=0)
        return True

    _draft_ms = 0.0

    def _batch(self) -> list:
        """This launch's items: (sequence, tokens, logits rows wanted). Decoding
        sequences first (their last pick and drafts), then prompt chunks within the
        chunk budget."""
        active = [s for s in self.seqs if not s.done and s.leader is None and not s.queued]
        n = len(active)
        if n > self.max_batch:
            k = self._rr % n
            active = (active[k:] + active[:k])[:self.max_batch]
            self._rr += self.max_batch
        decoding = [s for s in active if not s.pending]
        # Drafted rows must not push a step past the rows the backend computes exactly
        # (row by row as a lone step would): on CUDA, drafts only while a decode-only
        # step stays within that limit. The CPU's rows are all exact.
        cap = self.ctx.row_exact_max
        spare = 1 << 30
        if cap is not None:
            spare = 0 if len(decoding) < len(active) else max(0, cap - len(decoding))
        want = {}
        for s in decoding:
            s.draft = []
            if s.spec is None:
                continue
            # Never draft past max_tokens or the context: a block's last row picks the
            # sequence's last token at most.
            limit = min(s.max_tokens - s.picks - 1, s.slot.cap - s.slot.n_past - 1, spare)
            if s.spec.mode == "draft":
                d = s.spec.depth(limit)
                if d > 0:
                    want[s] = d
                    spare -= d
            else:
                s.draft = s.spec.propose(limit)
                spare -= len(s.draft)
        if len(decoding) > 1:
            self._gate_drafts(decoding)
        self._draft_ms = 0.0
        if want:
            t0 = time.perf_counter()
            self._model_drafts(want)
            self._draft_ms = (time.perf_counter() - t0) * 1000
        items = [(s, [s.next_tok] + s.draft, 1 + len(s.draft)) for s in decoding]
        budget = self.chunk if self.chunk is not None else 1 << 62
        rows = sum(k for _, _, k in items)
        if cap is not None and len(self.slots) > 1:
            # Prompt rows fill a step up to the exact limit, beside decode rows or not: the
            # decoding sequences keep the tokens they would get alone, a prompt's KV has
            # the same bits whatever else runs (so a server's output does not depend on
            # its load), and every step takes one of the few bucketed graphs a server
            # builds at start. (Beyond the limit a GPU takes its GEMM path: other bits,
            # and a graph built for each new row count.) A lone sequence keeps its chunk.
            pend = min(sum(len(s.pending) for s in active if s.pending), budget)
            # Waiting prompts get at least half of a full step: decode rows alone would
            # leave a new prompt a row a step once 63 sequences decode (the 64-client
            # burst's last first token waited ~125 steps). The decode rows left out
            # (in turn) wait one step; a step makes as many tokens either way. (Nothing
            # drafts while a prompt waits, so each decode item is one row.)
            room = max(cap - pend, cap // 2)
            if pend and rows > room:
                k = self._skip_rr % len(items)
                self._skip_rr += rows - room
                items = (items[k:] + items[:k])[:room]
                rows = room
            budget = min(budget, max(cap - rows, 0))
        for s in active:
            if s.pending and budget > 0:
                take = s.pending[:budget]
                budget -= len(take)
                items.append((s, take, 1))
        return items

    def _gate_drafts(self, decoding: list) -> None:
        """The greedy n-gram drafts of a batched step ride only where the measured step
        walls say they pay (speculate.BatchGate); sampled sequences keep theirs."""
        gated = [s for s in decoding if s.draft and s.spec.mode == "ngram" and s.sampling.plain_greedy]
        if not gated:
            return
        others = [s for s in decoding if s.draft and s not in gated]

        def gain(group):   # expected accepted drafts of the group's sequences
            return sum(expected_accepted(s.spec.policy.rate(s.spec.bucket), len(s.draft)) for s in group)

        plain_rows = len(decoding) + sum(len(s.draft) for s in others)
        plain_tokens = len(decoding) + gain(others)
        rows = plain_rows + sum(len(s.draft) for s in gated)
        tokens = plain_tokens + gain(gated)
        if not self.gate.keep(plain_rows, plain_tokens, rows, tokens):
            for s in gated:
                s.draft = []

    def _time_cycle(self, items, t0: float) -> None:
        """The wall from one batched decode launch to the next, by its rows, for the
        gate: the forward, the picks and whatever the host does per step in between (a
        cycle in which a graph was built says nothing about the steps after it)."""
        if self._cycle is not None:
            rows, start, builds = self._cycle
            if self.ctx.builds == builds:
                self.gate.observe(rows, (t0 - start) * 1000)
        decode_only = len(items) > 1 and all(not s.pending for s, _, _ in items)
        self._cycle = (sum(len(t) for _, t, _ in items), t0, self.ctx.builds) if decode_only else None

    def _model_drafts(self, want: dict) -> None:
        """Greedy drafts of the draft model for the sequences in `want` (sequence ->
        depth), batched across those that share a draft context: each draft sequence
        first catches up with its sequence (the prompt and the picks; its KV keeps the
        longest common prefix, so that is the last pick and the previous correction),
        then one-token forwards until each has its depth. A failure of the draft model
        costs only this step's drafts."""
        groups: dict = {}
        for s, d in want.items():
            groups.setdefault(id(s.spec.draft_session.context), {})[s] = d
        chunk = self.chunk or (1 << 30)
        for group in groups.values():
            dctx = next(iter(group)).spec.draft_session.context
            try:
                feeds = {}
                for s in group:
                    toks, ds = s.spec.toks, s.spec.draft_session
                    if len(toks) + group[s] > ds.n_ctx:
                        continue
                    keep = min(ds.common_prefix(toks), len(toks) - 1)
                    ds.truncate(keep)
                    feeds[s] = toks[keep:]
                while feeds:
                    order = list(feeds)
                    rows = dctx.decode_batch([(s.spec.draft_session, feeds[s][:chunk]) for s in order], copy=False)
                    for i, s in enumerate(order):
                        rest = feeds.pop(s)[chunk:]
                        if rest:
                            feeds[s] = rest
                        else:
                            s.draft = [int(np.argmax(rows[i]))]
                going = [s for s in group if s.draft and len(s.draft) < group[s]]
                while going:
                    rows = dctx.decode_batch([(s.spec.draft_session, [s.draft[-1]]) for s in going], copy=False)
                    for i, s in enumerate(going):
                        s.draft.append(int(np.argmax(rows[i])))
                    going = [s for s in going if len(s.draft) < group[s]]
            except Exception:  # noqa: BLE001 - the target's step goes on without drafts
                for s in group:
                    s.draft = []
                    s.spec.draft_session.reset()

    def _copy_mode(self, items) -> bool | None:
        """What the forward leaves where: None keeps the logits on the device (picks
        by its argmax, or from candidates it selects); False reads them as a host view
        (free on the CPU) for picks that need whole rows (logprobs, masks, sampled
        verification, shared prompts)."""
        rows = sum(k for _, _, k in items)
        if any(s.needs_rows for s, _, _ in items):
            return False
        if any(s.mask is not None for s, _, _ in items) and not self._masks_on_device(rows):
            return False
        if len(self.slots) == 1:
            if rows == 1:
                return None          # Context.argmax_last / last_row
            # A verified block scores whole rows, unless every pick is a plain argmax.
            return None if all(s.plain_greedy for s, _, _ in items) else False
        if any(s.draft for s, _, _ in items):
            ok = rows <= DeviceRows.MAX_ROWS and all(s.plain_greedy for s, _, _ in items)
            return None if ok and DeviceRows.usable(self.ctx, rows) else False
        return None if DeviceRows.usable(self.ctx, rows) else False

    def _masks_on_device(self, rows: int) -> bool:
        """Whether the device that holds the logits applies token masks in place
        (Context.mask_rows), so a masked pick reads no row back."""
        out = self.ctx._out
        return DeviceRows.usable(self.ctx, rows) and hasattr(out[0], "mask_rows")

    def _mask_of(self, s: Sequence, n: int) -> np.ndarray | None:
        """The sequence's mask for its next pick (bool[n]); None after failing the
        sequence (its hook's bug, or nothing allowed)."""
        allowed = np.asarray(s.mask(s), dtype=bool)
        if allowed.shape != (n,):   # the hook's bug: its own sequence fails
            self._fail(s, MinferError(f"a token mask must have {n} entries, got {allowed.shape}"))
            return None
        if not allowed.any():
            self._fail(s, MinferError("the token mask allows no token"))
            return None
        return allowed

    def _apply_masks(self, singles: list) -> None:
        """Masked sequences' masks, applied to their rows on the device (one call), so
        their picks go the way unmasked ones do."""
        n = self.ctx._out[2]
        which, masks = [], []
        for s, r in singles:
            if s.mask is not None and not s.done:
                allowed = self._mask_of(s, n)
                if allowed is not None:
                    which.append(r)
                    masks.append(allowed)
        if which:
            self.ctx.mask_rows(which, masks)

    # -- collecting ------------------------------------------------------------------
    def _collect(self, launch: Launch) -> None:
        ctx = self.ctx
        t0 = time.perf_counter()
        live = [it for it in launch.items if not it[0].done]
        if not live:
            return
        if ctx.runs != launch.runs:
            # Another user of this context ran a forward meanwhile: its logits replaced
            # ours. The KV rows are ours; the same forward again.
            for s, toks, _ in live:
                s.slot.truncate(s.slot.n_past - len(toks))
            launch.items = live
            launch.out = self._forward(live, launch.copy)
        items = launch.items          # an aborted sequence's rows keep their places
        rows_total = sum(k for _, _, k in items)
        singles, blocks = [], []      # (sequence, first row[, rows])
        off = 0
        for s, toks, k in items:
            if not s.done:
                if s.pending:
                    s.pending = s.pending[len(toks):]
                    if not s.pending:
                        singles.append((s, off))
                elif s.draft:
                    blocks.append((s, off, k))
                else:
                    singles.append((s, off))
            off += k
        picks = dev_rows = None
        if launch.copy is None and (rows_total > 1 or len(self.slots) > 1):
            if blocks:   # every sequence picks by argmax (_copy_mode): one call for all rows
                try:
                    picks = ctx.argmax_rows(min(s.picks for s, _, _ in items))
                except NumericsError as e:
                    for s, _, _ in items:
                        self._fail(s, e)
                    return
            else:
                dev_rows = DeviceRows(ctx)
        if launch.copy is None and any(s.mask is not None for s, _ in singles):
            self._apply_masks(singles)
            # Through DeviceRows: argmax_last may answer from an argmax the graph took
            # before the mask.
            dev_rows = dev_rows or DeviceRows(ctx)
        if singles:
            self._pick_singles(launch, singles, dev_rows, picks)
        if blocks:
            self._verify_blocks(launch, blocks, picks)
        if launch.timed and ctx.builds == launch.builds:
            # A lone greedy speculating sequence: what a block of n rows costs feeds its
            # depth policy (a forward that built a graph says nothing about that).
            s, _, k = items[0]
            ms = launch.fwd_ms + (time.perf_counter() - t0) * 1000
            s.spec.policy.timed(k, ms, launch.draft_ms, k - 1)

    def _pick_singles(self, launch: Launch, singles: list, dev_rows: DeviceRows | None, picks) -> None:
        """One pick per sequence from its last row: greedy by the device's argmax, the
        rest through one sample_rows call (batched draws), features on host rows."""
        ctx = self.ctx
        sources, order = [], []
        for s, r in singles:
            step = s.picks
            try:
                if picks is not None:
                    self._pick(s, picks[r])
                    continue
                if launch.copy is None:
                    if dev_rows is None:              # the forward's only row
                        if s.sampling.plain_greedy:
                            t = ctx.argmax_last(step)
                        else:
                            t = s.sampler.sample(ctx.last_row(step))
                        self._eager(s, t)
                        self._pick(s, t)
                        continue
                    else:
                        if s.sampling.plain_greedy:
                            self._pick(s, dev_rows.argmax(r, step))
                            continue
                        dev_rows.plan(r, s.sampler)
                        src = (dev_rows, r, step)
                else:
                    row = launch.out[r]
                    check_logits_finite(row, step)   # never a pick from NaN/Inf
                    if s.followers:
                        self._seed_followers(s, row)
                    if s.needs_rows or s.mask is not None:
                        self._pick_from_row(s, row)
                        continue
                    src = row
            except NumericsError as e:
                self._fail(s, e)
                continue
            sources.append(src)
            order.append(s)
        if not order:
            return
        rows = [dev_rows.source(src[1], src[2]) if isinstance(src, tuple) else src for src in sources]
        for s, got in zip(order, sample_rows([s.sampler for s in order], rows)):
            if isinstance(got, Exception):
                self._fail(s, got)
            else:
                self._pick(s, got)

    def _pick_from_row(self, s: Sequence, row: np.ndarray) -> None:
        """A pick that needs the whole row: masked, and/or with logprobs."""
        if s.mask is None:
            t = int(np.argmax(row)) if s.sampling.plain_greedy else s.sampler.sample(row)
        else:
            allowed = self._mask_of(s, row.size)
            if allowed is None:
                return
            ids = np.flatnonzero(allowed)
            if s.sampling.plain_greedy:   # the first best allowed id, as argmax of the masked row
                t = int(ids[np.argmax(row[ids])])
            else:
                # Disallowed ids far below any logit (finite: the candidate selection
                # refuses NaN/Inf), so no filter keeps them and their weight is 0.
                t = s.sampler.sample(np.where(allowed, row, np.float32(-3.0e38)).astype(np.float32))
        lp = top = None
        if s.logprobs is not None:
            lp, top = top_logprobs(row, t, s.logprobs)
        self._pick(s, t, lp, top)

    def _seed_followers(self, s: Sequence, row: np.ndarray) -> None:
        """n > 1: the followers read the leader's prompt KV where it lies (no second
        prefill, no copy: Context.lend, from the leader's own lender where it borrows)
        and pick their first token from the same row, each with its own sampler."""
        n = len(s.prompt_ids)
        ctx = self.ctx
        lender, m = ctx.lendable(s.slot.seq, n)
        for f in s.followers:
            if f.done:
                continue
            ctx.lend(lender, f.slot.seq, m)
            ctx.copy_positions(s.slot.seq, f.slot.seq, m, n)
            f.slot.tokens[:] = s.prompt_ids
            f.timings.cached_tokens = n
            f.leader = None
            try:
                self._pick_from_row(f, row)
            except NumericsError as e:
                self._fail(f, e)
        s.followers = []

    def _verify_blocks(self, launch: Launch, blocks: list, argmax) -> None:
        """Drafted blocks: the kept drafts and the target's own next pick, handed out one
        at a time as single steps would; the KV forgets the rejected drafts' cells."""
        for s, r, k in blocks:
            draft, s.draft = s.draft, []
            try:
                if argmax is not None:
                    picks, j = accept_picks(argmax[r:r + k], draft)
                else:
                    block = launch.out[r:r + k]
                    for i in range(k):
                        check_logits_finite(block[i], s.picks + i)
                    picks, j = verify(block, draft, s.sampler, s.logprobs is not None, s.sampling.plain_greedy)
            except NumericsError as e:
                self._fail(s, e)
                continue
            s.slot.truncate(s.slot.n_past - (len(draft) - j))
            s.spec.policy.record(s.spec.bucket, len(draft), j)
            s.spec.drafted += len(draft)
            s.spec.accepted += j
            s.timings.drafted += len(draft)
            s.timings.accepted += j
            if self.metrics is not None:
                self.metrics.on_verify(len(draft), j)
            for i, p in enumerate(picks):
                top = None
                if s.logprobs is not None and s.logprobs > 0 and launch.out is not None:
                    _, top = top_logprobs(launch.out[r + i], p.id, s.logprobs)
                if s.one_at_a_time and i > 0:
                    s.queued.append((p.id, p.logprob, top))
                elif not self._pick(s, p.id, p.logprob, top):
                    break

    def release(self, seq: Sequence) -> bool:
        """Hand out the next queued pick of a one-at-a-time sequence; False when none."""
        if seq.done or not seq.queued:
            return False
        tok, lp, top = seq.queued.popleft()
        if not self._pick(seq, tok, lp, top):
            seq.queued.clear()
        return True

    def _eager(self, s: Sequence, t: int) -> None:
        """A lone plain sequence's next forward goes out before its pick's text work and
        the caller's handling of the event (on an asynchronous device they overlap it),
        unless the pick ends the sequence by itself (an end-of-generation id, the last of
        max_tokens, a cancelled request). A stop string found in the text afterwards
        takes the token back (_finish trims the KV)."""
        if (len(self.slots) != 1 or s.spec is not None or s.needs_rows or s.mask is not None or s.queued or t in s.text.eog
                or len(s.text.ids) + 1 >= s.max_tokens or (s.cancelled is not None and s.cancelled())):
            return
        s.next_tok = t
        self._launch_items([(s, [t], 1)])

    def _pick(self, s: Sequence, tok: int, logprob: float | None = None, top=None) -> bool:
        """One pick handed out: False when it ended the sequence."""
        if s.done:                  # its eager forward failed
            return False
        now = time.perf_counter()
        s.picks += 1
        if s.t_first is None:
            s.t_first = now
            s.timings.prompt_ms = (now - s.t_start) * 1000
        s.sampler.accept(tok)
        if s.spec is not None:
            s.spec.extend([tok])
        piece, end = s.text.push(tok)
        if end is not None:
            self._finish(s, end)
            return False
        s.emit(TokenEvent(tok, piece, logprob, top_logprobs=top))
        if len(s.text.ids) >= s.max_tokens:
            self._finish(s, "length")
            return False
        if s.cancelled is not None and s.cancelled():
            self._finish(s, "cancelled")
            return False
        s.next_tok = tok
        return True

    def _release(self, s: Sequence) -> None:
        s.done = True
        s.queued.clear()
        if s in self.seqs:
            self.seqs.remove(s)
        for i, o in list(self._owner.items()):
            if o is s:
                del self._owner[i]
                self._used[i] = time.perf_counter()

    def _finish(self, s: Sequence, reason: str) -> None:
        if s.done:
            return
        rest, reason = s.text.finish(reason) if s.text is not None else ("", reason)
        # The KV keeps the prompt and every pick but the last (never fed): what a plain
        # stream holds, whatever was verified or launched past the end.
        if s.picks and s.slot is not None and s.slot.n_past > len(s.prompt_ids) + s.picks - 1:
            s.slot.truncate(len(s.prompt_ids) + s.picks - 1)
        self._timings(s)
        s.finish_reason = reason
        self._release(s)
        for f in s.followers:       # a leader that ended before its prompt's pick
            if not f.done:
                self._finish(f, reason)
        s.emit(TokenEvent(None, rest, done=True, stop_reason=reason, timings=s.timings))

    def _fail(self, s: Sequence, err: Exception) -> None:
        """End a sequence with an error; its slot forgets the KV (cells may hold a
        partial write). The other sequences carry on."""
        if s.done:
            return
        if s.slot is not None:
            s.slot.reset()
        self._timings(s)
        s.error = err
        s.finish_reason = "error"
        self._release(s)
        for f in s.followers:
            self._fail(f, err)
        s.emit(TokenEvent(None, "", done=True, stop_reason="error", timings=s.timings, error=err))

    def _timings(self, s: Sequence) -> None:
        now = time.perf_counter()
        tm = s.timings
        tm.generated_tokens = len(s.text.ids) if s.text is not None else 0
        if s.t_first is None:
            tm.prompt_ms = (now - s.t_start) * 1000 if s.t_start else 0.0
        else:
            tm.gen_ms = (now - s.t_first) * 1000


def run_one(engine: Engine, seq: Sequence, slot: int = 0, reuse_prefix: bool = True):
    """Drive `engine` for one sequence, yielding its events as they come (the
    generator behind Session.stream). Closing the generator aborts the sequence."""
    engine.add(seq, slot, reuse_prefix=reuse_prefix)
    try:
        while True:
            while seq.events:
                ev = seq.events.popleft()
                if ev.error is not None:
                    raise ev.error
                yield ev
                if ev.done:
                    return
            if engine.release(seq):
                continue
            if not engine.step() and not seq.events:
                return
    finally:
        if not seq.done:
            engine.abort(seq)
        # A forward launched for this sequence alone is not collected by anyone.
        if engine._launch is not None and all(it[0].done for it in engine._launch.items):
            engine._launch = None
