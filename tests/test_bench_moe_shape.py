"""bench/moe_shape.py's --fast mode (random quantized blocks written directly, for the
~17 GB qwen3-30b-a3b file) on a tiny custom shape: the file loads and runs on the CPU,
its blocks dequantize to finite values of the intended spread, the bytes do not depend
on the worker count, and the qwen3-30b-a3b preset is Qwen3-30B-A3B's shape."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import gguf
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

TINY = dict(arch="qwen3moe", n_layer=2, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_expert=8, n_used=2,
            n_ff_exp=256, n_ff=512, norm_w=True, qk_norm=True, rope_base=1000000.0)


def _moe_shape():
    spec = importlib.util.spec_from_file_location("moe_shape", ROOT / "bench" / "moe_shape.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def _vocab() -> Path:
    import families
    return families.converter_dir() / "models" / "ggml-vocab-qwen2.gguf"


def test_fast_mode_file_loads_and_runs_on_the_cpu(tmp_path, monkeypatch):
    from minfer.session import Session

    ms = _moe_shape()
    monkeypatch.setitem(ms.PRESETS, "tiny", TINY)
    paths = []
    for threads in (3, 1):
        p = tmp_path / f"tiny-{threads}.gguf"
        ms.make(p, "tiny", 0, threads, fast=True, vocab=_vocab())
        paths.append(p)
    assert paths[0].read_bytes() == paths[1].read_bytes(), "the bytes depend on the worker count"
    r = gguf.GGUFReader(str(paths[0]))
    types = {t.name: t.tensor_type for t in r.tensors}
    assert types["blk.0.ffn_gate_inp.weight"] == gguf.GGMLQuantizationType.F32
    quantized = [t for t in r.tensors if t.tensor_type not in (gguf.GGMLQuantizationType.F32,
                                                                gguf.GGMLQuantizationType.F16)]
    assert {t.tensor_type for t in quantized} >= {gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K}
    for t in quantized:
        rows = np.asarray(t.data).reshape(-1, np.asarray(t.data).shape[-1])[:64]
        v = gguf.quants.dequantize(rows, t.tensor_type)
        assert np.isfinite(v).all() and 0.005 < v.std() < 0.08, (t.name, float(v.std()))
    s = Session.open(paths[0], n_ctx=64, n_threads=2, backends=["cpu"])
    assert s.model.defn.moe.n_expert == 8
    lg = s.forward(list(range(100, 120)), n_out=20)
    assert lg.shape == (20, 151936) and np.isfinite(lg).all()
    assert len(s.generate_ids([5, 6, 7], 4)) == 4


def test_qwen3_30b_a3b_preset_is_the_real_shape():
    ms = _moe_shape()
    p = ms.PRESETS["qwen3-30b-a3b"]
    assert (p["n_layer"], p["n_embd"], p["n_head"], p["head_dim"], p["n_head_kv"]) == (48, 2048, 32, 128, 4)
    assert (p["n_expert"], p["n_used"], p["n_ff_exp"], p["qk_norm"], p["n_vocab"]) == (128, 8, 768, True, 151936)
    shapes = dict(ms.tensors_of(p, p["n_vocab"]))
    n = sum(int(np.prod(s)) for s in shapes.values())
    assert 30.4e9 < n < 30.7e9, n  # Qwen3-30B-A3B: 30.5 B parameters
    assert "output.weight" in shapes  # untied
