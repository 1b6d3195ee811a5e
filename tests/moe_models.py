"""Tiny random-weight mixture-of-experts checkpoints for the MoE tests and benchmarks.

Each family (qwen2moe, qwen3moe, and llama with experts: Mixtral) is built with
`transformers` from a small config, saved as a Hugging Face checkpoint with a tiny
byte-level BPE tokenizer (trained on tests/data/tokenizer_corpus.txt), and converted by
llama.cpp's own convert_hf_to_gguf.py (from the llama-cpp-python source distribution,
fetched and cached by tests/llama_quants_ref.py) to F32 and Q8_0; Q4_K_M comes from
`minfer quantize` of the F32 file (bytes equal to llama-quantize's). Nothing is
committed: everything lands under $MINFER_CACHE (default ~/.cache/minfer)/moe-tiny/<key>/,
where <key> hashes the recipe, so a changed recipe builds afresh and an unchanged one is
reused.

The converter's pre-tokenizer check hashes how a tokenizer splits a fixed text and only
knows released models, so the wrapper tells it this tokenizer is "qwen2" (the Qwen
pre-tokenizer; minfer's tokenizer then reads it as such). Only the tokenizer metadata is
affected; the model tensors and hyper-parameters are the converter's own.

Weights: transformers' own init (normal, std initializer_range = 0.02, its default). Larger
weights (0.05, 0.1: closer to a trained network's 1/sqrt(fan_in)) made these 2-layer
random networks chaotic: one 8-bit activation rounding that lands the other way (or an
expert pick it flips) moved later logits by up to 1.75 std for Q8_0, which leaves a
comparison with transformers nothing to bound. At 0.02 the router logits still spread
(std ~0.3 over 8 experts) and the quantized files stay within the tolerances of
tests/test_moe.py.

    python tests/moe_models.py            # build every family and type now, print paths
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import llama_quants_ref  # noqa: E402  (tests/ helper: the cached llama.cpp source)

RECIPE_VERSION = 1
VOCAB = 384

# name -> (transformers config class, config kwargs). Dims: multiples of 256 where a
# K-quant needs whole super-blocks (every matmul's input width), 8 experts, 2 per token.
_COMMON = dict(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
               tie_word_embeddings=False, initializer_range=0.02)
FAMILIES = {
    # shared expert with its sigmoid gate; weights not renormalised (llama.cpp's qwen2moe)
    "qwen2moe": ("Qwen2MoeConfig", dict(_COMMON, intermediate_size=512, moe_intermediate_size=256,
                                         shared_expert_intermediate_size=256, num_experts=8,
                                         num_experts_per_tok=2, norm_topk_prob=False, rope_theta=10000.0,
                                         decoder_sparse_step=1, mlp_only_layers=[])),
    # Qwen3-30B-A3B's layout: q/k norms, head dim 64 decoupled, renormalised top-k
    "qwen3moe": ("Qwen3MoeConfig", dict(_COMMON, intermediate_size=512, moe_intermediate_size=256, head_dim=64,
                                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                         rope_theta=1000000.0, decoder_sparse_step=1, mlp_only_layers=[])),
    # Mixtral: general.architecture llama with ffn_*_exps, renormalised top-k
    "mixtral": ("MixtralConfig", dict(_COMMON, intermediate_size=256, num_local_experts=8,
                                       num_experts_per_tok=2, rope_theta=1000000.0, sliding_window=None)),
}
TYPES = ("F32", "Q8_0", "Q4_K_M")
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _versions() -> str:
    import tokenizers
    import torch
    import transformers
    return f"{transformers.__version__}/{torch.__version__}/{tokenizers.__version__}/{llama_quants_ref.VERSION}"


def _key(family: str) -> str:
    cls, kw = FAMILIES[family]
    blob = json.dumps([RECIPE_VERSION, family, cls, kw, _versions()], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def model_dir(family: str) -> Path:
    return llama_quants_ref.cache_dir().parent.parent / "moe-tiny" / f"{family}-{_key(family)}"


def _log(msg: str) -> None:
    sys.stderr.write(f"moe_models: {msg}\n")


def _tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = (Path(__file__).parent / "data" / "tokenizer_corpus.txt").read_text(encoding="utf-8").splitlines()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - len(specials), special_tokens=[], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


def converter_dir() -> Path:
    """convert_hf_to_gguf.py, its conversion/ package and gguf-py from the sdist."""
    d = llama_quants_ref.cache_dir() / "convert-moe"
    if (d / "convert_hf_to_gguf.py").exists() and (d / "gguf-py").exists():
        return d
    want = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
    llama_quants_ref._extract(lambda rel: rel.startswith(want), d)
    return d


def hf_checkpoint(family: str) -> Path:
    """The Hugging Face checkpoint (weights, config, tokenizer), built once."""
    d = model_dir(family) / "hf"
    if (d / "config.json").exists() and (d / "tokenizer.json").exists():
        return d
    import torch
    import transformers

    cls_name, kw = FAMILIES[family]
    torch.manual_seed(1234)
    cfg = getattr(transformers, cls_name)(**kw)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    d.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=d.parent, prefix=".hf-"))
    model.save_pretrained(str(tmp))
    _tokenizer(tmp)
    os.replace(tmp, d)
    return d


_CONVERT = r"""
import sys
src = sys.argv[1]
sys.path.insert(0, src)
sys.path.insert(1, src + "/gguf-py")
import convert_hf_to_gguf
from conversion.base import TextModel
# A tokenizer of our own: the pre-tokenizer hash is unknown to the converter (see moe_models.py).
TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[2:]
convert_hf_to_gguf.main()
"""


def gguf_path(family: str, qtype: str = "F32") -> Path:
    """The family's GGUF of type F32, Q8_0 (converter) or Q4_K_M (minfer quantize)."""
    if qtype not in TYPES:
        raise ValueError(f"type {qtype!r}: one of {TYPES}")
    out = model_dir(family) / f"{family}-{qtype.lower()}.gguf"
    if out.exists():
        return out
    if qtype == "Q4_K_M":
        from minfer.tools.quantize import quantize_file

        tmp = out.with_suffix(".tmp.gguf")
        quantize_file(gguf_path(family, "F32"), tmp, "Q4_K_M", n_threads=2)
        os.replace(tmp, out)
        return out
    hf = hf_checkpoint(family)
    src = converter_dir()
    tmp = out.with_suffix(".tmp.gguf")
    _log(f"convert_hf_to_gguf.py {family} --outtype {qtype.lower()}")
    r = subprocess.run([sys.executable, "-c", _CONVERT, str(src), str(hf), "--outtype", qtype.lower(),
                        "--outfile", str(tmp)], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed for {family} ({qtype}):\n{r.stderr[-3000:]}")
    os.replace(tmp, out)
    return out


def hf_model(family: str):
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(hf_checkpoint(family)),
                                                             dtype=torch.float32).eval()


