"""A prompt prefix another slot already holds seeds a new sequence's KV (Engine.add):
it is read where it lies (Context.lend: no copy, no second prefill), only cells whose
forward has finished are taken, a short shared prefix is not worth sharing, a lender
that is about to change its cells first copies what its borrowers read, and the output
is the output alone."""

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


def test_a_held_prefix_is_read_in_place_not_prefilled(model):
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


def copies(ctx) -> list:
    """Record the context's cell copies (src, dst, n) from now on."""
    seen: list = []
    orig = ctx.copy_cells

    def rec(src: int, dst: int, n: int) -> None:
        seen.append((src, dst, n))
        orig(src, dst, n)

    ctx.copy_cells = rec
    return seen


def test_a_shared_prefix_is_borrowed_with_no_copy(model):
    """B reads A's cells of the prefix in place: nothing is copied, B's own cells of it
    stay unwritten (B's attention span starts its own cells after them), and both
    outputs are their outputs alone."""
    eng = engine(model)
    a = Sequence(P + TAIL_A, 12, GREEDY, stop_at_eog=False)
    eng.add(a, 0)
    while a.picks < 2:
        eng.step()
    seen = copies(eng.ctx)
    b = Sequence(P + TAIL_B, 12, GREEDY, stop_at_eog=False)
    eng.add(b, 1)
    assert eng.ctx.borrowed[1] == (0, len(P)) and b.timings.cached_tokens == len(P)
    lo, plo, phi = eng.ctx.span_head(1)
    assert (lo, plo, phi) == (eng.slots[1].base + len(P), eng.slots[0].base, eng.slots[0].base + len(P))
    eng.run()
    assert seen == []
    assert b.ids == alone(model, P + TAIL_B) and a.ids == alone(model, P + TAIL_A)


def test_a_borrowers_prefix_is_borrowed_from_its_lender_and_the_rest_copied(model):
    """C starts with all that B holds (A's prefix, which B borrows, and B's own tail):
    C borrows the prefix from A, never from B, and only B's own tail is copied."""
    eng = engine(model)
    a = Sequence(P + TAIL_A, 4, GREEDY, stop_at_eog=False)
    eng.add(a, 0)
    eng.run()
    b = Sequence(P + ids(5, 20), 4, GREEDY, stop_at_eog=False)
    eng.add(b, 1)
    eng.run()
    assert eng.ctx.borrowed[1] == (0, len(P))
    seen = copies(eng.ctx)
    c_prompt = b.prompt_ids + b.ids[:2] + [11, 12]
    c = Sequence(c_prompt, 6, GREEDY, stop_at_eog=False)
    eng.add(c, 2)
    held = len(b.prompt_ids) + 2
    assert eng.ctx.borrowed[2] == (0, len(P)) and c.timings.cached_tokens == held
    base1, base2 = eng.slots[1].base, eng.slots[2].base
    assert seen == [(base1 + len(P), base2 + len(P), held - len(P))]
    eng.run()
    assert c.ids == alone(model, c_prompt, 6)


def lent(eng, b_tokens: int = 8) -> tuple:
    """A (slot 0) runs P + TAIL_A to its end; B (slot 1, P + TAIL_B) then borrows P from it."""
    a = Sequence(P + TAIL_A, 4, GREEDY, stop_at_eog=False)
    eng.add(a, 0)
    eng.run()
    b = Sequence(P + TAIL_B, b_tokens, GREEDY, stop_at_eog=False)
    eng.add(b, 1)
    assert eng.ctx.borrowed[1] == (0, len(P))
    return a, b


def test_a_lender_that_moves_on_first_gives_its_borrowers_their_copies(model):
    """A's slot takes an unrelated prompt while B reads A's prefix: before A's new
    prompt overwrites those cells, B gets them copied into its own and stops borrowing;
    B's output is still its output alone, and so is B's next turn."""
    eng = engine(model, 2)
    _, b = lent(eng)
    seen = copies(eng.ctx)
    other = Sequence(ids(9, 30), 8, GREEDY, stop_at_eog=False)
    eng.add(other, 0, reuse_prefix=False)
    assert eng.ctx.borrowed[1] is None
    assert seen == [(eng.slots[0].base, eng.slots[1].base, len(P))]
    eng.run()
    assert b.ids == alone(model, P + TAIL_B, 8) and other.ids == alone(model, ids(9, 30), 8)
    turn2 = P + TAIL_B + b.ids + [5, 6, 7]
    b2 = Sequence(turn2, 6, GREEDY, stop_at_eog=False)
    eng.add(b2, 1)
    eng.run()
    assert b2.ids == alone(model, turn2, 6)


def test_a_lender_truncated_inside_the_prefix_gives_the_rest_over(model):
    """A's next turn keeps only part of what B borrows: B keeps borrowing that part and
    gets the rest copied, before A writes over it."""
    eng = engine(model, 2)
    _, b = lent(eng)
    seen = copies(eng.ctx)
    a2 = Sequence(P[:30] + ids(10, 12), 6, GREEDY, stop_at_eog=False)
    eng.add(a2, 0)
    assert eng.ctx.borrowed[1] == (0, 30)
    assert seen == [(eng.slots[0].base + 30, eng.slots[1].base + 30, len(P) - 30)]
    eng.run()
    assert b.ids == alone(model, P + TAIL_B, 8) and a2.ids == alone(model, P[:30] + ids(10, 12), 6)


def test_an_evicted_lender_in_a_pool_gives_its_borrowers_their_copies(model):
    """A pooled context short of cells forgets an idle lender (least recently used):
    its borrower gets the cells it reads first, and keeps its output alone."""
    ctx = Context(model, n_ctx=96, n_seq=3, n_cells=182)   # A 58 cells, B 74, a free 50
    eng = Engine(ctx, [ctx.session(i) for i in range(3)], chunk=16)
    a = Sequence(P + TAIL_A, 4, GREEDY, stop_at_eog=False)
    eng.add(a, 0)
    eng.run()                                     # A idle, holding its cells
    b = Sequence(P + TAIL_B, 20, GREEDY, stop_at_eog=False)
    eng.add(b, 1)
    assert ctx.borrowed[1] == (0, len(P))
    c = Sequence(ids(11, 30), 28, GREEDY, stop_at_eog=False)
    eng.add(c, 2)                                 # only A's room fits its 58
    assert ctx.ranges[0] == (0, 0) and ctx.borrowed[1] is None
    eng.run()
    assert b.ids == alone(model, P + TAIL_B, 20) and c.ids == alone(model, ids(11, 30), 28)


def test_a_saved_borrower_holds_its_whole_kv(model, tmp_path):
    """Saving a sequence that borrows its prefix writes the prefix's KV too: restored in
    a context of its own, its continuation is the one it gets in place."""
    from minfer.session import Session

    eng = engine(model, 2)
    lent(eng, 4)
    eng.run()
    assert eng.ctx.borrowed[1] == (0, len(P))
    eng.slots[1].save(tmp_path / "b.session")
    assert eng.ctx.borrowed[1] is None
    loaded = Session.load(model, tmp_path / "b.session", n_ctx=160)
    nxt = [3, 4, 5]
    want = eng.slots[1].generate_ids(list(eng.slots[1].tokens) + nxt, 6)
    assert loaded.generate_ids(list(loaded.tokens) + nxt, 6) == want
