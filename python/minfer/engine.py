"""The engine: load a GGUF, run forward passes through the cached graph, generate.

`forward` is the reuse kernel of §11.1 of the design of record: build (or reuse) the
graph for these params, fill the inputs, run the plans, read the logits. A prefill
builds once, then decode reuses one graph indefinitely; the KV lives in the cache's
allocator and survives the prefill -> decode rebuild.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from minfer.errors import ContextError, MinferError
from minfer.io.gguf_file import GGUFFile
from minfer.models import load_model
from minfer.sampling import Sampler, SamplingParams


def default_threads() -> int:
    """Physical cores available to this process (SMT siblings count once)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    cores = set()
    for c in cpus:
        try:
            with open(f"/sys/devices/system/cpu/cpu{c}/topology/core_id") as f:
                core = f.read().strip()
            with open(f"/sys/devices/system/cpu/cpu{c}/topology/physical_package_id") as f:
                pkg = f.read().strip()
            cores.add((pkg, core))
        except OSError:
            cores.add(("?", str(c)))
    return max(1, len(cores))


@dataclass
class GenerationResult:
    ids: list[int] = field(default_factory=list)
    text: str = ""
    stop_reason: str = "length"
    prompt_ms: float = 0.0
    gen_ms: float = 0.0
    n_prompt: int = 0

    @property
    def prompt_tps(self) -> float:
        return self.n_prompt / (self.prompt_ms / 1000) if self.prompt_ms > 0 else 0.0

    @property
    def gen_tps(self) -> float:
        # The first generated token comes out of the prefill; the rest are decode steps.
        steps = max(len(self.ids) - 1, 0)
        return steps / (self.gen_ms / 1000) if self.gen_ms > 0 and steps else 0.0


