"""GGUFFile against files written by the independent `gguf` package, then every kind of
malformed input, each of which must be a GGUFError that says where the problem is."""

from __future__ import annotations

import io
import os
import struct

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT, GGUFValueType as VT
from rich.console import Console

from minfer.errors import GGUFError
from minfer.io.gguf_file import GGUFFile, TensorInfo

BIG = list(range(1000, 1100))  # 100 > NUMPY_ARRAY_MIN_LEN: comes back as numpy


def _tensors(rng):
    return {
        "alpha": rng.standard_normal((3, 8)).astype(np.float32),
        "beta": rng.standard_normal((2, 16)).astype(np.float16),
        "gamma": gguf.quants.quantize(rng.standard_normal((2, 64)).astype(np.float32), QT.Q8_0),
        "delta": gguf.quants.quantize(rng.standard_normal((1, 32)).astype(np.float32), QT.Q4_0),
    }


def write_sample(path, alignment: int | None = None):
    rng = np.random.default_rng(1)
    w = gguf.GGUFWriter(path, "testarch")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_name("sample")
    w.add_key_value("t.u8", 200, VT.UINT8)
    w.add_key_value("t.i8", -5, VT.INT8)
    w.add_key_value("t.u16", 60000, VT.UINT16)
    w.add_key_value("t.i16", -30000, VT.INT16)
    w.add_key_value("t.u32", 4_000_000_000, VT.UINT32)
    w.add_key_value("t.i32", -2_000_000_000, VT.INT32)
    w.add_key_value("t.f32", 0.5, VT.FLOAT32)
    w.add_key_value("t.bool", True, VT.BOOL)
    w.add_key_value("t.str", "héllo wörld", VT.STRING)
    w.add_key_value("t.u64", 2**63 + 7, VT.UINT64)
    w.add_key_value("t.i64", -(2**62), VT.INT64)
    w.add_key_value("t.f64", 1e-300, VT.FLOAT64)
    w.add_key_value("t.small_arr", [1, 2, 3], VT.ARRAY, VT.INT32)
    w.add_key_value("t.big_arr", BIG, VT.ARRAY, VT.INT32)
    w.add_key_value("t.float_arr", [0.25, -1.5], VT.ARRAY, VT.FLOAT32)
    w.add_key_value("t.str_arr", ["a", "", "Ġthe", "<|im_end|>"], VT.ARRAY, VT.STRING)
    tensors = _tensors(rng)
    for name, arr in tensors.items():
        if arr.dtype == np.uint8:
            w.add_tensor(name, arr, raw_dtype=QT.Q8_0 if name == "gamma" else QT.Q4_0)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


@pytest.fixture
def sample(tmp_path):
    path = tmp_path / "sample.gguf"
    tensors = write_sample(path)
    return path, tensors


# ---- round trip ---------------------------------------------------------------------


def test_metadata_round_trip(sample):
    path, _ = sample
    with GGUFFile.open(path) as g:
        assert g.version == 3
        assert g.architecture == "testarch"
        m = g.metadata
        assert m["general.name"] == "sample"
        assert m["t.u8"] == 200 and m["t.i8"] == -5
        assert m["t.u16"] == 60000 and m["t.i16"] == -30000
        assert m["t.u32"] == 4_000_000_000 and m["t.i32"] == -2_000_000_000
        assert m["t.f32"] == 0.5 and m["t.bool"] is True
        assert m["t.str"] == "héllo wörld"
        assert m["t.u64"] == 2**63 + 7 and m["t.i64"] == -(2**62)
        assert m["t.f64"] == 1e-300
        assert m["t.small_arr"] == [1, 2, 3]
        assert isinstance(m["t.big_arr"], np.ndarray) and m["t.big_arr"].tolist() == BIG
        assert m["t.float_arr"] == [0.25, -1.5]
        assert m["t.str_arr"] == ["a", "", "Ġthe", "<|im_end|>"]
        assert g.metadata_types["t.u8"] == VT.UINT8
        # cross-check every key against the gguf package's own reader
        ref = gguf.GGUFReader(path)
        ref_keys = {k for k in ref.fields if not k.startswith("GGUF.")}
        assert list(m) == [k for k in ref.fields if k in ref_keys]
        for k in ref_keys:
            want = ref.fields[k].contents()
            got = m[k].tolist() if isinstance(m[k], np.ndarray) else m[k]
            assert got == pytest.approx(want) if isinstance(want, float) else got == want, k


