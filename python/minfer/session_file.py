"""Session files: a conversation's KV that outlives the process.

Layout (little-endian), version 1:

    b"MINFERKV"  u32 version  u32 header_len  header (JSON, UTF-8)
    token ids    int32 x n_tokens
    per layer:   K rows [0, n_tokens), then V rows [0, n_tokens), raw KV elements
    sha256 of everything above (32 bytes)

The header names what the rows mean: the model file's sha256, the graph parameters
that shape the KV (n_ctx, KV element type, per-layer row width), the number of
tokens, and an application `meta` object (`minfer chat` keeps its messages there).
Only the rows in use are stored, so the file grows with the conversation, not n_ctx.

Every refusal is one MinferError line: not a session file, a newer version, a
truncated or corrupted file (length, checksum), another model, KV type or context
size. Writes go to a temporary file in the same directory and are renamed over the
target (os.replace), so a crash mid-save leaves the previous good file in place.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import numpy as np

from minfer.errors import MinferError

MAGIC = b"MINFERKV"
VERSION = 1
_PRE = struct.Struct("<8sII")
_SUM = 32
KV_ELEMENT_BYTES = {"f32": 4, "f16": 2}


class SessionFileError(MinferError):
    """A session file cannot be used with this model and session."""


def model_sha256(model) -> str:
    """The model file's sha256, hashed once per Model (a strong identity: a file that
    merely has the same name or size is another model)."""
    h = getattr(model, "_sha256", None)
    if h is None:
        with open(model.path, "rb") as f:
            h = hashlib.file_digest(f, "sha256").hexdigest()
        model._sha256 = h
    return h


def kv_type_of(session) -> str:
    return str(getattr(session.context.cparams, "kv_type", "f32"))


def _kv_layers(session) -> list:
    """The session's KV regions by layer, allocated if no graph has run yet."""
    ctx = session.context
    alloc = ctx.cache.alloc
    if not alloc.kv:
        with ctx.lock:
            ctx.ensure_graph(ctx.params(1, 1))
    return [alloc.kv_pair(layer) for layer in sorted(alloc.kv)]


def save(session, path: str | Path, meta: dict | None = None) -> int:
    """Write the session's state to path atomically; returns the file size."""
    path = Path(path)
    regions = _kv_layers(session)
    alloc = session.context.cache.alloc
    if session.context.n_seq > 1:
        session.context.own_kv(session.seq)   # a prefix it reads in place, into its own cells
    n = session.n_past
    start = session.base
    header = {
        "model_sha256": model_sha256(session.model),
        "model_name": session.model_name,
        "n_layer": len(regions),
        "kv_dim": [r.kv_dim for r in regions],
        "n_ctx": session.n_ctx,
        "kv_type": kv_type_of(session),
        "n_tokens": n,
        "meta": meta or {},
    }
    hb = json.dumps(header, ensure_ascii=False).encode("utf-8")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    h = hashlib.sha256()
    try:
        with open(tmp, "wb") as f:
            def put(b) -> None:
                b = memoryview(b).cast("B")
                h.update(b)
                f.write(b)

            put(_PRE.pack(MAGIC, VERSION, len(hb)))
            put(hb)
            put(np.asarray(session.tokens, dtype="<i4").tobytes())
            for r in regions:
                k, v = alloc.read_kv_rows(r.layer, start, n)
                put(k)
                put(v)
            f.write(h.digest())
            f.flush()
            os.fsync(f.fileno())
        size = tmp.stat().st_size
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise SessionFileError(f"cannot write session file {path}: {e.strerror or e}") from None
    return size


def read(path: str | Path) -> tuple[dict, memoryview]:
    """(header, payload after the header) of a well-formed file; checks structure and
    checksum, not whether it fits a model."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise SessionFileError(f"cannot read session file {path}: {e.strerror or e}") from None
    if len(data) < _PRE.size and MAGIC.startswith(data[:len(MAGIC)]):
        raise SessionFileError(f"session file {path} is truncated")
    if data[:len(MAGIC)] != MAGIC:
        raise SessionFileError(f"{path} is not a minfer session file")
    if len(data) < _PRE.size:
        raise SessionFileError(f"session file {path} is truncated")
    _, version, hlen = _PRE.unpack_from(data)
    if version != VERSION:
        raise SessionFileError(f"session file {path} has format version {version}; this minfer reads {VERSION}")
    if len(data) < _PRE.size + hlen:
        raise SessionFileError(f"session file {path} is truncated")
    try:
        header = json.loads(bytes(data[_PRE.size:_PRE.size + hlen]).decode("utf-8"))
        n, kv_dims, elt = int(header["n_tokens"]), [int(x) for x in header["kv_dim"]], \
            KV_ELEMENT_BYTES[header["kv_type"]]
        int(header["n_ctx"]), str(header["model_sha256"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        raise SessionFileError(f"session file {path} is corrupted (bad header)") from None
    want = _PRE.size + hlen + 4 * n + sum(2 * n * d * elt for d in kv_dims) + _SUM
    if len(data) < want:
        raise SessionFileError(f"session file {path} is truncated ({len(data)} of {want} bytes)")
    if len(data) > want or hashlib.sha256(memoryview(data)[:-_SUM]).digest() != data[-_SUM:]:
        raise SessionFileError(f"session file {path} is corrupted (checksum mismatch)")
    return header, memoryview(data)[_PRE.size + hlen:-_SUM]


def restore(session, path: str | Path) -> dict:
    """Load a file into session (replacing its conversation); returns the meta object."""
    path = Path(path)
    header, payload = read(path)
    if header["model_sha256"] != model_sha256(session.model):
        raise SessionFileError(f"session file {path} was saved with another model "
                               f"({header.get('model_name', '?')}, sha256 {header['model_sha256'][:12]}...)")
    if header["kv_type"] != kv_type_of(session):
        raise SessionFileError(f"session file {path} holds a {header['kv_type']} KV; this session's KV is "
                               f"{kv_type_of(session)}")
    if int(header["n_ctx"]) != session.n_ctx:
        raise SessionFileError(f"session file {path} was saved with a context of {header['n_ctx']}; this session "
                               f"has {session.n_ctx} (use the same --ctx)")
    regions = _kv_layers(session)
    if [r.kv_dim for r in regions] != [int(x) for x in header["kv_dim"]]:
        raise SessionFileError(f"session file {path} has a KV shape this model does not have")
    n = int(header["n_tokens"])
    if n > session.n_ctx:
        raise SessionFileError(f"session file {path} holds {n} tokens, more than the context of {session.n_ctx}")
    if n > session.cap:
        raise SessionFileError(f"session file {path} holds {n} tokens; sequence {session.seq} has {session.cap} KV "
                               f"cells reserved")
    ids = np.frombuffer(payload[:4 * n], dtype="<i4")
    session.model.check_tokens(ids)
    alloc = session.context.cache.alloc
    session.reset()   # what other sequences read of its cells is theirs first
    start = session.base
    off = 4 * n
    elt = KV_ELEMENT_BYTES[header["kv_type"]]
    for r in regions:
        nb = n * r.kv_dim * elt
        alloc.write_kv_rows(r.layer, start, n, payload[off:off + nb], payload[off + nb:off + 2 * nb])
        off += 2 * nb
    session.tokens[:] = ids.tolist()
    return header.get("meta") or {}
