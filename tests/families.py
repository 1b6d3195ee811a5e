"""Tiny random-weight checkpoints of the dense families minfer runs beyond Qwen (llama,
gemma2, gemma3, phi3), made with transformers and converted by llama.cpp's own
convert_hf_to_gguf.py, for tests/test_families.py (and anyone who wants one).

For every variant in VARIANTS this builds, once per machine and cached under
$MINFER_CACHE (default ~/.cache/minfer)/families/<key>/:

- hf/: a transformers checkpoint (config.json, model.safetensors) from a small config of
  that family, its weights drawn from a fixed seed and scaled like a trained network's
  (std 1/sqrt(fan_in), norms near 1) so the logits spread and greedy picks are decisive,
  plus a tokenizer of that family's kind trained on a fixed corpus (SentencePiece BPE
  with byte fallback, or byte-level BPE with the family's pre-tokenizer split) and the
  family's chat template;
- F32.gguf, F16.gguf, Q8_0.gguf: llama.cpp's convert_hf_to_gguf.py of hf/ (the
  converter of the llama-cpp-python sdist that tests/llama_quants_ref.py fetches through
  pip); Q4_K_M.gguf: `minfer quantize F32.gguf Q4_K_M`.

One patch to the converter: a BPE tokenizer's tokenizer.ggml.pre is recognised by
hashing the tokenization of a test string, which only the real vocabularies hash to, so
the converter is told the name (get_vocab_base_pre returns the variant's pre-tokenizer).
Nothing else of the conversion is changed.

    python tests/families.py                 # build every variant now, print the paths
    python tests/families.py llama3 gemma3   # some
    python tests/families.py check-tokenize  # against llama.cpp's llama-tokenize (a dev check)
    python tests/families.py check-perplexity  # against llama.cpp's llama-perplexity (a dev check)
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_quants_ref  # noqa: E402  (the sdist download and unpacking, shared)

FORMAT = 6          # bump to rebuild every cached variant
TYPES = ("F32", "F16", "Q8_0", "Q4_K_M")


# ---- the llama.cpp converter from the sdist -------------------------------------------

def converter_dir() -> Path:
    """convert_hf_to_gguf.py, its conversion/ package, gguf-py and the vocab test files."""
    d = llama_quants_ref.cache_dir() / "convert"
    if (d / "convert_hf_to_gguf.py").exists() and (d / "models").exists():
        return d
    want = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "models/ggml-vocab-", "models/templates/")
    llama_quants_ref._extract(lambda rel: rel.startswith(want), d)
    return d


def vocab_dir() -> Path:
    """llama.cpp's vocab-only GGUFs and their tokenizer test vectors (.inp / .out)."""
    return converter_dir() / "models"


def template(name: str) -> str:
    """A chat template from llama.cpp's models/templates (real models' templates)."""
    return (converter_dir() / "models" / "templates" / name).read_text(encoding="utf-8")


# In-process runner: patch the BPE pre-tokenizer detection, then run the converter's main()
# once per (outtype, outfile) so torch and transformers are imported once.
_RUNNER = r"""
import json, os, sys
jobs = json.loads(sys.argv[1])
conv = jobs["converter"]
sys.path.insert(0, conv)
os.chdir(conv)
import convert_hf_to_gguf as c
from conversion import base
pre = jobs.get("pre")
if pre:
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
for outtype, outfile in jobs["outputs"]:
    sys.argv = ["convert_hf_to_gguf.py", jobs["hf"], "--outtype", outtype, "--outfile", outfile]
    c.main()
"""


def convert(hf_dir: Path, outputs: list, pre: str | None) -> None:
    job = {"converter": str(converter_dir()), "hf": str(hf_dir), "outputs": [[t, str(p)] for t, p in outputs],
           "pre": pre}
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, "-c", _RUNNER, json.dumps(job)], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed for {hf_dir}:\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}")


