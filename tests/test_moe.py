"""Mixture-of-experts models end to end on the CPU: qwen2moe (shared expert with its
sigmoid gate), qwen3moe (Qwen3-30B-A3B's layout) and llama with experts (Mixtral), each a
tiny random-weight checkpoint made with transformers and converted by llama.cpp's
convert_hf_to_gguf.py to F32 and Q8_0, plus `minfer quantize` Q4_K_M (tests/moe_models.py;
built once, cached, never committed).

References:
- transformers' own forward. For the F32 files on the original weights; for the quantized
  files on the file's weights (the `gguf` package's dequantization loaded into the same
  transformers model), so what is compared is the engine, not the quantization;
- tests/moe_reference.py, float64 NumPy on the dequantized weights with the engine's
  8-bit activation rounding (act_quant), teacher-forced per layer: each MoE block is fed
  the engine's own input, which isolates the block (routing, expert matmuls, weights,
  shared expert) from the chaos a rounding flip starts in a random network.

Tolerances are on max |minfer - reference| over the vocabulary divided by the reference
logits' std at that position (err/std), the measure of tests/test_e2e_synthetic.py.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

import moe_models
from minfer.cli import main
from minfer.errors import UnsupportedModelError
from minfer.graph.ir import Gating
from minfer.session import Session

FAMILIES = tuple(moe_models.FAMILIES)
ARCH = {"qwen2moe": "qwen2moe", "qwen3moe": "qwen3moe", "mixtral": "llama"}

# F32 files vs transformers on the same weights: float32 accumulation order only.
# Measured max 4.2e-6 (KV f32); with the default f16 KV cache (f16 rounding of K and V)
# max 1.2e-3, over the 3 families x 4 sequences (69 positions each).
F32_TOL = {"f32": 1e-4, "f16": 5e-3}
# Quantized files vs transformers on the file's own (dequantized) weights: the engine
# rounds every matmul input to 8 bits per block (Q8_0 / Q8_K), ~0.5% relative per matmul,
# which in a random network also flips the odd expert pick (a whole expert's output moves)
# and spreads to later positions through the KV cache. Measured over the 3 families x 2
# types, 8 sequences (138 positions each): median 0.026-0.045, p90 0.032-0.118, max
# 0.04-0.52. A wrong routing rule, weight, expert row or shared-expert gate moves every
# position by O(1).
Q_MEDIAN, Q_P90 = 0.1, 0.2
# Greedy picks whose top1 - top2 margin (in logits std) is below this may legitimately
# flip under the deviations above; the others must agree. Random-weight logits are flat:
# over 6 prompts x 16 steps the median margin measured 0.19-0.36 and a quarter of the
# steps cleared 0.3 (26-50 steps a case), while the engine's deviation at a greedy step
# measured median 0.03, p90 0.03-0.08.
MARGIN = 0.3
# The MoE block fed the engine's own input, vs float64 with the same activation rounding:
# float32 accumulation only (measured 1e-6 of the block output's scale), except a row
# whose activation lands on a rounding boundary (the reference rounds in float64).
BLOCK_TOL, BLOCK_FLIP_TOL = 2e-5, 5e-3


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


def _seqs(seed: int, lens=(1, 7, 20, 41)) -> list:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, moe_models.VOCAB - 3, n).tolist() for n in lens]


def _hf_logits(hf, ids) -> np.ndarray:
    import torch

    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].double().numpy()


def _row_err(got, want) -> np.ndarray:
    return np.abs(got.astype(np.float64) - want).max(axis=-1) / want.std(axis=-1)


# ---------------------------------------------------------------- the model loads as it should


def test_architecture_and_spec_from_metadata(family):
    path = moe_models.gguf_path(family, "F32")
    s = Session.open(path, n_ctx=64, n_threads=2)
    defn = s.model.defn
    assert defn.arch == ARCH[family]
    m = defn.moe
    assert (m.n_expert, m.n_used, m.n_ff) == (8, 2, 256)
    assert m.gating is Gating.Softmax
    assert m.norm is (family != "qwen2moe")          # llama.cpp's rule per architecture
    assert m.n_ff_shared == (256 if family == "qwen2moe" else 0)
    ops = [n["op"] for n in s.graph_json(1, decode=True)["nodes"]]
    assert ops.count("MatMulId") == 3 * 2 and ops.count("MoeTopK") == 2 and ops.count("MoeSum") == (
        4 if family == "qwen2moe" else 2)
    # A decode step reads each picked expert's rows: the expert tensors count n_used / n_expert.
    full = sum(defn.tensors[n].nbytes for n in defn.expected_tensors())
    exps = sum(defn.tensors[n].nbytes for n in defn.expected_tensors() if n.endswith("_exps.weight"))
    out = defn.tensors[defn.output_weight]
    emb = defn.tensors["token_embd.weight"]
    assert defn.weight_bytes_per_token() == full - exps + exps // 4 - emb.nbytes + emb.row_nbytes
    assert out.name == "output.weight"


# ---------------------------------------------------------------- logits vs transformers


@pytest.mark.parametrize("kv", ["f32", "f16"])
def test_f32_logits_match_transformers(family, kv):
    hf = moe_models.hf_model(family)
    s = Session.open(moe_models.gguf_path(family, "F32"), n_ctx=128, n_threads=2, kv_type=kv)
    for seq in _seqs(1):
        s.reset()
        got = s.forward(seq, n_out=len(seq))
        err = _row_err(got, _hf_logits(hf, seq))
        assert err.max() < F32_TOL[kv], f"{family} kv {kv}: per-position err/std {np.round(err, 6)}"
    # Chunked prefill, then decode steps: the same rows.
    seq = _seqs(2)[3]
    s.reset()
    got = np.concatenate([s.forward(seq[:13], n_out=13)] + [s.forward([t]) for t in seq[13:]])
    err = _row_err(got, _hf_logits(hf, seq))
    assert err.max() < F32_TOL[kv], f"{family} kv {kv}: prefill + decode err/std {np.round(err, 6)}"


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K_M"])
def test_quantized_logits_match_transformers_on_the_files_weights(family, qtype):
    path = moe_models.gguf_path(family, qtype)
    hf = moe_models.hf_model_on(family, path)
    s = Session.open(path, n_ctx=128, n_threads=2)
    errs = []
    for seed in (3, 4):
        for seq in _seqs(seed):
            s.reset()
            errs.append(_row_err(s.forward(seq, n_out=len(seq)), _hf_logits(hf, seq)))
    e = np.concatenate(errs)
    assert np.median(e) < Q_MEDIAN and np.percentile(e, 90) < Q_P90, \
        f"{family} {qtype}: err/std median {np.median(e):.3f} p90 {np.percentile(e, 90):.3f} max {e.max():.3f}"


@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "Q4_K_M"])
def test_greedy_continuations_follow_transformers_where_margins_allow(family, qtype):
    """minfer's greedy ids vs transformers' argmax on the same prefix (teacher forcing): up
    to the first near-tie this is comparing greedy continuations; past one the prefix is
    still shared, so every later comfortable step is checked too."""
    path = moe_models.gguf_path(family, qtype)
    hf = moe_models.hf_model(family) if qtype == "F32" else moe_models.hf_model_on(family, path)
    s = Session.open(path, n_ctx=128, n_threads=2)
    prompts, n = _seqs(30, (3, 6, 11, 17, 4, 9)), 16
    compared = 0
    for p in prompts:
        s.reset()
        out = s.generate_ids(p, n, temperature=0.0)
        assert len(out) == n
        lg = _hf_logits(hf, p + out[:-1])[len(p) - 1:]
        top2 = np.sort(lg, axis=-1)[:, -2:]
        ok = (top2[:, 1] - top2[:, 0]) / lg.std(axis=-1) > (1e-3 if qtype == "F32" else MARGIN)
        bad = [k for k in range(n) if ok[k] and out[k] != int(lg[k].argmax())]
        assert not bad, f"{family} {qtype}: prompt {p} left transformers' greedy path at steps {bad}"
        compared += int(ok.sum())
    assert compared >= n, f"{family} {qtype}: only {compared} greedy steps had a comfortable margin"


# ---------------------------------------------------------------- the block vs float64


class _Capture:
    """A context.tracer that runs the plan step by step and keeps some nodes' values."""

    def __init__(self, names):
        self.names, self.values = set(names), {}

    def execute(self, cache):
        alloc = cache.alloc

        def on_step(node, ls):
            if node.name in self.names:
                self.values[node.name] = np.array(alloc.host_view(node.id)).copy()

        cache.execute(on_step=on_step)


