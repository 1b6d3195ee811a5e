"""The CUDA backend's weight-row layout (csrc/cuda/layout.h), which needs no GPU: the packing
is host code in every core. Each packed row is unpacked here by a NumPy reading of the
documented offsets and must give back the GGUF row's bytes exactly, with zero padding and
the documented row stride. (The kernels that read the layout are checked on the GPU
against float64: tests/test_cuda.py.)"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from minfer import _core

BLOCK = {Q.Q4_0: 18, Q.Q4_1: 20, Q.Q5_0: 22, Q.Q5_1: 24, Q.Q8_0: 34, Q.Q4_K: 144, Q.Q6_K: 210}


def _pad16(n: int) -> int:
    return (n + 15) // 16 * 16


def _unpack_legacy(qt, row: np.ndarray, nb: int) -> np.ndarray:
    """Quants (16 or 32 bytes a block), then Q5's qh (4 a block), then d (and m) per block."""
    qs_bytes = 32 if qt == Q.Q8_0 else 16
    high = qt in (Q.Q5_0, Q.Q5_1)
    sc_bytes = 4 if qt in (Q.Q4_1, Q.Q5_1) else 2
    sc_at = (qs_bytes + (4 if high else 0)) * nb
    out = []
    for c in range(nb):
        blk = [row[sc_at + sc_bytes * c: sc_at + sc_bytes * (c + 1)]]  # GGUF: d (and m) first
        if high:
            blk.append(row[qs_bytes * nb + 4 * c: qs_bytes * nb + 4 * c + 4])
        blk.append(row[qs_bytes * c: qs_bytes * (c + 1)])
        out.append(np.concatenate(blk))
    return np.concatenate(out)


def _group_half(u: int, i: int) -> int:
    """Unit u's half i in 8-unit groups of 256 bytes: a group's first halves, then its second."""
    return 256 * (u // 8) + 128 * i + 16 * (u % 8)


def _unpack_q4k(row: np.ndarray, ns: int) -> np.ndarray:
    out = []
    for s in range(ns):
        blk = [row[16 * s: 16 * s + 16]]  # d, dmin, 12 scale bytes
        for p in range(4):
            for i in range(2):
                at = 16 * ns + _group_half(4 * s + p, i)
                blk.append(row[at: at + 16])
        out.append(np.concatenate(blk))
    return np.concatenate(out)


def _unpack_q6k(row: np.ndarray, ns: int) -> np.ndarray:
    nsp = ns + ns % 2  # whole 8-unit groups
    out = []
    for s in range(ns):
        ql = [row[_group_half(4 * s + p, i): _group_half(4 * s + p, i) + 16] for p in range(4) for i in range(2)]
        qh = []
        for n in range(2):
            pair = 2 * s + n  # units 4s + 2n and 4s + 2n + 1 share 32 qh bytes; 4-pair groups of 128
            for i in range(2):
                at = 128 * nsp + 128 * (pair // 4) + 64 * i + 16 * (pair % 4)
                qh.append(row[at: at + 16])
        sc = row[192 * nsp + 16 * s: 192 * nsp + 16 * s + 16]
        d = row[192 * nsp + 16 * ns + 2 * s: 192 * nsp + 16 * ns + 2 * s + 2]
        out.append(np.concatenate(ql + qh + [sc, d]))
    return np.concatenate(out)


def _stride(qt, row_bytes: int, ns: int) -> int:
    if qt == Q.Q4_K:
        return 16 * ns + 128 * (ns + ns % 2)
    if qt == Q.Q6_K:
        return _pad16(192 * (ns + ns % 2) + 18 * ns)
    return _pad16(row_bytes)


CASES = ([(qt, d) for qt in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0) for d in (32, 224, 896, 4864)]
         + [(qt, 256 * ns) for qt in (Q.Q4_K, Q.Q6_K) for ns in (1, 2, 3, 14, 19, 74)])


@pytest.mark.parametrize("qt,in_dim", CASES, ids=lambda v: getattr(v, "name", str(v)))
def test_packed_rows_unpack_to_the_gguf_bytes(qt, in_dim):
    rows = 3
    per = in_dim // (256 if qt in (Q.Q4_K, Q.Q6_K) else 32)
    row_bytes = per * BLOCK[qt]
    raw = np.random.default_rng(in_dim * 31 + int(qt)).integers(0, 256, (rows, row_bytes), dtype=np.uint8)
    packed = _core.testing.cuda_pack_rows(int(qt), raw, rows, in_dim)
    assert packed.shape == (rows, _stride(qt, row_bytes, per))
    for r in range(rows):
        row = packed[r]
        if qt == Q.Q4_K:
            back = _unpack_q4k(row, per)
        elif qt == Q.Q6_K:
            back = _unpack_q6k(row, per)
        else:
            back = _unpack_legacy(qt, row, per)
        assert back.tobytes() == raw[r].tobytes(), f"{qt.name} {in_dim}: row {r} does not unpack to its bytes"
        # Everything the unpacking did not read is padding, and zero.
        assert int(row.astype(np.int64).sum()) == int(raw[r].astype(np.int64).sum()), "padding is not zero"


def test_unpacked_types_are_refused():
    with pytest.raises(ValueError, match="not a packed type"):
        _core.testing.cuda_pack_rows(int(Q.Q5_K), np.zeros((1, 176), np.uint8), 1, 256)