def quantize(src: Path, dst: Path, qtype: str) -> None:
    r = subprocess.run([sys.executable, "-m", "minfer.cli", "quantize", str(src), str(dst), qtype, "-t", "2"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"minfer quantize {src} {qtype} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")


# ---- tokenizers -------------------------------------------------------------------------

def corpus() -> str:
    """A fixed training text: English prose, code, numbers, whitespace runs and a few
    scripts, so the tokenizers learn real merges and the byte fallback gets used."""
    words = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex "
             "every jolly vexing bottle of fizz as pale moonlight drifts across the valley").split()
    lines = []
    for i in range(160):
        k = (i * 7) % len(words)
        s = " ".join(words[(k + j * 3) % len(words)] for j in range(5 + i % 9))
        lines.append(s.capitalize() + (". " if i % 3 else "? ") + f"It costs {i * 37 % 1000} coins, said {words[k]}.")
    code = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i * i)\n",
            "if (x > 0) { y = x; } else { y = -x; }\n", "    indented  line\twith\ttabs\n",
            "SELECT name, age FROM users WHERE age >= 21;\n", "{\"key\": [1, 2, 3], \"ok\": true}\n"]
    other = ["Héllo wörld, ça va très bien.", "Привет, как дела?", "日本語のテキストです。", "中文文本。",
             "emoji 😀 and ✓ marks", "  two  spaces   three   ", "I'm sure you'll see it's fine, we've won."]
    return "\n".join(lines + code * 8 + other * 6) + "\n"


def train_spm(out: Path, vocab_size: int, *, add_dummy_prefix: bool = True, ids=(0, 1, 2, -1),
              pieces=("<unk>", "<s>", "</s>", "<pad>"), user_defined=(), control=()) -> None:
    """A SentencePiece BPE model with byte fallback (Llama 2 / Mistral / Gemma / Phi-3 style).
    ids and pieces: (unk, bos, eos, pad)."""
    import sentencepiece as spm

    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "corpus.txt"
        text.write_text(corpus(), encoding="utf-8")
        unk, bos, eos, pad = ids
        spm.SentencePieceTrainer.train(
            input=str(text), model_prefix=str(Path(tmp) / "m"), vocab_size=vocab_size, model_type="bpe",
            byte_fallback=True, character_coverage=1.0, add_dummy_prefix=add_dummy_prefix,
            remove_extra_whitespaces=False, normalization_rule_name="identity", split_digits=True,
            allow_whitespace_only_pieces=True, num_threads=1, minloglevel=2, unk_id=unk, bos_id=bos, eos_id=eos,
            pad_id=pad, unk_piece=pieces[0], bos_piece=pieces[1], eos_piece=pieces[2], pad_piece=pieces[3],
            user_defined_symbols=list(user_defined), control_symbols=list(control))
        shutil.copy(Path(tmp) / "m.model", out)


