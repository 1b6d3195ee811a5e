"""The dense families beyond Qwen (llama, gemma2, gemma3, phi3) against transformers.

Every variant of tests/families.py is a tiny random-weight transformers checkpoint of
that family, converted by llama.cpp's convert_hf_to_gguf.py (F32, F16, Q8_0) and
quantized by `minfer quantize` (Q4_K_M). The reference is transformers' forward of the
same checkpoint (float32, eager attention); for quantized files, transformers computing
on the file's own dequantized weights, so what is compared is minfer's arithmetic, not the
quantization error of random weights (that error is reported beside, not asserted).

Tolerances, as max |minfer - transformers| over every logit of every row, divided by the
std of transformers' logits ("rel"), and the root mean square of the same ("rms"):

    F32 (f32 KV)          rel <= 1e-4           (measured ~2e-6 .. 1e-5)
    F16 (f32 KV)          rel <= 1e-4 vs dequantized weights
    Q8_0, Q4_K_M          rms <= 0.05, rel <= 0.25 vs dequantized weights (minfer, like
                          llama.cpp, multiplies with 8-bit activations; measured rms
                          0.006 .. 0.025)
    F32 with f16 KV       rel <= 5e-3

Greedy continuations: minfer's greedy tokens, teacher-forced through transformers, must
each be within a margin of transformers' best logit at that position (exactly the best
for F32/F16 unless two logits are within 1e-3), on a fixed prompt set.
"""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest

import families
from minfer.cli import main
from minfer.session import Context, Session

VARIANTS = list(families.VARIANTS)
TYPES = list(families.TYPES)
QUANT = ("Q8_0", "Q4_K_M")
# Fixed prompts (token ids drawn from a seeded generator; 40 tokens cross every sliding
# window of 8 several times; phi3-long's original context is 32).
PROMPT_LENS = (5, 23, 40)


@pytest.fixture(scope="session")
def built():
    """{variant: {type: path, 'hf': dir}}, built (or found in the cache) once."""
    return {name: families.ensure(name) for name in VARIANTS}


def prompts(name: str) -> list:
    n_vocab = families.hf_model(name).config.vocab_size
    rng = np.random.default_rng(sum(map(ord, name)))
    return [rng.integers(3, n_vocab, size=n).tolist() for n in PROMPT_LENS]


def _session(path, n_ctx=128, kv="f32", threads=2, **kw):
    return Session.open(path, n_ctx=n_ctx, n_threads=threads, backends=["cpu"], kv_type=kv, **kw)


def ctx_for(name: str, n_tokens: int) -> int:
    """LongRoPE variants pick their factors by context (minfer, llama.cpp) or by the
    positions seen (transformers): a context that covers exactly the original one when
    the tokens fit in it makes both take the short factors, a longer one the long."""
    orig = families.VARIANTS[name].config.get("original_max_position_embeddings")
    if families.VARIANTS[name].config.get("rope_parameters", {}) and orig and n_tokens <= orig:
        return orig
    return 128


def _stats(got, ref) -> tuple:
    d = np.abs(np.asarray(got, np.float64) - ref)
    return float(d.max() / ref.std()), float(np.sqrt((d ** 2).mean()) / ref.std())


# ---- logits ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", VARIANTS)
def test_f32_logits_match_transformers(built, name):
    """Every row of a prefill, then a decode step by step, against transformers."""
    path = built[name]["F32"]
    worst = 0.0
    for ids in prompts(name):
        ref = families.hf_logits(name, ids)
        s = _session(path, ctx_for(name, len(ids)))
        rel, _ = _stats(s.forward(ids, n_out=len(ids)), ref)
        worst = max(worst, rel)
        # The same tokens one at a time through the KV cache (decode graphs, windows).
        s = _session(path, ctx_for(name, len(ids)))
        rows = [s.forward(ids[:3], n_out=3)]
        rows += [s.forward([t]) for t in ids[3:]]
        rel, _ = _stats(np.concatenate([np.asarray(r).reshape(-1, ref.shape[1]) for r in rows]), ref)
        worst = max(worst, rel)
    assert worst <= 1e-4, f"{name} F32: max |minfer - transformers| / std = {worst:.2e}"


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("qtype", ["F16", *QUANT])
def test_quantized_logits_match_transformers_on_the_same_weights(built, name, qtype):
    path = built[name][qtype]
    rels, rmss = [], []
    for ids in prompts(name):
        ref = families.hf_logits(name, ids, weights=path)
        rel, rms = _stats(_session(path, ctx_for(name, len(ids))).forward(ids, n_out=len(ids)), ref)
        rels.append(rel)
        rmss.append(rms)
    if qtype == "F16":
        assert max(rels) <= 1e-4, f"{name} F16: rel {max(rels):.2e}"
    else:
        assert max(rmss) <= 0.05 and max(rels) <= 0.25, f"{name} {qtype}: rms {max(rmss):.3f} rel {max(rels):.3f}"