@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "Q4_K_M"])
def test_moe_block_matches_float64_reference_on_its_own_input(family, qtype):
    from moe_reference import MoeReference

    path = moe_models.gguf_path(family, qtype)
    ref = MoeReference(str(path), act_quant=True)
    s = Session.open(path, n_ctx=128, n_threads=2)
    out_node = "ffn_out" if family == "qwen2moe" else "ffn_moe_out"
    names = [f"blk.{i}.{n}" for i in range(ref.n_layer) for n in ("ffn_norm", out_node, "ffn_moe_topk")]
    checked = flips = 0
    for seq in _seqs(5, (1, 9, 33)):
        s.reset()
        cap = s.context.tracer = _Capture(names)
        s.forward(seq, n_out=len(seq))
        s.context.tracer = None
        for i, L in enumerate(ref.layers):
            p = f"blk.{i}."
            h = cap.values[p + "ffn_norm"].reshape(len(seq), -1).astype(np.float64)
            ref.margins = []
            want = ref._moe(L, h)
            got = cap.values[p + out_node].reshape(len(seq), -1)
            # The picks: the same experts, best first, wherever the choice is not a near-tie.
            lg = h @ L.router
            ids = np.argsort(-lg, axis=1, kind="stable")[:, :ref.n_used]
            srt = np.sort(lg, axis=1)[:, ::-1]
            clear = srt[:, ref.n_used - 1] - srt[:, ref.n_used] > 1e-4
            got_ids = cap.values[p + "ffn_moe_topk"].view(np.int32).reshape(len(seq), -1)
            assert np.array_equal(got_ids[clear], ids[clear]), f"{family} {qtype} layer {i}: other experts picked"
            err = np.abs(got - want).max(axis=1) / np.abs(want).max()
            err = err[clear]
            flips += int((err > BLOCK_TOL).sum())
            checked += err.size
            assert err.max() < BLOCK_FLIP_TOL, f"{family} {qtype} layer {i}: block err {np.round(err, 7)}"
    assert flips <= max(1, checked // 20), f"{family} {qtype}: {flips} of {checked} rows off beyond {BLOCK_TOL}"
    assert checked >= 50


# ---------------------------------------------------------------- identities


def test_threads_reuse_and_fusion_give_the_same_bits(family):
    path = moe_models.gguf_path(family, "Q4_K_M")
    seq = _seqs(9)[3]
    outs = []
    for threads, fuse in ((1, True), (2, True), (3, True), (2, False)):
        s = Session.open(path, n_ctx=128, n_threads=threads, fuse=fuse)
        a = s.forward(seq, n_out=len(seq))
        s.reset()
        b = np.concatenate([s.forward(seq[:5], n_out=5)] + [s.forward([t]) for t in seq[5:]])
        assert np.array_equal(a, b), f"{family}: prefill and decode rows differ (threads {threads}, fuse {fuse})"
        outs.append(a)
    assert all(np.array_equal(o, outs[0]) for o in outs[1:])


# ---------------------------------------------------------------- front ends


def test_generate_and_bench_cli(family, capsys):
    path = str(moe_models.gguf_path(family, "Q4_K_M"))
    rc = main(["generate", path, "hello world", "-n", "8", "--temp", "0", "--json", "--ctx", "64", "-t", "2"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    r = json.loads(out)
    assert r["stop_reason"] in ("length", "eos", "stop") and len(r["ids"]) <= 8
    rc = main(["bench", path, "-p", "16", "-n", "8", "-r", "1", "-t", "2", "-o", "json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    rows = json.loads(out)
    assert {r["n_prompt"] for r in rows} >= {16} and all(r["avg_ts"] > 0 for r in rows)


# ---------------------------------------------------------------- metadata and refusals


def _stub(md: dict, arch: str = "qwen3moe", n_ff: int = 512):
    g = SimpleNamespace(path="m.gguf", metadata={f"{arch}.{k}": v for k, v in md.items()})
    return SimpleNamespace(gguf=g, arch=arch, hp=SimpleNamespace(n_ff=n_ff))


def test_spec_follows_the_metadata_keys():
    from minfer.models.moe import read_moe_spec

    m = read_moe_spec(_stub({"expert_count": 128, "expert_used_count": 8, "expert_feed_forward_length": 768}),
                      norm=True)
    assert (m.n_expert, m.n_used, m.n_ff, m.gating, m.norm, m.scale) == (128, 8, 768, Gating.Softmax, True, 0.0)
    m = read_moe_spec(_stub({"expert_count": 8, "expert_used_count": 2, "expert_weights_norm": False,
                             "expert_gating_func": 2, "expert_weights_scale": 2.5}), norm=True)
    assert (m.n_ff, m.gating, m.norm, m.scale) == (256, Gating.Sigmoid, False, 2.5)   # n_ff: 512 / 2 used
    m = read_moe_spec(_stub({"expert_count": 8, "expert_used_count": 2, "expert_used_count_unused": 1},
                            arch="llama"), norm=True, n_ff=14336)
    assert m.n_ff == 14336
    m = read_moe_spec(_stub({"expert_count": 60, "expert_used_count": [4, 4],
                             "expert_shared_feed_forward_length": 5632}, arch="qwen2moe"), norm=False, shared=True)
    assert (m.n_used, m.n_ff_shared, m.norm) == (4, 5632, False)


@pytest.mark.parametrize("md,why", [
    ({"expert_used_count": 2}, "expert_count"),
    ({"expert_count": 8}, "expert_used_count"),
    ({"expert_count": 8, "expert_used_count": 9}, "out of range"),
    ({"expert_count": 8, "expert_used_count": 2, "expert_gating_func": 7}, "gating"),
    ({"expert_count": 8, "expert_used_count": [2, 4]}, "per-layer"),
    ({"expert_count": 8, "expert_used_count": 2, "expert_weights_norm": 3}, "boolean"),
    ({"expert_count": 8, "expert_used_count": 2, "expert_weights_scale": -1.0}, "expert_weights_scale"),
])
def test_bad_metadata_is_refused_by_key(md, why):
    from minfer.models.moe import read_moe_spec

    with pytest.raises(UnsupportedModelError, match=why):
        read_moe_spec(_stub(md), norm=True)


def test_cuda_takes_every_moe_node():
    """CUDA runs the MoE ops (tests/test_cuda_moe.py on a GPU): its capability matrix
    accepts every node of each family's decode and prefill graphs."""
    from minfer.backends import cuda

    for family in FAMILIES:
        s = Session.open(moe_models.gguf_path(family, "Q4_K_M"), n_ctx=64, n_threads=1)
        for nt in (1, 40):
            g = s.context.preview_graph(nt)
            bad = [(n.name, n.op) for n in g.nodes if not cuda.supports_op(n)]
            assert not bad, f"{family}: cuda refuses {bad[:3]}"
