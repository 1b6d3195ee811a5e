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
        ids, probs = self.distribution(logits)
        if probs is None:
            return int(ids)
        return int(ids[draw(self.rng, probs)])

    def distribution(self, logits, recent=None):
        """What `sample` draws from: (ids, probs) over the surviving candidates, or
        (argmax id, None) at temperature 0. `logits` is a row, or a source that keeps the
        row where it was computed (a device) and answers for its best candidates (see
        HostRow). `recent` replaces the penalty history (the speculative verifier scores
        a row as if the drafted tokens before it had been accepted)."""
        p = self.params
        # The logits may be a read-only view of the engine's buffer: never edited in
        # place; the penalized values travel beside them.
        src = logits if hasattr(logits, "best") else HostRow(logits)
        n = src.n
        k, pen_ids = self.needs(n, recent)
        if k == 0:
            return src.argmax(), None
        k = max(k, 0)
        extra = 0 if pen_ids is None else pen_ids.size
        if k and src.takes(min(k + extra, n)):
            ids, vals, raw = src.best(min(k + extra, n), pen_ids)
            pen = None if pen_ids is None else (pen_ids, self._penalize(raw))
            order, vals = _merge(ids, vals, k, pen)
        else:  # no top-k, or more candidates than the source selects at once
            row = src.row()
            pen = None if pen_ids is None else (pen_ids, self._penalize(row[pen_ids].astype(np.float64)))
            if k:
                order, vals = _best(row, k, pen)
            else:
                order, vals, probs = _nucleus_prefix(row, pen, p.top_p, p.min_p)
        if k:
            if p.temperature <= 0.0:
                return int(order[0]), None
            probs = _softmax(vals)
        if p.top_p < 1.0:
            cum = np.cumsum(probs)
            keep = int(np.searchsorted(cum, p.top_p) + 1)
            order, vals, probs = order[:keep], vals[:keep], probs[:keep]
        if p.min_p > 0.0:
            keep = probs >= p.min_p * probs[0]
            order, vals = order[keep], vals[keep]
        # Shift before scaling: with a tiny temperature vals / T overflows, (vals - max) / T
        # only underflows (to -inf, whose exp is 0; the top token stays at exp(0) = 1).
        with np.errstate(over="ignore", divide="ignore"):
            probs = _softmax((vals - vals.max()) / p.temperature)
        return order, probs

    def needs(self, n: int, recent=None) -> tuple[int, np.ndarray | None]:
        """What `distribution` reads of a row of n: (k, pen_ids). k = 0: the argmax alone;
        k > 0: the row's k + len(pen_ids) best candidates and its values at pen_ids (the
        penalized ids, or None); k = -1: the whole row (no top-k). A device selecting
        candidates for several rows at once plans with it (session.DeviceRows)."""
        p = self.params
        recent = self.recent if recent is None else recent
        pen_ids = None
        if p.repeat_penalty != 1.0 and recent:
            pen_ids = np.fromiter(set(recent), dtype=np.int64)
        if p.temperature <= 0.0:
            return (0 if pen_ids is None else 1), pen_ids
        return (p.top_k if 0 < p.top_k < n else -1), pen_ids

    def _penalize(self, vals: np.ndarray) -> np.ndarray:
        # llama.cpp's rule: shrink positive logits, grow negative ones. An extreme penalty
        # can push a value past float64: kept finite so the softmax never computes inf - inf.
        r = self.params.repeat_penalty
        with np.errstate(over="ignore", under="ignore"):
            vals = np.where(vals > 0, vals / r, vals * r)
        return np.clip(vals, -_BIG, _BIG)


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
    penalty only lowers a value, so the k best are among the row's k + len(ids) best and
    the penalized ids)."""
    extra = 0 if pen is None else pen[0].size
    ids, vals, _ = HostRow(logits).best(min(k + extra, np.asarray(logits).size), None)
    return _merge(ids, vals, k, pen)


def _merge(ids: np.ndarray, vals: np.ndarray, k: int, pen: tuple | None) -> tuple[np.ndarray, np.ndarray]:
    """The k best of a row's best candidates (ids, vals) once the penalized values
    pen = (ids, values) replace the row's at those ids."""
    if pen is None:
        return ids[:k], vals[:k]
    # The penalized entries first, so unique() keeps their values for ids in both.
    ids, first = np.unique(np.concatenate([pen[0], ids]), return_index=True)
    vals = np.concatenate([pen[1], vals])[first]
    best = np.lexsort((ids, -vals))[:k]
    return ids[best], vals[best]


def _nucleus_prefix(logits: np.ndarray, pen: tuple | None, top_p: float, min_p: float):
    """Without top-k the softmax spans the whole row, yet top-p and min-p keep only a
    prefix of its sorted order: the best ids, their values and probabilities, enough of
    them to hold that prefix (grown 8x at a time; the whole row when neither filter
    bites, as a plain temperature draw needs)."""
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
        probs = np.exp(vals - top) / total
        if (k >= n or (top_p < 1.0 and probs.sum() >= top_p)
                or (min_p > 0.0 and probs[-1] < min_p * probs[0])):
            return order, vals, probs
        k *= 8


def draw(rng: np.random.Generator, probs: np.ndarray) -> int:
    """rng.choice(probs.size, p=probs), the same index from the same generator state (its
    normalized cumulative sum searched for one uniform draw), without choice's argument
    checks, which cost more than a GPU decode step's share of sampling (~20 us)."""
    cdf = np.cumsum(probs)
    cdf /= cdf[-1]
    return int(np.searchsorted(cdf, rng.random(), side="right"))


_BIG = np.finfo(np.float64).max / 4


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()