@pytest.mark.parametrize("name", VARIANTS)
def test_f16_kv_cache_stays_close(built, name):
    ids = prompts(name)[-1]
    ref = families.hf_logits(name, ids)
    rel, _ = _stats(_session(built[name]["F32"], ctx_for(name, len(ids)), kv="f16").forward(ids, n_out=len(ids)), ref)
    assert rel <= 5e-3, f"{name}: f16 KV rel {rel:.2e}"


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("qtype", TYPES)
def test_greedy_continuations_are_consistent(built, name, qtype):
    """16 greedy tokens per prompt from minfer's engine; transformers, fed the same
    sequence, must rank each pick at (or within the margin of) its top."""
    path = built[name][qtype]
    weights = None if qtype == "F32" else path
    margin = {"F32": 1e-3, "F16": 1e-3, "Q8_0": 0.25, "Q4_K_M": 0.4}[qtype]
    for ids in prompts(name):
        s = _session(path, ctx_for(name, len(ids) + 16), kv="f32")
        out = s.forward(ids, n_out=1)
        gen = []
        for _ in range(16):
            t = int(np.argmax(np.asarray(out).reshape(-1)))
            gen.append(t)
            out = s.forward([t])
        ref = families.hf_logits(name, ids + gen[:-1], weights=weights)[len(ids) - 1:]
        for j, t in enumerate(gen):
            gap = ref[j].max() - ref[j][t]
            assert gap <= margin, (f"{name} {qtype}: token {j} of the continuation ({t}) is {gap:.4f} below "
                                   f"transformers' best ({int(ref[j].argmax())})")


def test_phi3_longrope_short_and_long_factors(built):
    """LongRoPE: a context past the original one uses the long factors, else the short
    ones; transformers switches on the positions seen, so short prompts in a short
    context and long ones in a long context agree."""
    name = "phi3-long"
    path = built[name]["F32"]
    short = prompts(name)[1]                  # 23 tokens <= 32
    ref = families.hf_logits(name, short)     # transformers: short factors
    rel, _ = _stats(_session(path, n_ctx=32).forward(short, n_out=len(short)), ref)
    assert rel <= 1e-4
    rel_long, _ = _stats(_session(path, n_ctx=128).forward(short, n_out=len(short)), ref)
    assert rel_long > 1e-3   # the long factors really are different
    # Four sequences of 32 cells are not one context of 128: short factors (llama.cpp's
    # n_ctx_per_seq).
    from minfer.model import Model
    from minfer.session import Context
    ctx = Context(Model.open(path, n_threads=2, backends=["cpu"]), n_ctx=32, n_seq=4, kv_type="f32")
    rel4, _ = _stats(ctx.session(2).forward(short, n_out=len(short)), ref)
    assert rel4 <= 1e-4


# ---- the engine's identities on the new ops --------------------------------------------

