"""A prompt prefix another slot already holds seeds a new sequence's KV (Engine.add):
the cells are copied where the KV lives instead of being prefilled again, only cells
whose forward has finished are taken, a short shared prefix is not worth a copy, and
the output is the output without the copy."""

from __future__ import annotations

import pytest

from minfer.engine import Engine, Sequence
from minfer.model import Model
from minfer.sampling import SamplingParams
from minfer.session import Context
from scheduler_helpers import token_ids

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def model(mixed_model) -> Model:
    return mixed_model


ids = token_ids


P = ids(1, 48)                       # the shared prefix (three chunks of 16)
TAIL_A, TAIL_B = [7] + ids(2, 5), [9] + ids(3, 6)


def engine(model, n_seq: int = 3) -> Engine:
    ctx = Context(model, n_ctx=160, n_seq=n_seq)
    return Engine(ctx, [ctx.session(i) for i in range(n_seq)], chunk=16)


def alone(model, prompt: list[int], n: int = 12) -> list[int]:
    """The same prompt in a fresh context, prefilled in the same chunks."""
    eng = engine(model, 1)
    s = Sequence(prompt, n, GREEDY, stop_at_eog=False)
    eng.add(s)
    eng.run()
    return s.ids


def test_a_held_prefix_is_copied_not_prefilled(model):
    eng = engine(model)
    a = Sequence(P + TAIL_A, 12, GREEDY, stop_at_eog=False)
    eng.add(a, 0)
    while a.picks < 2:               # A's prompt is processed and its KV settled
        eng.step()
    b = Sequence(P + TAIL_B, 12, GREEDY, stop_at_eog=False)
    c = Sequence(P[:10] + TAIL_B, 12, GREEDY, stop_at_eog=False)   # shares too little to copy
    eng.add(b, 1)
    eng.add(c, 2)
    assert b.timings.cached_tokens == len(P) and c.timings.cached_tokens == 0
    eng.run()
    assert b.ids == alone(model, P + TAIL_B) and a.ids == alone(model, P + TAIL_A)
    assert c.ids == alone(model, P[:10] + TAIL_B)


def test_only_cells_whose_forward_finished_are_taken(model):
    """A slot still prefilling: the chunk in flight is not copied (a device may still be
    writing it); what was copied plus what is prefilled gives the output alone."""
    eng = engine(model)
    long = P + ids(4, 40)
    a = Sequence(long, 4, GREEDY, stop_at_eog=False)
    eng.add(a, 0)
    eng.step()                        # chunk [0, 16) in flight
    eng.step()                        # [0, 16) done, [16, 32) in flight
    assert eng.slots[0].n_past == 32
    b = Sequence(P + TAIL_B, 12, GREEDY, stop_at_eog=False)
    eng.add(b, 1)
    assert b.timings.cached_tokens == 16
    eng.run()
    assert b.ids == alone(model, P + TAIL_B)


def test_an_idle_slots_conversation_seeds_a_new_one(model):
    """A finished conversation's KV (an idle slot) seeds a prompt that starts the same,
    in a slot of its own; the seeded slot's tokens are what its KV holds."""
    eng = engine(model, 2)
    a = Sequence(P + TAIL_A, 6, GREEDY, stop_at_eog=False)
    eng.add(a, 0)
    eng.run()
    b = Sequence(P + TAIL_B, 6, GREEDY, stop_at_eog=False)
    eng.add(b, 1)
    assert b.timings.cached_tokens == len(P)
    eng.run()
    assert eng.slots[1].tokens[:len(P) + len(TAIL_B)] == P + TAIL_B
    assert b.ids == alone(model, P + TAIL_B, 6)