def test_tensor_infos_and_bytes_match_reference_reader(sample):
    path, tensors = sample
    ref = gguf.GGUFReader(path)
    with GGUFFile.open(path) as g:
        assert list(g.tensors) == ["alpha", "beta", "gamma", "delta"]
        assert g.file_size == os.path.getsize(path)
        assert g.data_offset % g.alignment == 0
        for rt in ref.tensors:
            t = g.tensors[rt.name]
            assert isinstance(t, TensorInfo)
            assert t.type == int(rt.tensor_type) and t.type_name == rt.tensor_type.name
            assert t.shape == tuple(int(d) for d in rt.shape)
            assert t.n_elements == rt.n_elements and t.nbytes == rt.n_bytes
            assert t.offset == rt.data_offset and t.offset % g.alignment == 0
            data = g.tensor_data(rt.name)
            assert data.dtype == np.uint8 and data.nbytes == t.nbytes
            assert data.tobytes() == tensors[rt.name].tobytes()
        assert g.tensors["alpha"].shape == (8, 3)
        assert g.tensors["gamma"].shape == (64, 2) and g.tensors["gamma"].type_name == "Q8_0"
        assert g.tensors["gamma"].row_nbytes == 34 * 2


def test_tensor_data_is_zero_copy_and_survives_close(sample):
    path, tensors = sample
    g = GGUFFile.open(path)
    view = g.tensor_data("alpha")
    assert not view.flags.owndata and not view.flags.writeable
    g.close()
    # the mapping stays alive while a view references it
    assert view.tobytes() == tensors["alpha"].tobytes()
    with pytest.raises(GGUFError, match="closed"):
        g.tensor_data("alpha")


def test_version_2_is_read(sample):
    path, _ = sample
    data = bytearray(path.read_bytes())
    struct.pack_into("<I", data, 4, 2)
    path.write_bytes(data)
    with GGUFFile.open(path) as g:
        assert g.version == 2 and g.metadata["t.u8"] == 200


def test_custom_alignment(tmp_path):
    path = tmp_path / "a.gguf"
    tensors = write_sample(path, alignment=64)
    with GGUFFile.open(path) as g:
        assert g.alignment == 64 and g.data_offset % 64 == 0
        for name, info in g.tensors.items():
            assert info.offset % 64 == 0
            assert g.tensor_data(name).tobytes() == tensors[name].tobytes()


def test_need_and_get(sample):
    path, _ = sample
    with GGUFFile.open(path) as g:
        assert g.get("nope", 7) == 7
        assert g.need("t.u32", int) == 4_000_000_000
        assert g.need("t.u32", float) == 4e9  # an int is an acceptable float
        with pytest.raises(GGUFError, match="'nope' is missing"):
            g.need("nope")
        with pytest.raises(GGUFError, match="should be int"):
            g.need("t.str", int)
        with pytest.raises(GGUFError, match="should be int"):
            g.need("t.bool", int)
        with pytest.raises(GGUFError, match="'zeta' not found"):
            g.tensor("zeta")
        assert g.arch_key("block_count") == "testarch.block_count"


# ---- malformed input -----------------------------------------------------------------


def _kv(data: bytes, key: str) -> tuple[int, int]:
    """(offset of the key's length field, offset of its value-type field)."""
    k = key.encode()
    i = data.index(struct.pack("<Q", len(k)) + k)
    return i, i + 8 + len(k)


