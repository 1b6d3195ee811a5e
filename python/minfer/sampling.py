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
        return int(ids[self.rng.choice(probs.size, p=probs)])

    def distribution(self, logits: np.ndarray, recent=None):
        """What `sample` draws from: (ids, probs) over the surviving candidates, or
        (argmax id, None) at temperature 0. `recent` replaces the penalty history (the
        speculative verifier scores a row as if the drafted tokens before it had been
        accepted)."""
        p = self.params
        recent = self.recent if recent is None else recent
        # The logits may be a read-only view of the engine's buffer: never edited in
        # place; the penalized values travel beside them.
        logits = np.asarray(logits)
        pen = None
        if p.repeat_penalty != 1.0 and recent:
            ids = np.fromiter(set(recent), dtype=np.int64)
            vals = logits[ids].astype(np.float64)
            # llama.cpp's rule: shrink positive logits, grow negative ones. An extreme
            # penalty can push a value past float64: kept finite so the softmax below
            # never computes inf - inf.
            with np.errstate(over="ignore", under="ignore"):
                vals = np.where(vals > 0, vals / p.repeat_penalty, vals * p.repeat_penalty)
            pen = (ids, np.clip(vals, -_BIG, _BIG))
        if p.temperature <= 0.0:
            if pen is None:
                return int(np.argmax(logits)), None
            order, _ = _best(logits, 1, pen)
            return int(order[0]), None

        n = logits.size
        if 0 < p.top_k < n:
            order, vals = _best(logits, p.top_k, pen)
            probs = _softmax(vals)
        else:
            order, vals, probs = _nucleus_prefix(logits, pen, p.top_p, p.min_p)
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


def _best(logits: np.ndarray, k: int, pen: tuple | None) -> tuple[np.ndarray, np.ndarray]:
    """The k best ids of a row and their values (float64), best first, equal values by
    id; with pen = (ids, values) the penalized values replace the row's at those ids (a
    penalty only lowers a value, so the k best are among the row's k + len(ids) best and
    the penalized ids)."""
    row = np.ascontiguousarray(logits, dtype=np.float32).reshape(-1)
    extra = 0 if pen is None else pen[0].size
    ids = _core.top_k(row, min(k + extra, row.size))
    if ids is None:  # a NaN or Inf in the row: the check words the error
        check_logits_finite(row, None)
        raise NumericsError("top_k flagged a row that checks finite")
    vals = row[ids].astype(np.float64)
    if pen is not None:
        # The penalized entries first, so unique() keeps their values for ids in both.
        ids, first = np.unique(np.concatenate([pen[0], ids]), return_index=True)
        vals = np.concatenate([pen[1], vals])[first]
        best = np.lexsort((ids, -vals))[:k]
        ids, vals = ids[best], vals[best]
    return ids, vals


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


_BIG = np.finfo(np.float64).max / 4


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()
