"""`minfer quantize IN.gguf OUT.gguf TYPE`: what llama.cpp's llama-quantize does, with the
compiled core doing the arithmetic (`_core.quantize`, csrc/cpu/quantize.cpp).

This module only plans and writes:
- the plan: each tensor's output type, chosen by llama.cpp's rules (`llama_tensor_get_type`
  in src/llama-quant.cpp) for the file types below, with the same tensor order, the same
  per-role counters (attn_v, ffn_down), the same "more bits" layers and the same fallbacks
  for rows that are not a whole number of blocks;
- the file: the input's metadata copied byte for byte (general.quantization_version set to
  2 and general.file_type to llama.cpp's LLAMA_FTYPE value, both moved last as llama.cpp
  does; split.* keys dropped unless asked),
  tensors in llama.cpp's order, streamed in row chunks into a temporary file in the output's
  folder that is renamed over OUT only when complete.
"""

from __future__ import annotations

import mmap
import os
import re
import shutil
import struct
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT, GGUFValueType

from minfer.errors import GGUFError, MinferError
from minfer.io.gguf_file import GGUFFile

# llama.cpp's file types this tool makes: name -> (LLAMA_FTYPE value, default tensor type).
FTYPES: dict[str, tuple[int, QT]] = {
    "Q4_0": (2, QT.Q4_0), "Q4_1": (3, QT.Q4_1), "Q5_0": (8, QT.Q5_0), "Q5_1": (9, QT.Q5_1),
    "Q8_0": (7, QT.Q8_0), "Q4_K_S": (14, QT.Q4_K), "Q4_K_M": (15, QT.Q4_K), "Q5_K_S": (16, QT.Q5_K),
    "Q5_K_M": (17, QT.Q5_K), "Q6_K": (18, QT.Q6_K), "F16": (1, QT.F16), "BF16": (32, QT.BF16),
}
FTYPE_BY_VALUE = {v: k for k, (v, _) in FTYPES.items()}
# Tensor types the core writes (--output-type, --token-embedding-type).
TENSOR_TYPES: dict[str, QT] = {t.name: t for t in (
    QT.F32, QT.F16, QT.BF16, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K)}
FLOAT_TYPES = (QT.F32, QT.F16, QT.BF16)
# Types the core dequantizes itself; others go through gguf's NumPy dequantizers.
CORE_READS = frozenset((QT.F32, QT.F16, QT.BF16, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0,
                        QT.Q4_K, QT.Q5_K, QT.Q6_K))
GGML_QNT_VERSION = 2
SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")
# f32 elements converted per chunk (64 MiB of f32): bounds memory on any tensor size.
CHUNK_ELEMS = 16 << 20


def parse_ftype(name: str) -> str:
    """The canonical spelling of a TYPE argument, or ValueError (any case is accepted)."""
    u = name.strip().upper()
    if u not in FTYPES:
        raise ValueError(f"unknown quantization type {name!r}; choose one of {', '.join(FTYPES)}")
    return u


def parse_tensor_type(name: str, flag: str) -> QT:
    u = name.strip().upper()
    if u not in TENSOR_TYPES:
        raise ValueError(f"{flag} must be a tensor type, one of {', '.join(TENSOR_TYPES)}; not {name!r}")
    return TENSOR_TYPES[u]


def block_size(t: int) -> int:
    return GGML_QUANT_SIZES[QT(t)][0]


def tensor_nbytes(t: int, shape: Sequence[int]) -> int:
    bs, ts = GGML_QUANT_SIZES[QT(t)]
    n = 1
    for d in shape:
        n *= d
    return n // bs * ts


def is_quantized(t: int) -> bool:
    return QT(t) not in FLOAT_TYPES and QT(t) not in (QT.I8, QT.I16, QT.I32, QT.I64, QT.F64)


# ---- the plan: llama.cpp's rules ---------------------------------------------------------

_LAYER_RE = re.compile(r"^blk\.(\d+)")


def layer_of(name: str) -> int:
    """The N of 'blk.N.', or -1 (llama.cpp's sscanf("blk.%d."))."""
    m = _LAYER_RE.match(name)
    return int(m.group(1)) if m else -1


def llama_order(names: Iterable[str]) -> list[str]:
    """llama.cpp's tensor order (its weights_map comparer): tensors outside the blocks
    first, then block by block in layer number, by name within each."""
    return sorted(names, key=lambda n: (layer_of(n), n.encode()))