def _tinfo(data: bytes, name: str) -> dict[str, int]:
    n = name.encode()
    i = data.index(struct.pack("<Q", len(n)) + n)
    nd_at = i + 8 + len(n)
    (n_dims,) = struct.unpack_from("<I", data, nd_at)
    type_at = nd_at + 4 + 8 * n_dims
    return {"start": i, "n_dims": nd_at, "dims": nd_at + 4, "type": type_at, "offset": type_at + 4}


def _mutated(path, fn) -> None:
    data = bytearray(path.read_bytes())
    out = fn(data)
    path.write_bytes(out if out is not None else data)


def _fails(path, *patterns: str) -> str:
    with pytest.raises(GGUFError) as ei:
        GGUFFile.open(path)
    msg = str(ei.value)
    for p in patterns:
        assert p in msg, f"{p!r} not in {msg!r}"
    return msg


def test_missing_path_and_directory(tmp_path):
    _fails(tmp_path / "absent.gguf", "cannot open")
    _fails(tmp_path, "directory")


def test_empty_file(tmp_path):
    p = tmp_path / "empty.gguf"
    p.write_bytes(b"")
    _fails(p, "truncated header")


def test_wrong_magic(sample):
    path, _ = sample
    _mutated(path, lambda d: d.__setitem__(slice(0, 4), b"GGML"))
    _fails(path, "magic at byte 0", "b'GGML'")


@pytest.mark.parametrize("version", [1, 4, 0x03000000])
def test_unsupported_version(sample, version):
    path, _ = sample
    _mutated(path, lambda d: struct.pack_into("<I", d, 4, version))
    msg = _fails(path, f"unsupported GGUF version {version}", "byte 4")
    assert ("big-endian" in msg) == (version == 0x03000000)


def test_truncated_header(sample):
    path, _ = sample
    _mutated(path, lambda d: d[:13])
    _fails(path, "truncated header (tensor count)", "at byte 8")


def test_truncated_metadata(sample):
    path, _ = sample
    data = path.read_bytes()
    _, vt = _kv(data, "t.str")
    path.write_bytes(data[: vt + 4 + 8 + 3])  # inside the string value
    _fails(path, "'t.str'", "byte")


def test_truncated_tensor_infos(sample):
    path, _ = sample
    data = path.read_bytes()
    ti = _tinfo(data, "gamma")
    path.write_bytes(data[: ti["type"] + 2])
    _fails(path, "truncated type of tensor 'gamma'", f"at byte {ti['type']}")


def test_truncated_tensor_data(sample):
    path, _ = sample
    with GGUFFile.open(path) as g:
        end = g.tensors["delta"].offset + g.tensors["delta"].nbytes
    _mutated(path, lambda d: d[: end - 5])  # the writer pads the tail; cut into the data
    _fails(path, "'delta'", "runs past the end of the file", "truncated")


def test_tensor_data_out_of_bounds(sample):
    path, _ = sample
    data = path.read_bytes()
    ti = _tinfo(data, "alpha")
    _mutated(path, lambda d: struct.pack_into("<Q", d, ti["offset"], 1 << 20))
    _fails(path, "'alpha'", "past the end of the file")


def test_misaligned_tensor_offset(sample):
    path, _ = sample
    data = path.read_bytes()
    ti = _tinfo(data, "beta")
    (off,) = struct.unpack_from("<Q", data, ti["offset"])
    _mutated(path, lambda d: struct.pack_into("<Q", d, ti["offset"], off + 4))
    _fails(path, "'beta'", f"data offset {off + 4}", "alignment 32")


@pytest.mark.parametrize("type_id", [4, 5, 99, 2**32 - 1])
def test_unknown_tensor_type(sample, type_id):
    path, _ = sample
    ti = _tinfo(path.read_bytes(), "alpha")
    _mutated(path, lambda d: struct.pack_into("<I", d, ti["type"], type_id))
    _fails(path, f"unknown type id {type_id}", f"byte {ti['type']}")


