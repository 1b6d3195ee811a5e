"""Where each sequence's KV cells live in a context's arena.

A context's arena has n_cells cells. Without a pool (n_cells = n_ctx * n_seq) sequence s
owns cells [s * n_ctx, (s + 1) * n_ctx) for good. With one (fewer cells than that), a
sequence holds one contiguous range sized to what it was admitted for (its prompt plus
its token budget), taken when it starts and kept while idle so its next turn reuses
the prefix; a sequence that needs more room grows in place, moves (its kept prefix
copied along), or takes the room of idle sequences, least recently used first. Cells of
a range are contiguous because attention reads each query's span [lo, hi) of cells.

A sequence may also borrow the KV of its first n positions from another's cells
(Context.lend: a shared prompt prefix read in place). Its range still covers those
positions, unwritten, so that when the lender is about to write over, move or forget
them (Context.keep_kv) the borrower's copy always has room.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Placement:
    """What reserving room for sequence `seq` takes: its new range, the idle sequences
    whose ranges it takes (to forget), and whether its kept cells move."""

    base: int
    cap: int
    evict: list
    moved: bool


def first_fit(ranges: list[tuple[int, int]], n_cells: int, need: int, skip: set) -> int | None:
    """The lowest base of `need` free cells, the ranges of sequences in `skip` counted
    free; None when there is none."""
    taken = sorted((b, b + c) for i, (b, c) in enumerate(ranges) if c > 0 and i not in skip)
    at = 0
    for lo, hi in taken:
        if lo - at >= need:
            return at
        at = max(at, hi)
    return at if n_cells - at >= need else None


def place(ranges: list[tuple[int, int]], n_cells: int, seq: int, need: int, keep: int,
          idle_lru: list[int]) -> Placement | None:
    """Room for `need` cells for sequence `seq`, whose first `keep` cells hold KV worth
    keeping. Tried in order: its own range if large enough; growing it in place; any
    free range (one that overlaps its own old range only when nothing is kept); then
    the same after forgetting idle sequences (idle_lru, least recently used first) one
    at a time. None when even every idle sequence's room would not do."""
    base, cap = ranges[seq]
    if cap >= need:
        return Placement(base, cap, [], False)
    evict: list[int] = []
    for k in range(len(idle_lru) + 1):
        skip = set(evict) | {seq}
        if cap > 0 and base + need <= n_cells and _free(ranges, skip, base + cap, base + need):
            return Placement(base, need, list(evict), False)
        # Kept cells are copied to the new range: it must not overlap the old one.
        at = first_fit(ranges, n_cells, need, skip if keep == 0 else set(evict))
        if at is not None:
            return Placement(at, need, list(evict), keep > 0 and at != base)
        if k < len(idle_lru):
            evict.append(idle_lru[k])
    return None


def _free(ranges: list[tuple[int, int]], skip: set, lo: int, hi: int) -> bool:
    """No range outside `skip` meets cells [lo, hi)."""
    return all(c == 0 or i in skip or b + c <= lo or b >= hi for i, (b, c) in enumerate(ranges))
