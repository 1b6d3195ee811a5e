"""POST /v1/embeddings: sentence embeddings from an embedding model's hidden states.

A GGUF is an embedding model when it declares a pooling type ({arch}.pooling_type, as
llama.cpp writes it: 1 mean, 2 CLS (first token), 3 last token; 0 none and 4 rank are
not embeddings). The forward is the model's own graph with its last RMSNorm as the
output (GraphParams.hidden: no lm head), over a context of its own: the inputs of one
request are packed into one forward, each input in its own cells with its own
positions (an explicit attention span per token, so inputs never see each other),
and pooled as declared, then L2-normalized (as llama-server's OpenAI endpoint does).
`dimensions` truncates (Matryoshka models) before normalizing.

Forwards of the embedder run one at a time (a lock) on a worker thread; an embedding
model serves no generation (the chat and completion endpoints answer 400), so its
forwards never run beside the scheduler's.
"""

from __future__ import annotations

import base64
import threading

import numpy as np

from minfer.graph.params import GraphParams, GraphType
from minfer.server.protocol import ApiError, bad
from minfer.session import Context

POOLING = {1: "mean", 2: "cls", 3: "last"}
ARENA = 4096          # tokens per embedding forward (and the longest input)
MAX_INPUTS = 2048     # as OpenAI


def pooling_of(model) -> str | None:
    """The pooling the GGUF declares, None for a model that is not an embedding model."""
    md = model.gguf.metadata
    v = md.get(f"{model.hp.arch}.pooling_type")
    if v is None:
        return None
    try:
        return POOLING.get(int(v))
    except (TypeError, ValueError):
        return None


class _HiddenContext(Context):
    """A Context whose graphs output the final-normed hidden states."""

    def params(self, n_tokens: int, n_out: int) -> GraphParams:
        p = self._params.get((n_tokens, n_out))
        if p is None or p.cparams is not self.cparams:
            gtype = GraphType.Decode if n_tokens == 1 else GraphType.Prefill
            p = GraphParams(n_tokens=n_tokens, n_out=n_out, gtype=gtype, cparams=self.cparams, hidden=True)
            self._params[(n_tokens, n_out)] = p
        return p