class Engine:
    def __init__(self, gguf: GGUFFile, n_ctx: int, n_threads: int | None, backends: list[str] | None,
                 reuse: bool = True, fuse: bool = True):
        from minfer.runtime import Runtime

        self.gguf = gguf
        self.model = load_model(gguf)
        hp = self.model.hp
        if n_ctx <= 0:
            raise MinferError(f"--ctx must be positive, got {n_ctx}")
        self.n_ctx = n_ctx
        self.n_threads = n_threads or default_threads()
        self.reuse = reuse
        self.fuse = fuse
        self.runtime = Runtime(self.model, gguf, n_threads=self.n_threads, backends=backends)
        self.n_past = 0
        self._tokenizer = None
        self.hp = hp

    @classmethod
    def load(cls, path: str | Path | None = None, n_ctx: int | None = None, n_threads: int | None = None,
             backends: list[str] | None = None, reuse: bool = True, fuse: bool = True) -> "Engine":
        if path is None:
            from minfer.io.model_cache import default_model_path

            path = default_model_path(pull=True, progress=True)
        gguf = GGUFFile.open(path)
        return cls(gguf, n_ctx or 4096, n_threads, backends, reuse=reuse, fuse=fuse)

    # -- facts -------------------------------------------------------------------------
    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from minfer.tokenizer import Tokenizer

            self._tokenizer = Tokenizer.from_metadata(self.gguf.metadata)
        return self._tokenizer

    @property
    def model_name(self) -> str:
        return Path(self.gguf.path).name

    @property
    def backend_names(self) -> list[str]:
        return self.runtime.backend_names

    @property
    def model_info(self) -> dict:
        m = self.model
        n_params = sum(t.n_elements for t in m.tensors.values())
        size = sum(t.nbytes for t in m.tensors.values())
        ftype = self.gguf.metadata.get("general.file_type")
        return {
            "arch": m.hp.arch,
            "n_params": n_params,
            "size_bytes": size,
            "type": f"{m.hp.arch} {self.gguf.metadata.get('general.size_label', '')} {_FILE_TYPES.get(ftype, '')}".strip(),
            "weight_bytes_per_token": m.weight_bytes_per_token(),
            "filename": str(self.gguf.path),
        }

    # -- forward -----------------------------------------------------------------------
    def check_fits(self, n_prompt: int, n_predict: int) -> None:
        if n_prompt == 0:
            raise ContextError("the prompt is empty after tokenization")
        need = n_prompt + n_predict
        if need > self.n_ctx:
            raise ContextError(
                f"prompt ({n_prompt} tokens) + -n {n_predict} = {need} tokens exceeds the context of {self.n_ctx} "
                f"(raise --ctx or shorten the prompt)"
            )

    def reset(self) -> None:
        self.n_past = 0

    def forward(self, tokens: list[int] | np.ndarray, n_out: int = 1, copy: bool = True) -> np.ndarray:
        """Append tokens at position n_past; return logits [n_out, n_vocab] of the last n_out.
        copy=False: a read-only view, valid until the next forward."""
        nt = len(tokens)
        if nt == 0:
            raise MinferError("forward needs at least one token")
        if not 1 <= n_out <= nt:
            raise MinferError(f"n_out must be in [1, {nt}], got {n_out}")
        if self.n_past + nt > self.n_ctx:
            raise ContextError(f"{self.n_past} + {nt} tokens exceed the context of {self.n_ctx}")
        ids = np.asarray(tokens, dtype=np.int32)
        if ids.min() < 0 or ids.max() >= self.hp.n_vocab:
            raise MinferError(f"token id out of range [0, {self.hp.n_vocab})")
        logits = self.runtime.forward(ids, self.n_past, n_out=n_out, n_ctx=self.n_ctx,
                                      reuse=self.reuse, fuse=self.fuse, copy=copy)
        self.n_past += nt
        return logits

    def dump_graph(self, path: str | Path, n_tokens: int, decode: bool) -> None:
        self.runtime.dump_graph(path, n_tokens=n_tokens, n_ctx=self.n_ctx, decode=decode, fuse=self.fuse)

    def graph_json(self, n_tokens: int, decode: bool) -> dict:
        """The minfer-graph JSON document of the prefill (n_tokens) or decode graph."""
        from minfer.graph.export import graph_json

        g = self.runtime.preview_graph(n_tokens, self.n_ctx, decode, fuse=self.fuse)
        return graph_json(g, self.model_name, "decode" if decode else "prefill", self.runtime.cache.registry.name_of)

    # -- generation --------------------------------------------------------------------
    def generate_ids(self, prompt_ids: list[int], n: int, temperature: float = 0.0, seed: int | None = None) -> list[int]:
        sp = SamplingParams(temperature=temperature, seed=seed)
        return self.generate(prompt_ids, n, sp, stop=[], stop_at_eog=False).ids

    def generate(self, prompt_ids: list[int], n_predict: int, sampling: SamplingParams,
                 stop: list[str] | None = None, on_text: Callable[[str], None] | None = None,
                 stop_at_eog: bool = True) -> GenerationResult:
        from minfer.tokenizer import StreamDecoder

        self.check_fits(len(prompt_ids), n_predict)
        self.reset()
        sampler = Sampler(sampling)
        for t in prompt_ids:
            sampler.accept(t)
        res = GenerationResult(n_prompt=len(prompt_ids))
        if n_predict == 0:
            res.stop_reason = "length"
            return res
        tok = self.tokenizer
        eog = tok.eot_ids if stop_at_eog else set()
        stream = StreamDecoder(tok)
        stops = [s for s in (stop or []) if s]
        hold = max((len(s) for s in stops), default=1) - 1
        emitted = 0  # characters of res.text already passed to on_text

        def emit(final: bool) -> None:
            nonlocal emitted
            # Hold back a tail that could still grow into a stop string.
            upto = len(res.text) if final else max(emitted, len(res.text) - hold)
            if on_text and upto > emitted:
                on_text(res.text[emitted:upto])
            emitted = max(emitted, upto)

        # Greedy without penalties needs only the argmax, which C++ takes in place.
        greedy = sampling.temperature <= 0.0 and sampling.repeat_penalty == 1.0

        def step(ids: list[int]) -> int:
            if greedy:
                self.forward(ids, n_out=1, copy=False)
                return self.runtime.argmax_last()
            return sampler.sample(self.forward(ids, n_out=1, copy=False)[0])

        t0 = time.perf_counter()
        nxt = step(prompt_ids)
        res.prompt_ms = (time.perf_counter() - t0) * 1000
        t1 = time.perf_counter()
        while True:
            sampler.accept(nxt)
            if nxt in eog:
                res.stop_reason = "eos"
                break
            res.ids.append(nxt)
            res.text += stream.push(nxt)
            hit = _find_stop(res.text, stops)
            if hit is not None:
                res.text = res.text[:hit]
                res.stop_reason = "stop"
                break
            emit(final=False)
            if len(res.ids) >= n_predict:
                res.stop_reason = "length"
                break
            nxt = step([nxt])
        if res.stop_reason != "stop":
            res.text += stream.flush()
            hit = _find_stop(res.text, stops)
            if hit is not None:
                res.text, res.stop_reason = res.text[:hit], "stop"
        res.gen_ms = (time.perf_counter() - t1) * 1000
        emit(final=True)
        return res


def _find_stop(text: str, stops: list[str]) -> int | None:
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or i < best):
            best = i
    return best


# general.file_type labels as llama.cpp prints them (the ones our types can produce).
_FILE_TYPES = {
    0: "all F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1",
    14: "Q4_K - Small", 15: "Q4_K - Medium", 16: "Q5_K - Small", 17: "Q5_K - Medium", 18: "Q6_K",
}
