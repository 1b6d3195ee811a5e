"""Fuzz the GGUF header parser: whatever the bytes, GGUFFile.open either succeeds with
self-consistent results or raises GGUFError. Any other exception is a bug."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT, GGUFValueType as VT
from hypothesis import HealthCheck, given, settings, strategies as st

from minfer.errors import GGUFError
from minfer.io.gguf_file import GGUFFile

FUZZ = settings(
    max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None
)
INTERESTING = [0, 1, 2, 3, 4, 7, 8, 9, 12, 13, 31, 32, 33, 255, 256, 2**16, 2**31 - 1, 2**31,
               2**32 - 1, 2**32, 2**62, 2**63, 2**64 - 1]


def _base_bytes(tmp_dir) -> tuple[bytes, int]:
    path = tmp_dir / "base.gguf"
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "fuzz")
    w.add_key_value("f.u32", 7, VT.UINT32)
    w.add_key_value("f.str", "abc", VT.STRING)
    w.add_key_value("f.arr", [1, 2, 3], VT.ARRAY, VT.INT32)
    w.add_key_value("f.sarr", ["x", "yz"], VT.ARRAY, VT.STRING)
    w.add_key_value("f.f64", 2.5, VT.FLOAT64)
    w.add_tensor("a", rng.standard_normal((2, 4)).astype(np.float32))
    w.add_tensor("b", gguf.quants.quantize(rng.standard_normal((1, 32)).astype(np.float32), QT.Q8_0),
                 raw_dtype=QT.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = path.read_bytes()
    with GGUFFile.open(path) as g:
        header_end = g.data_offset
    return data, header_end


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    data, header_end = _base_bytes(d)
    return d / "case.gguf", data, header_end


def _check(path, data: bytes) -> None:
    path.write_bytes(data)
    try:
        g = GGUFFile.open(path)
    except GGUFError as e:
        assert str(e)  # a message, never an empty error
        return
    with g:
        assert g.version in (2, 3)
        assert g.data_offset <= len(data) or not g.tensors
        for name, t in g.tensors.items():
            assert t.offset + t.nbytes <= g.file_size
            assert t.offset % g.alignment == 0
            assert g.tensor_data(name).nbytes == t.nbytes
        for v in g.metadata.values():
            repr(v)


@FUZZ
@given(st.data())
def test_byte_flips(base, data):
    path, raw, header_end = base
    buf = bytearray(raw)
    n = data.draw(st.integers(1, 8))
    for _ in range(n):
        pos = data.draw(st.integers(0, header_end - 1))
        buf[pos] = data.draw(st.integers(0, 255))
    _check(path, bytes(buf))


@FUZZ
@given(st.data())
def test_field_overwrites(base, data):
    """Write an interesting 4- or 8-byte integer over a header position: counts,
    lengths, types and offsets are where parsers go wrong."""
    path, raw, header_end = base
    buf = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 3))):
        width = data.draw(st.sampled_from([4, 8]))
        pos = data.draw(st.integers(0, header_end - width))
        v = data.draw(st.sampled_from(INTERESTING)) % (1 << (8 * width))
        struct.pack_into("<I" if width == 4 else "<Q", buf, pos, v)
    _check(path, bytes(buf))


@FUZZ
@given(st.data())
def test_truncate_and_splice(base, data):
    path, raw, _ = base
    buf = bytearray(raw)
    op = data.draw(st.sampled_from(["truncate", "insert", "delete", "duplicate"]))
    pos = data.draw(st.integers(0, len(buf)))
    if op == "truncate":
        buf = buf[:pos]
    elif op == "insert":
        buf[pos:pos] = data.draw(st.binary(min_size=1, max_size=16))
    elif op == "delete":
        buf[pos : pos + data.draw(st.integers(1, 16))] = b""
    else:
        end = data.draw(st.integers(pos, min(len(buf), pos + 64)))
        buf[pos:pos] = buf[pos:end]
    _check(path, bytes(buf))


@FUZZ
@given(st.binary(max_size=96))
def test_random_headers(base, tail):
    """Valid magic and version followed by garbage."""
    path, _, _ = base
    _check(path, b"GGUF" + struct.pack("<I", 3) + tail)


def test_unmodified_base_opens(base):
    path, raw, _ = base
    path.write_bytes(raw)
    with GGUFFile.open(path) as g:
        assert list(g.tensors) == ["a", "b"] and g.metadata["f.sarr"] == ["x", "yz"]
