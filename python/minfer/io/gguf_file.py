"""Open a GGUF (v2/v3) file by mmap and describe it without copying tensor data.

The header parser is our own rather than `gguf.GGUFReader` because a user's file is
untrusted input: every length and count is checked against the bytes that remain
*before* anything is allocated, and every failure is a GGUFError that names the byte
offset. Only the enum/size tables come from the `gguf` package.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from minfer.errors import GGUFError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# ggml tensors have at most 4 dimensions; anything more is corruption, not a model.
MAX_DIMS = 4
# Numeric arrays at least this long come back as numpy arrays (token types, scores);
# shorter ones as lists, which read naturally in metadata like rope sections.
NUMPY_ARRAY_MIN_LEN = 64

_SCALAR_FORMATS: dict[int, tuple[str, np.dtype]] = {
    GGUFValueType.UINT8: ("<B", np.dtype("<u1")),
    GGUFValueType.INT8: ("<b", np.dtype("<i1")),
    GGUFValueType.UINT16: ("<H", np.dtype("<u2")),
    GGUFValueType.INT16: ("<h", np.dtype("<i2")),
    GGUFValueType.UINT32: ("<I", np.dtype("<u4")),
    GGUFValueType.INT32: ("<i", np.dtype("<i4")),
    GGUFValueType.FLOAT32: ("<f", np.dtype("<f4")),
    GGUFValueType.BOOL: ("<?", np.dtype("<u1")),
    GGUFValueType.UINT64: ("<Q", np.dtype("<u8")),
    GGUFValueType.INT64: ("<q", np.dtype("<i8")),
    GGUFValueType.FLOAT64: ("<d", np.dtype("<f8")),
}
# Smallest encoding of one array element of each type, used to reject absurd counts.
_MIN_ELEM_SIZE = {t: struct.calcsize(f) for t, (f, _) in _SCALAR_FORMATS.items()}
_MIN_ELEM_SIZE[GGUFValueType.STRING] = 8
_MIN_ELEM_SIZE[GGUFValueType.ARRAY] = 12
# name length + n_dims + type + offset, with an empty name and zero dims.
_MIN_TENSOR_INFO_SIZE = 8 + 4 + 4 + 8
# key length + value type + a one-byte value.
_MIN_KV_SIZE = 8 + 4 + 1


def ggml_type_name(type_id: int) -> str:
    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        return f"type{type_id}"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type: int
    type_name: str
    shape: tuple[int, ...]  # GGUF order: ne0 (the contiguous row length) first
    n_elements: int
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def block_size(self) -> int:
        return GGML_QUANT_SIZES[GGMLQuantizationType(self.type)][0]

    @property
    def type_size(self) -> int:
        return GGML_QUANT_SIZES[GGMLQuantizationType(self.type)][1]

    @property
    def row_nbytes(self) -> int:
        return self.shape[0] // self.block_size * self.type_size if self.shape else self.type_size


class _Cursor:
    """Bounds-checked little-endian reads over the mapped bytes."""

    __slots__ = ("buf", "pos", "size")

    def __init__(self, buf, size: int) -> None:
        self.buf = buf
        self.pos = 0
        self.size = size

    @property
    def remaining(self) -> int:
        return self.size - self.pos

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise GGUFError(
                f"truncated {what} at byte {self.pos}: need {n} bytes, "
                f"only {self.size - self.pos} remain (file is {self.size} bytes)"
            )

    def scalar(self, fmt: str, n: int, what: str):
        self.need(n, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def u32(self, what: str) -> int:
        return self.scalar("<I", 4, what)

    def u64(self, what: str) -> int:
        return self.scalar("<Q", 8, what)

    def raw_string(self, what: str) -> tuple[int, bytes]:
        start = self.pos
        n = self.u64(f"{what} length")
        if n > self.size - self.pos:
            raise GGUFError(
                f"{what} at byte {start} claims {n} bytes but only "
                f"{self.size - self.pos} remain in the file"
            )
        b = self.buf[self.pos : self.pos + n]
        self.pos += n
        return start, b

    def name_string(self, what: str) -> str:
        start, b = self.raw_string(what)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(f"{what} at byte {start} is not valid UTF-8: {e}") from None

    def value_string(self, what: str) -> str:
        # Values (tokens especially) are displayed and tokenized, never used as keys;
        # a stray invalid byte should not make an otherwise good model unloadable.
        return self.raw_string(what)[1].decode("utf-8", errors="replace")


def _value_type(raw: int, at: int, what: str) -> GGUFValueType:
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise GGUFError(f"unknown metadata value type {raw} for {what} at byte {at}") from None


_U64 = struct.Struct("<Q")


def _string_array(cur: _Cursor, count: int, key: str) -> list[str]:
    """The hot path of opening a model (~300k vocabulary strings): the same checks as
    _Cursor.value_string, inlined."""
    buf, pos, size = cur.buf, cur.pos, cur.size
    unpack = _U64.unpack_from
    out: list[str] = [""] * count
    for i in range(count):
        if pos + 8 > size:
            cur.pos = pos
            cur.need(8, f"length of element {i} of {key!r}")
        (n,) = unpack(buf, pos)
        pos += 8
        if n > size - pos:
            raise GGUFError(
                f"element {i} of {key!r} at byte {pos - 8} claims {n} bytes but only "
                f"{size - pos} remain in the file"
            )
        out[i] = buf[pos : pos + n].decode("utf-8", errors="replace")
        pos += n
    cur.pos = pos
    return out


def _read_value(cur: _Cursor, vtype: GGUFValueType, key: str, depth: int = 0) -> Any:
    if vtype == GGUFValueType.STRING:
        return cur.value_string(f"string value of {key!r}")
    if vtype != GGUFValueType.ARRAY:
        fmt, _ = _SCALAR_FORMATS[vtype]
        return cur.scalar(fmt, _MIN_ELEM_SIZE[vtype], f"value of {key!r}")

    if depth > 0:
        # llama.cpp itself rejects nested arrays; refusing them bounds recursion too.
        raise GGUFError(f"nested array in metadata {key!r} at byte {cur.pos} is not supported")
    at = cur.pos
    etype = _value_type(cur.u32(f"array element type of {key!r}"), at, f"array {key!r}")
    count_at = cur.pos
    count = cur.u64(f"array length of {key!r}")
    min_size = _MIN_ELEM_SIZE[etype]
    if count * min_size > cur.remaining:
        raise GGUFError(
            f"array {key!r} at byte {count_at} claims {count} elements of type {etype.name} "
            f"(at least {count * min_size} bytes) but only {cur.remaining} bytes remain"
        )
    if etype == GGUFValueType.STRING:
        return _string_array(cur, count, key)
    if etype == GGUFValueType.ARRAY:
        return [_read_value(cur, etype, key, depth + 1) for _ in range(count)]
    _, dtype = _SCALAR_FORMATS[etype]
    nbytes = count * dtype.itemsize
    arr = np.frombuffer(cur.buf, dtype=dtype, count=count, offset=cur.pos).copy()
    cur.pos += nbytes
    if etype == GGUFValueType.BOOL:
        arr = arr.astype(bool)
    if count >= NUMPY_ARRAY_MIN_LEN:
        arr.flags.writeable = False
        return arr
    return arr.tolist()


class GGUFFile:
    """A parsed GGUF header plus a read-only mapping of the whole file.

    `tensor_data(name)` returns zero-copy uint8 views into the mapping; they stay
    valid after `close()` (the mapping is released when the last view goes away).
    """

    def __init__(self, path: Path, mm: mmap.mmap | None, size: int) -> None:
        self.path = path
        self.file_size = size
        self._mm = mm
        self._bytes = np.frombuffer(mm, dtype=np.uint8) if mm is not None else np.empty(0, np.uint8)
        self.version = 0
        self.alignment = DEFAULT_ALIGNMENT
        self.data_offset = 0
        self.metadata: dict[str, Any] = {}
        self.metadata_types: dict[str, GGUFValueType] = {}
        self.tensors: dict[str, TensorInfo] = {}

    # ---- construction -------------------------------------------------------------

    @classmethod
    def open(cls, path: str | os.PathLike) -> "GGUFFile":
        p = Path(path)
        try:
            with open(p, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        except IsADirectoryError:
            raise GGUFError(f"{p} is a directory, not a GGUF file") from None
        except OSError as e:
            raise GGUFError(f"cannot open GGUF file {p}: {e.strerror or e}") from None
        self = cls(p, mm, size)
        try:
            self._parse()
        except GGUFError as e:
            self.close()
            raise GGUFError(f"{p}: {e}") from None
        return self

    def _parse(self) -> None:
        cur = _Cursor(self._mm if self._mm is not None else b"", self.file_size)
        cur.need(4, "header (magic)")
        magic = bytes(cur.buf[0:4])
        if magic != GGUF_MAGIC:
            raise GGUFError(f"not a GGUF file: magic at byte 0 is {magic!r}, expected {GGUF_MAGIC!r}")
        cur.pos = 4
        version = cur.u32("header (version)")
        if version not in SUPPORTED_VERSIONS:
            hint = " (big-endian file?)" if version & 0xFFFF == 0 and version else ""
            raise GGUFError(
                f"unsupported GGUF version {version} at byte 4{hint}; supported: "
                + ", ".join(map(str, SUPPORTED_VERSIONS))
            )
        self.version = version
        count_at = cur.pos
        n_tensors = cur.u64("header (tensor count)")
        n_kv = cur.u64("header (metadata count)")
        if n_tensors * _MIN_TENSOR_INFO_SIZE > cur.remaining:
            raise GGUFError(
                f"tensor count {n_tensors} at byte {count_at} is impossible: the rest of the "
                f"file ({cur.remaining} bytes) cannot hold that many tensor infos"
            )
        if n_kv * _MIN_KV_SIZE > cur.remaining:
            raise GGUFError(
                f"metadata count {n_kv} at byte {count_at + 8} is impossible: the rest of the "
                f"file ({cur.remaining} bytes) cannot hold that many key/value pairs"
            )

        for _ in range(n_kv):
            at = cur.pos
            key = cur.name_string("metadata key")
            if key in self.metadata:
                raise GGUFError(f"duplicate metadata key {key!r} at byte {at}")
            t_at = cur.pos
            vtype = _value_type(cur.u32(f"value type of {key!r}"), t_at, repr(key))
            self.metadata[key] = _read_value(cur, vtype, key)
            self.metadata_types[key] = vtype

        align = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if (
            not isinstance(align, int)
            or isinstance(align, bool)
            or align <= 0
            or align & (align - 1)
        ):
            raise GGUFError(f"general.alignment must be a positive power of two, got {align!r}")
        self.alignment = align

        for _ in range(n_tensors):
            at = cur.pos
            name = cur.name_string("tensor name")
            if name in self.tensors:
                raise GGUFError(f"duplicate tensor name {name!r} at byte {at}")
            n_dims = cur.u32(f"dimension count of tensor {name!r}")
            if n_dims > MAX_DIMS:
                raise GGUFError(
                    f"tensor {name!r} at byte {at} has {n_dims} dimensions; at most {MAX_DIMS} allowed"
                )
            shape = tuple(cur.u64(f"dimensions of tensor {name!r}") for _ in range(n_dims))
            t_at = cur.pos
            ttype = cur.u32(f"type of tensor {name!r}")
            rel = cur.u64(f"data offset of tensor {name!r}")
            info = self._tensor_info(name, at, shape, ttype, t_at, rel)
            self.tensors[name] = info  # offsets finalised below, once data_offset is known

        self.data_offset = -(-cur.pos // self.alignment) * self.alignment
        if self.tensors and self.data_offset > self.file_size:
            raise GGUFError(
                f"truncated file: tensor data should start at byte {self.data_offset} "
                f"but the file is {self.file_size} bytes"
            )
        for name, info in list(self.tensors.items()):
            start = self.data_offset + info.offset
            end = start + info.nbytes
            if end > self.file_size:
                raise GGUFError(
                    f"tensor data of {name!r} ({info.type_name}, {info.nbytes} bytes at byte {start}) "
                    f"runs past the end of the file ({self.file_size} bytes): truncated tensor data "
                    f"or an out-of-bounds offset"
                )
            self.tensors[name] = TensorInfo(
                name, info.type, info.type_name, info.shape, info.n_elements, start, info.nbytes
            )
        self._check_no_overlap()

    def _check_no_overlap(self) -> None:
        # Two tensors sharing bytes would alias weights (a write-free engine would still
        # read one tensor's data as another's): no writer produces that, so refuse it.
        spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in self.tensors.values() if t.nbytes)
        for (s0, e0, n0), (s1, e1, n1) in zip(spans, spans[1:]):
            if s1 < e0:
                raise GGUFError(
                    f"tensor data of {n1!r} (bytes {s1}..{e1}) overlaps that of {n0!r} (bytes {s0}..{e0})"
                )

    def _tensor_info(
        self, name: str, at: int, shape: tuple[int, ...], ttype: int, t_at: int, rel: int
    ) -> TensorInfo:
        try:
            qtype = GGMLQuantizationType(ttype)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise GGUFError(f"tensor {name!r} has unknown type id {ttype} at byte {t_at}") from None
        n_elements = 1
        for d in shape:
            n_elements *= d
        row = shape[0] if shape else 1
        if row % block:
            raise GGUFError(
                f"tensor {name!r} at byte {at}: row length {row} is not a multiple of the "
                f"{qtype.name} block size {block}"
            )
        nbytes = n_elements // block * type_size
        if nbytes > self.file_size:
            raise GGUFError(
                f"tensor {name!r} at byte {at} (shape {list(shape)}, {qtype.name}) needs {nbytes} "
                f"bytes, more than the whole file ({self.file_size} bytes)"
            )
        if rel % self.alignment:
            raise GGUFError(
                f"tensor {name!r}: data offset {rel} (at byte {t_at + 4}) is not a multiple of "
                f"the alignment {self.alignment}"
            )
        # offset holds the *relative* offset until _parse knows where data starts.
        return TensorInfo(name, ttype, qtype.name, shape, n_elements, rel, nbytes)

    # ---- access -------------------------------------------------------------------

    @property
    def architecture(self) -> str:
        return self.need("general.architecture", str)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def need(self, key: str, kind: type | tuple[type, ...] | None = None) -> Any:
        """The value of a required metadata key, optionally type-checked."""
        if key not in self.metadata:
            raise GGUFError(f"{self.path}: required metadata key {key!r} is missing")
        v = self.metadata[key]
        if kind is not None:
            ok = isinstance(v, kind)
            # bool is an int subclass; a flag must not satisfy a count.
            if ok and isinstance(v, bool) and not (kind is bool or (isinstance(kind, tuple) and bool in kind)):
                ok = False
            if not ok and kind is float and isinstance(v, int) and not isinstance(v, bool):
                v, ok = float(v), True
            if not ok:
                want = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
                raise GGUFError(
                    f"{self.path}: metadata key {key!r} should be {want}, got {type(v).__name__} {v!r}"
                )
        return v

    def arch_key(self, suffix: str) -> str:
        """`<arch>.<suffix>`, the spelling of per-architecture hyper-parameters."""
        return f"{self.architecture}.{suffix}"

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(f"{self.path}: tensor {name!r} not found") from None

    def tensor_data(self, name: str) -> np.ndarray:
        """Zero-copy read-only uint8 view of the tensor's bytes."""
        info = self.tensor(name)
        if self._mm is None and info.nbytes:
            raise GGUFError(f"{self.path}: file is closed")
        return self._bytes[info.offset : info.offset + info.nbytes]

    # ---- lifetime -----------------------------------------------------------------

    def close(self) -> None:
        mm, self._mm = self._mm, None
        self._bytes = np.empty(0, np.uint8)
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                # Views handed out by tensor_data still reference the mapping; it is
                # unmapped when the last of them is garbage collected.
                pass

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"GGUFFile({str(self.path)!r}, v{self.version}, {len(self.metadata)} keys, "
            f"{len(self.tensors)} tensors)"
        )
