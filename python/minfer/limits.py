"""Limits on sizes the user chooses, checked before anything is built: a context or a
thread count that cannot work is refused up front, never left to end in an overflow
or a livelock deep inside the core. (Memory: the allocator reserves the whole KV in one
go and refuses an impossible one naming its bytes, graph/alloc.py.)"""

from __future__ import annotations

import os

from minfer.errors import ContextError

# Positions are int32 in the graph.
MAX_CTX = (1 << 31) - 1


def logical_cpus() -> int:
    """CPUs this process may run on (SMT siblings count separately)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def check_context(n_cells: int) -> None:
    """Refuse a KV size (cells over all sequences) below 1 or beyond int32 positions."""
    if n_cells < 1:
        raise ContextError(f"the context must be >= 1 token (0 = the model's trained context), got {n_cells}")
    if n_cells > MAX_CTX:
        raise ContextError(f"a context of {n_cells} cells is beyond the {MAX_CTX} positions minfer supports")
