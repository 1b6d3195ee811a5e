"""What the scheduler tests share: collecting what jobs emit (no HTTP), prompts, a mix
of sampling settings that covers every way a pick is made, and a model copy whose
embedding row for one token is NaN."""

from __future__ import annotations

import queue
from pathlib import Path

import numpy as np

from minfer.io.gguf_file import GGUFFile
from minfer.sampling import SamplingParams


def collect_events(q: queue.Queue, n_jobs: int, timeout: float = 120) -> list[dict]:
    """(job index, event) pairs from q until every job's final event: each job's token
    ids, text and final event. An error event fails the test with its message."""
    out = [{"ids": [], "text": "", "done": None} for _ in range(n_jobs)]
    left = n_jobs
    while left:
        k, ev = q.get(timeout=timeout)
        assert ev.kind != "error", ev.message
        out[k]["text"] += ev.text
        if ev.kind == "token":
            out[k]["ids"].append(ev.id)
        else:
            out[k]["done"] = ev
            left -= 1
    return out


def token_ids(seed: int, n: int) -> list[int]:
    """n random token ids (3..249) from a seed: a prompt of a fixed length."""
    return [int(t) for t in np.random.default_rng(seed).integers(3, 250, size=n)]


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, 250, size=int(rng.integers(5, 40)))] for _ in range(n)]


def pick_mix(p: list[list[int]]) -> list[tuple]:
    """(prompt, tokens, sampling) for 8 prompts: greedy, top-k alone, the CLI defaults,
    a penalty with top-k, greedy through the sampler (penalized), a penalty without
    history (its argmax), all filters with a penalty below 1, greedy again."""
    return [
        (p[0], 12, SamplingParams(temperature=0.0)),
        (p[0], 12, SamplingParams(temperature=1.5, top_k=40, top_p=1.0, min_p=0.0, seed=3)),
        (p[1], 10, SamplingParams(temperature=0.8, seed=5)),
        (p[2], 10, SamplingParams(temperature=1.0, top_k=5, top_p=1.0, min_p=0.0, repeat_penalty=1.3,
                                  repeat_last_n=16, seed=7)),
        (p[3], 9, SamplingParams(temperature=0.0, repeat_penalty=1.5)),
        (p[4], 8, SamplingParams(temperature=0.0, repeat_penalty=1.5, repeat_last_n=0)),
        (p[5], 11, SamplingParams(temperature=1.2, top_k=30, top_p=0.9, min_p=0.02, repeat_penalty=0.7, seed=9)),
        (p[6], 7, SamplingParams(temperature=0.0)),
    ]


def poison_token_row(src: Path, dst: Path, token: int, n_embd: int) -> Path:
    """A copy of the model at src whose (F32) embedding row of `token` is NaN: the
    logits after that token is fed are broken, nothing before."""
    dst.write_bytes(Path(src).read_bytes())
    with GGUFFile.open(dst) as g:
        t = g.tensors["token_embd.weight"]
        assert t.type_name == "F32"
        off = t.offset + token * n_embd * 4
    with open(dst, "r+b") as f:
        f.seek(off)
        f.write(np.full(n_embd, np.nan, np.float32).tobytes())
    return dst
