"""Token sampling: greedy, temperature, top-k, top-p, min-p and repetition penalty.

The order of the filters follows llama.cpp's default chain (penalties, top-k, top-p,
min-p, temperature, draw) so the knobs mean what users of llama.cpp expect.
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


class Sampler:
    """Stateful sampler: remembers recent tokens for the repetition penalty and owns
    its random generator, so one seed gives one output."""

    def __init__(self, params: SamplingParams):
        params.validate()
        self.params = params
        self.rng = np.random.default_rng(params.seed)
        self.recent: deque[int] = deque(maxlen=max(params.repeat_last_n, 0) or None)

    def accept(self, token: int) -> None:
        if self.params.repeat_last_n != 0:
            self.recent.append(int(token))

    def sample(self, logits: np.ndarray) -> int:
        return _pick(self, self.candidates(logits))

    def distribution(self, logits, recent=None):
        """What `sample` draws from: (ids, probs) over the surviving candidates, or
        (argmax id, None) at temperature 0. `logits` is a row, or a source that keeps the
        row where it was computed (a device) and answers for its best candidates (see
        HostRow). `recent` replaces the penalty history (the speculative verifier scores
        a row as if the drafted tokens before it had been accepted)."""
        got = self.candidates(logits, recent)
        if isinstance(got, int):
            return got, None
        order, w = _weights(*got, self.params)
        return order, w / w.sum()

    def candidates(self, logits, recent=None):
        """The first half of `distribution`: the argmax id (temperature 0), or (ids,
        values, total) best first before top-p, min-p and temperature, total None for a
        top-k's candidates (their softmax is their own), without top-k the whole row's sum
        of exp(value - max) over a prefix of it."""
        p = self.params
        # The logits may be a read-only view of the engine's buffer: never edited in
        # place; the penalized values travel beside them.
        src = logits if hasattr(logits, "best") else HostRow(logits)
        n = src.n
        k, pen_ids = self.needs(n, recent)
        if k == 0:
            return src.argmax()
        extra = 0 if pen_ids is None else pen_ids.size
        if k > 0 and src.takes(min(k + extra, n)):
            ids, vals, raw = src.best(min(k + extra, n), pen_ids)
            pen = None if pen_ids is None else (pen_ids, self._penalize(raw))
            order, vals = _merge(ids, vals, k, pen)
        else:  # no top-k, or more candidates than the source selects at once
            row = src.row()
            pen = None if pen_ids is None else (pen_ids, self._penalize(row[pen_ids].astype(np.float64)))
            if k > 0:
                order, vals = _best(row, k, pen)
            else:
                return _nucleus_prefix(row, pen, p.top_p, p.min_p)
        if p.temperature <= 0.0:
            return int(order[0])
        return order, vals, None

    def needs(self, n: int, recent=None) -> tuple[int, np.ndarray | None]:
        """What `distribution` reads of a row of n: (k, pen_ids). k = 0: the argmax alone;
        k > 0: the row's k + len(pen_ids) best candidates and its values at pen_ids (the
        penalized ids, ascending, or None); k = -1: the whole row (no top-k). A device
        selecting candidates for several rows at once plans with it (session.DeviceRows)."""
        p = self.params
        recent = self.recent if recent is None else recent
        pen_ids = None
        if p.repeat_penalty != 1.0 and recent:
            pen_ids = np.array(sorted(set(recent)), dtype=np.int64)
        if p.temperature <= 0.0:
            return (0 if pen_ids is None else 1), pen_ids
        return (p.top_k if 0 < p.top_k < n else -1), pen_ids

    def _penalize(self, vals: np.ndarray) -> np.ndarray:
        # llama.cpp's rule: shrink positive logits, grow negative ones. An extreme penalty
        # can push a value past float64: kept finite so the softmax never computes inf - inf.
        r = self.params.repeat_penalty
        with np.errstate(over="ignore", under="ignore"):
            vals = np.where(vals > 0, vals / r, vals * r)
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


def draw(rng: np.random.Generator, probs: np.ndarray) -> int:
    """rng.choice(probs.size, p=probs), the same index from the same generator state (its
    normalized cumulative sum searched for one uniform draw), without choice's argument
    checks, which cost more than a GPU decode step's share of sampling (~20 us). probs
    may be weights that do not sum to 1: the cumulative sum is normalized anyway."""
    cdf = np.cumsum(probs)
    cdf /= cdf[-1]
    return int(np.searchsorted(cdf, rng.random(), side="right"))


_BIG = np.finfo(np.float64).max / 4
