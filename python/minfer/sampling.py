"""Token sampling, the one sampler every caller uses: greedy, temperature, top-k, top-p,
min-p, repetition / presence / frequency penalties, logit bias and seeds; logprobs.

The order follows llama.cpp's default chain (logit bias, penalties, top-k, top-p, min-p,
temperature, draw) so the knobs mean what users of llama.cpp expect. The repetition
penalty looks at the last `repeat_last_n` tokens, prompt included (llama.cpp); the
presence and frequency penalties at the tokens generated so far (OpenAI's definition:
`logit - frequency * count - presence * (count > 0)`).
Candidates come from a top-k selection in the compiled core (a NumPy sort of a 152k
vocabulary took milliseconds, more than a GPU decode step); the filters are NumPy on
the few that survive.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from minfer import _core
from minfer.errors import MinferError, NumericsError
from minfer.logits_check import check_logits_finite


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple = ()      # ((token id, bias), ...): added to the logit before anything else

    @property
    def adjusts(self) -> bool:
        """Whether some logits are changed before the pick (penalties, bias)."""
        return (self.repeat_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or bool(self.logit_bias))

    @property
    def plain_greedy(self) -> bool:
        """The pick is the raw row's argmax: the device that holds the row takes it."""
        return self.temperature <= 0.0 and not self.adjusts

    def validate(self) -> None:
        if self.temperature < 0:
            raise MinferError(f"--temp must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise MinferError(f"--top-k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise MinferError(f"--top-p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p < 1.0:
            raise MinferError(f"--min-p must be in [0, 1), got {self.min_p}")
        if self.repeat_penalty <= 0:
            raise MinferError(f"--repeat-penalty must be > 0, got {self.repeat_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:
                raise MinferError(f"--{name.replace('_', '-')} must be in [-2, 2], got {v}")
        for item in self.logit_bias:
            if len(item) != 2 or not isinstance(item[0], (int, np.integer)) or item[0] < 0:
                raise MinferError(f"a logit bias must map a token id (>= 0) to a number, got {item!r}")
            if not -100.0 <= float(item[1]) <= 100.0:
                raise MinferError(f"a logit bias must be in [-100, 100], got {item[1]} for token {item[0]}")


class History:
    """What the penalties look at: the recent tokens (prompt included) and the counts of
    the generated ones. A speculative verifier scores a block on a copy, as if the
    drafted tokens before each row had been accepted."""

    __slots__ = ("recent", "counts")

    def __init__(self, last_n: int):
        self.recent: deque[int] = deque(maxlen=max(last_n, 0) or None)
        self.counts: dict[int, int] = {}

    def copy(self) -> "History":
        h = History.__new__(History)
        h.recent = deque(self.recent, maxlen=self.recent.maxlen)
        h.counts = dict(self.counts)
        return h


class Sampler:
    """Stateful sampler: remembers recent tokens for the repetition penalty and owns
    its random generator, so one seed gives one output."""

    def __init__(self, params: SamplingParams):
        params.validate()
        self.params = params
        self.rng = np.random.default_rng(params.seed)
        self.history = History(params.repeat_last_n)
        self._bias = (np.array([t for t, _ in params.logit_bias], dtype=np.int64),
                      np.array([b for _, b in params.logit_bias], dtype=np.float64))

    @property
    def recent(self) -> deque:
        return self.history.recent

    def accept_prompt(self, tokens) -> None:
        """The prompt's tokens: seen by the repetition penalty, not counted as generated."""
        if self.params.repeat_last_n != 0:
            self.history.recent.extend(int(t) for t in tokens)

    def accept(self, token: int) -> None:
        """A generated token."""
        accept(self.params, self.history, int(token))

    def sample(self, logits: np.ndarray) -> int:
        return _pick(self, self.candidates(logits))

    def distribution(self, logits, hist: History | None = None):
        """What `sample` draws from: (ids, probs) over the surviving candidates, or
        (argmax id, None) at temperature 0. `logits` is a row, or a source that keeps the
        row where it was computed (a device) and answers for its best candidates (see
        HostRow). `hist` replaces the penalty history (the speculative verifier scores
        a row as if the drafted tokens before it had been accepted)."""
        got = self.candidates(logits, hist)
        if isinstance(got, int):
            return got, None
        order, w = _weights(*got, self.params)
        return order, w / w.sum()

    def candidates(self, logits, hist: History | None = None):
        """The first half of `distribution`: the argmax id (temperature 0), or (ids,
        values, total) best first before top-p, min-p and temperature, total None for a
        top-k's candidates (their softmax is their own), without top-k the whole row's sum
        of exp(value - max) over a prefix of it."""
        p = self.params
        # The logits may be a read-only view of the engine's buffer: never edited in
        # place; the penalized values travel beside them.
        src = logits if hasattr(logits, "best") else HostRow(logits)
        n = src.n
        hist = self.history if hist is None else hist
        k, pen_ids = self.needs(n, hist)
        if k == 0:
            return src.argmax()
        extra = 0 if pen_ids is None else pen_ids.size
        if k > 0 and src.takes(min(k + extra, n)):
            ids, vals, raw = src.best(min(k + extra, n), pen_ids)
            pen = None if pen_ids is None else (pen_ids, self._adjust(pen_ids, raw, hist))
            order, vals = _merge(ids, vals, k, pen)
        else:  # no top-k, or more candidates than the source selects at once
            row = src.row()
            pen = None if pen_ids is None else (pen_ids, self._adjust(pen_ids, row[pen_ids].astype(np.float64), hist))
            if k > 0:
                order, vals = _best(row, k, pen)
            else:
                return _nucleus_prefix(row, pen, p.top_p, p.min_p)
        if p.temperature <= 0.0:
            return int(order[0])
        return order, vals, None

    def needs(self, n: int, hist: History | None = None) -> tuple[int, np.ndarray | None]:
        """What `distribution` reads of a row of n: (k, pen_ids). k = 0: the argmax alone;
        k > 0: the row's k + len(pen_ids) best candidates and its values at pen_ids (the
        adjusted ids: penalized or biased, ascending, or None); k = -1: the whole row (no
        top-k). A device selecting candidates for several rows at once plans with it
        (rows.DeviceRows)."""
        p = self.params
        hist = self.history if hist is None else hist
        ids: set[int] = set()
        if p.repeat_penalty != 1.0:
            ids.update(hist.recent)
        if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
            ids.update(hist.counts)
        if p.logit_bias:
            ids.update(int(t) for t in self._bias[0] if t < n)
        pen_ids = np.array(sorted(ids), dtype=np.int64) if ids else None
        if p.temperature <= 0.0:
            return (0 if pen_ids is None else 1), pen_ids
        return (p.top_k if 0 < p.top_k < n else -1), pen_ids

    def _adjust(self, ids: np.ndarray, vals: np.ndarray, hist: History) -> np.ndarray:
        """The values at `ids` (ascending) after the logit bias and the penalties."""
        p = self.params
        vals = np.array(vals, dtype=np.float64)
        if p.logit_bias:
            bid, bval = self._bias
            at = np.searchsorted(ids, bid)
            ok = (at < ids.size) & (ids[np.minimum(at, ids.size - 1)] == bid)
            np.add.at(vals, at[ok], bval[ok])
        if p.repeat_penalty != 1.0 and hist.recent:
            # llama.cpp's rule: shrink positive logits, grow negative ones.
            r = p.repeat_penalty
            hit = np.isin(ids, np.fromiter(hist.recent, dtype=np.int64))
            with np.errstate(over="ignore", under="ignore"):
                vals = np.where(hit, np.where(vals > 0, vals / r, vals * r), vals)
        if (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0) and hist.counts:
            c = np.array([hist.counts.get(int(t), 0) for t in ids], dtype=np.float64)
            vals = vals - p.frequency_penalty * c - p.presence_penalty * (c > 0)
        # An extreme penalty can push a value past float64: kept finite so the softmax
        # never computes inf - inf.
        return np.minimum(np.maximum(vals, -_BIG), _BIG)


class HostRow:
    """A logits row in host memory, as `Sampler.distribution` reads a row. A source that
    keeps the row elsewhere (a device) has the same methods: `best` answers for the
    candidates in one call, `row` brings the whole row when a filter needs it."""

    def __init__(self, row):
        self.data = np.asarray(row).reshape(-1)
        self.n = self.data.size

    def argmax(self) -> int:
        return int(np.argmax(self.data))

    def takes(self, k: int) -> bool:
        return True

    def best(self, k: int, ids: np.ndarray | None):
        """The k best ids (best first, equal values by id), their values and the values
        at `ids`, as float64; NumericsError for a row holding NaN or Inf."""
        row = np.ascontiguousarray(self.data, dtype=np.float32)
        top = _core.top_k(row, k)
        if top is None:  # a NaN or Inf in the row: the check words the error
            check_logits_finite(row, None)
            raise NumericsError("top_k flagged a row that checks finite")
        return top, row[top].astype(np.float64), None if ids is None else row[ids].astype(np.float64)

    def row(self) -> np.ndarray:
        return self.data


def _best(logits: np.ndarray, k: int, pen: tuple | None) -> tuple[np.ndarray, np.ndarray]:
    """The k best ids of a row and their values (float64), best first, equal values by
    id; with pen = (ids, values) the penalized values replace the row's at those ids (a
    penalty moves only those values, so the k best are among the row's k + len(ids) best
    and the penalized ids, whichever way a penalty above or below 1 moves them)."""
    extra = 0 if pen is None else pen[0].size
    ids, vals, _ = HostRow(logits).best(min(k + extra, np.asarray(logits).size), None)
    return _merge(ids, vals, k, pen)


def _merge(ids: np.ndarray, vals: np.ndarray, k: int, pen: tuple | None) -> tuple[np.ndarray, np.ndarray]:
    """The k best of a row's best candidates (ids, vals) once the penalized values
    pen = (ids ascending, values) replace the row's at those ids."""
    if pen is None:
        return ids[:k], vals[:k]
    pid, pval = pen
    at = np.minimum(np.searchsorted(pid, ids), pid.size - 1)
    other = pid[at] != ids     # the candidates not penalized
    ids = np.concatenate([ids[other], pid])
    vals = np.concatenate([vals[other], pval])
    best = np.lexsort((ids, -vals))[:k]
    return ids[best], vals[best]


def _nucleus_prefix(logits: np.ndarray, pen: tuple | None, top_p: float, min_p: float):
    """Without top-k the softmax spans the whole row, yet top-p and min-p keep only a
    prefix of its sorted order: the best ids, their values and the whole row's sum of
    exp(value - max) (for _weights), enough of them to hold that prefix (grown 8x at a
    time; the whole row when neither filter bites, as a plain temperature draw needs)."""
    row = np.asarray(logits, dtype=np.float64).reshape(-1)
    if pen is not None:
        row = row.copy()
        row[pen[0]] = pen[1]
    top = row.max()
    if not np.isfinite(top):
        _best(logits, 1, None)  # names the NaN / Inf
    total = float(np.exp(row - top).sum())
    n = row.size
    k = 64 if top_p < 1.0 or min_p > 0.0 else n
    while True:
        order, vals = _best(logits, min(k, n), pen)
        e = np.exp(vals - top)  # _weights' terms: the prefix ends where its filters end
        if (k >= n or (top_p < 1.0 and np.cumsum(e)[-1] >= top_p * total)
                or (min_p > 0.0 and e[-1] < min_p)):
            return order, vals, total
        k *= 8


def _weights(order: np.ndarray, vals: np.ndarray, total: float | None, p: SamplingParams):
    """top-p, min-p, then temperature over candidates best first: (ids, weights), the
    weights unnormalized. top-p and min-p judge exp(value - max) against top_p times
    `total` (None: the candidates' own sum) and min_p (the best's term is exp(0) = 1).
    Sums are sequential (cumsum): `_sample_batch`, which pads rows with zeros, gets the
    same bits."""
    if p.top_p < 1.0 or p.min_p > 0.0:
        e = np.exp(vals - vals[0])
        if p.top_p < 1.0:
            c = np.cumsum(e)
            n = int(np.searchsorted(c, p.top_p * (c[-1] if total is None else total))) + 1
            order, vals, e = order[:n], vals[:n], e[:n]
        if p.min_p > 0.0:
            keep = e >= p.min_p
            order, vals = order[keep], vals[keep]
    # Shifted before scaling, so the best weighs exp(0) = 1 at any temperature; the
    # shifted values over a tiny one overflow (to -inf, whose exp is 0) only when their
    # spread over it passes the float range: then without the warning.
    t = p.temperature
    if vals[0] - vals[-1] < t * 1e300:
        z = (vals - vals[0]) / t
    else:
        with np.errstate(over="ignore"):
            z = (vals - vals[0]) / t
    return order, np.exp(z)


def sample_rows(samplers: list[Sampler], rows: list) -> list:
    """The next id of each row, or the exception its row raised (a NumericsError for
    NaN/Inf), each as samplers[i].sample(rows[i]) gives it: the same bits, the same draw
    from that sampler's generator. A batched step's rows pay the filters' NumPy calls
    once, not once a row: the rows whose candidates are a top-k go through top-p,
    min-p, temperature and the draw as one padded matrix (bench/sampling.py). A row
    source's `best` may answer for every row at once (session.DeviceRows)."""
    out: list = [None] * len(rows)
    batch = []
    for i, (s, row) in enumerate(zip(samplers, rows)):
        try:
            got = s.candidates(row)
        except NumericsError as e:  # the row's own error: the others go on
            out[i] = e
            continue
        if isinstance(got, int) or got[2] is not None or len(rows) == 1:
            out[i] = _pick(s, got)
        else:
            batch.append((i, s, got[0], got[1]))
    if batch:
        for (i, _, _, _), t in zip(batch, _sample_batch(batch)):
            out[i] = t
    return out


def _pick(s: Sampler, got) -> int:
    """The draw from what s.candidates gave (an id is the pick itself)."""
    if isinstance(got, int):
        return got
    order, w = _weights(*got, s.params)
    return int(order[draw(s.rng, w)])


def _sample_batch(batch) -> list[int]:
    """_weights and draw for rows of top-k candidates (row i: (_, sampler, ids,
    values)), one row of a matrix each, padded at the end with -inf. Padding and dropped
    candidates weigh 0 and every sum is a cumsum, whose +0 terms change no bits: each
    row gets _weights' weights and draw's index, bit for bit."""
    m, k = len(batch), max(v.size for _, _, _, v in batch)
    vals = np.full((m, k), -np.inf)
    ids = np.zeros((m, k), dtype=np.int64)
    params = []
    for r, (_, s, o, v) in enumerate(batch):
        vals[r, :v.size], ids[r, :o.size] = v, o
        params.append(s.params)
    d = vals - vals[:, :1]
    keep = None
    if any(p.top_p < 1.0 or p.min_p > 0.0 for p in params):
        e = np.exp(d)
        c = np.add.accumulate(e, axis=1)
        # searchsorted(c, thr) + 1 candidates: the first, and each whose predecessor's
        # cumulative sum is below the threshold (c never decreases).
        thr = np.array([p.top_p if p.top_p < 1.0 else np.inf for p in params]) * c[:, -1]
        keep = e >= np.array([[p.min_p] for p in params])
        keep[:, 1:] &= c[:, :-1] < thr[:, None]
    with np.errstate(over="ignore"):
        w = np.exp(d / np.array([[p.temperature] for p in params]))
    if keep is not None:
        w *= keep
    # draw(): the normalized cumulative sum searched for one uniform from each row's own
    # generator; a dropped candidate repeats its predecessor's cdf, so it is never found.
    cdf = np.add.accumulate(w, axis=1)
    cdf /= cdf[:, -1:]
    u = np.array([[s.rng.random()] for _, s, _, _ in batch])
    at = np.argmax(cdf > u, axis=1)
    return ids[np.arange(m), at].tolist()


def accept(params: SamplingParams, hist: History, token: int) -> None:
    """A generated token into a penalty history."""
    if params.repeat_last_n != 0:
        hist.recent.append(token)
    hist.counts[token] = hist.counts.get(token, 0) + 1


def logprob(row: np.ndarray, t: int) -> float:
    """log softmax(row)[t], in float64."""
    x = row.astype(np.float64)
    m = x.max()
    return float(x[t] - m - np.log(np.exp(x - m).sum()))


def top_logprobs(row: np.ndarray, t: int, n: int) -> tuple[float, list | None]:
    """The pick's logprob and the n most likely tokens' (id, logprob), best first, of the
    raw row (the model's distribution, before any sampling filter)."""
    x = np.asarray(row).astype(np.float64)
    m = x.max()
    log_sum = np.log(np.exp(x - m).sum())
    lp = float(x[t] - m - log_sum)
    if not n:
        return lp, None
    top = _core.top_k(np.ascontiguousarray(row, dtype=np.float32), min(n, x.size))
    if top is None:
        check_logits_finite(np.asarray(row), None)
        raise NumericsError("top_k flagged a row that checks finite")
    return lp, [(int(i), float(x[i] - m - log_sum)) for i in top]


def draw(rng: np.random.Generator, probs: np.ndarray) -> int:
    """rng.choice(probs.size, p=probs), the same index from the same generator state (its
    normalized cumulative sum searched for one uniform draw), without choice's argument
    checks, which cost more than a GPU decode step's share of sampling (~20 us). probs
    may be weights that do not sum to 1: the cumulative sum is normalized anyway."""
    cdf = np.cumsum(probs)
    cdf /= cdf[-1]
    return int(np.searchsorted(cdf, rng.random(), side="right"))


_BIG = np.finfo(np.float64).max / 4
