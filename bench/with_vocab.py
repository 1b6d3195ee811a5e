"""A GGUF with another file's tokenizer: every key and tensor of MODEL, the tokenizer.*
keys of VOCAB (e.g. llama.cpp's vocab-only ggml-vocab-qwen2.gguf), for benches that need
a real vocabulary on a shaped random-weight model (bench/schema_overhead.py on the GPU
machine, which has neither the default model nor a network).

    python bench/with_vocab.py MODEL.gguf VOCAB.gguf OUT.gguf

The vocabulary must not be larger than the model's rows (token_embd); a smaller one is
padded to them with unused `[PAD<id>]` tokens, as convert_hf_to_gguf.py pads a real
model's (Qwen2-7B's 152,064 rows over its tokenizer's 151,936 entries here): the
vocabulary then names every id the output can pick, which llama.cpp requires.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    import gguf

    from minfer.testing.gguf_io import fields, write

    if len(argv) != 3:
        print(__doc__.strip().splitlines()[-5].strip(), file=sys.stderr)
        return 2
    src, voc, out = (gguf.GGUFReader(argv[0]), gguf.GGUFReader(argv[1]), argv[2])
    n_tok = len(voc.fields["tokenizer.ggml.tokens"].contents())
    emb = next(t for t in src.tensors if t.name == "token_embd.weight")
    if n_tok > int(emb.shape[-1]):
        print(f"error: the vocabulary has {n_tok} tokens, the model {int(emb.shape[-1])} rows", file=sys.stderr)
        return 1
    arch = src.fields["general.architecture"].contents()
    n_rows = int(emb.shape[-1])
    pad = {"tokenizer.ggml.tokens": [f"[PAD{i}]" for i in range(n_tok, n_rows)],
           "tokenizer.ggml.token_type": [int(gguf.TokenType.UNUSED)] * (n_rows - n_tok),
           "tokenizer.ggml.scores": [0.0] * (n_rows - n_tok)}
    keys = [k for k in fields(src) if not k[0].startswith("tokenizer.")]
    keys += [(name, list(val) + pad[name] if name in pad else val, vt, sub)
             for name, val, vt, sub in fields(voc) if name.startswith("tokenizer.")]
    write(out, arch, keys, src.tensors)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
