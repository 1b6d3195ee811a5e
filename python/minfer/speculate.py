"""Speculative decoding: a drafter proposes d tokens, the target verifies them in one
forward of d + 1 tokens (the graph for that block size is built once and reused), and
the longest acceptable prefix plus one token of the target's own is kept.

Drafters:
- `ngram` (prompt lookup): the longest recent n-gram of the context that ends like the
  context does proposes what followed it. No second model; strong on editing tasks,
  where the answer copies long stretches of the prompt.
- `draft`: a smaller GGUF with the same vocabulary, decoded greedily in a Session of
  its own (its own Model, so its own WeightRegistry and backend stores: names never
  collide with the target's); the engine drafts for all such sequences of a step in
  batched forwards.

Speculation is a property of a sequence inside the engine (engine.SeqSpec), not a
loop of its own: this module holds the drafters, the depth policy and the
verification rule.

Acceptance. Greedy: a drafted token is kept while it equals the target's pick for
that row, so the output is the plain greedy output token for token (the kernels are
row-independent: row i of a block forward is bitwise the logits a single step would
give). Sampling: the drafts are deterministic (q = one-hot), and the standard rule
then reads: keep draft x with probability p(x); on the first rejection draw from p
with x removed (renormalised); if all d are kept, draw one more from the last row.
Every emitted token is then distributed as the target sampler's p.

Rolling back is only bookkeeping: the session forgets the rejected cells, and the
next forward overwrites them.

Adaptive depth. Each verify of d drafts costs about c1 * (1 + r*d) (c1 a single step,
r the measured extra cost per row; once a block size has been timed, its own measured
cost) and yields (1 - a^(d+1)) / (1 - a) tokens for a
per-token acceptance a, estimated per match length (n-gram) with decay. The depth
that maximises tokens per cost is used; when no depth beats a plain step the drafter
is skipped (a plain step) and probed again now and then, which is what keeps the
loss on text that does not repeat itself to a few percent.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from minfer.errors import MinferError
from minfer.sampling import accept, draw, logprob

MODES = ("ngram", "draft")


class Speculation:
    """What a stream needs to speculate, and what outlives one stream: the acceptance
    and cost estimates, and the draft model's session (its KV prefix is reused across
    turns like the target's)."""

    def __init__(self, mode: str = "ngram", draft_max: int = 8, draft_model=None, adaptive: bool = True,
                 ngram_min: int = 1, ngram_max: int = 4):
        if mode not in MODES:
            raise MinferError(f"--speculate must be one of {', '.join(MODES)}, got {mode!r}")
        if not 1 <= draft_max <= 64:
            raise MinferError(f"--draft-max must be in [1, 64], got {draft_max}")
        if mode == "draft" and draft_model is None:
            raise MinferError("--speculate draft needs --draft-model PATH")
        if mode == "ngram" and draft_model is not None:
            raise MinferError("--draft-model is only used with --speculate draft")
        if not 1 <= ngram_min <= ngram_max:
            raise MinferError(f"n-gram lengths must satisfy 1 <= min <= max, got {ngram_min}, {ngram_max}")
        self.mode = mode
        self.draft_max = int(draft_max)
        self.draft_model = draft_model
        self.adaptive = adaptive
        self.ngram = (int(ngram_min), int(ngram_max))
        self.policy = Policy(adaptive)
        self._draft_session = None

    @classmethod
    def open(cls, mode: str, draft_max: int = 8, draft_model_path=None, target=None, **kw) -> "Speculation":
        """The CLI's constructor: opens the draft GGUF (same threads and backends as the
        target) and checks the vocabularies match."""
        dm = None
        if draft_model_path is not None:
            # The target's own Model class: this module sits below model.py's layer.
            dm = type(target).open(draft_model_path, backends=getattr(target, "backends", None),
                                   n_threads=getattr(target, "n_threads", None))
            check_same_vocab(target, dm)   # refused before any stream, not at its first draft
        return cls(mode, draft_max=draft_max, draft_model=dm, **kw)

    def drafter(self, session) -> "Drafter":
        """An n-gram sequence's drafter (prompt lookup over its own tokens)."""
        return NgramDrafter(*self.ngram)

    def draft_session(self, session):
        """The draft model's session for a target session: kept between streams, so its
        KV prefix is reused across turns like the target's."""
        check_same_vocab(session.model, self.draft_model)
        # A decode step reads every weight once: the weight bytes' ratio is a draft step's
        # cost relative to a target step until timings (greedy streams) refine it.
        self.policy.q0 = (self.draft_model.defn.weight_bytes_per_token()
                          / max(1, session.model.defn.weight_bytes_per_token()))
        ds = self._draft_session
        if ds is None or ds.n_ctx < session.n_ctx:
            # The target's own Session class: this module never imports session.py.
            ds = self._draft_session = type(session)(self.draft_model, n_ctx=session.n_ctx)
        return ds