@pytest.mark.parametrize("name", ["llama3", "gemma2", "gemma3", "phi3"])
def test_fused_unfused_threads_and_steps_are_bitwise_equal(built, name):
    path = built[name]["Q4_K_M"]
    ids = prompts(name)[-1]
    base = np.asarray(_session(path, threads=2).forward(ids, n_out=len(ids)))
    assert np.array_equal(base, np.asarray(_session(path, threads=1).forward(ids, n_out=len(ids))))
    assert np.array_equal(base, np.asarray(_session(path, threads=2, fuse=False).forward(ids, n_out=len(ids))))
    # Row i of a block forward is bitwise the single step's (speculative decoding relies on it).
    s = _session(path)
    first = np.asarray(s.forward(ids[:10], n_out=10))
    steps = [np.asarray(s.forward([t])).reshape(-1) for t in ids[10:]]
    assert np.array_equal(base[:10], first) and np.array_equal(base[10:], np.stack(steps))


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "phi3"])
def test_several_sequences_match_one_at_a_time(built, name):
    """Sliding windows over explicit per-sequence spans (a context of two sequences)."""
    path = built[name]["F32"]
    a, b = prompts(name)[2], prompts(name)[1]
    solo = [np.asarray(_session(path).forward(p, n_out=1)).reshape(-1) for p in (a, b)]
    from minfer.model import Model

    ctx = Context(Model.open(path, backends=["cpu"], n_threads=2), n_ctx=64, n_seq=2, kv_type="f32")
    sa, sb = ctx.session(0), ctx.session(1)
    sa.forward(a[:-1], n_out=1)
    sb.forward(b[:-1], n_out=1)
    rows = ctx.decode_batch([(sa, [a[-1]]), (sb, [b[-1]])])
    for got, want in zip(np.asarray(rows), solo):
        assert np.max(np.abs(got - want)) / want.std() <= 1e-5


# ---- tokenizers and chat templates --------------------------------------------------------

CONVERSATIONS = [
    [{"role": "user", "content": "Hello there, how are you?"}],
    [{"role": "user", "content": "Write 2+2."}, {"role": "assistant", "content": "It is 4."},
     {"role": "user", "content": "Thanks!  Bye"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "日本語 😀 ok"}],
]


def _texts():
    from test_tokenizer import CORPUS

    return CORPUS


@pytest.mark.parametrize("name", VARIANTS)
def test_tokenizer_matches_reference(built, name):
    """Byte-level BPE: transformers' tokenizer of the checkpoint, on the whole corpus.
    SentencePiece: the sentencepiece library on the checkpoint's tokenizer.model (what
    llama.cpp follows), and transformers where they agree (transformers' Metaspace does
    not add the ▁ prefix before text that starts with a space, sentencepiece does)."""
    from transformers import AutoTokenizer

    from minfer.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf_path(built[name]["F32"])
    ref = AutoTokenizer.from_pretrained(str(built[name]["hf"]))
    texts = _texts()
    if tok.model == "gpt2":
        bad = [s for s in texts if tok.encode(s, add_bos=False) != ref.encode(s, add_special_tokens=False)]
        assert not bad, f"{len(bad)} of {len(texts)} differ from transformers; first {bad[:3]!r}"
    else:
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_file=str(built[name]["hf"] / "tokenizer.model"))
        specials = [tok.token_to_piece(i) for i in range(tok.n_vocab) if tok.is_special(i)]
        plain = [s for s in texts if not any(x in s for x in specials)]
        bad = [s for s in plain if tok.encode(s, add_bos=False) != sp.encode(s)]
        assert not bad, f"{len(bad)} of {len(plain)} differ from sentencepiece; first {bad[:3]!r}"
        agree = [s for s in texts if not s[:1].isspace()]
        bad = [s for s in agree if tok.encode(s, add_bos=False) != ref.encode(s, add_special_tokens=False)]
        assert not bad, f"{len(bad)} of {len(agree)} differ from transformers; first {bad[:3]!r}"
    # Decoding gives the text back (SentencePiece: behind the space prefix it added).
    prefix = " " if tok.add_space_prefix else ""
    specials = [tok.token_to_piece(i) for i in range(tok.n_vocab) if tok.is_special(i)]
    for s in texts:
        if tok.model == "gpt2":
            assert tok.decode(tok.encode(s, add_bos=False)) == s
        elif s and not any(x in s for x in specials):
            assert tok.decode(tok.encode(s, add_bos=False)) == prefix + s


# Where llama.cpp (and so minfer) tokenizes a rendered prompt unlike transformers 5: a
# SentencePiece vocabulary with a space prefix puts ▁ after every special token, as
# llama.cpp and Meta's Llama 2 reference code do; transformers 5 does not.
IDS_DIFFER = {"llama2", "mistral"}


