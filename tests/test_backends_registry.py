"""Backend registry: fixed ids and priorities, fences by name, the three refusals."""

from __future__ import annotations

import dataclasses

import pytest

from minfer.backends import CPU_ID, CUDA_ID, METAL_ID, cpu, default_registry, parse_backend_list
from minfer.backends import cuda as cuda_backend
from minfer.errors import BackendError, MinferError


def test_builtin_ids_and_priority_order():
    reg = default_registry()
    assert (reg.by_name("cpu").id, reg.by_name("metal").id, reg.by_name("cuda").id) == (CPU_ID, METAL_ID, CUDA_ID) \
        == (0, 1, 2)
    assert [(e.name, e.priority) for e in reg.entries()] == [("metal", 300), ("cuda", 200), ("cpu", 100)]
    from minfer import _core
    assert reg.by_name("cuda").compiled == bool(_core.HAS_CUDA)
    assert not reg.by_name("metal").compiled


def _cuda_refusal() -> str:
    """What naming CUDA is refused with in this build on this machine ('' if it runs)."""
    e = cuda_backend.ENTRY
    if not e.compiled:
        return "backend 'cuda' is not compiled into this build"
    if not e.usable:
        return "backend 'cuda' is not usable on this machine: no CUDA device visible"
    return ""


def test_default_selection_is_what_can_run(monkeypatch):
    monkeypatch.delenv("MINFER_BACKENDS", raising=False)
    expect = ["cpu"] if _cuda_refusal() else ["cuda", "cpu"]
    assert [e.name for e in default_registry().select_backends()] == expect


def test_unknown_backend_lists_the_known_ones():
    with pytest.raises(BackendError, match=r"unknown backend 'tpu' \(known backends: cpu, cuda, metal\)"):
        default_registry().select_backends(["tpu"])


def test_backend_not_compiled_in():
    with pytest.raises(BackendError, match="backend 'metal' is not compiled into this build"):
        default_registry().select_backends(["cpu", "metal"])


def test_cuda_refusal_names_what_is_missing():
    why = _cuda_refusal()
    if not why:  # a CUDA build with a device: naming it works
        assert [e.name for e in default_registry().select_backends(["cpu", "cuda"])] == ["cuda", "cpu"]
        return
    with pytest.raises(BackendError, match=why):
        default_registry().select_backends(["cpu", "cuda"])


def test_backend_not_usable_here_gives_the_reason():
    reg = default_registry().copy()
    reg.register(dataclasses.replace(cpu.make_entry("gpu9", id=9, priority=250), usable=False,
                                     unusable_reason="no device found"))
    with pytest.raises(BackendError, match="backend 'gpu9' is not usable on this machine: no device found"):
        reg.select_backends(["gpu9"])
    assert [e.name for e in reg.select_backends(None)] == ["cpu"]    # silently absent only when not asked for


def test_three_refusals_are_distinct_minfer_errors():
    reg = default_registry().copy()
    reg.register(dataclasses.replace(cpu.make_entry("gpu9", id=9, priority=250), usable=False, unusable_reason="x"))
    msgs = set()
    for name in ("nope", "metal", "gpu9"):
        with pytest.raises(MinferError) as e:
            reg.select_backends([name])
        msgs.add(str(e.value).split(":")[0].replace(name, "<n>"))
    assert len(msgs) == 3


def test_env_fence(monkeypatch):
    monkeypatch.setenv("MINFER_BACKENDS", " CPU ")
    assert [e.name for e in default_registry().select_backends()] == ["cpu"]
    monkeypatch.setenv("MINFER_BACKENDS", "cpu,metal")
    with pytest.raises(BackendError, match="not compiled"):
        default_registry().select_backends()
    assert parse_backend_list("cpu, metal") == ["cpu", "metal"]
    with pytest.raises(BackendError):
        parse_backend_list(" , ")


def test_registration_rules():
    reg = default_registry().copy()
    with pytest.raises(BackendError, match="id 0"):
        reg.register(cpu.make_entry("other", id=CPU_ID))
    with pytest.raises(BackendError, match="name 'cpu'"):
        reg.register(cpu.make_entry("cpu", id=11))
    reg.register(cpu.make_entry("extra", id=11, priority=50))
    assert [e.name for e in reg.select_backends(["extra", "cpu"])] == ["cpu", "extra"]
    assert "extra" not in [e.name for e in default_registry().entries()]   # copies do not leak