def check_same_vocab(target, draft) -> None:
    if target.hp.n_vocab != draft.hp.n_vocab:
        raise MinferError(f"the draft model's vocabulary ({draft.hp.n_vocab} tokens) differs from the target's "
                          f"({target.hp.n_vocab})")
    key = "tokenizer.ggml.tokens"
    a, b = target.gguf.metadata.get(key), draft.gguf.metadata.get(key)
    if a is not None and b is not None and list(a) != list(b):
        raise MinferError("the draft model's tokens differ from the target's (a draft must share the vocabulary)")


# ----------------------------------------------------------------------------- drafters


class Drafter:
    """Sees the context grow (prompt, then every pick) and proposes continuations."""

    def extend(self, tokens) -> None:
        raise NotImplementedError

    def propose(self, k: int) -> tuple[list[int], int]:
        """Up to k tokens and the bucket their acceptance is tracked in."""
        raise NotImplementedError


class NgramDrafter(Drafter):
    """Prompt lookup over an incremental index: for each n in [n_min, n_max], the
    n-gram ending at position i-1 maps to i, the position that followed its most
    recent occurrence. A lookup of the context's last n tokens is then one dict read."""

    def __init__(self, n_min: int = 1, n_max: int = 4):
        self.n_min, self.n_max = n_min, n_max
        self.toks: list[int] = []
        self.index: list[dict] = [dict() for _ in range(n_max + 1)]

    def extend(self, tokens) -> None:
        toks, index = self.toks, self.index
        for t in tokens:
            i = len(toks)
            for n in range(self.n_min, min(self.n_max, i) + 1):
                index[n][tuple(toks[i - n:i])] = i
            toks.append(int(t))

    def propose(self, k: int) -> tuple[list[int], int]:
        toks = self.toks
        L = len(toks)
        for n in range(min(self.n_max, L), self.n_min - 1, -1):
            p = self.index[n].get(tuple(toks[L - n:]))
            if p is not None:
                return toks[p:p + k], n
        return [], 0


# ----------------------------------------------------------------------------- policy