class Embedder:
    def __init__(self, model, pooling: str, arena: int = ARENA):
        self.model = model
        self.pooling = pooling
        self.n_embd = model.hp.n_embd
        self.arena = min(arena, max(16, model.hp.n_ctx_train))
        causal = model.gguf.metadata.get(f"{model.hp.arch}.attention.causal", True)
        self.refusal = None if causal else (
            "this model's attention is bidirectional (attention.causal = false), which minfer's graphs do not run")
        self.add_eos = bool(model.gguf.metadata.get("tokenizer.ggml.add_eos_token", False))
        self._ctx = None
        self._lock = threading.Lock()

    def _context(self) -> Context:
        if self._ctx is None:
            # Two sequences of arena/2 cells: one arena, explicit spans (cells are ours to place).
            self._ctx = _HiddenContext(self.model, n_ctx=(self.arena + 1) // 2, n_seq=2)
        return self._ctx

    def tokenize(self, text: str) -> list[int]:
        tok = self.model.tokenizer
        ids = tok.encode(text)
        if self.add_eos and tok.eos_id is not None:
            ids.append(tok.eos_id)
        return ids

    def embed(self, inputs: list[list[int]], normalize: bool = True, dimensions: int | None = None) -> list[np.ndarray]:
        """One vector per input (each a non-empty token list no longer than the arena)."""
        if self.refusal:
            raise bad(self.refusal, param="model", code="unsupported_model")
        out: list = [None] * len(inputs)
        with self._lock:
            ctx = self._context()
            batch, used = [], 0
            for i, ids in enumerate(inputs):
                if batch and used + len(ids) > ctx.n_ctx * ctx.n_seq:
                    self._run(ctx, batch, inputs, out)
                    batch, used = [], 0
                batch.append(i)
                used += len(ids)
            if batch:
                self._run(ctx, batch, inputs, out)
        res = []
        for v in out:
            v = v[:dimensions] if dimensions else v
            if normalize:
                n = float(np.linalg.norm(v))
                v = v / n if n > 0 else v
            res.append(v.astype(np.float32))
        return res

    def _run(self, ctx: Context, batch: list[int], inputs: list, out: list) -> None:
        toks, pos, cells, span, tail = [], [], [], [], []
        base = 0
        firsts = []
        for i in batch:
            ids = inputs[i]
            n = len(ids)
            firsts.append(len(toks))
            toks += ids
            pos += range(n)
            cells += range(base, base + n)
            for j in range(n):
                span += [base, base + j + 1, 0, 0]
            base += n
        if self.pooling == "mean":
            tail = list(range(len(toks)))
        elif self.pooling == "cls":
            tail = firsts
        else:
            tail = [f + len(inputs[i]) - 1 for f, i in zip(firsts, batch)]
        arr = lambda x: np.asarray(x, dtype=np.int32)  # noqa: E731
        with ctx.lock:
            h = ctx.run(arr(toks), arr(pos), arr(cells), arr(span), arr(tail), n_out=len(tail), copy=True)
        h = np.asarray(h, dtype=np.float32).reshape(len(tail), -1)[:, :self.n_embd]
        if self.pooling == "mean":
            for k, (f, i) in enumerate(zip(firsts, batch)):
                out[i] = h[f:f + len(inputs[i])].astype(np.float64).mean(axis=0)
        else:
            for k, i in enumerate(batch):
                out[i] = h[k].astype(np.float64)

    def close(self) -> None:
        self._ctx = None


# -- the request -----------------------------------------------------------------------------

EMBED_FIELDS = {"input", "model", "encoding_format", "dimensions", "user"}


def parse_embeddings(obj: dict) -> dict:
    from minfer.server.protocol import _is_int, _no_unknown

    _no_unknown(obj, EMBED_FIELDS)
    if "input" not in obj:
        raise bad("'input' is required", param="input", code="missing_required_parameter")
    v = obj["input"]
    if isinstance(v, str):
        items = [v]
    elif isinstance(v, list) and v and all(_is_int(t) for t in v):
        items = [[int(t) for t in v]]
    elif isinstance(v, list) and v:
        items = v
    else:
        raise bad("'input' must be a string, an array of strings, an array of token ids or an array of those",
                  param="input", code="invalid_type")
    if len(items) > MAX_INPUTS:
        raise bad(f"'input' takes at most {MAX_INPUTS} items", param="input")
    for k, it in enumerate(items):
        if isinstance(it, str):
            if not it:
                raise bad(f"'input[{k}]' is an empty string", param="input")
        elif isinstance(it, list) and it and all(_is_int(t) for t in it):
            pass
        else:
            raise bad(f"'input[{k}]' must be a non-empty string or array of token ids", param="input",
                      code="invalid_type")
    fmt = obj.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise bad("'encoding_format' must be \"float\" or \"base64\"", param="encoding_format")
    dims = obj.get("dimensions")
    if dims is not None and (not _is_int(dims) or dims < 1):
        raise bad("'dimensions' must be a positive integer", param="dimensions", code="invalid_type")
    if obj.get("user") is not None and not isinstance(obj["user"], str):
        raise bad("'user' must be a string", param="user", code="invalid_type")
    m = obj.get("model")
    if m is not None and not isinstance(m, str):
        raise bad("'model' must be a string", param="model", code="invalid_type")
    return {"items": items, "format": fmt, "dimensions": dims, "model": m}


def embed_request(embedder: Embedder, n_vocab: int, parsed: dict) -> tuple[list, int]:
    """Tokenize, check and embed (a worker thread). Returns (vectors, prompt tokens)."""
    dims = parsed["dimensions"]
    if dims is not None and dims > embedder.n_embd:
        raise bad(f"'dimensions' is {dims}; this model's embeddings have {embedder.n_embd}", param="dimensions")
    seqs = []
    for k, it in enumerate(parsed["items"]):
        if isinstance(it, str):
            try:
                ids = embedder.tokenize(it)
            except ValueError as e:
                raise bad(f"'input[{k}]' cannot be tokenized: {e}", param="input", code="invalid_encoding") from None
        else:
            if any(not 0 <= t < n_vocab for t in it):
                raise bad(f"a token id of 'input[{k}]' is outside [0, {n_vocab})", param="input")
            ids = list(it)
        if not ids:
            raise bad(f"'input[{k}]' is empty after tokenization", param="input")
        if len(ids) > embedder.arena:
            raise bad(f"'input[{k}]' is {len(ids)} tokens; at most {embedder.arena} fit one embedding",
                      param="input", code="context_length_exceeded")
        seqs.append(ids)
    vecs = embedder.embed(seqs, normalize=True, dimensions=dims)
    return vecs, sum(len(s) for s in seqs)


def embeddings_body(vecs: list, fmt: str, model_id: str, n_tokens: int) -> dict:
    data = []
    for i, v in enumerate(vecs):
        if fmt == "base64":
            e = base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode("ascii")
        else:
            e = [float(x) for x in v]
        data.append({"object": "embedding", "index": i, "embedding": e})
    return {"object": "list", "data": data, "model": model_id,
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}}


def not_embedding_model(name: str) -> ApiError:
    return ApiError(400, f"the model {name!r} is not an embedding model (its GGUF declares no pooling type); "
                    f"serve an embedding model (e.g. a Qwen3-Embedding GGUF) for /v1/embeddings",
                    param="model", code="model_not_embedding")
