"""Perplexity as llama.cpp's perplexity tool computes it.

The text is tokenized once and cut into chunks of n_ctx tokens. Each chunk is one
forward from an empty KV (the first token replaced by BOS when the model adds one),
and only the second half of each chunk is scored: those predictions see at least
n_ctx/2 tokens of context, which is what makes numbers comparable across tools.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from minfer.errors import MinferError
from minfer.logits_check import check_logits_finite


@dataclass
class PerplexityResult:
    ppl: float
    stderr: float
    n_chunks: int
    n_scored: int
    chunk_ppls: list[float]


def _log_softmax_at(logits: np.ndarray, ids: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(x - m).sum(axis=1))
    return x[np.arange(len(ids)), ids] - lse


def run_perplexity(engine, text: str, n_ctx: int, max_chunks: int = 0,
                   out: Callable[[str], None] = print) -> PerplexityResult:
    if n_ctx < 8:
        raise MinferError(f"--ctx must be at least 8 for perplexity, got {n_ctx}")
    tok = engine.tokenizer
    tokens = tok.encode(text)
    n_chunks = len(tokens) // n_ctx
    if max_chunks > 0:
        n_chunks = min(n_chunks, max_chunks)
    if n_chunks == 0:
        raise MinferError(f"the text has {len(tokens)} tokens; perplexity needs at least --ctx={n_ctx}")
    first = n_ctx // 2
    nlls: list[np.ndarray] = []
    chunk_ppls: list[float] = []
    out(f"perplexity: {len(tokens)} tokens, {n_chunks} chunks of {n_ctx}, scoring the second half of each")
    for c in range(n_chunks):
        chunk = list(tokens[c * n_ctx:(c + 1) * n_ctx])
        if tok.add_bos and tok.bos_id is not None:
            chunk[0] = tok.bos_id
        engine.reset()
        # Logits only for the scored rows (positions first .. n_ctx-1), via the tail rows.
        logits = engine.forward(chunk, n_out=n_ctx - first)
        check_logits_finite(logits, c + 1, what="chunk")
        targets = np.asarray(chunk[first + 1:], dtype=np.int64)
        nll = -_log_softmax_at(logits[:-1], targets)
        nlls.append(nll)
        chunk_ppls.append(float(math.exp(nll.mean())))
        running = float(math.exp(np.concatenate(nlls).mean()))
        out(f"[{c + 1}]{running:.4f}")
    all_nll = np.concatenate(nlls)
    mean = float(all_nll.mean())
    ppl = math.exp(mean)
    # Delta method, as llama.cpp reports it: stderr(ppl) = ppl * stderr(mean nll).
    stderr = ppl * float(all_nll.std(ddof=1) / math.sqrt(all_nll.size)) if all_nll.size > 1 else 0.0
    out(f"Final estimate: PPL = {ppl:.4f} +/- {stderr:.5f}")
    return PerplexityResult(ppl, stderr, n_chunks, int(all_nll.size), chunk_ppls)
