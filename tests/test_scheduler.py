"""The server's scheduler without HTTP: continuous batching (jobs joining and leaving
between steps, prompts in chunks) gives each job exactly its tokens alone; MINFER_BATCH
bounds the sequences per step; prefix routing picks the slot holding the conversation."""

from __future__ import annotations

import queue
import time

import numpy as np
import pytest

from minfer.errors import MinferError
from minfer.model import Model
from minfer.sampling import SamplingParams
from minfer.server.scheduler import Job, Scheduler, default_max_batch
from minfer.session import Session
from minfer.testing import write_model
from scheduler_helpers import collect_events, poison_token_row, prompts


CTX = 96


@pytest.fixture(scope="module")
def model(mixed_model) -> Model:
    return mixed_model




def run_jobs(sched: Scheduler, specs: list[tuple[list[int], int]]) -> list[dict]:
    """Submit every job at once; collect each one's ids, text and usage."""
    q: queue.Queue = queue.Queue()
    jobs = []
    for k, (p, n) in enumerate(specs):
        job = Job(prompt_ids=p, n_predict=n, sampling=SamplingParams(temperature=0.0), stop_at_eog=False,
                  emit=lambda ev, k=k: q.put((k, ev)))
        jobs.append(job)
        sched.submit(job)
    return collect_events(q, len(specs), timeout=60)


def alone(model, p, n):
    return Session(model, n_ctx=CTX).generate(p, n, SamplingParams(temperature=0.0), stop_at_eog=False)


@pytest.mark.parametrize("max_batch", [None, 1, 3])
def test_jobs_batched_in_chunks_equal_each_alone(model, max_batch):
    specs = [(p, 4 + i % 5) for i, p in enumerate(prompts(7, seed=1))]  # 7 jobs, 3 slots: they queue
    sched = Scheduler(model, n_slots=3, n_ctx=CTX, chunk=8, max_batch=max_batch)
    sched.start()
    try:
        got = run_jobs(sched, specs)
    finally:
        assert sched.stop()
    for (p, n), g in zip(specs, got):
        ref = alone(model, p, n)
        assert g["ids"] == ref.ids and g["text"] == ref.text
        assert g["done"].reason == "length" and g["done"].usage["completion_tokens"] == n
    assert sched.max_batch == (3 if max_batch is None else max_batch)


def test_prefix_routing_reuses_the_slot_holding_the_conversation(model):
    a, b = prompts(2, seed=2)
    sched = Scheduler(model, n_slots=2, n_ctx=CTX, chunk=16)
    sched.start()
    try:
        ra, rb = run_jobs(sched, [(a, 5), (b, 5)])
        # The next turn of each conversation: its slot holds prompt + reply (but the last pick).
        turn_a = a + ra["ids"] + [7, 8, 9]
        turn_b = b + rb["ids"] + [10, 11]
        r2b, r2a = run_jobs(sched, [(turn_b, 3), (turn_a, 3)])
    finally:
        assert sched.stop()
    assert r2a["done"].usage["prompt_tokens_details"]["cached_tokens"] == len(a) + 4
    assert r2b["done"].usage["prompt_tokens_details"]["cached_tokens"] == len(b) + 4
    assert r2a["ids"] == alone(model, turn_a, 3).ids and r2b["ids"] == alone(model, turn_b, 3).ids


def test_cancel_and_queue_bound(model):
    from minfer.server.scheduler import QueueFull, ShuttingDown

    sched = Scheduler(model, n_slots=1, n_ctx=CTX, max_queue=1)
    q: queue.Queue = queue.Queue()

    def paced(ev):
        # The client takes 20 ms a token, so the decode loop cannot run many steps ahead
        # of this thread's cancel (a fast loop had emitted 28 tokens, or all 50, first).
        q.put(ev)
        time.sleep(0.02)
    long = Job(prompt_ids=prompts(1, 3)[0], n_predict=50, sampling=SamplingParams(temperature=0.0),
               stop_at_eog=False, emit=paced)
    sched.submit(long)
    with pytest.raises(QueueFull):  # not started: the first job still waits
        sched.submit(Job(prompt_ids=[5, 6], n_predict=1, sampling=SamplingParams(), emit=q.put))
    sched.start()
    try:
        first = q.get(timeout=30)
        assert first.kind == "token"
        long.cancel()
        evs = [first]
        while not evs[-1].kind == "done":
            evs.append(q.get(timeout=30))
        assert evs[-1].reason == "cancelled" and len(evs) < 10  # within a step or two
        assert sched.slots_busy == 0
        # A waiting job whose client left gives its queue place back at the next step,
        # even while every slot is busy. The busy job's client takes 10 ms a token, so it
        # holds its slot for ~0.9 s (a fast decode loop had finished its 86 tokens before
        # the checks below ran).
        busy = Job(prompt_ids=[5, 6, 7], n_predict=CTX - 10, sampling=SamplingParams(temperature=0.0),
                   stop_at_eog=False, emit=lambda ev: time.sleep(0.01))
        sched.submit(busy)
        end = time.monotonic() + 30
        while sched.slots_busy == 0 and time.monotonic() < end:
            time.sleep(0.01)
        waiting = Job(prompt_ids=[8, 9], n_predict=2, sampling=SamplingParams(), emit=q.put)
        sched.submit(waiting)
        waiting.cancel()
        ev = q.get(timeout=30)
        assert ev.kind == "done" and ev.reason == "cancelled" and sched.queue_depth == 0
        assert busy.cancelled.is_set() is False and sched.slots_busy == 1
        busy.cancel()
    finally:
        assert sched.stop()
    with pytest.raises(ShuttingDown):
        sched.submit(Job(prompt_ids=[5, 6], n_predict=1, sampling=SamplingParams(), emit=q.put))


