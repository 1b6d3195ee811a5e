"""Thread placement of the CPU executor (csrc/cpu/thread_pin.h): after a run with n
threads, 2 <= n <= the CPUs of the process's mask, worker i (i >= 1) is pinned to the
i-th CPU of the mask in cores-first order and the calling thread has its own mask back;
with MINFER_CPU_PIN=0 or more threads than CPUs every thread may use the whole mask.
OpenMP keeps its workers between regions, so `thread_masks(n)` reads what the last run
left each thread of an n-thread team with. Pinning changes no arithmetic: the logits of
pinned and unpinned runs are equal bit for bit."""

from __future__ import annotations

import os

import numpy as np
import pytest

from minfer import _core
from minfer.session import Session

IDS = [5, 17, 42, 99, 3, 250, 7, 11, 64, 12, 33]


def mask() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def core_of(cpu: int) -> tuple:
    try:
        base = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
        with open(base + "physical_package_id") as f, open(base + "core_id") as g:
            return (f.read().strip(), g.read().strip())
    except OSError:
        return ("cpu", str(cpu))


def run(session: Session) -> np.ndarray:
    session.reset()
    return np.array(session.forward(IDS)[0], copy=True)


@pytest.fixture(autouse=True)
def pin_default(monkeypatch):
    for k in ("MINFER_CPU_PIN", "OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY"):
        monkeypatch.delenv(k, raising=False)


def test_pin_order_is_the_mask_cores_first():
    order = _core.testing.cpu_pin_order()
    assert sorted(order) == mask()
    n_cores = len({core_of(c) for c in mask()})
    assert len({core_of(c) for c in order[:n_cores]}) == n_cores  # one CPU per core first
    # The mask of the calling thread is what counts, not the machine's CPUs.
    full = os.sched_getaffinity(0)
    last = max(full)
    os.sched_setaffinity(0, {last})
    try:
        assert _core.testing.cpu_pin_order() == [last]
    finally:
        os.sched_setaffinity(0, full)


def test_workers_pinned_to_distinct_cpus_of_the_mask(synth_model_path, monkeypatch):
    cpus = mask()
    n = min(len(cpus), 4)
    session = Session.open(synth_model_path, n_ctx=64, n_threads=max(n, 2))
    pinned = run(session)
    masks = _core.testing.thread_masks(max(n, 2))
    assert sorted(os.sched_getaffinity(0)) == cpus  # the caller got its mask back
    assert masks[0] == cpus
    if n >= 2:
        order = _core.testing.cpu_pin_order()
        assert [m for m in masks[1:]] == [[c] for c in order[1:n]]
        assert len({m[0] for m in masks[1:]} | {order[0]}) == n  # distinct, and not the caller's
    else:  # a one-CPU mask: two threads oversubscribe it, so nobody is pinned
        assert all(m == cpus for m in masks)

    # Off by request: the same session's workers are given the whole mask back.
    monkeypatch.setenv("MINFER_CPU_PIN", "0")
    free = run(session)
    assert all(m == cpus for m in _core.testing.thread_masks(max(n, 2)))
    assert np.array_equal(pinned, free)  # bit for bit
    monkeypatch.delenv("MINFER_CPU_PIN")
    run(session)
    if n >= 2:
        assert _core.testing.thread_masks(n)[1] == [_core.testing.cpu_pin_order()[1]]


def test_no_pinning_when_oversubscribed_or_openmp_binds(synth_model_path, monkeypatch):
    cpus = mask()
    small = Session.open(synth_model_path, n_ctx=64, n_threads=2)
    ref = run(small)
    over = len(cpus) + 1
    session = Session.open(synth_model_path, n_ctx=64, n_threads=over)
    run(small)  # leaves worker 1 pinned where the mask has 2+ CPUs
    out = run(session)
    assert all(m == cpus for m in _core.testing.thread_masks(over))
    assert np.array_equal(out, ref)
    # An explicit OpenMP binding request leaves placement to OpenMP (none here).
    run(small)
    monkeypatch.setenv("OMP_PROC_BIND", "close")
    run(small)
    assert all(m == cpus for m in _core.testing.thread_masks(2))
