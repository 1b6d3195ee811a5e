"""End-to-end engine vs. the independent float64 reference on random-weight models.

Small synthetic models let us cover what the real model does not: Qwen3 (q/k norms, a
head dim decoupled from n_embd / n_head), every weight type we claim to support, and
tied embeddings, while staying fast.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from reference_forward import ReferenceModel  # noqa: E402

from minfer.session import Session  # noqa: E402
from minfer.testing.synth import write_model  # noqa: E402

# Every quant type appears in one of the two qwen2 mixes, on a different role in each,
# so a type's kernel is exercised both as a narrow (n_embd-row) and a wide matrix.
QWEN2_MIX_A = {
    "token_embd": "Q4_0", "output": "Q4_1", "attn_q": "Q5_0", "attn_k": "Q5_1", "attn_v": "Q8_0",
    "attn_output": "Q4_K", "ffn_gate": "Q5_K", "ffn_up": "Q6_K", "ffn_down": "F16",
}
QWEN2_MIX_B = {
    "token_embd": "F16", "output": "Q6_K", "attn_q": "Q4_K", "attn_k": "Q8_0", "attn_v": "Q4_0",
    "attn_output": "Q5_1", "ffn_gate": "Q4_1", "ffn_up": "Q5_0", "ffn_down": "Q5_K",
}
QWEN3_MIX = {
    "token_embd": "Q8_0", "output": "Q6_K", "attn_q": "Q4_K", "attn_k": "Q5_0", "attn_v": "Q8_0",
    "attn_output": "Q5_K", "ffn_gate": "Q4_0", "ffn_up": "F16", "ffn_down": "Q6_K",
}

# n_embd 256 / n_ff 512 keep every row length a multiple of the 256-wide K-quant block.
MODELS = {
    "qwen3-decoupled-f32": dict(arch="qwen3", n_layer=2, n_embd=256, n_head=8, head_dim=64, n_head_kv=2,
                                n_ff=512, seed=1),
    "qwen3-decoupled-quant": dict(arch="qwen3", n_layer=2, n_embd=256, n_head=8, head_dim=64, n_head_kv=2,
                                  n_ff=512, types=QWEN3_MIX, seed=2),
    "qwen2-mix-a": dict(arch="qwen2", n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512,
                        types=QWEN2_MIX_A, seed=3),
    "qwen2-mix-b": dict(arch="qwen2", n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512,
                        types=QWEN2_MIX_B, seed=4),
    "qwen2-f32-tied": dict(arch="qwen2", n_layer=2, n_embd=128, n_head=4, n_head_kv=1, n_ff=256,
                           tie_embeddings=True, seed=5),
}

# Tolerances are on max |engine - reference| over the vocab, divided by the reference
# logits' std at that position (random-weight logits have std ~1, so roughly absolute).
#
# IDEAL_TOL, vs the float64 reference: the engine rounds every matmul input to 8 bits
# per block (Q8_0 / Q8_K) for quantized weights, ~0.5% relative error per matmul that
# compounds over the layers; measured max 0.12 (typical 0.06-0.10) over 63 positions x
# 4 quant mixes. A real bug (wrong RoPE pairing, missing bias or q/k norm, bad block
# decode, position off by one) moves logits by O(1) std, so 0.2 still catches them.
IDEAL_TOL = 0.2
# vs the act_quant reference (same 8-bit rounding of matmul inputs, float64 otherwise)
# only accumulation order differs: measured median 5e-7, and F32-weight models max 2e-6.
# Quantized models also show rare rounding flips (an input landing on the other side of
# a rounding boundary after float32 accumulation), worth up to 0.075 and propagating to
# later positions through the KV cache. A systematic error would touch every position,
# so we require a quarter of all prefill positions to be exact to float32 accuracy and
# bound the rest.
EXACT_TOL = 1e-4
# With an f16 KV cache the same comparison (reference rounding K/V to f16 too) also sees
# f16 rounding flips: a K/V element within float32 error of an f16 rounding boundary
# rounds the other way in the engine, moving it by one f16 ulp (2^-11 relative).
# Measured max 1.5e-4 (qwen3-decoupled-f32, F32 weights); bounded at 5e-4, still 200x
# below what a wrongly stored or read K/V element (an O(1) error in one cell) produces.
EXACT_TOL_KV_F16 = 5e-4
FLIP_TOL = 0.15
MIN_EXACT_FRACTION = 0.25
# A greedy step whose top1 - top2 reference margin is below 2 x the worst measured
# deviation (0.12) is a near-tie rounding may legitimately flip; it is not compared.
MARGIN = 0.25


def _is_f32(name: str) -> bool:
    return "f32" in name.split("@")[0]


def _exact_tol(name: str) -> float:
    return EXACT_TOL_KV_F16 if name.endswith("@f16") else EXACT_TOL


# Every model runs with both KV element types. The tight comparisons use a reference
# that stores K/V the same way (rounded to f16, or exact); the float64 ideal bound
# (IDEAL_TOL) is the same for both: f16 K/V rounding (2^-11 relative) is far below the
# 8-bit activation rounding that sets it.
@pytest.fixture(scope="module", params=[(m, kv) for m in sorted(MODELS) for kv in ("f16", "f32")],
                ids=lambda p: f"{p[0]}-kv{p[1]}")
def model(request, tmp_path_factory):
    name, kv_type = request.param
    path = tmp_path_factory.mktemp("e2e-synth") / f"{name}.gguf"
    write_model(path, **MODELS[name])
    ref = ReferenceModel(str(path))
    refq = ReferenceModel(str(path), act_quant=True, kv_f16=kv_type == "f16")
    eng = Session.open(path, n_ctx=128, kv_type=kv_type)
    assert eng.kv_type == kv_type
    return f"{name}@{kv_type}", ref, refq, eng


def _sequences(n_vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, n_vocab, n).tolist() for n in (1, 5, 17, 40)]


def _row_err(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    return np.abs(got.astype(np.float64) - want).max(axis=-1) / want.std(axis=-1)


def _check(name: str, got: np.ndarray, ref: ReferenceModel, refq: ReferenceModel, seq: list[int]) -> np.ndarray:
    want, wantq = ref.logits(seq), refq.logits(seq)
    assert got.shape == want.shape
    ideal = _row_err(got, want)
    assert ideal.max() < IDEAL_TOL, f"{name}: vs float64 reference, per-position err {np.round(ideal, 4)}"
    err = _row_err(got, wantq)
    if _is_f32(name):
        assert err.max() < _exact_tol(name), f"{name}: F32 weights, per-position err {err}"
    else:
        assert err.max() < FLIP_TOL, f"{name}: vs act_quant reference, per-position err {np.round(err, 4)}"
    top2 = np.sort(want, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > MARGIN
    assert np.array_equal(got.argmax(-1)[clear], want.argmax(-1)[clear])
    return err


def test_reference_selfcheck(model):
    """The reference's incremental (KV-cached) path agrees with its full-sequence path."""
    _, ref, _, _ = model
    seq = _sequences(ref.n_vocab, 0)[2]
    full = ref.logits(seq)
    cache = ref.new_cache()
    parts = np.concatenate([ref.forward(seq[:6], cache), ref.forward(seq[6:7], cache), ref.forward(seq[7:], cache)])
    np.testing.assert_allclose(parts, full, rtol=0, atol=1e-10)