def category(name: str) -> str:
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for key, cat in (("attn_qkv.weight", "attn_qkv"), ("attn_kv_b.weight", "attn_kv_b"),
                     ("attn_v.weight", "attn_v"), ("attn_k.weight", "attn_k"), ("attn_q.weight", "attn_q"),
                     ("attn_output.weight", "attn_output"), ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"),
                     ("ffn_down", "ffn_down")):
        if key in name:
            return cat
    return "other"


def _is_attn_v(cat: str) -> bool:
    return cat in ("attn_v", "attn_qkv", "attn_kv_b")


def n_dims(shape: Sequence[int]) -> int:
    """ggml_n_dims: trailing dimensions of 1 do not count."""
    n = 1
    for i, d in enumerate(shape):
        if d > 1:
            n = i + 1
    return n


_NEVER_SUBSTR = (
    "_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel", "per_layer_model_proj",
    "ssm_conv1d", "shortconv.conv.weight", "indexer.k_proj.weight", "indexer.q_proj.weight",
    "time_mix_first.weight", "time_mix_w0.weight", "time_mix_w1.weight", "time_mix_w2.weight",
    "time_mix_v0.weight", "time_mix_v1.weight", "time_mix_v2.weight", "time_mix_a0.weight",
    "time_mix_a1.weight", "time_mix_a2.weight", "time_mix_g1.weight", "time_mix_g2.weight",
    "time_mix_decay_w1.weight", "time_mix_decay_w2.weight", "time_mix_lerp_fused.weight",
    "attn_rel_b.weight", ".position_embd", "sam.pos_embd", "sam.neck.", "sam.net_", ".rel_pos",
    ".patch_embd", ".patch_merger", "a.rvq.codebook", "mm.a.code_embd",
)


def allows_quantization(name: str, shape: Sequence[int]) -> bool:
    """llama.cpp's tensor_allows_quantization: 2-D and larger weights, not norms, not the
    small or special tensors it names."""
    if n_dims(shape) < 2 or not name.endswith("weight"):
        return False
    if name in ("position_embd.weight", "token_types.weight"):
        return False
    return not any(s in name for s in _NEVER_SUBSTR)


def _fallback(ncols: int, t: QT) -> tuple[QT, str]:
    """llama.cpp's tensor_type_fallback for rows that are not whole blocks."""
    bs = block_size(t)
    if ncols % bs == 0:
        return t, ""
    to = {QT.Q4_K: QT.Q5_0, QT.Q5_K: QT.Q5_1, QT.Q6_K: QT.Q8_0}.get(t, t)
    if ncols % block_size(to):
        to = QT.F16
    return to, f"{ncols} % {bs} != 0: {t.name} -> {to.name}"


@dataclass
class PlanEntry:
    name: str
    shape: tuple[int, ...]
    src: QT
    dst: QT
    note: str = ""

    @property
    def converts(self) -> bool:
        return self.src != self.dst

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes_in(self) -> int:
        return tensor_nbytes(self.src, self.shape)

    @property
    def nbytes_out(self) -> int:
        return tensor_nbytes(self.dst, self.shape)


@dataclass
class _State:
    ftype: str
    n_layer: int
    n_expert: int
    n_attention_wv: int
    has_tied_embeddings: bool
    arch: str
    is_70b: bool
    output_type: QT | None
    i_attention_wv: int = 0
    i_ffn_down: int = 0


def _use_more_bits(i_layer: int, n_layers: int) -> bool:
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def _layer_info(qs: _State, counter: int, name: str) -> tuple[int, int]:
    if qs.n_expert > 1:
        i = layer_of(name)
        if i < 0 or i >= qs.n_layer:
            raise MinferError(f"cannot tell the layer of expert tensor {name!r} (n_layer {qs.n_layer})")
        return i, qs.n_layer
    return counter, qs.n_layer