@pytest.mark.parametrize("name", VARIANTS)
def test_chat_template_renders_as_transformers(built, name):
    from transformers import AutoTokenizer

    from minfer.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf_path(built[name]["F32"])
    ref = AutoTokenizer.from_pretrained(str(built[name]["hf"]))
    assert tok.chat_template == ref.chat_template
    checked = 0
    for conv in CONVERSATIONS:
        for gen in (True, False):
            try:
                theirs = ref.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
            except Exception as e:  # noqa: BLE001  (the template refuses a system role, say)
                with pytest.raises(Exception, match=str(e)[:30].replace("(", ".").replace(")", ".")):
                    tok.render_chat(conv, add_generation_prompt=gen)
                continue
            ours = tok.render_chat(conv, add_generation_prompt=gen)
            assert ours == theirs
            checked += 1
            if name not in IDS_DIFFER:
                ids = ref.apply_chat_template(conv, tokenize=True, add_generation_prompt=gen)
                ids = ids["input_ids"] if hasattr(ids, "keys") else ids
                assert tok.encode(ours, add_bos=False) == list(ids)
    assert checked >= 2


def test_end_of_turn_tokens(built):
    from minfer.tokenizer import Tokenizer

    want = {"llama3": "<|eot_id|>", "smollm2": "<|im_end|>", "gemma2": "<end_of_turn>", "gemma3": "<end_of_turn>",
            "phi3": "<|end|>", "phi4mini": "<|end|>", "llama2": "</s>", "mistral": "</s>"}
    for name, text in want.items():
        tok = Tokenizer.from_gguf_path(built[name]["F32"])
        assert tok.id_of(text) in tok.eot_ids, (name, text)


# ---- the command line ---------------------------------------------------------------------

def _run(capsys, *args):
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("name", VARIANTS)
def test_cli_runs_the_family(built, name, capsys, tmp_path, monkeypatch):
    path = built[name]["Q4_K_M"]
    rc, out, err = _run(capsys, "generate", path, "Hello there", "-n", "8", "--temp", "0", "-t", "2", "-c", "128")
    assert rc == 0, err
    rc, out, err = _run(capsys, "generate", path, "Hello there", "-n", "4", "--temp", "0", "--chat", "-c", "128")
    assert rc == 0, err
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi!\nAnd again?\n"))
    rc, out, err = _run(capsys, "chat", path, "-n", "6", "--temp", "0", "-c", "128")
    assert rc == 0, err
    rc, out, err = _run(capsys, "bench", path, "-p", "16", "-n", "4", "-r", "1", "-t", "2", "-o", "json")
    assert rc == 0, err
    rows = json.loads(out)
    assert rows and all(r["avg_ts"] > 0 for r in rows)
    check_perplexity_and_graphs(capsys, path, tmp_path)


def check_perplexity_and_graphs(capsys, path, tmp_path) -> str:
    """`minfer perplexity` gives a finite PPL above 1 and --dump-graph / --dump-graph-json
    write their formats (also tests/test_family_commands.py's); returns the DOT text."""
    text = tmp_path / "t.txt"
    text.write_text(families.corpus()[:3000], encoding="utf-8")
    rc, out, err = _run(capsys, "perplexity", path, "-f", text, "--ctx", "64", "--chunks", "2", "-t", "2")
    assert rc == 0, err
    ppl = float(out.split("Final estimate: PPL = ")[1].split()[0])
    assert math.isfinite(ppl) and ppl > 1
    dot = tmp_path / "g.dot"
    rc, out, err = _run(capsys, "generate", path, "Hello", "--dump-graph", dot)
    assert rc == 0 and dot.read_text().startswith("digraph")
    js = tmp_path / "g.json"
    rc, out, err = _run(capsys, "generate", path, "Hello", "--dump-graph-json", js, "--decode")
    assert rc == 0
    doc = json.loads(js.read_text())
    assert doc["format"] == "minfer-graph" and doc["nodes"]
    return dot.read_text()


def test_chat_prompt_starts_with_one_bos(built):
    """A template that writes bos_token, encoded the model's way, starts with one BOS."""
    from minfer.tokenizer import Tokenizer

    for name in ("llama2", "llama3", "mistral", "gemma2", "gemma3"):
        tok = Tokenizer.from_gguf_path(built[name]["F32"])
        ids = tok.encode(tok.render_chat(CONVERSATIONS[0], add_generation_prompt=True))
        assert ids[0] == tok.bos_id and ids[1] != tok.bos_id, name
        assert tok.encode("hi", add_bos=True)[0] == tok.bos_id
        assert tok.encode(tok.token_to_piece(tok.bos_id) + "hi", add_bos=True)[:2] == [tok.bos_id] * 2


