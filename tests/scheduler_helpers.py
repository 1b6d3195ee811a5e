"""Collecting what scheduler jobs emit, for the scheduler tests (no HTTP)."""

from __future__ import annotations

import queue


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