def test_row_not_multiple_of_block(sample):
    path, _ = sample
    ti = _tinfo(path.read_bytes(), "alpha")  # F32 with ne0 = 8
    _mutated(path, lambda d: struct.pack_into("<I", d, ti["type"], int(QT.Q8_0)))
    _fails(path, "'alpha'", "row length 8", "Q8_0 block size 32")


def test_too_many_dims(sample):
    path, _ = sample
    ti = _tinfo(path.read_bytes(), "alpha")
    _mutated(path, lambda d: struct.pack_into("<I", d, ti["n_dims"], 9))
    _fails(path, "9 dimensions")


def test_huge_tensor_shape(sample):
    path, _ = sample
    ti = _tinfo(path.read_bytes(), "alpha")
    _mutated(path, lambda d: struct.pack_into("<Q", d, ti["dims"] + 8, 2**62))
    _fails(path, "'alpha'", "more than the whole file")


def test_string_length_larger_than_file(sample):
    path, _ = sample
    i, _ = _kv(path.read_bytes(), "t.u8")
    _mutated(path, lambda d: struct.pack_into("<Q", d, i, 2**62))
    _fails(path, "metadata key", f"at byte {i}", str(2**62))


def test_string_value_length_larger_than_file(sample):
    path, _ = sample
    _, vt = _kv(path.read_bytes(), "t.str")
    _mutated(path, lambda d: struct.pack_into("<Q", d, vt + 4, 10**12))
    _fails(path, "string value of 't.str'", f"at byte {vt + 4}")


@pytest.mark.parametrize("key", ["t.big_arr", "t.str_arr"])
def test_array_length_larger_than_file(sample, key):
    path, _ = sample
    _, vt = _kv(path.read_bytes(), key)
    count_at = vt + 4 + 4
    _mutated(path, lambda d: struct.pack_into("<Q", d, count_at, 2**61))
    _fails(path, f"array {key!r}", f"at byte {count_at}", str(2**61))


def test_unknown_metadata_value_type(sample):
    path, _ = sample
    _, vt = _kv(path.read_bytes(), "t.i8")
    _mutated(path, lambda d: struct.pack_into("<I", d, vt, 13))
    _fails(path, "unknown metadata value type 13", f"at byte {vt}")


def test_unknown_array_element_type(sample):
    path, _ = sample
    _, vt = _kv(path.read_bytes(), "t.small_arr")
    _mutated(path, lambda d: struct.pack_into("<I", d, vt + 4, 77))
    _fails(path, "unknown metadata value type 77", "'t.small_arr'")


def test_nested_array_rejected(sample):
    path, _ = sample
    _, vt = _kv(path.read_bytes(), "t.small_arr")
    _mutated(path, lambda d: struct.pack_into("<I", d, vt + 4, int(VT.ARRAY)))
    _fails(path, "nested array", "'t.small_arr'")


def test_duplicate_tensor_name(sample):
    path, _ = sample
    ti = _tinfo(path.read_bytes(), "gamma")
    _mutated(path, lambda d: d.__setitem__(slice(ti["start"] + 8, ti["start"] + 13), b"alpha"))
    _fails(path, "duplicate tensor name 'alpha'", f"at byte {ti['start']}")


def test_duplicate_metadata_key(sample):
    path, _ = sample
    i, _ = _kv(path.read_bytes(), "t.u16")
    _mutated(path, lambda d: d.__setitem__(slice(i + 8, i + 13), b"t.i16"))
    msg = _fails(path, "duplicate metadata key")
    assert "'t.i16'" in msg or "'t.u16'" in msg


@pytest.mark.parametrize("field,at", [("tensor count", 8), ("metadata count", 16)])
def test_absurd_counts(sample, field, at):
    path, _ = sample
    _mutated(path, lambda d: struct.pack_into("<Q", d, at, 2**40))
    _fails(path, f"{field} {2**40}", "impossible")