def test_spm_continuation_has_no_space_prefix(built):
    from minfer.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf_path(built["llama2"]["F32"])
    assert tok.decode(tok.encode("hello", add_bos=False)) == " hello"
    assert tok.decode(tok.encode("hello", add_bos=False, add_space_prefix=False)) == "hello"


# ---- llama.cpp's tokenizer test vectors -----------------------------------------------------

VECTORS = ["llama-spm", "phi-3", "llama-bpe", "gpt-2", "qwen2", "starcoder"]


def _vectors(name: str) -> list:
    d = families.vocab_dir()
    inp = (d / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    out = (d / f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8").split("\n")[:len(inp)]
    return [(s, [int(x) for x in o.split()]) for s, o in zip(inp, out)]


@pytest.mark.parametrize("name", VECTORS)
def test_llama_cpp_tokenizer_vectors(name):
    """test-tokenizer-0's cases (texts tokenized by the model's own HF tokenizer, as
    llama.cpp's convert_hf_to_gguf_update.py recorded them), on llama.cpp's vocab GGUFs."""
    from minfer.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf_path(families.vocab_dir() / f"ggml-vocab-{name}.gguf")
    cases = _vectors(name)
    assert len(cases) >= 40
    bad = [(s, want) for s, want in cases if tok.encode(s, add_bos=False) != want]
    assert not bad, f"{len(bad)} of {len(cases)} differ; first {bad[:2]!r}"


def test_spm_matches_sentencepiece_on_llama_vocab():
    """Llama's real 32k SentencePiece vocabulary (from llama.cpp's vocab GGUF, rebuilt
    as a sentencepiece model) on the tokenizer corpus."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    from minfer.tokenizer import Tokenizer, read_gguf_metadata

    md = read_gguf_metadata(families.vocab_dir() / "ggml-vocab-llama-spm.gguf")
    tok = Tokenizer.from_metadata(md)
    mp = pb.ModelProto()
    kinds = {1: pb.ModelProto.SentencePiece.NORMAL, 2: pb.ModelProto.SentencePiece.UNKNOWN,
             3: pb.ModelProto.SentencePiece.CONTROL, 4: pb.ModelProto.SentencePiece.USER_DEFINED,
             5: pb.ModelProto.SentencePiece.UNUSED, 6: pb.ModelProto.SentencePiece.BYTE}
    for t, sc, ty in zip(md["tokenizer.ggml.tokens"], md["tokenizer.ggml.scores"], md["tokenizer.ggml.token_type"]):
        p = mp.pieces.add()
        p.piece, p.score, p.type = t, float(sc), kinds[int(ty)]
    mp.trainer_spec.model_type = pb.TrainerSpec.BPE
    mp.trainer_spec.byte_fallback = True
    mp.normalizer_spec.name = "identity"
    mp.normalizer_spec.add_dummy_prefix = True
    mp.normalizer_spec.remove_extra_whitespaces = False
    mp.normalizer_spec.escape_whitespaces = True
    sp = spm.SentencePieceProcessor(model_proto=mp.SerializeToString())
    specials = [tok.token_to_piece(i) for i in range(tok.n_vocab) if tok.is_special(i)]
    texts = [s for s in _texts() if not any(x in s for x in specials)]
    bad = [s for s in texts if tok.encode(s, add_bos=False) != sp.encode(s)]
    assert len(texts) > 300 and not bad, f"{len(bad)} differ; first {bad[:3]!r}"


@pytest.mark.parametrize("name, model, pre", [("command-r", "gpt2", "command-r"), ("qwen35", "gpt2", "qwen35"),
                                              ("gemma-4", "gemma4", None)])
def test_unknown_tokenizers_are_refused_by_name(name, model, pre):
    from minfer.errors import UnsupportedModelError
    from minfer.tokenizer import Tokenizer

    with pytest.raises(UnsupportedModelError, match=pre or model):
        Tokenizer.from_gguf_path(families.vocab_dir() / f"ggml-vocab-{name}.gguf")


# ---- refusals -------------------------------------------------------------------------------

def _patched(src, dst, *, set_kv=None, drop=(), arch=None):
    """A copy of GGUF `src` with metadata keys set / dropped (tensors as they are)."""
    import gguf

    from minfer.testing.gguf_io import fields, write

    r = gguf.GGUFReader(str(src))
    set_kv = set_kv or {}
    keys = [k for k in fields(r) if k[0] not in drop and k[0] not in set_kv]
    keys += [(k, v, vt, None) for k, (v, vt) in set_kv.items()]
    write(dst, arch or r.fields["general.architecture"].contents(), keys, r.tensors)
    return dst


@pytest.mark.parametrize("name, key, value, match", [
    ("llama2", "llama.rope.scaling.type", "yarn", "llama: rope scaling type 'yarn' is not supported"),
    ("llama3", "llama.rope.dimension_count", 32, "rope.dimension_count 32 must equal the head dim 64"),
    ("llama3", "llama.vocab_size", 1000, "llama.vocab_size 1000 disagrees with token_embd.weight's"),
    ("phi3", "phi3.rope.scaling.type", "yarn", "phi3: rope scaling type 'yarn' is not supported"),
    ("gemma3", "gemma3.rope.scaling.type", "yarn", "gemma3: rope scaling type 'yarn' is not supported"),
])
def test_unimplemented_features_are_refused_by_name(built, tmp_path, name, key, value, match):
    import gguf

    from minfer.errors import UnsupportedModelError
    from minfer.model import Model

    vt = gguf.GGUFValueType.STRING if isinstance(value, str) else gguf.GGUFValueType.UINT32
    bad = _patched(built[name]["F32"], tmp_path / "bad.gguf", set_kv={key: (value, vt)})
    with pytest.raises(UnsupportedModelError, match=match.replace("(", r"\(").replace(")", r"\)")):
        Model.open(bad, backends=["cpu"])
    rc, out, err = _run_proc(bad)
    assert rc == 1 and err.count("\n") == 1 and match.split(":")[0] in err


def _run_proc(path):
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "minfer.cli", "generate", str(path), "hi", "-n", "1"],
                       capture_output=True, text=True)
    return p.returncode, p.stdout, p.stderr


@pytest.mark.parametrize("name", VARIANTS)
def test_cuda_takes_every_node_of_every_family(built, name):
    """The CUDA matrix accepts every node of every family (interleaved RoPE with frequency
    factors and scaling, GELU / GeGLU, scale, soft-caps, sliding windows, the column slice,
    head dim 96), prefill and decode graphs alike, so a GPU run of these models places
    every node on the GPU: nothing is refused and nothing is left to the CPU."""
    from minfer.backends import cuda
    from minfer.graph.params import CParams, GraphParams, GraphType
    from minfer.io.gguf_file import GGUFFile
    from minfer.models import load_model

    model = load_model(GGUFFile.open(built[name]["Q4_K_M"]))
    for params in (GraphParams(4, 1, GraphType.Prefill, CParams(n_ctx=64, gpu=True)),
                   GraphParams(1, 1, GraphType.Decode, CParams(n_ctx=64, gpu=True))):
        g = model.build_graph(params)
        left = [f"{n.name} ({n.op})" for n in g.nodes if not cuda.supports_op(n)]
        assert not left, f"{name}: the cuda backend does not take {left}"


def test_synthetic_llama_rope_factors_are_the_converters(built):
    """minfer.testing.synth writes Llama 3's rope_freqs.weight (the benchmark shape's, and
    its tests') as llama.cpp's converter does: the llama3 variant's converted factors."""
    from minfer.io.gguf_file import GGUFFile
    from minfer.testing.synth import llama3_rope_factors

    rp = families.VARIANTS["llama3"].config["rope_parameters"]
    with GGUFFile.open(built["llama3"]["F32"]) as g:
        got = np.frombuffer(g.tensor_data("rope_freqs.weight"), np.float32)
    want = llama3_rope_factors(64, rp["rope_theta"], rp["factor"], rp["low_freq_factor"], rp["high_freq_factor"],
                               rp["original_max_position_embeddings"])
    assert np.array_equal(got, want)


def test_cuda_refuses_nothing_of_qwen(tmp_path):
    from minfer.backends import cuda
    from minfer.graph.params import CParams, GraphParams, GraphType
    from minfer.io.gguf_file import GGUFFile
    from minfer.models import load_model
    from minfer.testing import write_model

    write_model(tmp_path / "q.gguf")
    g = load_model(GGUFFile.open(tmp_path / "q.gguf")).build_graph(
        GraphParams(4, 1, GraphType.Prefill, CParams(n_ctx=64, gpu=True)))
    for n in g.nodes:   # no refusal (whether the tiny head dim has a kernel is another matter)
        cuda.supports_op(n)
