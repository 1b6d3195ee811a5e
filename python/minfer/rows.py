"""Logits rows left where a forward computed them, as the sampler reads a row.

A pick needs an id, or a sampler's few hundred candidates; reading a row back costs
n_vocab * 4 bytes (600 KB for a 152k vocabulary). These sources answer the sampler
(`Sampler.candidates`) from the device that holds the logits when it can select there,
and read the row back only when a filter needs the whole of it. Each answers exactly
as `sampling.HostRow` over the same row would: the plan decides what is read back,
never what is picked.
"""

from __future__ import annotations

import numpy as np

from minfer.errors import NumericsError
from minfer.logits_check import check_logits_finite
from minfer.sampling import HostRow, Sampler


class DeviceRow:
    """The one logits row of a context's last forward, left on the device that wrote it:
    the sampler's candidates (the best k, the penalized ids' values) come back from the
    device's selection in one call; a filter that needs the whole row (no top-k) reads it
    back. Same ids and values as HostRow on that row, so the same picks."""

    def __init__(self, ctx, step: int | None):
        self.ctx, self.step = ctx, step
        self.dev, self.buf, self.n, _ = ctx._out

    def argmax(self) -> int:
        return self.ctx.argmax_last(self.step)

    def takes(self, k: int) -> bool:
        return k <= getattr(self.dev, "top_k_max", 0)

    def best(self, k: int, ids: np.ndarray | None):
        gather = np.zeros((1, 0), dtype=np.int32) if ids is None else np.asarray(ids, dtype=np.int32).reshape(1, -1)
        got = self.dev.top_k_rows(self.buf, self.n, 1, k, gather)[0]
        if got is None:  # NaN or Inf in the row: the row words the error
            self.row()
            raise NumericsError(f"the device flagged non-finite logits (step {self.step}) that read back finite")
        top, vals, at = got
        return top, vals.astype(np.float64), None if ids is None else at.astype(np.float64)

    def row(self) -> np.ndarray:
        row = self.ctx.cache.alloc.host_view(self.ctx.cache.graph.outputs[0])[-1]
        check_logits_finite(row, self.step)
        return row


