"""The family and mixture-of-experts checkpoints the GPU suite runs (CUDA against CPU).

Building them needs transformers and llama.cpp's converter (tests/families.py,
tests/moe_models.py), which the GPU machine lacks; so they are built here and carried:

    python tests/gpu_models.py DIR      # copy every variant's Q8_0 and Q4_K_M into DIR
    GPU_SUITE_MODELS=DIR pytest -m cuda tests/test_cuda_families.py

With GPU_SUITE_MODELS set, a missing file is an error (never a skip); unset, the
files come from (or are built into) the usual caches.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

DENSE = ("llama2", "llama3", "mistral", "smollm2", "gemma2", "gemma3", "phi3", "phi3-long", "phi4mini")
MOE = ("qwen2moe", "qwen3moe", "mixtral")
QTYPES = ("Q8_0", "Q4_K_M")
ENV = "GPU_SUITE_MODELS"


def _carried(name: str, qtype: str) -> Path | None:
    d = os.environ.get(ENV)
    if not d:
        return None
    p = Path(d) / f"{name}-{qtype}.gguf"
    if not p.exists():
        raise FileNotFoundError(f"{ENV}={d} has no {p.name} (make it with: python tests/gpu_models.py DIR)")
    return p


def family_gguf(name: str, qtype: str) -> Path:
    """A dense family variant's GGUF (tests/families.py's VARIANTS) of type Q8_0 or Q4_K_M."""
    p = _carried(name, qtype)
    if p is not None:
        return p
    import families
    return families.ensure(name, (qtype,))[qtype]


def moe_gguf(name: str, qtype: str) -> Path:
    """A mixture-of-experts family's GGUF (tests/moe_models.py) of type Q8_0 or Q4_K_M."""
    p = _carried(name, qtype)
    if p is not None:
        return p
    import moe_models
    return moe_models.gguf_path(name, qtype)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python tests/gpu_models.py DIR", file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    for names, get in ((DENSE, family_gguf), (MOE, moe_gguf)):
        for n in names:
            for q in QTYPES:
                shutil.copyfile(get(n, q), out / f"{n}-{q}.gguf")
    total = sum(p.stat().st_size for p in out.glob("*.gguf"))
    print(f"{out}: {len(list(out.glob('*.gguf')))} files, {total / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
