"""CUDA backend pieces that need no GPU: the build decision (MINFER_CUDA=AUTO/ON/OFF),
the registry entry's refusal, the fusion switches."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from pathlib import Path

import pytest

from minfer import _core
from minfer.backends import cuda
from minfer.errors import BackendError
from minfer.graph.params import CParams
from minfer.backends import default_registry

ROOT = Path(__file__).resolve().parent.parent


def _decide(mode: str, nvcc: bool, cublas: bool) -> tuple[str, str]:
    cmake = shutil.which("cmake")
    assert cmake, "cmake is a build requirement"
    out = subprocess.run([cmake, f"-DMODE={mode}", f"-DNVCC={int(nvcc)}", f"-DCUBLAS={int(cublas)}", "-P",
                          str(ROOT / "cmake" / "MinferCudaDecide.cmake")], capture_output=True, text=True, check=True)
    line = (out.stdout + out.stderr).strip().splitlines()[-1]
    build, reason = line.removeprefix("build=").split(";", 1)
    return build, reason


@pytest.mark.parametrize("nvcc,cublas,build", [(True, True, "ON"), (True, False, "OFF"), (False, True, "OFF"),
                                               (False, False, "OFF")])
def test_cmake_auto_builds_cuda_only_with_compiler_and_cublas(nvcc, cublas, build):
    got, reason = _decide("AUTO", nvcc, cublas)
    assert got == build
    if not nvcc:
        assert "nvcc" in reason
    if not cublas:
        assert "cuBLAS" in reason


def test_cmake_on_fails_naming_what_is_missing_and_off_never_builds():
    assert _decide("ON", True, True)[0] == "ON"
    b, r = _decide("ON", True, False)
    assert b == "ERROR" and "cuBLAS" in r
    assert _decide("OFF", True, True)[0] == "OFF"
    assert _decide("maybe", True, True)[0] == "ERROR"


def test_entry_matches_the_build_and_the_machine():
    e = cuda.ENTRY
    assert (e.id, e.priority, e.name) == (2, 200, "cuda")
    assert e.compiled == bool(_core.HAS_CUDA)
    if not e.compiled:
        assert not e.usable and "not compiled into this build" in e.unusable_reason
    elif not e.usable:
        n, why = _core.cuda_device_count()
        assert n == 0 and e.unusable_reason == why and why.startswith("no CUDA device visible")
    if not e.usable:
        with pytest.raises(BackendError, match="backend 'cuda' is not"):
            default_registry().select_backends(["cuda"])


def test_fusion_switches(monkeypatch):
    """MINFER_CUDA_FUSE (a diagnostic, docs/configuration.md): unset, 1 or all = every
    decode step merge; none or 0 = none; else a comma list, validated."""
    every = {"qkv", "ffn", "residual", "quant", "rope"}
    monkeypatch.delenv(cuda.ENV_FUSE, raising=False)
    assert cuda.fusions_from_env() == every
    for v in ("all", "1", " ALL "):
        monkeypatch.setenv(cuda.ENV_FUSE, v)
        assert cuda.fusions_from_env() == every
    monkeypatch.setenv(cuda.ENV_FUSE, "residual,quant")
    assert cuda.fusions_from_env() == {"residual", "quant"}
    monkeypatch.setenv(cuda.ENV_FUSE, "0")
    assert cuda.fusions_from_env() == frozenset()
    monkeypatch.setenv(cuda.ENV_FUSE, "none")
    assert cuda.fusions_from_env() == frozenset()
    monkeypatch.setenv(cuda.ENV_FUSE, "ffn, qkv")
    assert cuda.fusions_from_env() == {"ffn", "qkv"}
    for bad in ("qkv,bogus", "norm"):  # norm: the deleted norm fusion
        monkeypatch.setenv(cuda.ENV_FUSE, bad)
        with pytest.raises(BackendError, match="unknown fusion"):
            cuda.fusions_from_env()
    # The step merges are the CUDA backend's plan flags, read at lowering from the
    # cache's options and the variable: not graph parameters.
    monkeypatch.setenv(cuda.ENV_FUSE, "qkv,residual")
    assert cuda.plan_flags({}) == 1 | 4 and cuda.plan_flags({"fuse": True}) == 1 | 4
    monkeypatch.setenv(cuda.ENV_FUSE, "quant")
    assert cuda.plan_flags({}) == 8
    monkeypatch.setenv(cuda.ENV_FUSE, "rope")
    assert cuda.plan_flags({}) == 32
    monkeypatch.delenv(cuda.ENV_FUSE)
    assert cuda.plan_flags({}) == 1 | 2 | 4 | 8 | 32
    assert cuda.plan_flags({"fuse": False}) == 0
    assert not any(f.name.startswith("fuse_") and f.name != "fuse_swiglu" for f in dataclasses.fields(CParams))


def test_fusion_bits_match_the_executor_header():
    """Every FUSE_* bit in cuda/executor.h is the one plan_flags sets for that fusion."""
    import re
    text = (ROOT / "csrc" / "cuda" / "executor.h").read_text()
    bits = {k.lower(): int(v) for k, v in re.findall(r"FUSE_(\w+) = (\d+)", text)}
    assert bits == cuda._FLAG_BITS


def test_moe_nodes_are_cuda_nodes():
    """The mixture-of-experts ops have CUDA kernels (csrc/cuda/k_moe.cu, matvec_id): the
    registry entry takes every node of an MoE block, MatMulId for each weight type the
    matvec runs (rows of a multiple of 32), and no op is refused by name any more."""
    from minfer.graph.builder import GraphBuilder
    from minfer.graph.ir import Gating, MoeRouteMeta, Op

    def block(wtype: int, in_dim: int = 256):
        b = GraphBuilder()
        x = b.input("x", (in_dim, 3))
        route = MoeRouteMeta(8, 2, Gating.Softmax, True, 0.0)
        logits = b.matmul(x, "router", 0, in_dim, 8)
        ids = b.moe_topk(logits, route)
        w = b.moe_weights(logits, route)
        gate = b.matmul_id(x, ids, "gate", wtype, in_dim, 64, 8)
        act = b.sigmoid(gate)
        down = b.matmul_id(act, ids, "down", wtype, 64, in_dim, 8)
        b.moe_sum(down, w)
        return b

    for wtype in sorted(cuda.WEIGHT_TYPES):
        nodes = block(wtype)._nodes
        assert {n.op for n in nodes} >= {Op.MoeTopK, Op.MoeWeights, Op.MatMulId, Op.Sigmoid, Op.MoeSum}
        for n in nodes:
            assert cuda.supports_op(n), f"{n.op} ({n.name}) with weight type {wtype}"
    odd = [n for n in block(0, in_dim=48)._nodes if n.op is Op.MatMulId and n.meta.in_dim == 48]
    assert odd and not cuda.supports_op(odd[0])  # rows of 48: not a multiple of 32
    assert not hasattr(cuda, "_NO_KERNEL")


def test_dense_family_nodes_are_cuda_nodes(tmp_path):
    """The dense families' ops have CUDA kernels: a synthetic Llama 3.1 (interleaved RoPE
    with rope_freqs factors) is CUDA's node for node, prefill and decode; so are scale,
    soft-cap, GELU, the column slice, RoPE of either style with linear scaling and an
    attention factor, and attention with a sliding window and a soft-cap at head dims 96
    and 256. A head dim with no attention kernel (80) is still not taken."""
    from minfer.graph.builder import GraphBuilder
    from minfer.graph.ir import AttnMeta, DType, Op, RoPEMeta, RopeStyle
    from minfer.graph.params import CParams, GraphParams, GraphType
    from minfer.io.gguf_file import GGUFFile
    from minfer.models import load_model
    from minfer.testing import write_model
    from minfer.testing.synth import LLAMA31_ROPE

    cfg = write_model(tmp_path / "l.gguf", arch="llama", n_embd=256, n_head=4, n_head_kv=2, n_ff=512,
                      llama3_rope=LLAMA31_ROPE)
    with GGUFFile.open(cfg.path) as g:
        model = load_model(g)
        for params in (GraphParams(5, 1, GraphType.Prefill, CParams(n_ctx=64, gpu=True)),
                       GraphParams(1, 1, GraphType.Decode, CParams(n_ctx=64, gpu=True))):
            nodes = model.build_graph(params).nodes
            assert any(n.op is Op.RoPE and n.meta.factors and n.meta.style is RopeStyle.Normal for n in nodes)
            assert [n.name for n in nodes if not cuda.supports_op(n)] == []

    def nodes(hd: int):
        b = GraphBuilder()
        nt, nh = 3, 4
        x = b.input("x", (nh * hd, nt))
        pos = b.input("pos", (nt,), DType.I32)
        for style in RopeStyle:
            b.rope(x, pos, RoPEMeta(n_rot=hd // 2, freq_base=1e4, hd=hd, nh=nh, style=style, freq_scale=0.25,
                                    attn_factor=1.2, factors=None))
        b.gelu(b.softcap(b.scale(x, 2.0), 30.0))
        b.slice(x, hd, hd)
        kv = b.kvcache_load(0, 2 * hd, 64, kv_type=DType.F16)
        b.attn(x, kv, pos, AttnMeta(layer=0, n_head=nh, n_head_kv=2, hd=hd, scale=hd ** -0.5, n_ctx=64,
                                    kv_type=DType.F16, window=8, softcap=50.0))
        return b._nodes

    for hd in (96, 256):
        assert [n.op for n in nodes(hd) if not cuda.supports_op(n)] == []
    assert [n.op for n in nodes(80) if not cuda.supports_op(n)] == [Op.Attn]
    assert cuda.supports_fused("geglu") and cuda.supports_fused("swiglu")
