"""The Metal backend's registry entry. Its kernels are not compiled into this build,
so it is registered (fixed id, priority, name) but never usable: naming it is a
clear refusal, and no node is ever assigned to it."""

from __future__ import annotations

from minfer.graph.registry import METAL_ID, BackendEntry


def _never(*_args, **_kw) -> bool:
    return False


def _no_pool():
    from minfer.errors import BackendError
    raise BackendError("backend 'metal' is not compiled into this build")


ENTRY = BackendEntry(
    name="metal", id=METAL_ID, priority=300, compiled=False, usable=False,
    unusable_reason="not compiled into this build",
    supports_op=_never, supports_fused=_never, supports_attn_span=_never, make_pool=_no_pool,
)