def _get_type_impl(qs: _State, new: QT, name: str, shape: Sequence[int], cat: str) -> QT:
    """llama_tensor_get_type_impl, for the file types of FTYPES."""
    ft = qs.ftype
    if cat == "output" or (qs.has_tied_embeddings and cat == "token_embd"):
        if qs.output_type is not None:
            return qs.output_type
        if qs.arch == "falcon" or shape[0] % block_size(new):
            return QT.Q8_0
        return new if new == QT.Q8_0 else QT.Q6_K
    if cat == "token_embd":
        return new  # --token-embedding-type was applied by the caller
    if _is_attn_v(cat):
        if ft in ("Q4_K_M", "Q5_K_M") and _use_more_bits(qs.i_attention_wv, qs.n_attention_wv):
            new = QT.Q6_K
        elif ft == "Q4_K_S" and qs.i_attention_wv < 4:
            new = QT.Q5_K
        if qs.is_70b and new == QT.Q4_K:  # 8 heads share attn_v: more bits cost little
            new = QT.Q5_K
        if qs.n_expert == 8:
            new = QT.Q8_0
        qs.i_attention_wv += 1
    elif cat == "attn_k":
        if qs.n_expert == 8:
            new = QT.Q8_0
    elif cat == "ffn_down":
        i_layer, n_layer = _layer_info(qs, qs.i_ffn_down, name)
        if ft == "Q4_K_M":
            if qs.arch == "falcon":
                new = (QT.Q6_K if i_layer < n_layer // 16 else
                       QT.Q5_K if _use_more_bits(i_layer, n_layer) else QT.Q4_K)
            elif _use_more_bits(i_layer, n_layer):
                new = QT.Q6_K
        elif ft == "Q5_K_M" and _use_more_bits(i_layer, n_layer):
            new = QT.Q6_K
        elif ft == "Q4_K_S" and qs.arch != "falcon" and i_layer < n_layer // 8:
            new = QT.Q5_K
        qs.i_ffn_down += 1
    elif cat == "attn_output":
        if qs.arch != "falcon" and qs.n_expert == 8 and ft in ("Q4_K_S", "Q4_K_M"):
            new = QT.Q5_K
    return new


def make_plan(
    tensors: Sequence[tuple[str, Sequence[int], int]],
    ftype: str,
    n_layer: int,
    *,
    arch: str = "",
    n_expert: int = 1,
    pure: bool = False,
    output_type: QT | None = None,
    token_embedding_type: QT | None = None,
    order: str = "llama.cpp",
) -> list[PlanEntry]:
    """Each tensor's output type, as llama_tensor_get_type picks it.

    `tensors`: (name, GGUF shape with ne0 first, current type) in file order. `order`:
    "llama.cpp" (what llama-quantize does today: its tensor map sorts by layer, then name;
    the attn_v / ffn_down counters follow that order) or "file" (the input's order, as
    llama.cpp counted before it sorted; the default model was made that way)."""
    ftype = parse_ftype(ftype)
    _, default = FTYPES[ftype]
    if order not in ("llama.cpp", "file"):
        raise ValueError(f"order must be 'llama.cpp' or 'file', not {order!r}")
    by_name = {n: (tuple(int(d) for d in s), QT(t)) for n, s, t in tensors}
    names = llama_order(by_name) if order == "llama.cpp" else [n for n, _, _ in tensors]
    qs = _State(
        ftype=ftype, n_layer=n_layer, n_expert=max(1, n_expert),
        n_attention_wv=sum(1 for n in names if _is_attn_v(category(n))),
        has_tied_embeddings=not any(category(n) == "output" for n in names),
        arch=arch, is_70b=n_layer == 80 and arch in ("llama", "qwen2"), output_type=output_type,
    )
    plan: list[PlanEntry] = []
    for name in names:
        shape, cur = by_name[name]
        cat = category(name)
        note = ""
        if not allows_quantization(name, shape):
            new = cur
        elif token_embedding_type is not None and cat == "token_embd":
            new, note = _fallback(shape[0], token_embedding_type)
        elif output_type is not None and cat == "output":
            new, note = _fallback(shape[0], output_type)
        else:
            new = default
            if new not in FLOAT_TYPES:
                if not pure:
                    new = _get_type_impl(qs, new, name, shape, cat)
                new, note = _fallback(shape[0], new)
        plan.append(PlanEntry(name, shape, cur, QT(new), note))
    return plan


def model_plan(gf: GGUFFile, ftype: str, **kw) -> list[PlanEntry]:
    """make_plan for an open GGUF file (n_layer, n_expert and arch from its metadata)."""
    arch = str(gf.get("general.architecture", "") or "")
    n_layer = gf.get(f"{arch}.block_count")
    if not isinstance(n_layer, int) or isinstance(n_layer, bool):
        n_layer = 1 + max((layer_of(n) for n in gf.tensors), default=-1)
    n_expert = gf.get(f"{arch}.expert_count", 1)
    n_expert = n_expert if isinstance(n_expert, int) and not isinstance(n_expert, bool) else 1
    tensors = [(t.name, t.shape, t.type) for t in gf.tensors.values()]
    return make_plan(tensors, ftype, n_layer, arch=arch, n_expert=n_expert, **kw)


