"""Synthetic test models: real tensor names/keys, right shapes and types, finite weights of
sane magnitude (checked through the gguf package's independent dequantizer)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize

from minfer.io.gguf_file import GGUFFile
from minfer.testing import QWEN2_Q4_K_M_TYPES, ROLES, write_model
from minfer.testing.synth import CHATML_TEMPLATE, LLAMA31_ROPE, SPECIAL_TOKENS, bytes_to_unicode, llama3_rope_factors


def _weights(g: GGUFFile, name: str) -> np.ndarray:
    t = g.tensors[name]
    return dequantize(g.tensor_data(name), QT(t.type)).reshape(-1)


def test_default_model_is_well_formed(tmp_path):
    cfg = write_model(tmp_path / "m.gguf")
    with GGUFFile.open(cfg.path) as g:
        m = g.metadata
        assert g.architecture == "qwen2"
        assert m["qwen2.block_count"] == 2 and m["qwen2.embedding_length"] == 64
        assert m["qwen2.feed_forward_length"] == 128 and m["qwen2.context_length"] == 256
        assert m["qwen2.attention.head_count"] == 4 and m["qwen2.attention.head_count_kv"] == 2
        assert m["qwen2.rope.freq_base"] == 1e6
        assert m["qwen2.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
        assert "qwen2.attention.key_length" not in m
        T = g.tensors
        assert T["token_embd.weight"].shape == (64, cfg.n_vocab)
        assert T["output.weight"].shape == (64, cfg.n_vocab)
        assert T["output_norm.weight"].shape == (64,)
        assert T["blk.1.attn_q.weight"].shape == (64, 64)
        assert T["blk.1.attn_k.weight"].shape == (64, 32)
        assert T["blk.1.attn_v.weight"].shape == (64, 32)
        assert T["blk.1.attn_q.bias"].shape == (64,) and T["blk.1.attn_k.bias"].shape == (32,)
        assert T["blk.1.attn_output.weight"].shape == (64, 64)
        assert T["blk.1.ffn_gate.weight"].shape == (64, 128)
        assert T["blk.1.ffn_up.weight"].shape == (64, 128)
        assert T["blk.1.ffn_down.weight"].shape == (128, 64)
        assert "blk.2.attn_norm.weight" not in T and "blk.0.attn_q_norm.weight" not in T
        assert {t.type_name for t in T.values()} == {"F32"}
        assert len(T) == 3 + 2 * 12


def test_qwen3_decoupled_head_dim_and_every_type(tmp_path):
    types = {
        "token_embd": "Q8_0", "output": "F16", "attn_q": "Q4_K", "attn_k": "Q5_K",
        "attn_v": "Q6_K", "attn_output": "Q4_0", "ffn_gate": "Q4_1", "ffn_up": "Q5_0",
        "ffn_down": "Q5_1",
    }
    cfg = write_model(
        tmp_path / "q3.gguf", arch="qwen3", n_layer=1, n_embd=256, n_head=8, n_head_kv=2,
        head_dim=64, n_ff=512, types=types, seed=3,
    )
    assert cfg.q_dim == 512 and cfg.kv_dim == 128
    with GGUFFile.open(cfg.path) as g:
        m = g.metadata
        assert m["qwen3.attention.key_length"] == 64 and m["qwen3.attention.value_length"] == 64
        T = g.tensors
        assert T["blk.0.attn_q.weight"].shape == (256, 512)
        assert T["blk.0.attn_output.weight"].shape == (512, 256)
        assert T["blk.0.attn_q_norm.weight"].shape == (64,)
        assert T["blk.0.attn_k_norm.weight"].shape == (64,)
        assert "blk.0.attn_q.bias" not in T
        for role, tname in types.items():
            name = f"{role}.weight" if role in ("token_embd", "output") else f"blk.0.{role}.weight"
            assert T[name].type_name == tname, name
        for name, t in T.items():
            w = _weights(g, name)
            assert w.size == t.n_elements and np.isfinite(w).all(), name
            if name.endswith("norm.weight"):
                assert 0.8 < w.mean() < 1.2, name
            elif name.endswith(".weight"):
                # initialiser-like scale: std ~ 1/sqrt(fan_in), roughly zero mean
                fan_in = t.shape[0]
                assert 0.5 < w.std() * np.sqrt(fan_in) < 2.0, (name, w.std())
                assert abs(w.mean()) < 0.3 * w.std(), (name, w.mean())


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_blocks_use_the_full_code_range(tmp_path, qtype):
    cfg = write_model(tmp_path / "k.gguf", n_embd=256, n_head=4, n_ff=256, n_layer=1,
                      types={"ffn_up": qtype})
    with GGUFFile.open(cfg.path) as g:
        w = _weights(g, "blk.0.ffn_up.weight")
    # random codes: many distinct values, both signs, magnitude in the requested band
    assert len(np.unique(w)) > 200
    assert (w > 0).mean() > 0.3 and (w < 0).mean() > 0.3
    assert 0.02 < np.abs(w).mean() < 0.1


def test_real_like_type_mix(tmp_path):
    cfg = write_model(tmp_path / "mix.gguf", n_embd=256, n_head=4, n_ff=512, n_layer=1,
                      types=QWEN2_Q4_K_M_TYPES)
    with GGUFFile.open(cfg.path) as g:
        assert g.tensors["blk.0.ffn_down.weight"].type_name == "Q6_K"
        assert g.tensors["token_embd.weight"].type_name == "Q5_0"
        assert g.metadata["general.quantization_version"] == 2


def test_tokenizer_metadata(tmp_path):
    cfg = write_model(tmp_path / "t.gguf", n_vocab=300)
    with GGUFFile.open(cfg.path) as g:
        m = g.metadata
        tokens = m["tokenizer.ggml.tokens"]
        types = list(m["tokenizer.ggml.token_type"])
        assert len(tokens) == 300 == len(types) == g.tensors["token_embd.weight"].shape[1]
        assert m["tokenizer.ggml.model"] == "gpt2" and m["tokenizer.ggml.pre"] == "qwen2"
        byte_chars = [c for _, c in bytes_to_unicode()]
        assert tokens[:256] == byte_chars and len(set(byte_chars)) == 256
        assert tokens[0] == "!" and "Ġ" in tokens[:256]
        for merge in m["tokenizer.ggml.merges"]:
            a, b = merge.split(" ")
            assert a in tokens and b in tokens and a + b in tokens
        for s in SPECIAL_TOKENS:
            assert types[tokens.index(s)] == 3  # CONTROL
        assert m["tokenizer.ggml.eos_token_id"] == tokens.index("<|im_end|>") == cfg.eos_id
        assert m["tokenizer.ggml.bos_token_id"] == tokens.index("<|endoftext|>") == cfg.bos_id
        assert tokens[-1].startswith("[PAD") and types[-1] == 5  # UNUSED
        assert m["tokenizer.chat_template"] == CHATML_TEMPLATE
        assert m["tokenizer.ggml.add_bos_token"] is False
        assert len(set(tokens)) == len(tokens)


def test_chat_template_renders_chatml(tmp_path):
    import jinja2

    out = jinja2.Environment().from_string(CHATML_TEMPLATE).render(
        messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True
    )
    assert out == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_no_tokenizer_and_tied_embeddings(tmp_path):
    cfg = write_model(tmp_path / "n.gguf", with_tokenizer=False, tie_embeddings=True, n_vocab=96)
    with GGUFFile.open(cfg.path) as g:
        assert "tokenizer.ggml.tokens" not in g.metadata
        assert "output.weight" not in g.tensors
        assert g.tensors["token_embd.weight"].shape == (64, 96)


def test_seed_determinism(tmp_path):
    a = write_model(tmp_path / "a.gguf", seed=5)
    b = write_model(tmp_path / "b.gguf", seed=5)
    c = write_model(tmp_path / "c.gguf", seed=6)
    assert a.path.read_bytes() == b.path.read_bytes() != c.path.read_bytes()


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"arch": "gemma2"}, "arch"),
        ({"llama3_rope": LLAMA31_ROPE}, "arch must be 'llama'"),
        ({"n_head": 3}, "n_head_kv"),
        ({"head_dim": 32}, "only qwen3"),
        ({"types": {"attn_q": "Q4_K"}}, "block size 256"),
        ({"types": {"attn_q": "IQ2_XS"}}, "unsupported type"),
        ({"types": {"attn_qq": "F32"}}, "unknown role"),
        ({"n_vocab": 100}, "smaller than the tokenizer"),
    ],
)
def test_bad_arguments(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        write_model(tmp_path / "x.gguf", **kw)


def test_roles_cover_every_matrix():
    assert set(ROLES) == set(QWEN2_Q4_K_M_TYPES)


def test_llama_loads_and_runs_on_the_cpu(tmp_path):
    """arch llama: the keys and tensors llama.cpp's converter writes for a Llama 3.1
    checkpoint (no biases, rope.dimension_count, vocab_size, llama-bpe, rope_freqs.weight
    from the llama3 scaling; a K-quant mix like Q4_K_M's), loaded by minfer's llama
    model: interleaved RoPE with the frequency factors, and a forward on the CPU whose
    logits are finite and spread, the last row of a prefill that of the same token
    decoded after the others."""
    from minfer.graph.ir import Op, RopeStyle
    from minfer.graph.params import CParams, GraphParams, GraphType
    from minfer.models import load_model
    from minfer.session import Session

    types = {r: "Q4_K" for r in ROLES} | {"output": "Q6_K", "attn_v": "Q6_K"}
    cfg = write_model(tmp_path / "l.gguf", arch="llama", n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512,
                      rope_base=500000.0, types=types, seed=2, llama3_rope=LLAMA31_ROPE, fast=True)
    factors = llama3_rope_factors(64, 500000.0, **LLAMA31_ROPE)
    assert factors[0] == 1.0 and factors[-1] == 8.0 and np.all(np.diff(factors) >= 0)
    with GGUFFile.open(cfg.path) as g:
        m = g.metadata
        assert g.architecture == "llama"
        assert m["llama.rope.dimension_count"] == 64 and m["llama.vocab_size"] == cfg.n_vocab
        assert m["llama.rope.freq_base"] == 500000.0 and m["tokenizer.ggml.pre"] == "llama-bpe"
        assert "llama.attention.key_length" not in m
        T = g.tensors
        assert not any(n.endswith(".bias") or "_norm.weight" in n and "attn_q" in n for n in T)
        assert T["rope_freqs.weight"].shape == (32,)
        assert np.array_equal(np.frombuffer(g.tensor_data("rope_freqs.weight"), np.float32), factors)
        graph = load_model(g).build_graph(GraphParams(3, 1, GraphType.Prefill, CParams(n_ctx=64)))
    ropes = [n.meta for n in graph.nodes if n.op is Op.RoPE]
    assert ropes and all(r.style is RopeStyle.Normal and r.factors == "rope_freqs.weight" for r in ropes)
    ids = [5, 77, 120, 9, 31, 250, 17]
    s = Session.open(cfg.path, n_ctx=64, backends=["cpu"], n_threads=2)
    block = np.asarray(s.forward(ids, n_out=len(ids)))
    assert np.isfinite(block).all() and block.std() > 0.1
    s = Session.open(cfg.path, n_ctx=64, backends=["cpu"], n_threads=2)
    s.forward(ids[:-1])
    last = np.asarray(s.forward(ids[-1:])).reshape(-1)
    assert np.max(np.abs(last - block[-1])) <= 1e-3 * block.std()
