"""ModelDef: what the engine needs from an architecture (§10 of the design of record).

A model reads its hyper-parameters and tensor table from the GGUF, validates them
(names and shapes) up front, and builds the compute graph for given params. It never
executes anything: weights are referenced by name. Which weight types can run is
the selected backends' call (they refuse a type at registration, naming the tensor).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from minfer.errors import UnsupportedModelError

if TYPE_CHECKING:
    from minfer.io.gguf_file import GGUFFile, TensorInfo
    from minfer.graph.ir import ComputeGraph
    from minfer.graph.params import GraphParams


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
        a = self.arch
        md = g.metadata

        def need(key: str):
            k = f"{a}.{key}"
            if k not in md:
                raise UnsupportedModelError(f"{g.path}: missing metadata key {k}")
            return md[k]

        n_embd = int(need("embedding_length"))
        n_head = int(need("attention.head_count"))
        n_head_kv = int(md.get(f"{a}.attention.head_count_kv", n_head))
        head_dim = int(md.get(f"{a}.attention.key_length", n_embd // max(n_head, 1)))
        emb = g.tensors.get("token_embd.weight")
        if emb is None:
            raise UnsupportedModelError(f"{g.path}: missing tensor token_embd.weight")
        if n_head <= 0 or n_head_kv <= 0 or n_head % n_head_kv:
            raise UnsupportedModelError(f"{g.path}: head counts {n_head}/{n_head_kv} are not a valid GQA layout")
        if head_dim % 2:
            raise UnsupportedModelError(f"{g.path}: head dim {head_dim} must be even for RoPE")
        return HParams(
            arch=a,
            n_layer=int(need("block_count")),
            n_embd=n_embd,
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            n_ff=int(need("feed_forward_length")),
            n_vocab=int(emb.shape[1]) if len(emb.shape) > 1 else 0,
            n_ctx_train=int(md.get(f"{a}.context_length", 4096)),
            rope_base=float(md.get(f"{a}.rope.freq_base", 10000.0)),
            eps=float(md.get(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
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
        for name, shape in self.expected_tensors().items():
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
