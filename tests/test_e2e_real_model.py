"""End-to-end: the engine on the real Qwen2.5-Coder-0.5B Q4_K_M vs. an independent float64
NumPy forward pass (tests/reference_forward.py, built only from gguf + NumPy).

One Engine and one ReferenceModel are shared by the module; reference work is batched
(all prompts share each weight matmul) to keep the module within a few minutes on 2 cores.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from reference_forward import ReferenceModel  # noqa: E402

from minfer.session import Session  # noqa: E402
from minfer.tokenizer import Tokenizer  # noqa: E402

CHAT = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"

PROMPTS = [
    "def fibonacci(n):",
    "import numpy as np\n\ndef softmax(x):\n    ",
    "#include <stdio.h>\n\nint main(void) {\n",
    "SELECT name, COUNT(*) FROM users",
    "fn main() {\n    let v: Vec<i32> = ",
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "In mathematics, a prime number is",
    "1, 2, 3, 5, 8, 13, 21,",
    "3.14159 * 2 = ",
    "2024-01-15T10:30:00Z",
    "床前明月光，",
    "人工智能是",
    "東京は日本の",
    "Привет, как",
    "<|im_start|>user\nWrite a haiku about rust.<|im_end|>\n<|im_start|>assistant\n",
    CHAT.format("Write a Python function that reverses a string."),
    CHAT.format("What is 17 * 23?"),
    "{\"name\": \"minfer\", \"version\": ",
    "    return x\n\nclass Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):",
    "a",
    "!!!???...",
    # Memorized text: continuations with a clear top-1 at every step, so a few greedy
    # comparisons run the full 32 steps without a near-tie.
    "Permission is hereby granted, free of charge, to any person obtaining a copy",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,",
    "Licensed under the Apache License, Version 2.0 (the \"License\");\nyou",
]

# ~300 tokens of mixed code and prose: exercises long attention spans and RoPE angles
# far from position 0, where a wrong frequency formula shows up first.
LONG_PROMPT = (
    "# Utilities for parsing and validating configuration files.\n"
    "import json\nimport os\nfrom dataclasses import dataclass, field\n\n\n"
    "@dataclass\nclass Config:\n    name: str\n    threads: int = 4\n    paths: list[str] = field(default_factory=list)\n\n"
    "    def validate(self) -> None:\n        if self.threads <= 0:\n            raise ValueError('threads must be positive')\n"
    "        for p in self.paths:\n            if not os.path.exists(p):\n                raise FileNotFoundError(p)\n\n\n"
    "def load(path: str) -> Config:\n    \"\"\"Read a JSON config file and return a validated Config.\n\n"
    "    The file must contain an object with a 'name' key; 'threads' and 'paths' are optional.\n"
    "    Unknown keys are rejected so that typos do not silently fall back to defaults.\n    \"\"\"\n"
    "    with open(path) as f:\n        raw = json.load(f)\n    allowed = {'name', 'threads', 'paths'}\n"
    "    unknown = set(raw) - allowed\n    if unknown:\n        raise KeyError(f'unknown keys: {sorted(unknown)}')\n"
    "    cfg = Config(**raw)\n    cfg.validate()\n    return cfg\n\n\n"
    "def merge(base: Config, override: dict) -> Config:\n    \"\"\"Return a new Config with the keys of override applied on top of base.\"\"\"\n"
    "    data = {'name': base.name, 'threads': base.threads, 'paths': list(base.paths)}\n"
    "    data.update(override)\n    cfg = Config(**data)\n    cfg.validate()\n    return cfg\n\n\n"
    "def save(cfg: Config, path: str) -> None:\n"
)

# Prompts whose greedy continuations are compared (decoded in lockstep by the reference).
GREEDY_PROMPTS = [0, 5, 16, 17, 22, 23, 24]
N_GREEDY = 32
# A greedy step whose reference top1 - top2 margin is below this is a near-tie the
# engine's 8-bit activation rounding may legitimately break the other way (see LOGIT_TOL).
GREEDY_MARGIN = 0.5

# Max |engine - reference| over the whole vocab at the last position.
# Why: the engine rounds every quantized matmul's input to 8 bits per 32- or 256-wide
# block (Q8_0 / Q8_K, as llama.cpp does) and accumulates in float32; the reference keeps
# float64 activations, so the weights are identical and only activation rounding differs.
# Measured over these prompts (logit std ~2.2): max |d| 0.26-0.73 on most prompts, 1.18
# on the 2-token CJK prompt; mean |d| 0.045-0.09, 0.24 at most. The outliers are the
# rounding itself: the reference with act_quant=True (same 8-bit input rounding, float64
# otherwise) moves 1.35 away from the float64 reference on that prompt, while the engine
# sits within 0.35 of it. 2.0 leaves ~1.7x margin over the worst case; the median of the
# per-prompt mean |d| (measured 0.065) is bounded tightly because a systematic error
# (RoPE, bias, norm, a block decoder) shifts every prompt, not just one.
LOGIT_TOL = 2.0
MEDIAN_MEAN_TOL = 0.15


@pytest.fixture(scope="module")
def ref(real_model_path) -> ReferenceModel:
    return ReferenceModel(str(real_model_path))


@pytest.fixture(scope="module")
def eng(real_model_path) -> Session:
    return Session.open(real_model_path, n_ctx=512)


@pytest.fixture(scope="module")
def prompt_ids(real_model_path) -> list[list[int]]:
    tok = Tokenizer.from_gguf_path(real_model_path)
    ids = [tok.encode(p) for p in PROMPTS] + [tok.encode(LONG_PROMPT)]
    assert all(len(i) > 0 for i in ids)
    assert 250 <= len(ids[-1]) <= 400, len(ids[-1])
    return ids


@pytest.fixture(scope="module")
def ref_last(ref, prompt_ids) -> np.ndarray:
    return ref.last_logits_batch(prompt_ids)


def test_last_logits_match_reference(eng, ref, prompt_ids, ref_last):
    assert len(prompt_ids) >= 20
    rows = []
    for ids, want in zip(prompt_ids, ref_last):
        eng.reset()
        got = eng.forward(ids, n_out=1)
        assert got.shape == (1, ref.n_vocab) and got.dtype == np.float32
        assert eng.n_past == len(ids)
        got = got[0].astype(np.float64)
        top2 = np.argsort(want)[-2:]
        rows.append((len(ids), int(got.argmax()), int(want.argmax()), float(np.abs(got - want).max()),
                     float(np.abs(got - want).mean()), float(want[top2[1]] - want[top2[0]])))
    report = "\n".join(f"n={n:3d} top1 eng={a} ref={b} max|d|={d:.4f} mean|d|={m:.5f} margin={g:.3f}"
                       for n, a, b, d, m, g in rows)
    # A reference top1 - top2 margin below GREEDY_MARGIN is a near-tie the rounding may
    # break either way; there the engine's pick must still be one of the tied candidates:
    # a token whose reference logit is within GREEDY_MARGIN of the reference maximum
    # (top-2 alone is too narrow for a three-way tie: one prompt has its reference top-3
    # within 0.12, and a kernel's summation order decides among them).
    clear = [r for r in rows if r[5] >= GREEDY_MARGIN]
    assert len(clear) >= 20, "too few prompts with a clear top-1:\n" + report
    assert all(a == b for _, a, b, _, _, _ in clear), "top-1 differs:\n" + report
    assert all(want.max() - want[a] < GREEDY_MARGIN for (_, a, _, _, _, _), want in zip(rows, ref_last)), (
        "engine top-1 is not a near-tie candidate of the reference:\n" + report)
    worst = max(r[3] for r in rows)
    assert worst < LOGIT_TOL, f"max |dlogit| {worst:.4f} >= {LOGIT_TOL}:\n" + report
    med = float(np.median([r[4] for r in rows]))
    assert med < MEDIAN_MEAN_TOL, f"median mean |dlogit| {med:.4f} >= {MEDIAN_MEAN_TOL}:\n" + report


def test_all_positions_and_chunked_prefill_match_reference(eng, ref, prompt_ids):
    """Every position of a prefill (n_out = all) and a prefill split across calls,
    so the causal mask and n_past > 0 prefill are checked, not just the last row."""
    ids = prompt_ids[GREEDY_PROMPTS[1]] + prompt_ids[GREEDY_PROMPTS[6]]
    want = ref.logits(ids)
    eng.reset()
    whole = eng.forward(ids, n_out=len(ids)).astype(np.float64)
    eng.reset()
    cut = len(ids) // 3
    parts = np.concatenate([eng.forward(ids[:cut], n_out=cut), eng.forward(ids[cut:], n_out=len(ids) - cut)])
    for got in (whole, parts.astype(np.float64)):
        assert np.array_equal(got.argmax(-1), want.argmax(-1)) or _only_near_ties(got, want)
        assert np.abs(got - want).max() < LOGIT_TOL


def _only_near_ties(got: np.ndarray, want: np.ndarray) -> bool:
    top2 = np.sort(want, axis=-1)[:, -2:]
    differ = got.argmax(-1) != want.argmax(-1)
    return bool(np.all((top2[:, 1] - top2[:, 0])[differ] < GREEDY_MARGIN))


def test_greedy_continuations_match_reference(eng, ref, prompt_ids):
    """Engine greedy ids == reference greedy ids, checked by teacher forcing.

    The reference scores each prompt + the engine's continuation in one batched prefill
    (decoding 32 steps in float64 would cost minutes). While the engine's ids equal the
    reference argmax, both see the same prefix, so "engine token == reference argmax at
    every step up to the first near-tie" is exactly "the continuations are identical up
    to that step". Past a near-tie the prefix is still shared, so we keep checking every
    step whose reference margin is comfortable, which is stricter than the plain
    comparison that would have to stop there.
    """
    prompts = [prompt_ids[i] for i in GREEDY_PROMPTS]
    outs = [eng.generate_ids(p, N_GREEDY, temperature=0.0) for p in prompts]
    assert all(len(o) == N_GREEDY for o in outs)
    # Row k of each block is the reference's prediction for out[k].
    scored = ref.logits_batch([p + o[:-1] for p, o in zip(prompts, outs)], [len(p) - 1 for p in prompts])
    full, checked, lines = 0, 0, []
    for i, out, lg in zip(GREEDY_PROMPTS, outs, scored):
        top2 = np.sort(lg, axis=-1)[:, -2:]
        margins = top2[:, 1] - top2[:, 0]
        want = lg.argmax(-1)
        comfortable = margins >= GREEDY_MARGIN
        bad = [k for k in range(N_GREEDY) if comfortable[k] and out[k] != want[k]]
        lines.append(f"prompt {i}: {int(comfortable.sum())}/{N_GREEDY} comfortable, "
                     f"first near-tie {int(np.argmin(comfortable)) if not comfortable.all() else '-'}, "
                     f"mismatches at {bad}")
        assert not bad, f"prompt {i}: engine left the reference's greedy path:\n" + lines[-1]
        full += bool(comfortable.all())
        checked += int(comfortable.sum())
    summary = "\n".join(lines)
    assert full >= 3, "too few prompts with no near-tie in all 32 steps:\n" + summary
    assert checked >= N_GREEDY * len(prompts) // 2, summary


def test_graph_reuse_is_bitwise_identical_to_rebuild(real_model_path, eng, prompt_ids):
    fresh = Session.open(real_model_path, n_ctx=512, reuse=False)

    def decode(e: Session) -> list[np.ndarray]:
        e.reset()
        out = [e.forward(prompt_ids[0], n_out=1)]
        for _ in range(16):
            out.append(e.forward([int(out[-1][0].argmax())], n_out=1))
        return out

    a, b = decode(eng), decode(fresh)
    assert len(a) == len(b) == 17
    for k, (x, y) in enumerate(zip(a, b)):
        assert np.array_equal(x, y), f"step {k}: reuse vs rebuild differ by {np.abs(x - y).max()}"
