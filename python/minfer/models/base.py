"""ModelDef: what the engine needs from an architecture (§10 of the design of record).

A model reads its hyper-parameters and tensor table from the GGUF, validates them
(names and shapes) up front, and builds the compute graph for given params. It never
executes anything: weights are referenced by name. Which weight types can run is
the selected backends' call (they refuse a type at registration, naming the tensor).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from minfer.errors import UnsupportedModelError

if TYPE_CHECKING:
    from minfer.io.gguf_file import GGUFFile, TensorInfo
    from minfer.graph.ir import ComputeGraph
    from minfer.graph.params import GraphParams


# Upper bound for any count or dimension in the metadata: far above any real model,
# low enough that products of a few of them stay exact and allocations stay sane.
_MAX_DIM = 1 << 24


def _natural(name: str) -> list:
    # blk.2 before blk.10 in error messages.
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


@dataclass(frozen=True)
class HParams:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    rope_base: float
    eps: float

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim


def _squeeze(shape: tuple[int, ...]) -> tuple[int, ...]:
    # GGUF may store a vector as [n] or [n, 1]: compare shapes without trailing ones.
    s = list(shape)
    while len(s) > 1 and s[-1] == 1:
        s.pop()
    return tuple(s)


class MetaReader:
    """Checked reads of `<arch>.<key>` metadata: each bad value is refused naming its key."""

    def __init__(self, g: GGUFFile, arch: str):
        self.g, self.arch, self.md = g, arch, g.metadata

    def key(self, k: str) -> str:
        return f"{self.arch}.{k}"

    def has(self, k: str) -> bool:
        return self.key(k) in self.md

    def bad(self, k: str, v, why: str) -> UnsupportedModelError:
        return UnsupportedModelError(f"{self.g.path}: metadata {self.key(k)} = {v!r} {why}")

    def count(self, k: str, default: int | None = None, lo: int = 1) -> int:
        if self.key(k) not in self.md:
            if default is None:
                raise UnsupportedModelError(f"{self.g.path}: missing metadata key {self.key(k)}")
            return default
        v = self.md[self.key(k)]
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise self.bad(k, v, "is not an integer")
        if not lo <= int(v) <= _MAX_DIM:
            raise self.bad(k, int(v), f"is out of range (must be in [{lo}, {_MAX_DIM}])")
        return int(v)

    def real(self, k: str, default: float, ok, rule: str) -> float:
        v = self.md.get(self.key(k), default)
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
            raise self.bad(k, v, "is not a number")
        v = float(v)
        if not (math.isfinite(v) and ok(v)):
            raise self.bad(k, v, f"is invalid (must be {rule})")
        return v

    def string(self, k: str, default: str | None = None) -> str | None:
        v = self.md.get(self.key(k), default)
        if v is not None and not isinstance(v, str):
            raise self.bad(k, v, "is not a string")
        return v

    def flags(self, k: str, n: int) -> list[bool] | None:
        """A per-layer boolean array of n entries (e.g. attention.sliding_window_pattern), or None."""
        if self.key(k) not in self.md:
            return None
        v = self.md[self.key(k)]
        try:
            out = [bool(x) for x in v]
        except TypeError:
            raise self.bad(k, v, "is not an array") from None
        if len(out) != n:
            raise self.bad(k, v, f"has {len(out)} entries, expected one per layer ({n})")
        return out


class ModelDef:
    """Base class: hyper-parameters, tensor lookup and validation shared by the Qwen family."""

    arch: str = ""

    def __init__(self, gguf: GGUFFile):
        self.gguf = gguf
        self.hp = self._read_hparams(gguf)
        self.tensors: dict[str, TensorInfo] = dict(gguf.tensors)
        self._validate()

    # -- hyper-parameters -------------------------------------------------------------
    def _read_hparams(self, g: GGUFFile) -> HParams:
        # A file is untrusted input: every hyper-parameter is type- and range-checked
        # here, naming the key, so a lying file never reaches the graph as garbage.
        md = self.meta = MetaReader(g, self.arch)
        count, real = md.count, md.real

        n_layer = count("block_count")
        n_embd = count("embedding_length")
        n_head = count("attention.head_count")
        n_head_kv = count("attention.head_count_kv", n_head)
        head_dim = count("attention.key_length", max(n_embd // n_head, 1))
        n_ff = count("feed_forward_length")
        n_ctx_train = count("context_length", 4096)
        rope_base = real("rope.freq_base", 10000.0, lambda v: v > 0, "a finite number > 0")
        eps = real("attention.layer_norm_rms_epsilon", 1e-6, lambda v: 0 < v < 1, "a finite number in (0, 1)")
        emb = g.tensors.get("token_embd.weight")
        if emb is None:
            raise UnsupportedModelError(f"{g.path}: missing tensor token_embd.weight")
        if n_head % n_head_kv:
            raise UnsupportedModelError(f"{g.path}: head counts {n_head}/{n_head_kv} are not a valid GQA layout")
        if head_dim % 2:
            raise UnsupportedModelError(f"{g.path}: head dim {head_dim} must be even for RoPE")
        if md.has("attention.value_length") and count("attention.value_length") != head_dim:
            raise UnsupportedModelError(
                f"{g.path}: {self.arch}: a value head dim ({count('attention.value_length')}) other than the key "
                f"head dim ({head_dim}) is not supported")
        n_vocab = int(emb.shape[1]) if len(emb.shape) > 1 else 0
        if n_vocab < 1:
            raise UnsupportedModelError(f"{g.path}: token_embd.weight has shape {list(emb.shape)}; expected [n_embd, n_vocab]")
        return HParams(
            arch=self.arch,
            n_layer=n_layer,
            n_embd=n_embd,
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            n_ff=n_ff,
            n_vocab=n_vocab,
            n_ctx_train=n_ctx_train,
            rope_base=rope_base,
            eps=eps,
        )

    # -- tensors ----------------------------------------------------------------------
    def expected_tensors(self) -> dict[str, tuple[int, ...]]:
        """name -> GGUF shape (ne0 first) of every tensor the graph reads."""
        raise NotImplementedError

    def tensor(self, name: str) -> TensorInfo:
        return self.tensors[name]

    def has(self, name: str) -> bool:
        return name in self.tensors

    @property
    def output_weight(self) -> str:
        # Tied embeddings: no output.weight, the embedding table doubles as the lm head.
        return "output.weight" if "output.weight" in self.tensors else "token_embd.weight"

    def _validate(self) -> None:
        expected = self.expected_tensors()
        # A tensor the architecture never reads means the metadata and the file disagree
        # (e.g. block_count below the file's layer count): refuse rather than run part of it.
        unused = sorted(set(self.tensors) - set(expected), key=_natural)
        if unused:
            shown = ", ".join(unused[:8]) + (f" and {len(unused) - 8} more" if len(unused) > 8 else "")
            raise UnsupportedModelError(
                f"{self.gguf.path}: {len(unused)} tensor(s) in the file are not used by the {self.hp.arch} "
                f"architecture with {self.arch}.block_count = {self.hp.n_layer}: {shown}"
            )
        for name, shape in expected.items():
            t = self.tensors.get(name)
            if t is None:
                raise UnsupportedModelError(f"{self.gguf.path}: missing tensor {name}")
            got = tuple(int(d) for d in t.shape)
            if _squeeze(got) != _squeeze(shape):
                raise UnsupportedModelError(f"{self.gguf.path}: tensor {name} has shape {list(got)}, expected {list(shape)}")

    def weight_bytes_per_token(self) -> int:
        """Bytes of weights a decode step reads: every matmul weight once, plus one
        embedding row (the lm head is read in full)."""
        total = 0
        for name in self.expected_tensors():
            t = self.tensors[name]
            if name == "token_embd.weight" and self.output_weight != name:
                total += t.row_nbytes
            else:
                total += t.nbytes
        return total

    def build_graph(self, params: GraphParams) -> ComputeGraph:
        raise NotImplementedError