class DeviceRows:
    """Every logits row of a context's last forward (a batched step, one row per
    sequence), left on the device that wrote them, for the picks of all rows at once.
    Reading the rows back costs n_vocab * 4 bytes each (600 KB for a 152k vocabulary,
    per sequence per step) where a pick needs an int, or a sampler's few hundred
    candidates: the greedy rows' picks come from ONE argmax_rows call and the sampled
    rows' candidates from ONE top_k_rows call over the rows, each call made only when a
    row first asks for it. A device takes at most MAX_ROWS rows per call; the caller
    keeps to that (`usable`).

    One top_k_rows call serves every row, so what the sampled rows will ask is planned
    (`plan`) before any asks: k is the most candidates a planned row takes, and each
    row gathers its penalized ids. A request outside the plan, a filter that needs the
    whole row (no top-k) or a device without the calls reads the rows back (once a
    step), so the plan only decides what is read back, never what is picked: each row
    (`source`) answers as HostRow on that row would."""

    MAX_ROWS = 64  # rows one argmax_rows / top_k_rows call takes (kArgmaxMaxRows in csrc/cuda)

    def __init__(self, ctx):
        self.ctx = ctx
        self.dev, self.buf, self.n, self.rows = ctx._out
        self.on_device = self.rows <= self.MAX_ROWS and self.usable_device(self.dev)
        self.k_max = min(getattr(self.dev, "top_k_max", 0), self.n) if self.on_device else 0
        self.k = 0                     # candidates the one top_k_rows call selects per row
        self.gather: dict[int, np.ndarray] = {}  # row -> its penalized ids (int64)
        self._argmax = None            # argmax_rows' answers, once a row asked
        self._top = None               # top_k_rows' answers, once a row asked
        self._host = None              # the rows read back, once a row needed them

    @staticmethod
    def usable_device(dev) -> bool:
        return hasattr(dev, "argmax_rows") and hasattr(dev, "top_k_rows")

    @classmethod
    def usable(cls, ctx, rows: int) -> bool:
        """Whether a forward of `rows` logits rows can leave them on the device: its
        device (the last forward's; none before the first) picks in place."""
        return rows <= cls.MAX_ROWS and ctx._out is not None and cls.usable_device(ctx._out[0])

    def plan(self, r: int, sampler: Sampler) -> None:
        """Row r will be picked from by `sampler`: note the candidates its distribution
        will ask for (Sampler.distribution's rule). Before any row asks for candidates."""
        if not self.on_device:
            return
        k, pen = sampler.needs(self.n)
        if k <= 0:
            return                     # the argmax, or the whole row (read back)
        want = min(k + (0 if pen is None else pen.size), self.n)
        if want > self.k_max:
            return                     # more than one call selects: read back
        self.k = max(self.k, want)
        if pen is not None:
            self.gather[r] = pen

    def source(self, r: int, step: int | None) -> "BatchedRow":
        return BatchedRow(self, r, step)

    def argmax(self, r: int, step: int | None) -> int:
        if not self.on_device:
            return int(np.argmax(self.host_row(r, step)))
        if self._argmax is None:
            self._argmax = [int(t) for t in self.dev.argmax_rows(self.buf, self.n, self.rows)]
        t = self._argmax[r]
        if t < 0:
            self._broken(r, step)
        return t

    def takes(self, k: int) -> bool:
        return 0 < k <= self.k

    def best(self, r: int, k: int, ids: np.ndarray | None, step: int | None):
        if not self.takes(k):
            return HostRow(self.host_row(r, step)).best(k, ids)
        if self._top is None:
            g = max((v.size for v in self.gather.values()), default=0)
            gather = np.full((self.rows, g), -1, dtype=np.int32)
            for i, v in self.gather.items():
                gather[i, :v.size] = v
            self._top = self.dev.top_k_rows(self.buf, self.n, self.rows, self.k, gather)
        got = self._top[r]
        if got is None:
            self._broken(r, step)
        top, vals, at = got
        if k > top.size:               # planned after the call: more than it selected
            return HostRow(self.host_row(r, step)).best(k, ids)
        if ids is None:
            return top[:k], vals[:k].astype(np.float64), None
        # By id, not by position: the ids come as the sampler's set iterates them.
        mine = self.gather.get(r)
        where = {} if mine is None else {int(i): j for j, i in enumerate(mine)}
        pos = [where.get(int(i), -1) for i in ids]
        if min(pos, default=0) < 0:    # an id the plan did not gather
            return HostRow(self.host_row(r, step)).best(k, ids)
        return top[:k], vals[:k].astype(np.float64), at[pos].astype(np.float64)

    def host_row(self, r: int, step: int | None) -> np.ndarray:
        """Row r read back (all rows are, once), checked for NaN/Inf."""
        if self._host is None:
            self._host = self.ctx.cache.alloc.host_view(self.ctx.cache.graph.outputs[0])
        row = self._host[r]
        check_logits_finite(row, step)
        return row

    def _broken(self, r: int, step: int | None):
        """The device flagged NaN/Inf in row r: the row read back words the error."""
        self.host_row(r, step)
        raise NumericsError(f"the device flagged non-finite logits (step {step}) that read back finite")


class BatchedRow:
    """Row r of a DeviceRows, as Sampler.distribution reads a row (see HostRow); `step`
    names the decode step in a NumericsError."""

    def __init__(self, rows: DeviceRows, r: int, step: int | None):
        self.rows, self.r, self.step = rows, r, step
        self.n = rows.n

    def argmax(self) -> int:
        return self.rows.argmax(self.r, self.step)

    def takes(self, k: int) -> bool:
        return self.rows.takes(k)

    def best(self, k: int, ids: np.ndarray | None):
        return self.rows.best(self.r, k, ids, self.step)

    def row(self) -> np.ndarray:
        return self.rows.host_row(self.r, self.step)