class Policy:
    """Depth choice from acceptance (per bucket, decayed) and measured forward costs."""

    DECAY = 0.9
    PROBE_EVERY = 16

    def __init__(self, adaptive: bool = True):
        self.adaptive = adaptive
        self.acc: dict = {}       # bucket -> [successes, trials]
        self.skips: dict = {}     # bucket -> plain steps taken instead of drafting
        self.c1: float | None = None   # ms of a single-token target forward
        self.r0 = self.r = 0.15   # extra cost per verified row, relative to c1 (prior, measured)
        self.q0 = 0.0             # drafter's own cost per drafted token, relative to c1
        self.q: float | None = None
        # Measured ms of a verify forward per block size: a block's cost is not linear in
        # its rows where a backend batches them in fixed groups (CUDA's matvec takes 8,
        # 4, 2 or 1 columns per launch: 8 rows read the weights once, 9 or 7 rows more).
        self.cost: dict[int, float] = {}

    def rate(self, bucket) -> float:
        s, t = self.acc.get(bucket, (0.0, 0.0))
        return (s + 2.0) / (t + 3.0)  # prior 2/3: optimistic enough to try a bucket

    def depth(self, bucket, limit: int, measured: bool = True) -> int:
        """measured=False (sampling): decide from the priors and acceptance only, never
        from the clock, so a seed gives one output whatever the machine's load."""
        if limit <= 0:
            return 0
        if not self.adaptive:
            return limit
        if measured and self.c1 is None:
            return 0  # one plain step first: it measures the cost everything is relative to
        r, q = (self.r, self.q if self.q is not None else self.q0) if measured else (self.r0, self.q0)
        a = min(self.rate(bucket), 0.999)
        best, best_gain = 0, 1.0
        for d in range(1, limit + 1):
            gain = block_tokens(a, d) / (self.rel_cost(d + 1, r, measured) + q * d)
            if gain > best_gain * 1.02:
                best, best_gain = d, gain
        if best == 0:
            n = self.skips.get(bucket, 0) + 1
            self.skips[bucket] = n
            if n >= self.PROBE_EVERY:  # look again: the text may have started repeating
                self.skips[bucket] = 0
                return 1
        return best

    def rel_cost(self, n: int, r: float, measured: bool = True) -> float:
        """A verify of n rows relative to a single step: measured for that n when it has
        been (and the clock may be read), else the linear model 1 + r (n - 1)."""
        ms = self.cost.get(n) if measured else None
        if ms is not None and self.c1:
            return max(ms / self.c1, 1.0)
        return 1 + r * (n - 1)

    def record(self, bucket, d: int, j: int) -> None:
        s, t = self.acc.get(bucket, (0.0, 0.0))
        self.acc[bucket] = [s * self.DECAY + j, t * self.DECAY + j + (1 if j < d else 0)]

    def timed(self, n: int, ms: float, draft_ms: float = 0.0, d: int = 0) -> None:
        if n > 1:
            c = self.cost.get(n)
            self.cost[n] = ms if c is None else 0.7 * c + 0.3 * ms
        if n == 1:
            self.c1 = ms if self.c1 is None else 0.7 * self.c1 + 0.3 * ms
        elif self.c1:
            r = min(max((ms / self.c1 - 1) / (n - 1), 0.01), 2.0)
            self.r = 0.7 * self.r + 0.3 * r
            if d and draft_ms:
                q = min(max(draft_ms / self.c1 / d, 0.0), 4.0)
                self.q = q if self.q is None else 0.7 * self.q + 0.3 * q


class BatchGate:
    """Whether the greedy drafts of a batched step pay for their rows, from measured step
    walls.

    A lone sequence's depth policy weighs a block against a single step. In a batch the
    comparison is the whole step: n decode rows alone, or n plus every draft. What a row
    costs there is the backend's (a GPU's batched matmul grows in steps with the rows)
    plus the host's per-token work, so both are measured: the wall from one batched
    decode launch to the next, by its total rows (the least of the recent ones), with
    the host's picks and streaming inside it. On one H100, 16 concurrent code-editing
    requests of the default model ran 7,325 tok/s plain and 6,786 with every draft
    kept (0.93x): the 64-row steps cost more than their accepted drafts gave.

    Greedy sequences only: their output is the same whatever is drafted, so the clock
    may decide; a sampled sequence's drafts change what its seed draws and stay as its
    own policy chose. The first step of a batch size runs plain (it measures what the
    drafts are weighed against); a row count beyond every measured one runs as
    proposed (it gets measured); between measured ones the cost is interpolated. When
    drafts lose, every PROBE_EVERY-th losing step keeps them anyway, so a measurement
    that has gone stale (acceptance rising, load falling) is made again."""

    PROBE_EVERY = 16
    RECENT = 8

    def __init__(self):
        self.ms: dict[int, float] = {}   # total rows -> wall of a batched decode step
        self._seen: dict[int, deque] = {}
        self.skips = 0

    def observe(self, rows: int, ms: float) -> None:
        # The least of the recent walls: a step that met a pause (a collection, the
        # event loop holding the interpreter) says nothing about what its rows cost,
        # and one such wall averaged in could keep paying drafts out for many steps.
        seen = self._seen.setdefault(rows, deque(maxlen=self.RECENT))
        seen.append(ms)
        self.ms[rows] = min(seen)

    def cost(self, rows: int) -> float | None:
        """The wall of a step of `rows` rows: measured, else interpolated between the
        nearest measured row counts around it; None when none is at or above it."""
        if rows in self.ms:
            return self.ms[rows]
        lo = max((r for r in self.ms if r < rows), default=None)
        hi = min((r for r in self.ms if r > rows), default=None)
        if hi is None:
            return None
        if lo is None:
            return self.ms[hi]
        return self.ms[lo] + (self.ms[hi] - self.ms[lo]) * (rows - lo) / (hi - lo)

    def keep(self, plain_rows: int, plain_tokens: float, rows: int, tokens: float) -> bool:
        """Drafts that make a step of `rows` rows and `tokens` expected tokens, against
        the step of `plain_rows` rows and `plain_tokens` without them."""
        t0 = self.ms.get(plain_rows)
        if t0 is None:
            return False
        t1 = self.cost(rows)
        if t1 is None or tokens / t1 >= plain_tokens / t0:
            self.skips = 0
            return True
        self.skips += 1
        if self.skips >= self.PROBE_EVERY:
            self.skips = 0
            return True
        return False


