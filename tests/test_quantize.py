"""`minfer quantize` (python/minfer/tools/quantize.py, csrc/cpu/quantize.cpp).

- blocks: what _core.quantize writes dequantizes to the same values with the gguf
  package's NumPy dequantizers as with minfer's own kernels, bit for bit;
- reference: llama.cpp's ggml-quants.c, built from the llama-cpp-python sdist by
  tests/llama_quants_ref.py, makes the same bytes from the same floats (so the RMSE is
  the same too; the RMSE <= 1.02 x llama.cpp's bound is asserted as well), on normal,
  heavy-tailed and structured real-shaped tensors, with 1 and 2 threads;
- the type plan: llama.cpp's rules on the default model's tensor list (the file itself
  is llama.cpp's Q4_K_M of it: its stored types are the plan), against llama-quantize
  --dry-run of the same llama.cpp (tests/data/llama_quantize_plans.json, recorded by
  bench/quantize_bench.py --record-plans), and on small synthetic models;
- end to end through the CLI: an F32 synthetic model quantized, reopened, generating;
  the command-line contract (exit codes, one-line errors, nothing left behind).
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import gguf
from gguf import GGMLQuantizationType as QT

import llama_quants_ref as ref
from minfer import _core
from minfer.cli import main as cli_main
from minfer.io.gguf_file import GGUFFile
from minfer.testing import write_model
from minfer.tools import quantize as qz

BLOCK_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
ALL_TYPES = BLOCK_TYPES + ["F16", "BF16"]
KERNEL_TYPES = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F16"}
DATA = Path(__file__).parent / "data"


def _cols(t: str) -> int:
    # Real row lengths: Qwen2.5-0.5B's n_ff for 256-blocks, its n_embd for the rest.
    return 4864 if t.endswith("_K") else 896


def make_data(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "normal":
        return (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)
    if kind == "heavy":  # Student-t, df 2: occasional huge values inside a block
        return (rng.standard_t(2, (rows, cols)) * 0.01).astype(np.float32)
    if kind == "outliers":  # a few large outliers per row, row scales over 3 decades
        x = rng.standard_normal((rows, cols)) * 0.02
        x *= np.exp(rng.uniform(-3.5, 3.5, (rows, 1)))
        idx = rng.integers(0, cols, (rows, 3))
        np.put_along_axis(x, idx, rng.choice([-1, 1], (rows, 3)) * rng.uniform(5, 40, (rows, 3)) * 0.02, 1)
        return x.astype(np.float32)
    if kind == "structured":  # zero rows/blocks, constant runs, positive-only, tiny values
        x = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
        x[0] = 0
        x[1, :256] = 0.25
        x[2] = np.abs(x[2])
        x[3] = -np.abs(x[3])
        x[4] *= 1e-20
        x[5, ::2] = 0
        x[6] = np.round(x[6] * 40) / 40  # already on a grid
        x[7, 32:64] = 3.0
        return x
    if kind == "blocks":  # every 16/32-element group drawn differently (the K-quants search
        # eight sub-blocks side by side: lanes must not leak into each other)
        x = np.empty((rows, cols), np.float32)
        g = x.reshape(-1, 16)
        pick = rng.integers(0, 7, len(g))
        for i, p in enumerate(pick):
            if p == 0:
                g[i] = rng.standard_normal(16) * 10.0 ** rng.uniform(-4, 1)
            elif p == 1:
                g[i] = rng.integers(-3, 4, 16) * 0.01  # few distinct values
            elif p == 2:
                g[i] = -abs(rng.standard_normal()) * 0.05  # one negative constant
            elif p == 3:
                g[i] = abs(rng.standard_normal()) * 0.05  # one positive constant
            elif p == 4:
                g[i] = np.abs(rng.standard_normal(16)) * 0.03
            elif p == 5:
                g[i] = 0.0
            else:
                g[i] = rng.standard_t(1, 16) * 0.01  # Cauchy
        return x
    raise ValueError(kind)


KINDS = ["normal", "heavy", "outliers", "structured", "blocks"]


# ---- blocks: gguf's dequantization == minfer's, bitwise ----------------------------------


@pytest.mark.parametrize("t", ALL_TYPES)
def test_gguf_and_minfer_dequantize_our_blocks_identically(t):
    x = make_data("outliers", 16, _cols(t), 1)
    raw = _core.quantize(t, x, 2)
    qt = QT[t]
    via_gguf = gguf.quants.dequantize(raw, qt).reshape(x.shape).astype(np.float32)
    if t in KERNEL_TYPES:  # the matmul kernels' dequantizer (as tests/test_quant_kernels.py uses)
        via_minfer = np.stack([_core.testing.dequantize_row(int(qt), np.ascontiguousarray(r), x.shape[1]) for r in raw])
    else:  # BF16 is no kernel weight type: the quantize module's own reader
        via_minfer = _core.dequantize(t, raw, x.shape[1], 2)
    assert np.array_equal(via_gguf.view(np.uint32), via_minfer.view(np.uint32))
    # and the round trip is a quantization of x, not garbage
    assert np.sqrt(np.mean((via_gguf - x) ** 2)) < 0.2 * np.sqrt(np.mean(x ** 2)) + 1e-30


@pytest.mark.parametrize("t", ALL_TYPES)
def test_dequantize_binding_matches_kernels(t):
    x = make_data("normal", 8, _cols(t), 2)
    raw = _core.quantize(t, x, 1)
    got = _core.dequantize(t, raw, x.shape[1], 2)
    want = gguf.quants.dequantize(raw, QT[t]).reshape(x.shape).astype(np.float32)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


# ---- the reference: llama.cpp's ggml-quants.c ------------------------------------------


def rmse(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sqrt(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("t", ALL_TYPES)
def test_same_bytes_and_error_as_llama_cpp(t, kind):
    x = make_data(kind, 64, _cols(t), 100 + ALL_TYPES.index(t))
    ours = _core.quantize(t, x, 2)
    theirs = ref.quantize(t, x)
    assert ours.shape == theirs.shape
    n_diff = int(np.count_nonzero(ours != theirs))
    assert n_diff == 0, f"{t}/{kind}: {n_diff} bytes differ from llama.cpp's"
    assert np.array_equal(_core.quantize(t, x, 1), ours)  # threads do not change a byte
    e_ours = rmse(gguf.quants.dequantize(ours, QT[t]).reshape(x.shape), x)
    e_ref = rmse(gguf.quants.dequantize(theirs, QT[t]).reshape(x.shape), x)
    assert e_ours <= 1.02 * e_ref + 1e-30


@pytest.mark.parametrize("t", BLOCK_TYPES)
def test_llama_cpp_dequantizes_our_blocks(t):
    # The reference library's own dequantizer reads our blocks as gguf does.
    x = make_data("heavy", 8, _cols(t), 7)
    raw = _core.quantize(t, x, 1)
    a = ref.dequantize(t, raw, x.shape[1])
    b = gguf.quants.dequantize(raw, QT[t]).reshape(x.shape).astype(np.float32)
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_quantize_rejects_bad_shapes_and_types():
    with pytest.raises(ValueError, match="block size"):
        _core.quantize("Q4_K", np.zeros((2, 896), np.float32), 1)
    with pytest.raises(ValueError, match="unknown tensor type"):
        _core.quantize("Q3_X", np.zeros((2, 256), np.float32), 1)
    with pytest.raises(ValueError, match="2-D"):
        _core.quantize("Q8_0", np.zeros(256, np.float32), 1)
    with pytest.raises(ValueError, match="whole number"):
        _core.dequantize("Q8_0", np.zeros(35, np.uint8), 32, 1)


# ---- the type plan --------------------------------------------------------------------------


def _as_f16(gf: GGUFFile):
    """The tensor list of a model as its F16 original had it: 2-D weights F16."""
    return [(t.name, t.shape, QT.F16 if len(t.shape) > 1 else QT.F32) for t in gf.tensors.values()]


def test_plan_reproduces_the_default_models_own_q4_k_m(real_model_path):
    # The default model is llama.cpp's Q4_K_M of an F16 file whose tensors were in this
    # order; the llama.cpp that made it counted attn_v / ffn_down in file order.
    with GGUFFile.open(real_model_path) as gf:
        n_layer = gf.get("qwen2.block_count")
        stored = {t.name: QT(t.type) for t in gf.tensors.values()}
        plan = qz.make_plan(_as_f16(gf), "Q4_K_M", n_layer, arch="qwen2", order="file")
    got = {e.name: e.dst for e in plan}
    assert got == stored
    # the more-bits layers really are a mix here (not a constant that would pass anyway)
    assert {stored[f"blk.{i}.ffn_down.weight"] for i in range(n_layer)} == {QT.Q4_K, QT.Q6_K}


def _recorded_plans():
    p = DATA / "llama_quantize_plans.json"
    return json.loads(p.read_text())


@pytest.mark.parametrize("ftype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M",
                                   "Q6_K", "F16", "BF16"])
def test_plan_matches_llama_quantize_dry_run(real_model_path, ftype):
    want = [tuple(x) for x in _recorded_plans()["plans"][ftype]]
    with GGUFFile.open(real_model_path) as gf:
        plan = qz.make_plan(_as_f16(gf), ftype, gf.get("qwen2.block_count"), arch="qwen2")
    # llama-quantize ran on the F16 file of the default model (bench/quantize_bench.py):
    # same tensors, same order, same type for each
    assert [(e.name, e.dst.name) for e in plan] == want


def _synth_names(n_layer: int, tied: bool) -> list[tuple[str, tuple[int, ...], QT]]:
    t = [("token_embd.weight", (256, 1000), QT.F32), ("output_norm.weight", (256,), QT.F32)]
    if not tied:
        t.append(("output.weight", (256, 1000), QT.F32))
    for i in range(n_layer):
        for role, shape in (("attn_norm", (256,)), ("attn_q", (256, 256)), ("attn_k", (256, 128)),
                            ("attn_v", (256, 128)), ("attn_output", (256, 256)), ("ffn_norm", (256,)),
                            ("ffn_gate", (256, 512)), ("ffn_up", (256, 512)), ("ffn_down", (512, 256))):
            t.append((f"blk.{i}.{role}.weight", shape, QT.F32))
    return t


# use_more_bits(i, 16): i < 2, i >= 14, (i - 2) % 3 == 2  ->  0 1 4 7 10 13 14 15
MORE_BITS_16 = {0, 1, 4, 7, 10, 13, 14, 15}


@pytest.mark.parametrize("ftype", ["Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M"])
@pytest.mark.parametrize("tied", [False, True])
def test_plan_rules_on_a_synthetic_tensor_list(ftype, tied):
    plan = {e.name: e.dst for e in qz.make_plan(_synth_names(16, tied), ftype, 16, arch="qwen2")}
    base = QT.Q4_K if ftype.startswith("Q4") else QT.Q5_K
    for i in range(16):
        v, d = plan[f"blk.{i}.attn_v.weight"], plan[f"blk.{i}.ffn_down.weight"]
        if ftype.endswith("_M"):
            assert v == d == (QT.Q6_K if i in MORE_BITS_16 else base), i
        elif ftype == "Q4_K_S":
            assert v == (QT.Q5_K if i < 4 else QT.Q4_K) and d == (QT.Q5_K if i < 2 else QT.Q4_K), i
        else:
            assert v == d == base
        for role in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            assert plan[f"blk.{i}.{role}.weight"] == base
        assert plan[f"blk.{i}.attn_norm.weight"] == QT.F32
    if tied:  # no output.weight: the embedding doubles as output and gets its type
        assert plan["token_embd.weight"] == QT.Q6_K
    else:
        assert plan["output.weight"] == QT.Q6_K and plan["token_embd.weight"] == base
    assert plan["output_norm.weight"] == QT.F32


def test_plan_fallbacks_pure_and_overrides():
    names = _synth_names(2, False) + [("blk.0.odd.weight", (96, 8), QT.F32), ("blk.1.weird.weight", (40, 8), QT.F32)]
    plan = {e.name: e for e in qz.make_plan(names, "Q4_K_M", 2)}
    assert plan["blk.0.odd.weight"].dst == QT.Q5_0 and "96 % 256" in plan["blk.0.odd.weight"].note
    assert plan["blk.1.weird.weight"].dst == QT.F16  # 40 is not even whole 32-blocks
    pure = {e.name: e.dst for e in qz.make_plan(names, "Q4_K_M", 2, pure=True)}
    assert all(t == QT.Q4_K for n, t in pure.items() if n.endswith(("attn_v.weight", "ffn_down.weight", "output.weight")))
    assert pure["blk.0.odd.weight"] == QT.Q5_0
    over = {e.name: e.dst for e in qz.make_plan(names, "Q4_K_M", 2, output_type=QT.Q8_0,
                                                token_embedding_type=QT.F16)}
    assert over["output.weight"] == QT.Q8_0 and over["token_embd.weight"] == QT.F16
    q8 = {e.name: e.dst for e in qz.make_plan(names, "Q8_0", 2)}
    assert q8["output.weight"] == QT.Q8_0 and q8["blk.1.weird.weight"] == QT.F16


# ---- end to end through the CLI ------------------------------------------------------------


def _cli(args, capsys):
    rc = cli_main([str(a) for a in args])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


@pytest.fixture(scope="module")
def synth_f32(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("qsynth") / "f32.gguf"
    write_model(p, n_layer=8, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, seed=3)
    return p


@pytest.mark.parametrize("ftype", ["Q4_K_M", "Q5_K_S", "Q8_0", "BF16"])
def test_cli_quantizes_a_synthetic_model_end_to_end(synth_f32, tmp_path, capsys, ftype):
    out = tmp_path / f"m-{ftype}.gguf"
    rc, stdout, err = _cli(["quantize", synth_f32, out, ftype, "-t", "2"], capsys)
    assert rc == 0, err
    assert err == ""
    assert f"-> {out}" in stdout.splitlines()[-1]
    with GGUFFile.open(synth_f32) as gin, GGUFFile.open(out) as gout:
        n_layer = gin.get("qwen2.block_count")
        plan = qz.model_plan(gin, ftype)
        assert list(gout.tensors) == [e.name for e in plan]
        for e in plan:
            info = gout.tensors[e.name]
            assert info.type == e.dst and info.shape == e.shape
            src = gin.tensor_data(e.name).view(np.float32).reshape(-1, e.shape[0])
            want = ref.quantize(e.dst.name, src) if e.dst != QT.F32 else src.view(np.uint8)
            assert np.array_equal(gout.tensor_data(e.name), want.reshape(-1)), e.name
        # metadata: copied, with llama.cpp's file type
        assert gout.get("general.file_type") == qz.FTYPES[ftype][0]
        assert gout.get("general.quantization_version") == 2
        # llama.cpp's gguf_set_val moves the keys it sets to the end, in this order
        assert list(gout.metadata)[-2:] == ["general.quantization_version", "general.file_type"]
        for k, v in gin.metadata.items():
            if k not in ("general.file_type", "general.quantization_version"):
                assert np.array_equal(np.asarray(gout.metadata[k]), np.asarray(v)), k
                assert gout.metadata_types[k] == gin.metadata_types[k], k
    if ftype == "Q4_K_M":
        types = {e.name: e.dst for e in plan}
        assert {types[f"blk.{i}.ffn_down.weight"] for i in range(n_layer)} == {QT.Q4_K, QT.Q6_K}
    if ftype != "BF16":  # minfer's kernels do not run BF16 weights
        import minfer

        llm = minfer.load(out, threads=2, n_ctx=64)
        c = llm.generate("the cat", max_tokens=6, temperature=0)
        assert len(c.ids) >= 1 and c.finish_reason in ("length", "eos")


def test_cli_dry_run_prints_the_plan_and_writes_nothing(synth_f32, tmp_path, capsys):
    out = tmp_path / "never.gguf"
    rc, stdout, err = _cli(["quantize", synth_f32, out, "Q4_K_M", "--dry-run"], capsys)
    assert rc == 0, err
    assert not out.exists() and list(tmp_path.iterdir()) == []
    lines = stdout.splitlines()
    assert "blk.0.ffn_down.weight" in stdout and "F32 -> Q6_K" in stdout
    assert lines[-1].startswith("dry run:") and "nothing written" in lines[-1]


def test_cli_requantizes_with_a_warning(synth_f32, tmp_path, capsys):
    q8 = tmp_path / "q8.gguf"
    assert _cli(["quantize", synth_f32, q8, "Q8_0"], capsys)[0] == 0
    out = tmp_path / "q4.gguf"
    rc, _, err = _cli(["quantize", q8, out, "Q4_K_M"], capsys)
    assert rc == 0
    warn = [ln for ln in err.splitlines() if ln]
    assert len(warn) == 1 and warn[0].startswith("minfer: warning:") and "loses quality" in warn[0]
    # it went through dequantization: the result is the quantization of Q8_0's values
    with GGUFFile.open(q8) as g8, GGUFFile.open(out) as g4:
        e = "blk.3.ffn_down.weight"
        x = _core.dequantize("Q8_0", g8.tensor_data(e), 512, 1)
        assert np.array_equal(g4.tensor_data(e), _core.quantize(g4.tensors[e].type_name, x, 1).reshape(-1))


def test_cli_keep_split_metadata(tmp_path, capsys):
    src = tmp_path / "s.gguf"
    write_model(src, n_embd=256, n_head=4, n_ff=512, metadata={"split.no": 0, "split.count": 1})
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    assert _cli(["quantize", src, a, "Q8_0"], capsys)[0] == 0
    assert _cli(["quantize", src, b, "Q8_0", "--keep-split-metadata"], capsys)[0] == 0
    with GGUFFile.open(a) as ga, GGUFFile.open(b) as gb:
        assert "split.count" not in ga.metadata and gb.get("split.count") == 1


# ---- the command-line contract ---------------------------------------------------------------


def _one_line_error(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("minfer: error:"), err
    assert "Traceback" not in err
    return lines[0]


def test_bad_type_name_is_a_usage_error(synth_f32, tmp_path, capsys):
    rc, _, err = _cli(["quantize", synth_f32, tmp_path / "o.gguf", "Q3_K_XL"], capsys)
    assert rc == 2 and "Q3_K_XL" in _one_line_error(err)
    rc, _, err = _cli(["quantize", synth_f32, tmp_path / "o.gguf", "Q4_K_M", "--output-type", "Q9"], capsys)
    assert rc == 2 and "--output-type" in _one_line_error(err)
    assert list(tmp_path.iterdir()) == []


def test_existing_output_needs_force(synth_f32, tmp_path, capsys):
    out = tmp_path / "o.gguf"
    out.write_bytes(b"keep me")
    rc, _, err = _cli(["quantize", synth_f32, out, "Q8_0"], capsys)
    assert rc == 1 and "--force" in _one_line_error(err)
    assert out.read_bytes() == b"keep me"
    rc, _, err = _cli(["quantize", synth_f32, out, "Q8_0", "--force"], capsys)
    assert rc == 0, err
    assert GGUFFile.open(out).get("general.file_type") == 7
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.gguf"]


def test_bad_inputs_are_one_line_errors(synth_f32, tmp_path, capsys):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf at all")
    for inp, what in ((tmp_path / "missing.gguf", "cannot open"), (garbage, "not a GGUF"),
                      (tmp_path, "directory")):
        rc, _, err = _cli(["quantize", inp, tmp_path / "o.gguf", "Q8_0"], capsys)
        assert rc == 1 and what in _one_line_error(err), err
    q8 = tmp_path / "q8.gguf"
    assert _cli(["quantize", synth_f32, q8, "Q8_0"], capsys)[0] == 0
    rc, _, err = _cli(["quantize", q8, tmp_path / "o.gguf", "Q8_0"], capsys)
    assert rc == 1 and "already Q8_0" in _one_line_error(err)
    rc, _, err = _cli(["quantize", q8, q8, "Q4_0", "--force"], capsys)
    assert rc == 1 and "is the input file" in _one_line_error(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["garbage.gguf", "q8.gguf"]


@pytest.mark.parametrize("when", ["first", "middle"])
def test_a_full_disk_leaves_nothing_behind(synth_f32, tmp_path, capsys, monkeypatch, when):
    real = qz.convert_tensor
    calls = []

    def failing(data, e, n_threads, write, advance=lambda n: None):
        calls.append(e.name)
        if when == "first" or len(calls) == 20:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(data, e, n_threads, write, advance)

    monkeypatch.setattr(qz, "convert_tensor", failing)
    out = tmp_path / "o.gguf"
    rc, _, err = _cli(["quantize", synth_f32, out, "Q4_K_M"], capsys)
    assert rc == 1 and "No space left on device" in _one_line_error(err)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_write_keeps_the_old_output(synth_f32, tmp_path, capsys, monkeypatch):
    out = tmp_path / "o.gguf"
    out.write_bytes(b"old")

    def boom(*a, **k):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(qz, "convert_tensor", boom)
    rc, _, err = _cli(["quantize", synth_f32, out, "Q8_0", "--force"], capsys)
    assert rc == 1 and "Input/output error" in _one_line_error(err)
    assert out.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["o.gguf"]


def test_console_script_exit_codes(synth_f32, tmp_path):
    exe = Path(sys.executable).with_name("minfer")
    p = subprocess.run([str(exe), "quantize", str(synth_f32), str(tmp_path / "o.gguf"), "q4_k_q"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.count("\n") == 1
    p = subprocess.run([str(exe), "quantize", str(synth_f32), str(tmp_path / "o.gguf"), "q4_k_s"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert GGUFFile.open(tmp_path / "o.gguf").get("general.file_type") == 14
