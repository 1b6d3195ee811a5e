"""The public Python API: `minfer.load()` and what it returns.

    import minfer
    llm = minfer.load()                                  # the default model
    out = llm.generate("def fib(n):", max_tokens=32, temperature=0)
    print(out.text, out.finish_reason, out.usage)

Everything runs through the engine (engine.py): one prompt streams through a session
of its own (its KV prefix is kept for the next call, as in a chat), several prompts or
n > 1 choices run batched in a context of `max_batch` sequences.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path

from minfer.engine import Engine, Sequence
from minfer.errors import MinferError
from minfer.sampling import SamplingParams
from minfer.session import Context, Session

__all__ = ["LLM", "Completion", "Token", "load"]


@dataclass
class Token:
    """One generated token: its id, the text it released (stop strings never appear;
    text that may still become one is held back), and with `logprobs`: its log
    probability and the most likely alternatives as (text, logprob), best first."""

    id: int
    text: str
    logprob: float | None = None
    top_logprobs: list[tuple[str, float]] | None = None


@dataclass
class Completion:
    """A finished generation. finish_reason: "length" (max_tokens reached), "eos" (the
    model ended its turn) or "stop" (a stop string)."""

    text: str
    ids: list[int]
    finish_reason: str
    usage: dict
    logprobs: list[Token] | None = None
    timings: dict = field(default_factory=dict)


_SAMPLING = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n", "presence_penalty",
             "frequency_penalty", "seed")


def _sampling(kw: dict) -> SamplingParams:
    unknown = sorted(set(kw) - set(_SAMPLING) - {"logit_bias"})
    if unknown:
        raise TypeError(f"unknown sampling keyword {unknown[0]!r}")
    args = {k: kw[k] for k in _SAMPLING if kw.get(k) is not None}
    bias = kw.get("logit_bias")
    if bias:
        args["logit_bias"] = tuple(sorted((int(t), float(b)) for t, b in dict(bias).items()))
    sp = SamplingParams(**args)
    sp.validate()
    return sp


class LLM:
    """A loaded model and the engine that runs it. Not thread-safe: one call at a time
    (the server, `minfer serve`, is what serves many callers)."""

    def __init__(self, model, n_ctx: int = 4096, kv_type: str = "f16", max_batch: int = 8):
        if max_batch < 1:
            raise MinferError(f"max_batch must be >= 1, got {max_batch}")
        self.model = model
        self.n_ctx = n_ctx
        self.kv_type = kv_type
        self.max_batch = max_batch
        self.session = Session(model, n_ctx=n_ctx, kv_type=kv_type)
        self._batch = None              # (Context, Engine) for batched calls, made on first use

    @property
    def tokenizer(self):
        return self.model.tokenizer

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def detokenize(self, ids: Seq[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def _ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenize(prompt)
        ids = [int(t) for t in prompt]
        if not ids:
            raise MinferError("the prompt is empty")
        return ids

    # -- generation ------------------------------------------------------------------
    def stream(self, prompt: str | Seq[int], *, max_tokens: int = 128, stop: Seq[str] | None = None,
               logprobs: int | None = None, **sampling) -> Iterator[Token]:
        """Tokens of one generation as they come. Breaking out of the loop stops it."""
        sp = _sampling(sampling)
        for ev in self.session.stream(self._ids(prompt), max_tokens, sp, stop=list(stop or []),
                                      logprobs=False if logprobs is None else logprobs):
            if ev.done:
                if ev.text:
                    yield Token(-1, ev.text)
                return
            yield self._token(ev)

    def generate(self, prompt: str | Seq[int] | list[str], *, max_tokens: int = 128, n: int = 1,
                 stop: Seq[str] | None = None, logprobs: int | None = None, **sampling):
        """One Completion for a prompt (a string or token ids), or a list of them for a
        list of string prompts (batched through the engine). n > 1: a list of n
        Completions per prompt, sharing the prompt's KV (one prefill); each choice i
        draws with seed + i."""
        sp = _sampling(sampling)
        if n < 1:
            raise MinferError(f"n must be >= 1, got {n}")
        many = isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt)
        prompts = [self._ids(p) for p in prompt] if many else [self._ids(prompt)]
        if not many and n == 1:
            seq = Sequence(prompts[0], max_tokens, sp, stop=list(stop or []), logprobs=logprobs)
            self._run_alone(seq)
            return self._completion(seq)
        groups = self._run_batched(prompts, n, max_tokens, sp, list(stop or []), logprobs)
        out = [[self._completion(s) for s in g] if n > 1 else self._completion(g[0]) for g in groups]
        return out if many else out[0]

    def chat(self, messages: list[dict], **kw) -> Completion:
        """The assistant's reply to a conversation (rendered with the model's own chat
        template); keywords as generate's."""
        text = self.tokenizer.render_chat(messages, add_generation_prompt=True)
        return self.generate(self.tokenize(text), **kw)

    # -- sessions ----------------------------------------------------------------------
    def save_session(self, path: str | os.PathLike) -> int:
        """Write what the single-prompt session's KV holds to a file (see Session.save)."""
        return self.session.save(path)

    def load_session(self, path: str | os.PathLike) -> None:
        """Restore a saved conversation into the single-prompt session (no prefill)."""
        self.session.restore(path)

    # -- internals ---------------------------------------------------------------------
    def _run_alone(self, seq: Sequence) -> None:
        _drive(self.session._engine(), seq)

    def _engine(self) -> Engine:
        if self._batch is None:
            ctx = Context(self.model, n_ctx=self.n_ctx, n_seq=self.max_batch, kv_type=self.kv_type)
            self._batch = Engine(ctx, [ctx.session(i) for i in range(self.max_batch)], chunk=512)
        return self._batch

    def _run_batched(self, prompts, n, max_tokens, sp, stop, logprobs) -> list[list[Sequence]]:
        """Every prompt's n choices through one engine: a prompt's group waits for n free
        slots; the others keep stepping meanwhile."""
        if n > self.max_batch:
            raise MinferError(f"n = {n} choices need as many sequences; this LLM batches {self.max_batch} "
                              f"(minfer.load(..., max_batch=N))")
        eng = self._engine()
        groups: list[list[Sequence]] = []
        for ids in prompts:
            g = []
            for i in range(n):
                s = SamplingParams(**{**sp.__dict__, "seed": sp.seed + i}) if sp.seed is not None and i else sp
                g.append(Sequence(ids, max_tokens, s, stop=stop, logprobs=logprobs, index=i))
            groups.append(g)
        waiting = list(groups)
        while waiting or eng.busy or eng._launch is not None:
            while waiting and len(eng.free_slots()) >= n:
                g = waiting.pop(0)
                for i, seq in enumerate(g):
                    eng.add(seq, share=g[0] if i else None)
            eng.step()
        for g in groups:
            for seq in g:
                if seq.error is not None:
                    raise seq.error
        return groups

    def _token(self, ev) -> Token:
        top = None
        if ev.top_logprobs is not None:
            top = [(self.tokenizer.token_bytes(t).decode("utf-8", errors="replace"), lp) for t, lp in ev.top_logprobs]
        return Token(ev.id, ev.text, ev.logprob, top)

    def _completion(self, seq: Sequence) -> Completion:
        text, toks = [], []
        for ev in seq.events:
            text.append(ev.text)
            if not ev.done:
                toks.append(self._token(ev))
        tm = seq.timings
        usage = {"prompt_tokens": tm.prompt_tokens, "completion_tokens": tm.generated_tokens,
                 "total_tokens": tm.prompt_tokens + tm.generated_tokens, "cached_tokens": tm.cached_tokens}
        return Completion("".join(text), list(seq.ids), seq.finish_reason or "length", usage,
                          toks if seq.logprobs is not None else None, tm.as_dict())