def train_bpe(out_dir: Path, vocab_size: int, splits: list, specials: list) -> None:
    """A byte-level BPE tokenizer.json whose pre-tokenizer is the family's split regexes
    (as its tokenizer.json states them) and whose specials are added tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus().split("\n"), trainer)
    tok.save(str(out_dir / "tokenizer.json"))


# ---- the variants -----------------------------------------------------------------------

LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
PHI4_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' and 'tools' in message and message['tools'] "
    "is not none %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|tool|>' + message['tools'] + "
    "'<|/tool|>' + '<|end|>' }}{% else %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}"
)

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                   "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]
PHI3_SPECIALS = ["<|endoftext|>", "<|assistant|>", "<|system|>", "<|end|>", "<|user|>"]


@dataclass(frozen=True)
class Variant:
    name: str
    arch: str                 # GGUF general.architecture minfer must see
    hf_class: str             # transformers model class
    config: dict              # transformers config kwargs (the family's, tiny)
    tokenizer: dict           # {"kind": "spm" | "bpe", ...}
    template: str             # chat template source: "file:<name>" (llama.cpp's templates) or the text
    pre: str | None = None    # BPE pre-tokenizer name told to the converter
    seed: int = 1234
    tied: bool = False
    notes: str = ""
    extra: dict = field(default_factory=dict)


_D = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
          max_position_embeddings=512, rms_norm_eps=1e-5)

VARIANTS: dict[str, Variant] = {v.name: v for v in [
    Variant("llama2", "llama", "LlamaForCausalLM",
            dict(_D, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}),
            {"kind": "spm", "vocab": 700}, LLAMA2_TEMPLATE,
            notes="Llama 2 / TinyLlama / CodeLlama: SentencePiece, GQA, linear RoPE scaling x2, theta 1e6"),
    Variant("llama3", "llama", "LlamaForCausalLM",
            dict(_D, tie_word_embeddings=True,
                 rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 64}),
            {"kind": "bpe", "vocab": 800, "pre": "llama-bpe", "specials": LLAMA3_SPECIALS,
             "bos": "<|begin_of_text|>", "eos": "<|eot_id|>"},
            "file:meta-llama-Llama-3.2-3B-Instruct.jinja", pre="llama-bpe", tied=True,
            notes="Llama 3.2: byte-level BPE (llama-bpe), llama3 RoPE factors (rope_freqs), tied embeddings"),
    Variant("mistral", "llama", "MistralForCausalLM",
            dict(_D, head_dim=96, sliding_window=None),
            {"kind": "spm", "vocab": 700, "control": ["[INST]", "[/INST]"]}, MISTRAL_TEMPLATE,
            notes="Mistral 7B v0.3 style: SentencePiece with [INST] control tokens, head dim 96 != n_embd/n_head"),
    Variant("smollm2", "llama", "LlamaForCausalLM",
            dict(_D, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 100000.0}),
            {"kind": "bpe", "vocab": 800, "pre": "smollm", "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
             "bos": "<|im_start|>", "eos": "<|im_end|>"},
            CHATML_TEMPLATE, pre="smollm", tied=True,
            notes="SmolLM2: byte-level BPE (smollm: digits split), ChatML, tied embeddings"),
    Variant("gemma2", "gemma2", "Gemma2ForCausalLM",
            dict(_D, head_dim=64, sliding_window=8, query_pre_attn_scalar=64, attn_logit_softcapping=50.0,
                 final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6),
            {"kind": "spm", "vocab": 700, "gemma": True}, "file:google-gemma-2-2b-it.jinja",
            notes="Gemma 2: (1+w) norms, sandwich norms, GELU-tanh, sqrt(d) embedding scale, soft-caps 50/30, "
                  "window 8 on even layers"),
    Variant("gemma3", "gemma3", "Gemma3ForCausalLM",
            dict(_D, num_hidden_layers=6, head_dim=64, sliding_window=8, query_pre_attn_scalar=64,
                 rms_norm_eps=1e-6,
                 rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
            {"kind": "spm", "vocab": 700, "gemma": True}, "file:google-gemma-2-2b-it.jinja",
            notes="Gemma 3 (text): q/k norms, 5 local : 1 global, window 8, local base 1e4, global 1e6 with linear x8"),
    Variant("phi3", "phi3", "Phi3ForCausalLM",
            dict(_D, sliding_window=8, original_max_position_embeddings=512, rope_parameters=None),
            {"kind": "spm", "vocab": 700, "added": PHI3_SPECIALS, "eos": "<|endoftext|>"},
            "file:microsoft-Phi-3.5-mini-instruct.jinja",
            notes="Phi-3-mini-4k style: fused attn_qkv and gate|up, sliding window 8"),
    Variant("phi3-long", "phi3", "Phi3ForCausalLM",
            dict(_D, sliding_window=None, max_position_embeddings=128, original_max_position_embeddings=32,
                 rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                  "short_factor": [1.0 + 0.05 * i for i in range(32)],
                                  "long_factor": [1.0 + 0.5 * i for i in range(32)]}),
            {"kind": "spm", "vocab": 700, "added": PHI3_SPECIALS, "eos": "<|endoftext|>"},
            "file:microsoft-Phi-3.5-mini-instruct.jinja",
            notes="Phi-3.5-mini / 128k style: LongRoPE short/long factors and attention factor"),
    Variant("phi4mini", "phi3", "Phi3ForCausalLM",
            dict(_D, tie_word_embeddings=True, sliding_window=None, max_position_embeddings=128,
                 original_max_position_embeddings=32,
                 rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                  "short_factor": [1.0 + 0.03 * i for i in range(24)],
                                  "long_factor": [1.0 + 0.4 * i for i in range(24)]}),
            {"kind": "bpe", "vocab": 800, "pre": "gpt-4o", "specials": ["<|endoftext|>"] + PHI3_SPECIALS[1:],
             "bos": "<|endoftext|>", "eos": "<|endoftext|>", "gpt2_class": True},
            PHI4_TEMPLATE, pre="gpt-4o", tied=True,
            notes="Phi-4-mini: byte-level BPE (gpt-4o), partial rotary 0.75, LongRoPE, tied embeddings"),
]}


def _spec_hash(v: Variant) -> str:
    blob = json.dumps({"format": FORMAT, "version": llama_quants_ref.VERSION, "variant": v.__dict__},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def variant_dir(name: str) -> Path:
    v = VARIANTS[name]
    root = Path(os.environ.get("MINFER_CACHE") or Path.home() / ".cache" / "minfer")
    return root / "families" / f"{name}-{_spec_hash(v)}"


# ---- building ---------------------------------------------------------------------------

def _template_text(v: Variant) -> str:
    return template(v.template[5:]) if v.template.startswith("file:") else v.template


def _build_tokenizer(v: Variant, hf: Path) -> tuple[int, dict]:
    """Write the tokenizer files; returns (vocab size, ids of bos/eos/pad for the config)."""
    t = v.tokenizer
    tcfg: dict = {"chat_template": _template_text(v), "clean_up_tokenization_spaces": False}
    if t["kind"] == "spm":
        from transformers import AutoTokenizer, GemmaTokenizer, LlamaTokenizer

        if t.get("gemma"):
            # Gemma's layout: <pad> 0, <eos> 1, <bos> 2, <unk> 3, no dummy prefix, the turn
            # markers user-defined pieces that its tokenizer config calls special.
            train_spm(hf / "tokenizer.model", t["vocab"], add_dummy_prefix=False, ids=(3, 2, 1, 0),
                      pieces=("<unk>", "<bos>", "<eos>", "<pad>"), user_defined=["<start_of_turn>", "<end_of_turn>"])
            tok = GemmaTokenizer.from_pretrained(str(hf))
            tok.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
        else:
            train_spm(hf / "tokenizer.model", t["vocab"], control=t.get("control", ()))
            tok = LlamaTokenizer.from_pretrained(str(hf), legacy=True)
        if t.get("control"):
            tok.add_special_tokens({"additional_special_tokens": list(t["control"])})
        if t.get("added"):
            tok.add_special_tokens({"additional_special_tokens": list(t["added"])})
            tok.eos_token = t.get("eos", tok.eos_token)
        tok.save_pretrained(str(hf))
        cfg_path = hf / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg.update(tcfg)
        # Real checkpoints (saved by transformers 4) list their added tokens in
        # tokenizer_config.json, where the converter's SentencePiece path reads them (it
        # does not read tokenizer.json); transformers 5 keeps them in tokenizer.json only.
        added = json.loads((hf / "tokenizer.json").read_text(encoding="utf-8"))["added_tokens"]
        cfg["added_tokens_decoder"] = {str(a["id"]): {k: a[k] for k in ("content", "lstrip", "normalized", "rstrip",
                                                                        "single_word", "special")} for a in added}
        cfg_path.write_text(json.dumps(cfg, indent=1, ensure_ascii=False))
        tok = AutoTokenizer.from_pretrained(str(hf))
        n = len(tok)
    else:
        from transformers import PreTrainedTokenizerFast

        from minfer.tokenizer import PRE_TOKENIZERS

        train_bpe(hf, t["vocab"], list(PRE_TOKENIZERS[t["pre"]].splits), t["specials"])
        tok = PreTrainedTokenizerFast(tokenizer_file=str(hf / "tokenizer.json"), bos_token=t["bos"],
                                      eos_token=t["eos"], clean_up_tokenization_spaces=False)
        tok.chat_template = tcfg["chat_template"]
        tok.save_pretrained(str(hf))
        cfg_path = hf / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg.update(tcfg)
        if t.get("gpt2_class"):
            cfg["tokenizer_class"] = "GPT2Tokenizer"
        cfg_path.write_text(json.dumps(cfg, indent=1, ensure_ascii=False))
        n = len(tok)
    ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
           "pad_token_id": tok.pad_token_id}
    return n, ids


def _init_weights(model, v: Variant, seed: int) -> None:
    """Weights like a trained network's scale: matrices ~ N(0, 1/fan_in), norms ~ 1 (Gemma
    stores w with its norms computing x * (1 + w): there ~ 0), embeddings ~ N(0, 1) (or
    0.25 when they are the lm head too), the lm head ~ N(0, 16/fan_in): logits with a std
    of a few units, as a trained model's, so greedy picks are clear."""
    import torch

    g = torch.Generator().manual_seed(seed)
    gemma = v.arch.startswith("gemma")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                base = 0.0 if (gemma and "norm" in name) else (1.0 if "norm" in name else 0.0)
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g) * (0.25 if v.tied else 1.0))
            elif "lm_head" in name:
                p.copy_(torch.randn(p.shape, generator=g) * (4.0 / math.sqrt(p.shape[1])))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))