def test_bad_alignment(tmp_path):
    path = tmp_path / "a.gguf"
    write_sample(path, alignment=64)
    _, vt = _kv(path.read_bytes(), "general.alignment")
    _mutated(path, lambda d: struct.pack_into("<I", d, vt + 4, 48))
    _fails(path, "general.alignment", "power of two")


def test_invalid_utf8_key(sample):
    path, _ = sample
    i, _ = _kv(path.read_bytes(), "t.u8")
    _mutated(path, lambda d: d.__setitem__(i + 8, 0xFF))
    _fails(path, "not valid UTF-8", f"at byte {i}")


# ---- `minfer info` rendering ----------------------------------------------------------


def _render(path, **kw) -> str:
    from minfer.tools.inspect import print_info

    buf = io.StringIO()
    print_info(path, console=Console(file=buf, width=200, color_system=None), **kw)
    return buf.getvalue()


def test_print_info_on_synthetic_model(tmp_path):
    from minfer.testing import write_model

    cfg = write_model(
        tmp_path / "m.gguf", n_layer=6, types={"attn_q": "Q8_0", "ffn_down": "Q4_0"}
    )
    out = _render(cfg.path)
    assert "qwen2" in out and "synthetic-qwen2" in out
    for key, val in [
        ("block_count", 6), ("embedding_length", 64), ("feed_forward_length", 128),
        ("head_count", 4), ("head_count_kv", 2), ("context_length", 256),
    ]:
        assert any(key in line and str(val) in line for line in out.splitlines()), key
    assert "gpt2" in out and "<|im_end|>" in out and "<|endoftext|>" in out
    assert f"{cfg.n_vocab}" in out  # vocab size
    assert "chat template" in out.lower()
    assert "token_embd.weight" in out and "blk.0.attn_q.weight" in out
    # middle layers elided by default, all listed with all_tensors
    assert "blk.3.ffn_up.weight" not in out
    full = _render(cfg.path, all_tensors=True)
    assert "blk.3.ffn_up.weight" in full
    # per-type histogram: 6 Q8_0 attn_q tensors, 6 Q4_0 ffn_down tensors
    hist = [line for line in out.splitlines() if line.strip("│ ").startswith(("Q8_0", "Q4_0"))]
    assert any("Q8_0" in line and " 6 " in line for line in hist), hist
    assert any("Q4_0" in line and " 6 " in line for line in hist), hist
    with GGUFFile.open(cfg.path) as g:
        n_params = sum(t.n_elements for t in g.tensors.values())
    assert f"{n_params:,}" in out


def test_print_info_bad_file_is_gguf_error(tmp_path):
    p = tmp_path / "bad.gguf"
    p.write_bytes(b"nope")
    with pytest.raises(GGUFError):
        _render(p)


def test_real_model_header(real_model_path):
    with GGUFFile.open(real_model_path) as g:
        assert g.architecture == "qwen2"
        assert g.need("qwen2.block_count", int) == 24
        assert g.need("qwen2.embedding_length", int) == 896
        assert len(g.metadata["tokenizer.ggml.tokens"]) == 151936
        assert len(g.tensors) == 291
        assert g.tensors["token_embd.weight"].shape == (896, 151936)
        assert {t.type_name for t in g.tensors.values()} == {"F32", "Q5_0", "Q8_0", "Q4_K", "Q6_K"}
    out = _render(real_model_path)
    assert "Qwen2.5 Coder 0.5B Instruct" in out and "151,936" in out


def test_print_info_without_tokenizer(tmp_path):
    from minfer.testing import write_model

    cfg = write_model(tmp_path / "n.gguf", with_tokenizer=False, tie_embeddings=True, n_layer=1)
    out = _render(cfg.path)
    assert "absent" in out  # no chat template
    names = {line.strip("│ ").split(" ")[0] for line in out.splitlines()}
    assert "output.weight" not in names and "blk.0.ffn_down.weight" in names