def _drive(engine: Engine, seq: Sequence) -> None:
    """Step a one-slot engine until `seq` ends; its events stay in seq.events."""
    engine.add(seq, 0)
    try:
        while not seq.done:
            if not engine.step():
                break
    finally:
        if not seq.done:
            engine.abort(seq)
        engine._launch = None
    if seq.error is not None:
        raise seq.error


def load(path: str | os.PathLike | None = None, *, threads: int | None = None, backend: str | None = None,
         n_ctx: int = 4096, kv_type: str = "f16", max_batch: int = 8) -> LLM:
    """Open a GGUF model (the default model when path is None: pulled and verified on
    first use). backend: "cpu", "cuda" or a comma list (default: every usable one).
    n_ctx: tokens per sequence. max_batch: sequences a batched call runs together."""
    from minfer.io.model_cache import default_model_path
    from minfer.model import Model

    if path is None:
        p = default_model_path(pull=True, progress=False)
    else:
        p = Path(path)
        if not p.is_file():
            raise MinferError(f"model file not found: {p}")
    backends = [b.strip().lower() for b in backend.split(",") if b.strip()] if backend else None
    return LLM(Model.open(p, backends=backends, n_threads=threads), n_ctx=n_ctx, kv_type=kv_type, max_batch=max_batch)
