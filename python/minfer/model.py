"""Model: what every conversation over one GGUF shares, read-only.

The GGUF mmap, the architecture definition, the tokenizer, the selected backends and
the weights by name (views into the mmap; each backend registers them in its own
store once, shared by every session). Sessions
(session.py) hold everything per conversation: graph cache, KV, positions. Opening a
model never touches the network: resolving the default model is the CLI's decision.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from minfer.errors import ContextError, MinferError, UnsupportedModelError
from minfer.graph.weights import WeightRegistry
from minfer.io.gguf_file import GGUFFile
from minfer.models import load_model


class Model:
    def __init__(self, gguf: GGUFFile, backends: list[str] | None = None, n_threads: int | None = None):
        from minfer.backends import default_threads, select_backends

        self.gguf = gguf
        self.defn = load_model(gguf)
        self.hp = self.defn.hp
        self.backends = backends
        # The registry is the composition root: it picks the backends; sessions get them.
        self.entries = select_backends(backends)
        if n_threads is not None and n_threads <= 0:
            raise MinferError(f"threads must be positive, got {n_threads}")
        self.n_threads = n_threads or default_threads()
        self.weights = WeightRegistry()
        for name in self.defn.expected_tensors():
            t = self.defn.tensors[name]
            ne0 = int(t.shape[0])
            ne1 = int(np.prod(t.shape[1:])) if len(t.shape) > 1 else 1
            self.weights.add(name, gguf.tensor_data(name), t.type, ne0, ne1)
        # Which weight types can run is the backends' call: refuse here, before any work.
        self.weights.check_types(self.entries)
        self._tokenizer = None

    @classmethod
    def open(cls, path: str | Path, backends: list[str] | None = None, n_threads: int | None = None) -> "Model":
        return cls(GGUFFile.open(path), backends=backends, n_threads=n_threads)

    @property
    def path(self) -> Path:
        return Path(self.gguf.path)

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from minfer.tokenizer import Tokenizer

            tok = Tokenizer.from_metadata(self.gguf.metadata)
            if tok.n_vocab != self.hp.n_vocab:
                # Every id the output can pick must name a token, and every token an
                # embedding row (llama.cpp refuses such a file too): a converter pads the
                # vocabulary to the model's rows.
                raise UnsupportedModelError(
                    f"{self.path.name}: the tokenizer names {tok.n_vocab} tokens but the model has "
                    f"{self.hp.n_vocab} token rows")
            self._tokenizer = tok
        return self._tokenizer

    def check_tokens(self, ids: np.ndarray) -> None:
        """Token ids are bounded here, on the fill side, so no backend ever reads past
        the embedding table (device buffers cannot be checked by the host)."""
        if ids.size == 0:
            return
        if ids.size == 1:  # a decode step: numpy's min and max cost a microsecond each
            self.check_token(int(ids.flat[0]))
        else:
            self.check_token(int(ids.min()))
            self.check_token(int(ids.max()))

    def check_token(self, token: int) -> None:
        """check_tokens for one id (the one-call decode step)."""
        if not 0 <= token < self.hp.n_vocab:
            raise MinferError(f"token id out of range [0, {self.hp.n_vocab})")

    def check_fits(self, n_prompt: int, n_predict: int, n_ctx: int) -> None:
        if n_prompt == 0:
            raise ContextError("the prompt is empty after tokenization")
        need = n_prompt + n_predict
        if need > n_ctx:
            raise ContextError(
                f"prompt ({n_prompt} tokens) + -n {n_predict} = {need} tokens exceeds the context of {n_ctx} "
                f"(raise --ctx or shorten the prompt)"
            )

    @property
    def info(self) -> dict:
        d = self.defn
        ftype = self.gguf.metadata.get("general.file_type")
        label = self.gguf.metadata.get("general.size_label", "")
        return {
            "arch": d.hp.arch,
            "n_params": sum(t.n_elements for t in d.tensors.values()),
            "size_bytes": sum(t.nbytes for t in d.tensors.values()),
            "type": f"{d.hp.arch} {label} {FILE_TYPES.get(ftype, '')}".strip(),
            "n_vocab": d.hp.n_vocab,
            "weight_bytes_per_token": d.weight_bytes_per_token(),
            "filename": str(self.gguf.path),
        }


# general.file_type labels as llama.cpp prints them (the ones our types can produce).
FILE_TYPES = {
    0: "all F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1",
    14: "Q4_K - Small", 15: "Q4_K - Medium", 16: "Q5_K - Small", 17: "Q5_K - Medium", 18: "Q6_K",
}