def build_hf(name: str, hf: Path) -> None:
    import torch
    import transformers

    v = VARIANTS[name]
    hf.mkdir(parents=True, exist_ok=True)
    n_vocab, ids = _build_tokenizer(v, hf)
    cls = getattr(transformers, v.hf_class)
    cfg_kwargs = {k: val for k, val in v.config.items() if val is not None or k == "sliding_window"}
    if cfg_kwargs.get("rope_parameters") is None:
        cfg_kwargs.pop("rope_parameters", None)
    config = cls.config_class(vocab_size=n_vocab, **ids, **cfg_kwargs)
    config.architectures = [v.hf_class]
    torch.manual_seed(v.seed)
    model = cls(config).eval()
    _init_weights(model, v, v.seed)
    if v.tied:
        model.tie_weights()
    model.save_pretrained(str(hf), safe_serialization=True)


def ensure(name: str, types=TYPES) -> dict:
    """{type: path} of the variant's GGUFs (and "hf": its checkpoint), built on first use."""
    v = VARIANTS[name]
    d = variant_dir(name)
    out = {t: d / f"{t}.gguf" for t in types}
    out["hf"] = d / "hf"
    if all(p.exists() for p in out.values()):
        return out
    d.mkdir(parents=True, exist_ok=True)
    lock = d / ".lock"
    import fcntl
    with open(lock, "w") as lf:
        fcntl.flock(lf, fcntl.LOCK_EX)
        if not (d / "hf" / "model.safetensors").exists():
            tmp = Path(tempfile.mkdtemp(dir=d, prefix=".hf-"))
            try:
                build_hf(name, tmp)
                if (d / "hf").exists():
                    shutil.rmtree(d / "hf")
                os.replace(tmp, d / "hf")
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        conv = [t for t in ("F32", "F16", "Q8_0") if (t in types or (t == "F32" and "Q4_K_M" in types))
                and not (d / f"{t}.gguf").exists()]
        if conv:
            tmpd = Path(tempfile.mkdtemp(dir=d, prefix=".gguf-"))
            try:
                convert(d / "hf", [(t.lower(), tmpd / f"{t}.gguf") for t in conv], v.pre)
                for t in conv:
                    os.replace(tmpd / f"{t}.gguf", d / f"{t}.gguf")
            finally:
                shutil.rmtree(tmpd, ignore_errors=True)
        if "Q4_K_M" in types and not (d / "Q4_K_M.gguf").exists():
            quantize(d / "F32.gguf", d / "Q4_K_M.gguf", "Q4_K_M")
    return out