# ---- metadata: raw KV copying -------------------------------------------------------------

_SCALAR_SIZE = {
    GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.UINT16: 2, GGUFValueType.INT16: 2,
    GGUFValueType.UINT32: 4, GGUFValueType.INT32: 4, GGUFValueType.FLOAT32: 4, GGUFValueType.BOOL: 1,
    GGUFValueType.UINT64: 8, GGUFValueType.INT64: 8, GGUFValueType.FLOAT64: 8,
}


def _skip_value(buf, pos: int, vtype: int) -> int:
    if vtype == GGUFValueType.STRING:
        (n,) = struct.unpack_from("<Q", buf, pos)
        return pos + 8 + n
    if vtype == GGUFValueType.ARRAY:
        etype, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if etype == GGUFValueType.STRING:
            unpack = struct.Struct("<Q").unpack_from
            for _ in range(count):
                (n,) = unpack(buf, pos)
                pos += 8 + n
            return pos
        if etype == GGUFValueType.ARRAY:
            for _ in range(count):
                pos = _skip_value(buf, pos, GGUFValueType.ARRAY)
            return pos
        return pos + count * _SCALAR_SIZE[GGUFValueType(etype)]
    return pos + _SCALAR_SIZE[GGUFValueType(vtype)]


def raw_metadata(path: Path) -> list[tuple[str, bytes]]:
    """(key, the KV pair's exact bytes) in file order. Call after GGUFFile.open accepted
    the file: its header has been bounds-checked."""
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        _, _, n_kv = struct.unpack_from("<IQQ", mm, 4)
        pos = 24
        out = []
        for _ in range(n_kv):
            start = pos
            (klen,) = struct.unpack_from("<Q", mm, pos)
            key = bytes(mm[pos + 8: pos + 8 + klen]).decode("utf-8")
            pos += 8 + klen
            (vtype,) = struct.unpack_from("<I", mm, pos)
            pos = _skip_value(mm, pos + 4, vtype)
            out.append((key, bytes(mm[start:pos])))
        return out
    finally:
        mm.close()


