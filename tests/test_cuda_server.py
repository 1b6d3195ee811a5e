"""The server's scheduler on the CUDA backend (marker `cuda`; CI deselects it, `pytest -m
cuda` runs it on the GPU machine, where it fails without a GPU rather than skip).

A batched decode step leaves its logits on the device and picks there (DeviceRows: one
argmax_rows call for the greedy rows, one top_k_rows call for the sampled rows'
candidates): the jobs get exactly the tokens of the host path (every row read back,
n_vocab * 4 bytes each), greedy, seeded sampling and penalties alike, while a step
reads back a small fraction of one row per pick; a row holding NaN fails only its job,
with the host path's error."""

from __future__ import annotations

import queue

import numpy as np
import pytest

from minfer import _core
from minfer.model import Model
from minfer.sampling import SamplingParams
from minfer.server.scheduler import Job, Scheduler
from minfer.session import Session
from minfer.testing.synth import write_model
from scheduler_helpers import pick_mix, poison_token_row, prompts

pytestmark = pytest.mark.cuda

CTX = 128
N_VOCAB = 32000  # a row of 128 KB: what the host path reads back per pick
SMALL = dict(n_layer=2, n_embd=128, n_head=4, n_head_kv=2, n_ff=256, n_vocab=N_VOCAB)  # head dim 32


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("cuda-server") / "m.gguf"
    write_model(path, types={"ffn_up": "Q8_0", "attn_q": "Q4_0"}, seed=3, **SMALL)
    return path




def scheduler(path, device_picks: bool) -> Scheduler:
    """A scheduler on CUDA; device_picks=False keeps every step on the host path (the
    reference). A first forward shows the context where its logits live, so the device
    path is taken from the jobs' first step."""
    sched = Scheduler(Model.open(path, backends=["cuda"]), n_slots=4, n_ctx=CTX, chunk=16)
    assert sched.ctx.backend_names[0] == "CUDA"
    if not device_picks:
        sched.engine._copy_mode = lambda items: False
    ses = sched.slots[0].session
    ses.forward([1, 2, 3], copy=None)
    ses.reset()
    return sched


def run(sched: Scheduler, specs, speculate=None) -> tuple[list[list], dict, int]:
    """Every job submitted before the scheduler starts (so both runs batch alike); each
    job's events (kind, id, text, reason, message), the CUDA counters over the run and
    its steps."""
    q: queue.Queue = queue.Queue()
    for k, (p, n, sp) in enumerate(specs):
        sched.submit(Job(prompt_ids=p, n_predict=n, sampling=sp, stop_at_eog=False, speculate=speculate,
                         emit=lambda ev, k=k: q.put((k, ev))))
    _core.cuda_sync()
    _core.testing.cuda_reset_counters()
    steps = sched.steps
    sched.start()
    out: list[list] = [[] for _ in specs]
    try:
        left = len(specs)
        while left:
            k, ev = q.get(timeout=120)
            out[k].append((ev.kind, ev.id, ev.text, ev.reason, ev.message))
            left -= ev.kind != "token"
    finally:
        assert sched.stop()
    _core.cuda_sync()
    return out, dict(_core.testing.cuda_counters()), sched.steps - steps


MIX = pick_mix(prompts(8, seed=31))


def test_device_picks_equal_the_host_path_reading_back_far_less_than_a_row(model_path):
    want, host, _ = run(scheduler(model_path, False), MIX)
    got, c, steps = run(scheduler(model_path, True), MIX)
    print(f"\nhost path: {host}\ndevice picks over {steps} steps: {c}")
    assert got == want
    for evs in got:
        assert evs[-1][0] == "done" and evs[-1][3] == "length", evs[-1]
    assert [e[1] for e in got[0]] != [e[1] for e in got[1]], "the seeded draw left the greedy path"
    picks = sum(e[0] == "token" for evs in got for e in evs)
    assert picks == sum(n for _, n, _ in MIX)
    row = N_VOCAB * 4
    assert host["d2h_bytes"] >= picks * row  # what the device path saves: every row read back
    # At most one argmax_rows and one top_k_rows readback a step: per row at most an int
    # and the candidates (a flag, 256 ids and values, 256 gathered values).
    assert c["d2h"] <= 2 * steps, (c, steps)
    assert c["d2h_bytes"] <= steps * 4 * (4 + 4 * (1 + 2 * 256 + 256)), (c, steps)
    assert c["d2h_bytes"] * 20 < picks * row, (c, picks)


def test_a_broken_row_fails_only_its_job_with_the_host_paths_error(model_path, tmp_path):
    """NaN in the embedding row of a's first greedy pick g0: a greedy a fails at step 1
    (argmax_rows flags it), a sampled a + [g0] at the prompt (top_k_rows flags it), each
    with the host path's error; b, batched beside it, finishes as on the host path. (Not
    compared with b alone: on CUDA a prompt in chunks may round apart from one forward.)"""
    a, b = prompts(2, seed=9)
    ok = Model.open(model_path, backends=["cuda"])
    g0 = Session(ok, n_ctx=CTX).generate(a, 1, SamplingParams(temperature=0.0), stop_at_eog=False).ids[0]
    want_b = Session(ok, n_ctx=CTX).generate(b, 6, SamplingParams(temperature=0.0), stop_at_eog=False).ids
    assert g0 not in want_b and g0 not in b, "pick other prompts"
    poisoned = poison_token_row(model_path, tmp_path / "row.gguf", g0, SMALL["n_embd"])
    cases = [
        ([(a, 6, SamplingParams(temperature=0.0)), (b, 6, SamplingParams(temperature=0.0))], "at step 1"),
        ([(a + [g0], 6, SamplingParams(temperature=0.8, seed=1)), (b, 6, SamplingParams(temperature=0.8, seed=2))],
         "at the prompt (step 0)"),
    ]
    for specs, where in cases:
        want, _, _ = run(scheduler(poisoned, False), specs)
        got, _, _ = run(scheduler(poisoned, True), specs)
        assert got == want
        end_a = got[0][-1]
        assert end_a[0] == "error" and f"non-finite logits {where}" in end_a[4], end_a
        assert got[1][-1][0] == "done" and got[1][-1][3] == "length", got[1][-1]


@pytest.mark.parametrize("concurrent,draft_max", [(1, 8), (4, 3)])
def test_ngram_speculation_in_the_server_equals_plain_greedy(model_path, concurrent, draft_max):
    """Speculative decoding in the server on CUDA (ngram drafts, verified in batched
    blocks on the device): every job's tokens are plain greedy decoding's, with drafts
    proposed and verified. Blocks stay within the exact rows (1 x 9, 4 x 4 <= 16)."""
    from minfer.server.metrics import Metrics
    from minfer.server.scheduler import SpecRequest

    # Prompts that repeat themselves, so the prompt lookup finds something to propose.
    rng = np.random.default_rng(17)
    specs = []
    for _ in range(concurrent):
        motif = [int(t) for t in rng.integers(3, N_VOCAB, size=6)]
        specs.append((motif * 5, 40, SamplingParams(temperature=0.0)))

    def sched():
        m = Metrics()
        return Scheduler(Model.open(model_path, backends=["cuda"]), n_slots=concurrent, n_ctx=CTX, chunk=16,
                         metrics=m), m

    plain, _ = sched()
    want, _, _ = run(plain, specs)
    spec, m = sched()
    got, _, _ = run(spec, specs, SpecRequest("ngram", draft_max))
    assert got == want
    assert m.drafted > 0, "no draft was proposed"
    print(f"\nngram x{concurrent}: drafted {m.drafted}, accepted {m.accepted}")