def llama_tokenize_check(names) -> int:
    """A development check, not a test: minfer's tokenization of the tokenizer corpus and
    of rendered chat prompts against llama.cpp's own llama-tokenize on each variant's GGUF
    (needs `ninja llama-tokenize` in llama_quants_ref's build-quantize directory). The
    tool reads escapes like \\n in its input, so texts with a backslash are skipped; a
    chat prompt's leading BOS text is dropped before the comparison (the tool adds BOS
    again where minfer, like llama.cpp's chat path, does not)."""
    from test_tokenizer import CORPUS

    from minfer.tokenizer import Tokenizer

    b = llama_quants_ref.cache_dir() / "build-quantize" / "bin"
    env = dict(os.environ, LD_LIBRARY_PATH=str(b))
    convs = [[{"role": "user", "content": "Hello there, how are you?"}],
             [{"role": "user", "content": "Write 2+2."}, {"role": "assistant", "content": "It is 4."},
              {"role": "user", "content": "Thanks!  Bye"}]]

    def lcpp(path, text):
        with tempfile.NamedTemporaryFile("w", encoding="utf-8", suffix=".txt", delete=False) as f:
            f.write(text)
        try:
            r = subprocess.run([str(b / "llama-tokenize"), "-m", str(path), "-f", f.name, "--ids", "--log-disable"],
                               capture_output=True, text=True, env=env)
        finally:
            os.unlink(f.name)
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("[")]
        return json.loads(lines[-1]) if lines else None

    bad = 0
    for name in names:
        path = ensure(name, ("F32",))["F32"]
        tok = Tokenizer.from_gguf_path(path)
        texts = [t for t in CORPUS if t and "\\" not in t]
        diff = [t for t in texts if tok.encode(t) != lcpp(path, t)]
        chat = []
        for c in convs:
            try:
                text = tok.render_chat(c)
            except Exception:  # noqa: BLE001  (a template that refuses the conversation)
                continue
            bos = tok.token_to_piece(tok.bos_id) if tok.bos_id is not None else None
            if bos and tok.add_bos and text.startswith(bos):
                text = text[len(bos):]
            chat.append(tok.encode(text) == lcpp(path, text))
        print(f"{name}: corpus {len(texts) - len(diff)}/{len(texts)} equal, chat prompts {chat}"
              + (f"; first differing {diff[:2]!r}" if diff else ""))
        bad += len(diff) + chat.count(False)
    return 1 if bad else 0