def _gguf_str(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _kv_u32(key: str, v: int) -> bytes:
    return _gguf_str(key) + struct.pack("<II", GGUFValueType.UINT32, v)


def output_metadata(raw: list[tuple[str, bytes]], ftype_value: int, keep_split: bool) -> list[tuple[str, bytes]]:
    """The input's KV pairs, then general.quantization_version and general.file_type (moved
    to the end as llama.cpp's gguf_set_val moves a key it sets), split.* dropped unless
    keep_split. With this order the whole file is byte for byte llama-quantize's."""
    out = [(k, b) for k, b in raw
           if k not in ("general.quantization_version", "general.file_type") and (keep_split or k not in SPLIT_KEYS)]
    out.append(("general.quantization_version", _kv_u32("general.quantization_version", GGML_QNT_VERSION)))
    out.append(("general.file_type", _kv_u32("general.file_type", ftype_value)))
    return out


# ---- conversion and writing ---------------------------------------------------------------


def _to_f32(raw: np.ndarray, src: QT, ne0: int, n_threads: int) -> np.ndarray:
    from minfer import _core

    if src == QT.F32:
        return raw.view(np.float32).reshape(-1, ne0)
    if src in CORE_READS:
        return _core.dequantize(int(src), raw, ne0, n_threads)
    import gguf

    bs, ts = GGML_QUANT_SIZES[src]
    return gguf.quants.dequantize(raw.reshape(-1, ne0 // bs * ts), src).reshape(-1, ne0).astype(np.float32)


def convert_tensor(data: np.ndarray, e: PlanEntry, n_threads: int, write: Callable[[object], None],
                   advance: Callable[[int], None] = lambda n: None) -> None:
    """Stream one tensor's output bytes to write(), CHUNK_ELEMS f32 values at a time."""
    from minfer import _core

    if not e.converts:
        step = 64 << 20
        for off in range(0, len(data), step):
            write(data[off: off + step])
        advance(e.n_elements)
        return
    ne0 = e.shape[0]
    rows = e.n_elements // ne0 if ne0 else 0
    in_row = tensor_nbytes(e.src, (ne0,))
    chunk = max(1, CHUNK_ELEMS // max(1, ne0))
    for r0 in range(0, rows, chunk):
        r1 = min(rows, r0 + chunk)
        x = _to_f32(data[r0 * in_row: r1 * in_row], e.src, ne0, n_threads)
        if e.dst == QT.F32:
            out = np.ascontiguousarray(x, dtype=np.float32)
        else:
            out = _core.quantize(int(e.dst), x, n_threads)
        write(memoryview(out).cast("B"))
        advance((r1 - r0) * ne0)


def _pad(n: int, align: int) -> int:
    return -n % align


def tensor_infos(plan: Sequence[PlanEntry], align: int) -> tuple[bytes, list[int]]:
    """The tensor-info section and each tensor's data offset (relative, aligned)."""
    parts, offsets, off = [], [], 0
    for e in plan:
        parts.append(_gguf_str(e.name) + struct.pack("<I", len(e.shape)) +
                     struct.pack(f"<{len(e.shape)}Q", *e.shape) + struct.pack("<IQ", int(e.dst), off))
        offsets.append(off)
        off += e.nbytes_out + _pad(e.nbytes_out, align)
    return b"".join(parts), offsets


@dataclass
class Result:
    plan: list[PlanEntry]
    seconds: float
    bytes_in: int
    bytes_out: int
    written: bool


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


def format_plan(plan: Sequence[PlanEntry]) -> list[str]:
    w = max((len(e.name) for e in plan), default=4)
    ws = max((len(str(list(e.shape))) for e in plan), default=5)
    lines = [f"{'#':>5}  {'tensor':<{w}}  {'shape':<{ws}}  {'from':>5} -> {'to':<5}  {'in':>10}  {'out':>10}  note"]
    for i, e in enumerate(plan, 1):
        how = e.note or ("" if e.converts else "copied")
        lines.append(f"{i:>5}  {e.name:<{w}}  {str(list(e.shape)):<{ws}}  {e.src.name:>5} -> {e.dst.name:<5}  "
                     f"{human(e.nbytes_in):>10}  {human(e.nbytes_out):>10}  {how}".rstrip())
    return lines


def _bpw(plan: Sequence[PlanEntry]) -> float:
    n = sum(e.n_elements for e in plan)
    return 8.0 * sum(e.nbytes_out for e in plan) / max(1, n)


def _default_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _warn(msg: str) -> None:
    sys.stderr.write(f"minfer: warning: {msg}\n")


def quantize_file(
    inp: str | os.PathLike,
    out: str | os.PathLike,
    ftype: str,
    *,
    n_threads: int | None = None,
    pure: bool = False,
    output_type: QT | None = None,
    token_embedding_type: QT | None = None,
    keep_split_metadata: bool = False,
    dry_run: bool = False,
    force: bool = False,
    progress: bool = True,
    echo: Callable[[str], None] = print,
) -> Result:
    """Quantize IN into OUT (see the module doc). Every failure is a MinferError and leaves
    no file behind (OUT is only ever replaced whole)."""
    ftype = parse_ftype(ftype)
    ftype_value, _ = FTYPES[ftype]
    inp, out = Path(inp), Path(out)
    n_threads = n_threads or _default_threads()
    if not dry_run:
        if out.exists() and out.is_dir():
            raise MinferError(f"output {out} is a directory")
        if inp.exists() and out.exists() and os.path.samefile(inp, out):
            raise MinferError(f"output {out} is the input file; write to another path")
        if out.exists() and not force:
            raise MinferError(f"output {out} already exists (use --force to overwrite it)")
        if not out.parent.is_dir():
            raise MinferError(f"output folder {out.parent} does not exist")

    gf = GGUFFile.open(inp)
    try:
        split_count = gf.get("split.count", 1)
        if isinstance(split_count, int) and split_count > 1:
            raise MinferError(f"{inp} is one shard of a {split_count}-file split model; merge the shards first "
                              "(llama-gguf-split --merge)")
        in_ftype = gf.get("general.file_type")
        if in_ftype == ftype_value:
            raise MinferError(f"{inp} is already {ftype} (general.file_type {in_ftype}); nothing to do")
        plan = model_plan(gf, ftype, pure=pure, output_type=output_type, token_embedding_type=token_embedding_type)
        if not any(e.converts for e in plan):
            raise MinferError(f"every tensor of {inp} already has its {ftype} type; nothing to do")
        requant = sorted({e.src.name for e in plan if e.converts and is_quantized(e.src)})
        if requant:
            _warn(f"{inp.name} holds quantized tensors ({', '.join(requant)}): they are dequantized and quantized "
                  f"again, which loses quality; quantize from the F16/BF16/F32 original when you have it")
        bytes_in = sum(e.nbytes_in for e in plan)
        bytes_out = sum(e.nbytes_out for e in plan)
        if dry_run:
            for line in format_plan(plan):
                echo(line)
            echo(f"dry run: {len(plan)} tensors, {sum(e.converts for e in plan)} converted; "
                 f"{human(bytes_in)} -> {human(bytes_out)} of tensor data ({_bpw(plan):.2f} bits/weight) as {ftype}; "
                 f"nothing written")
            return Result(plan, 0.0, bytes_in, bytes_out, False)

        raw_kv = raw_metadata(inp)
        kvs = output_metadata(raw_kv, ftype_value, keep_split_metadata)
        align = gf.alignment
        infos, _ = tensor_infos(plan, align)
        header = b"GGUF" + struct.pack("<IQQ", 3, len(plan), len(kvs)) + b"".join(b for _, b in kvs) + infos
        total = len(header) + _pad(len(header), align) + sum(e.nbytes_out + _pad(e.nbytes_out, align) for e in plan)
        try:
            free = shutil.disk_usage(out.parent).free
        except OSError:
            free = None
        if free is not None and free < total:
            raise MinferError(f"not enough space in {out.parent}: {out.name} needs {human(total)}, "
                              f"{human(free)} free")
        t0 = time.perf_counter()
        _write_atomic(out, lambda f: _write_body(f, gf, plan, header, align, n_threads, progress))
        dt = time.perf_counter() - t0
    finally:
        gf.close()

    for line in format_plan(plan):
        echo(line)
    n_conv = sum(e.converts for e in plan)
    echo(f"{ftype}: {n_conv} of {len(plan)} tensors converted, {human(bytes_in)} -> {human(total)} "
         f"({_bpw(plan):.2f} bits/weight) in {dt:.1f} s on {n_threads} threads -> {out}")
    return Result(plan, dt, bytes_in, total, True)


def _write_body(f, gf: GGUFFile, plan: Sequence[PlanEntry], header: bytes, align: int, n_threads: int,
                progress: bool) -> None:
    f.write(header)
    f.write(b"\0" * _pad(len(header), align))
    total = sum(e.n_elements for e in plan)
    with _Progress(total, progress) as bar:
        for e in plan:
            bar.describe(f"{e.name} {e.src.name}->{e.dst.name}")
            convert_tensor(gf.tensor_data(e.name), e, n_threads, f.write, bar.advance)
            f.write(b"\0" * _pad(e.nbytes_out, align))


def _write_atomic(out: Path, body: Callable) -> None:
    """body(file) into a temporary file beside OUT, fsync'd and renamed over OUT; on any
    failure (a full disk, Ctrl-C) the temporary file is removed and OUT is untouched."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".part", dir=out.parent)
    except OSError as e:
        raise MinferError(f"cannot create a file in {out.parent}: {e.strerror or e}") from None
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, "wb", buffering=1 << 20) as f:
            body(f)
            f.flush()
            os.fsync(f.fileno())
        # What we wrote must parse as GGUF before it replaces anything.
        GGUFFile.open(tmp).close()
        os.replace(tmp, out)
    except OSError as e:
        _unlink(tmp)
        raise MinferError(f"could not write {out}: {e.strerror or e}") from None
    except GGUFError as e:
        _unlink(tmp)
        raise MinferError(f"internal error: the written file does not parse: {e}") from None
    except BaseException:
        _unlink(tmp)
        raise


def _unlink(p: str) -> None:
    try:
        os.unlink(p)
    except OSError:
        pass


class _Progress:
    """A rich progress bar on stderr (only when stderr is a terminal and progress is on)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled = total, enabled and sys.stderr.isatty()
        self._p = None

    def __enter__(self) -> "_Progress":
        if self.enabled:
            from rich.console import Console
            from rich.progress import (BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn,
                                       TimeRemainingColumn)

            self._p = Progress(TextColumn("{task.description}", style="bold"), BarColumn(), TaskProgressColumn(),
                               TimeElapsedColumn(), TimeRemainingColumn(), console=Console(stderr=True),
                               transient=False)
            self._p.__enter__()
            self._task = self._p.add_task("quantize", total=self.total)
        return self

    def describe(self, text: str) -> None:
        if self._p is not None:
            self._p.update(self._task, description=f"{text:<48.48}")

    def advance(self, n: int) -> None:
        if self._p is not None:
            self._p.advance(self._task, n)

    def __exit__(self, *exc) -> None:
        if self._p is not None:
            self._p.__exit__(*exc)