def test_minfer_batch_env(model, monkeypatch):
    monkeypatch.setenv("MINFER_BATCH", "2")
    assert default_max_batch(model) == 2
    assert Scheduler(model, n_slots=4, n_ctx=16).max_batch == 2
    monkeypatch.setenv("MINFER_BATCH", "zero")
    with pytest.raises(MinferError):
        default_max_batch(model)
    monkeypatch.delenv("MINFER_BATCH")
    assert Scheduler(model, n_slots=4, n_ctx=16).max_batch == 4


def test_a_new_conversation_takes_an_empty_slot_not_one_sharing_only_a_prefix(model):
    a, b = prompts(2, seed=4)
    b = a[:3] + b  # shares a short prefix (like a chat template's) with conversation a
    sched = Scheduler(model, n_slots=2, n_ctx=CTX)
    sched.start()
    try:
        (ra,) = run_jobs(sched, [(a, 4)])
        (rb,) = run_jobs(sched, [(b, 4)])
        (ra2,) = run_jobs(sched, [(a + ra["ids"] + [9], 2)])
    finally:
        assert sched.stop()
    assert rb["done"].usage["prompt_tokens_details"]["cached_tokens"] == 0       # went to the empty slot
    assert ra2["done"].usage["prompt_tokens_details"]["cached_tokens"] == len(a) + 3  # a's slot kept its KV
    assert {len(s.session.tokens) for s in sched.slots} == {len(b) + 3, len(a) + 4 + 1 + 1}


def test_a_failing_step_fails_its_jobs_and_the_loop_goes_on(model, monkeypatch):
    """Not a forward fault (those are isolated per sequence) but a bug past it: the
    jobs of that step get a 500 and the scheduler keeps serving."""
    sched = Scheduler(model, n_slots=2, n_ctx=CTX)
    real = sched.engine._pick_singles
    calls = {"n": 0}

    def picks(*a):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return real(*a)

    monkeypatch.setattr(sched.engine, "_pick_singles", picks)
    sched.start()
    try:
        q: queue.Queue = queue.Queue()
        sched.submit(Job(prompt_ids=prompts(1, 5)[0], n_predict=3, sampling=SamplingParams(temperature=0.0),
                         emit=q.put))
        ev = q.get(timeout=30)
        assert ev.kind == "error" and ev.status == 500 and "boom" in ev.message
        (r,) = run_jobs(sched, [(prompts(1, 6)[0], 3)])
        assert len(r["ids"]) == 3 and sched.alive and sched.slots_busy == 0
    finally:
        assert sched.stop()


def test_steady_batches_reuse_their_graph(model):
    """Three jobs arriving together: one prefill graph (24 tokens, 3 outputs) and one
    decode graph (3, 3), reused for every later step; not a build per step."""
    ps = [p[:8] for p in prompts(3, seed=7) if len(p) >= 8][:3]
    assert len(ps) == 3
    sched = Scheduler(model, n_slots=3, n_ctx=CTX, chunk=64)
    # Submit before the thread starts, so all three are admitted into the same first step.
    q: queue.Queue = queue.Queue()
    for p in ps:
        sched.submit(Job(prompt_ids=p, n_predict=10, sampling=SamplingParams(temperature=0.0), stop_at_eog=False,
                         emit=q.put))
    sched.start()
    try:
        done = 0
        while done < 3:
            done += q.get(timeout=60).kind == "done"
    finally:
        assert sched.stop()
    assert sched.steps == 10 and sched.ctx.builds == 2


def test_broken_logits_end_only_their_job_naming_the_step(tmp_path):
    """A pick is never taken from NaN/Inf logits (their argmax is a plausible token): the
    job whose row is broken ends with a 500 naming its step, after the tokens before it;
    a job batched beside it finishes as it would alone."""
    small = dict(n_embd=128, n_head=4, n_head_kv=2, n_ff=256)
    path = write_model(tmp_path / "ok.gguf", **small).path
    ok = Model.open(path, n_threads=2)
    a, b = prompts(2, seed=9)
    g0 = alone(ok, a, 1).ids[0]
    want_b = alone(ok, b, 6)
    assert g0 not in want_b.ids and g0 not in b, "pick other prompts"
    # NaN in the embedding row of a's first pick: a's step 1 is broken, b never reads it.
    poisoned = poison_token_row(path, tmp_path / "row.gguf", g0, small["n_embd"])
    sched = Scheduler(Model.open(poisoned, n_threads=2), n_slots=3, n_ctx=CTX, chunk=16)
    sched.start()
    try:
        # Greedy: a's first pick is g0, so step 1 is broken. Sampling: a prompt ending
        # in g0 breaks the prompt's own row (step 0).
        for temp, pa, where, before in ((0.0, a, "at step 1", [g0]), (0.8, a + [g0], "at the prompt (step 0)", [])):
            q: queue.Queue = queue.Queue()
            for k, p in enumerate((pa, b)):
                sched.submit(Job(prompt_ids=p, n_predict=6, sampling=SamplingParams(temperature=temp, seed=1),
                                 stop_at_eog=False, emit=lambda ev, k=k: q.put((k, ev))))
            evs: list[list] = [[], []]
            while not all(e and e[-1].kind != "token" for e in evs):
                k, ev = q.get(timeout=60)
                evs[k].append(ev)
            end_a = evs[0][-1]
            assert end_a.kind == "error" and end_a.status == 500, end_a
            assert f"non-finite logits {where}" in end_a.message, end_a.message
            assert [e.id for e in evs[0][:-1]] == before
            assert evs[1][-1].kind == "done" and evs[1][-1].reason == "length"
            if temp == 0.0:
                assert [e.id for e in evs[1][:-1]] == want_b.ids
        assert sched.alive
    finally:
        assert sched.stop()
