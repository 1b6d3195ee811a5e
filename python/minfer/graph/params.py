"""The reuse identity: everything the topology of a graph depends on, and nothing else.

n_past is deliberately absent: positions and KV cells are graph inputs (data), so a
decode step at any position reuses the same graph.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class GraphType(enum.Enum):
    Prefill = "prefill"
    Decode = "decode"


KV_TYPES = ("f16", "f32")  # KV element types a graph may ask for; a backend says which it holds


@dataclass(frozen=True)
class CParams:
    n_ctx: int
    gpu: bool = False            # a GPU backend participates: assignment is topology
    explicit_span: bool = False  # attention reads an explicit per-token span input (several sequences)
    fuse_swiglu: bool = True     # the peephole pass folds silu*mul into SwiGLU where the backend can
    kv_type: str = "f16"         # KV element type ("f16" | "f32"): sizes the KV regions, picks the kernels
    seq_ctx: int = 0             # the context one sequence may use (0: n_ctx), as llama.cpp's n_ctx_per_seq


@dataclass(frozen=True)
class GraphParams:
    n_tokens: int
    n_out: int                   # tail rows that need logits: changes the topology (get_rows)
    gtype: GraphType
    cparams: CParams
    weights_version: int = 1     # reserved: a weight reload bumps it to break reuse
    hidden: bool = False         # output the final-normed hidden states [n_out, n_embd], not logits (embeddings)