def _unpermute(w, n_head: int):
    """Undo convert_hf_to_gguf's LlamaModel.permute of q / k rows (llama's RoPE layout)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_state_dict(family: str, path: Path) -> dict:
    """The GGUF's tensors, dequantized by the `gguf` package, under transformers' parameter
    names and shapes: what the file's weights are, for the transformers forward."""
    import gguf
    import numpy as np
    import torch

    cfg = hf_model(family).config
    r = gguf.GGUFReader(str(path))
    out: dict = {}
    for t in r.tensors:
        ne = [int(s) for s in t.shape]
        data = np.asarray(t.data)
        if t.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            data = gguf.quants.dequantize(data, t.tensor_type)
        a = np.asarray(data, dtype=np.float32).reshape(list(reversed(ne)))
        n = t.name
        if n == "token_embd.weight":
            out["model.embed_tokens.weight"] = a
            continue
        if n == "output.weight":
            out["lm_head.weight"] = a
            continue
        if n == "output_norm.weight":
            out["model.norm.weight"] = a
            continue
        _, i, rest = n.split(".", 2)
        p = f"model.layers.{i}."
        role, kind = rest.rsplit(".", 1)
        attn = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
                "attn_q_norm": "q_norm", "attn_k_norm": "k_norm"}
        if role in attn:
            if family == "mixtral" and role in ("attn_q", "attn_k"):
                a = _unpermute(a, cfg.num_attention_heads if role == "attn_q" else cfg.num_key_value_heads)
            out[f"{p}self_attn.{attn[role]}.{kind}"] = a
        elif role == "attn_norm":
            out[p + "input_layernorm.weight"] = a
        elif role == "ffn_norm":
            out[p + "post_attention_layernorm.weight"] = a
        elif role == "ffn_gate_inp":
            out[p + "mlp.gate.weight"] = a
        elif role in ("ffn_gate_exps", "ffn_up_exps"):
            out.setdefault(p + "mlp.experts.gate_up_proj", {})[role] = a
        elif role == "ffn_down_exps":
            out[p + "mlp.experts.down_proj"] = a
        elif role == "ffn_gate_inp_shexp":
            out[p + "mlp.shared_expert_gate.weight"] = a.reshape(1, -1)
        elif role.endswith("_shexp"):
            out[f"{p}mlp.shared_expert.{role[4:-6]}_proj.weight"] = a
        else:
            raise KeyError(f"no transformers name for GGUF tensor {n}")
    for k, v in list(out.items()):
        if isinstance(v, dict):
            out[k] = np.concatenate([v["ffn_gate_exps"], v["ffn_up_exps"]], axis=1)
    return {k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in out.items()}


def hf_model_on(family: str, path: Path):
    """The transformers model of `family` carrying the GGUF's (dequantized) weights."""
    m = hf_model(family)
    sd = gguf_state_dict(family, path)
    missing, unexpected = m.load_state_dict(sd, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise KeyError(f"{path}: state dict mismatch: missing {missing}, unexpected {unexpected}")
    return m


if __name__ == "__main__":
    for fam in FAMILIES:
        for t in TYPES:
            print(gguf_path(fam, t))
