"""A random-weight GGUF with a real model's shapes and metadata (for bench/cpu_sweep.sh).

    python bench/shaped_model.py extract MODEL.gguf META.json.gz   # metadata + tensor shapes
    python bench/shaped_model.py make META.json.gz OUT-f16.gguf [--seed 0]

`extract` keeps every metadata key (tokenizer included) and each tensor's name and shape,
not its data: a few MB that can travel to a machine without the model. `make` writes an
F16 model (1-D tensors F32, as llama.cpp's converters do) with normal(0, 0.02) weights
and unit norm weights, which llama.cpp's quantizer then turns into the usual type mix
(`llama-quantize OUT-f16.gguf OUT.gguf Q4_K_M`). Random weights make the same work per
token as trained ones: the benchmark times matmuls and attention, not the text.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys

import numpy as np


def extract(src: str, dst: str) -> None:
    import gguf

    from minfer.testing.gguf_io import fields as keys_of

    r = gguf.GGUFReader(src)
    fields = [{"key": name, "type": int(vt), "sub": None if sub is None else int(sub), "value": val}
              for name, val, vt, sub in keys_of(r) if name != "general.file_type"]
    tensors = [{"name": t.name, "shape": [int(x) for x in t.shape]} for t in r.tensors]
    arch = r.fields["general.architecture"].contents()
    with gzip.open(dst, "wt") as fh:
        json.dump({"arch": arch, "fields": fields, "tensors": tensors}, fh)


def make(meta_path: str, dst: str, seed: int) -> None:
    import gguf

    with gzip.open(meta_path, "rt") as fh:
        meta = json.load(fh)
    w = gguf.GGUFWriter(dst, meta["arch"])
    for f in meta["fields"]:
        if f["key"] == "general.architecture":
            continue
        vt = gguf.GGUFValueType(f["type"])
        sub = gguf.GGUFValueType(f["sub"]) if f["sub"] is not None else None
        w.add_key_value(f["key"], f["value"], vt, sub_type=sub)
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_F16))
    rng = np.random.default_rng(seed)
    for t in meta["tensors"]:
        shape = list(reversed(t["shape"]))  # numpy order: rows last-dim first
        if len(shape) == 1:
            a = np.ones(shape, np.float32) if "norm" in t["name"] else \
                (rng.standard_normal(shape, dtype=np.float32) * 0.02)
            w.add_tensor(t["name"], a.astype(np.float32))
        else:
            a = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)
            w.add_tensor(t["name"], a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sp = ap.add_subparsers(dest="cmd", required=True)
    e = sp.add_parser("extract")
    e.add_argument("src")
    e.add_argument("dst")
    m = sp.add_parser("make")
    m.add_argument("meta")
    m.add_argument("dst")
    m.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    try:
        extract(a.src, a.dst) if a.cmd == "extract" else make(a.meta, a.dst, a.seed)
    except (OSError, ValueError, KeyError) as exc:
        print(f"shaped_model: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