def llama_perplexity_check(names) -> int:
    """A development check, not a test: `minfer perplexity` against llama.cpp's
    llama-perplexity (built by bench/families_bench.py's llama_bench(build=True) directory,
    `cmake --build ... --target llama-perplexity`) on every variant and type, 6 chunks of
    the corpus. llama.cpp pads a context to at least 256 tokens, so the LongRoPE variants
    use a 64-token context (past their original 32: the long factors on both sides); Phi-3's
    sliding window, which llama.cpp ignores, makes phi3 differ by design (see
    docs/models.md). Prints a Markdown table."""
    import re

    b = llama_quants_ref.cache_dir() / "build-bench-noamx" / "bin" / "llama-perplexity"
    text = Path(tempfile.mkdtemp()) / "ppl.txt"
    text.write_text(corpus() * 3, encoding="utf-8")

    def ppl(cmd):
        for _ in range(3):   # llama.cpp's log thread sometimes loses its last line at exit
            r = subprocess.run(cmd, capture_output=True, text=True)
            m = re.search(r"Final estimate: PPL = ([0-9.e+]+)", r.stdout + r.stderr)
            if m:
                return float(m.group(1))
        raise RuntimeError(f"no perplexity from {cmd[0]}: {(r.stdout + r.stderr)[-500:]}")

    print("| variant | type | minfer | llama.cpp | relative difference |\n|---|---|---:|---:|---:|")
    for name in names:
        ctx = "64" if VARIANTS[name].config.get("original_max_position_embeddings", 512) < 64 else "128"
        for t in TYPES:
            p = str(ensure(name)[t])
            a = ppl([sys.executable, "-m", "minfer.cli", "perplexity", p, "-f", str(text), "--ctx", ctx, "--chunks", "6",
                     "-t", "2"])
            c = ppl([str(b), "-m", p, "-f", str(text), "-c", ctx, "--chunks", "6", "-t", "2", "-fa", "off"])
            print(f"| {name} | {t} | {a:.6g} | {c:.6g} | {abs(a - c) / c:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["check-tokenize"]:
        sys.exit(llama_tokenize_check(sys.argv[2:] or list(VARIANTS)))
    if sys.argv[1:2] == ["check-perplexity"]:
        sys.exit(llama_perplexity_check(sys.argv[2:] or list(VARIANTS)))
    for n in sys.argv[1:] or list(VARIANTS):
        paths = ensure(n)
        print(n, {k: str(p) for k, p in paths.items()})


# ---- the transformers side --------------------------------------------------------------

_HF_CACHE: dict = {}


def hf_model(name: str, weights: Path | None = None):
    """The variant's transformers model in float32 with eager attention (the reference
    implementation of soft-capping and sliding windows). weights: a GGUF of the variant
    whose (dequantized) tensors replace the checkpoint's, so a quantized file is compared
    with transformers computing on exactly its weights."""
    import torch
    import transformers

    key = (name, str(weights))
    if key in _HF_CACHE:
        return _HF_CACHE[key]
    v = VARIANTS[name]
    cls = getattr(transformers, v.hf_class)
    m = cls.from_pretrained(str(ensure(name, ())["hf"]), dtype=torch.float32, attn_implementation="eager").eval()
    if weights is not None:
        state = gguf_state_dict(name, weights, m)
        m.load_state_dict(state, strict=False)
        if v.tied or getattr(m.config, "tie_word_embeddings", False):
            m.tie_weights()
    _HF_CACHE[key] = m
    return m


def gguf_state_dict(name: str, path: Path, model) -> dict:
    """The GGUF's tensors, dequantized, under the HF names of `model`, undoing what the
    converter did to them: llama's q/k row permutation (interleaved RoPE), Gemma's +1 on
    the norms."""
    import numpy as np
    import torch
    from gguf import GGUFReader, get_tensor_name_map
    from gguf.constants import MODEL_ARCH_NAMES
    from gguf.quants import dequantize

    v = VARIANTS[name]
    arch = {n: a for a, n in MODEL_ARCH_NAMES.items()}[v.arch]
    cfg = model.config
    tmap = get_tensor_name_map(arch, cfg.num_hidden_layers)
    r = GGUFReader(str(path))
    data = {}
    for t in r.tensors:
        a = dequantize(t.data, t.tensor_type).astype(np.float32)
        data[t.name] = a.reshape([int(d) for d in reversed(t.shape)]) if len(t.shape) > 1 else a.reshape(-1)
    out = {}
    n_head, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    for hf_name, p in model.state_dict().items():
        g = tmap.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if g is None or g not in data:
            continue
        a = data[g]
        if v.arch == "llama" and (hf_name.endswith("q_proj.weight") or hf_name.endswith("k_proj.weight")):
            nh = n_head if "q_proj" in hf_name else n_kv
            a = a.reshape(nh, a.shape[0] // nh // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
        if v.arch.startswith("gemma") and hf_name.endswith("norm.weight"):
            a = a - 1.0
        assert tuple(a.shape) == tuple(p.shape), (hf_name, a.shape, tuple(p.shape))
        out[hf_name] = torch.from_numpy(np.ascontiguousarray(a))
    return out


def hf_logits(name: str, ids: list, weights: Path | None = None):
    """All rows' logits of one forward over `ids` (float64 numpy [len(ids), n_vocab])."""
    import numpy as np
    import torch

    m = hf_model(name, weights)
    with torch.no_grad():
        return m(torch.tensor([list(ids)])).logits[0].numpy().astype(np.float64)