def test_prefill_all_positions_match_reference(model):
    name, ref, refq, eng = model
    errs = []
    for seed in (10, 11, 12, 13):
        for seq in _sequences(ref.n_vocab, seed):
            eng.reset()
            got = eng.forward(seq, n_out=len(seq))
            assert eng.n_past == len(seq)
            errs.append(_check(name, got, ref, refq, seq))
    # Flips spread to later positions through the KV cache, so one sequence can be off
    # almost everywhere. One seed's four sequences (63 positions) were too few: their exact
    # fraction ranged 0.21-1.00 with the kernels of commit 454ee20 as with the repacked
    # K-quants (the 40-token sequence alone is 63% of them, so one early flip decides it).
    # Pooled over four seeds (252 positions) the worst model measured 0.47 and 0.53
    # respectively, while a systematic error would leave none exact.
    frac = float(np.mean(np.concatenate(errs) < _exact_tol(name)))
    assert frac >= MIN_EXACT_FRACTION, f"{name}: only {frac:.2f} of positions match the act_quant reference exactly"


def test_prefill_then_decode_matches_reference(model):
    """Chunked prefill then single-token decode steps (teacher-forced) vs the full-sequence reference."""
    name, ref, refq, eng = model
    seq = _sequences(ref.n_vocab, 20)[3]  # 40 tokens
    eng.reset()
    got = [eng.forward(seq[:13], n_out=13), eng.forward(seq[13:20], n_out=7)]
    for t in seq[20:]:
        got.append(eng.forward([t], n_out=1))
    assert eng.n_past == len(seq)
    _check(name, np.concatenate(got), ref, refq, seq)


def test_greedy_matches_reference_where_margins_allow(model):
    """Engine greedy ids vs the reference argmax on the same prefix (teacher forcing).

    While the engine's ids equal the reference argmax both see the same prefix, so this
    equals comparing greedy continuations up to the first near-tie; past one the prefix is
    still shared, so every later comfortable step is checked too.
    """
    name, ref, _, eng = model
    prompts = _sequences(ref.n_vocab, 30)
    n = 12
    outs = [eng.generate_ids(p, n, temperature=0.0) for p in prompts]
    assert all(len(o) == n for o in outs)
    scored = ref.logits_batch([p + o[:-1] for p, o in zip(prompts, outs)], [len(p) - 1 for p in prompts])
    compared = 0
    for prompt, out, lg in zip(prompts, outs, scored):
        top2 = np.sort(lg, axis=-1)[:, -2:]
        ok = top2[:, 1] - top2[:, 0] > MARGIN
        bad = [k for k in range(n) if ok[k] and out[k] != int(lg[k].argmax())]
        assert not bad, f"{name}: prompt {prompt[:5]}... left the reference's greedy path at steps {bad}"
        compared += int(ok.sum())
    # Random-weight logits are flat, so many steps are near-ties; still demand real coverage.
    assert compared >= n, f"{name}: only {compared} greedy steps had a comfortable margin"