def block_tokens(a: float, d: int) -> float:
    """Tokens a verified block of d drafts yields (the target's own pick included), each
    draft accepted with probability a < 1 while all before it were."""
    return (1 - a ** (d + 1)) / (1 - a)


def expected_accepted(a: float, d: int) -> float:
    """Drafts kept of d, each accepted with probability a while all before it were."""
    return block_tokens(min(max(a, 0.0), 0.999), d) - 1


# ----------------------------------------------------------------------------- verification


@dataclass
class Pick:
    id: int
    logprob: float | None


def accept_picks(picks: list[int], draft: list[int]) -> tuple[list[Pick], int]:
    """Greedy verification from the block's row picks alone: drafts are kept while each
    equals the target's pick for its row, then the target's own pick follows."""
    out: list[Pick] = []
    for j, x in enumerate(draft + [None]):
        out.append(Pick(picks[j], None))
        if picks[j] != x:
            return out, j
    return out, len(draft)


def verify(rows: np.ndarray, draft: list[int], sampler, logprobs: bool = False,
           plain_argmax: bool | None = None) -> tuple[list[Pick], int]:
    """The picks of one verified block and how many drafts were kept (j): rows[i] are
    the target's logits after the block's first i + 1 tokens (the fed pick, then the
    drafts), so there are j + 1 picks: the kept drafts and the target's own next one.
    Greedy keeps a draft while it is the argmax; sampling applies the rejection rule
    (module doc). The sampler's history is read, not changed: the caller accepts each
    pick as it hands it out (and may stop before the last)."""
    if plain_argmax is None:
        p = sampler.params
        plain_argmax = p.plain_greedy
    if plain_argmax:
        out, j = accept_picks([int(np.argmax(rows[i])) for i in range(len(draft) + 1)], draft)
        if logprobs:
            for i, pk in enumerate(out):
                pk.logprob = logprob(rows[i], pk.id)
        return out, j
    out: list[Pick] = []
    hist = sampler.history.copy()
    rng = sampler.rng
    for j in range(len(draft) + 1):
        ids, probs = sampler.distribution(rows[j], hist)
        x = draft[j] if j < len(draft) else None
        if probs is None:                      # temperature 0 with a penalty
            t = int(ids)
        elif x is None:                        # every draft kept: one more from p
            t = int(ids[draw(rng, probs)])
        else:
            hit = np.flatnonzero(ids == x)
            px = float(probs[hit[0]]) if hit.size else 0.0
            if rng.random() < px:
                t = x
            else:                              # residual: p without x, renormalised
                res = probs.copy()
                if hit.size:
                    res[hit[0]] = 0.0
                t = int(ids[draw(rng, res / res.sum())])
        out.append(Pick(t, logprob(rows[j], t) if logprobs else None))
        if t != x:
            return out, j
        accept(sampler.params, hist, t)  # as Sampler.accept
    return out, len(draft)

