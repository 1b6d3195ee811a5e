"""Token sampling: greedy, temperature, top-k, top-p, min-p and repetition penalty.

The order of the filters follows llama.cpp's default chain (penalties, top-k, top-p,
min-p, temperature, draw) so the knobs mean what users of llama.cpp expect.
Everything is NumPy on one logits row; the cost is negligible beside a forward pass.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from minfer.errors import MinferError


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
        # The logits may be a read-only view of the engine's buffer: copy only when a
        # penalty has to edit them (the common greedy path reads them in place).
        logits = np.asarray(logits)
        if p.repeat_penalty != 1.0 and recent:
            logits = logits.astype(np.float64)
            ids = np.fromiter(set(recent), dtype=np.int64)
            vals = logits[ids]
            # llama.cpp's rule: shrink positive logits, grow negative ones.
            with np.errstate(over="ignore", under="ignore"):
                logits[ids] = np.where(vals > 0, vals / p.repeat_penalty, vals * p.repeat_penalty)
            # An extreme penalty can push a value past float64; keep them finite so the
            # softmax below never computes inf - inf.
            np.clip(logits, -_BIG, _BIG, out=logits)
        if p.temperature <= 0.0:
            return int(np.argmax(logits)), None

        cand = np.arange(logits.size)
        if 0 < p.top_k < logits.size:
            cand = np.argpartition(-logits, p.top_k - 1)[: p.top_k]
        order = cand[np.argsort(-logits[cand], kind="stable")]
        vals = logits[order].astype(np.float64)
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


_BIG = np.finfo(np.float64).max / 4


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()
