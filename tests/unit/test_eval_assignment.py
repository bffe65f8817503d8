"""Which held-out batches each rank scores across evaluations (raytrec.eval_plan)."""

from __future__ import annotations

import random

from raytrec.eval_plan import assign_eval_batches, keep_eval_batches


def _check(
    assigned: dict[int, list[int | None]], num_batches: int, gang_of: dict[int, int]
) -> None:
    scored = sorted(b for batches in assigned.values() for b in batches if b is not None)
    assert scored == list(range(num_batches)), "every batch scored exactly once"
    for g in set(gang_of[r] for r in assigned):
        rounds = {len(assigned[r]) for r in assigned if gang_of[r] == g}
        assert len(rounds) == 1, f"gang {g}'s ranks do different numbers of forwards"


def _held(assigned: dict[int, list[int | None]]) -> dict[int, list[int]]:
    return {r: [b for b in batches if b is not None] for r, batches in assigned.items()}


def test_the_first_evaluation_is_the_round_robin_split() -> None:
    gang_of = {0: 0, 1: 0, 2: 1, 3: 1}
    ranks = [0, 1, 2, 3]
    kept = keep_eval_batches(10, ranks, before={}, gang_of=gang_of.__getitem__)
    assert kept == assign_eval_batches(10, ranks)


def test_survivors_keep_their_batches_and_a_joined_gang_takes_the_lost_ones_first() -> None:
    gang_of = {0: 0, 1: 0, 2: 1, 3: 1, 4: 2, 5: 2}
    first = assign_eval_batches(8, [0, 1, 2, 3])
    # Gang 0 (ranks 0, 1) lost; gang 2 (ranks 4, 5) joined.
    second = keep_eval_batches(8, [2, 3, 4, 5], before=_held(first), gang_of=gang_of.__getitem__)
    assert second[2] == first[2] and second[3] == first[3]
    assert second[2] != assign_eval_batches(8, [2, 3, 4, 5])[2]  # a new split would move it
    assert sorted(b for r in (4, 5) for b in second[r] if b is not None) == sorted(
        b for r in (0, 1) for b in first[r] if b is not None
    )
    _check(second, 8, gang_of)


def test_a_join_with_nothing_lost_leaves_every_batch_where_it_was() -> None:
    gang_of = {0: 0, 1: 1, 2: 2}
    first = assign_eval_batches(5, [0, 1])
    second = keep_eval_batches(5, [0, 1, 2], before=_held(first), gang_of=gang_of.__getitem__)
    assert _held(second) == {**_held(first), 2: []}


def _gang(gang_of: dict[int, int], gang_size: int) -> list[int]:
    """A new gang's ranks, numbered after the others."""
    gang = max(gang_of.values(), default=-1) + 1
    ranks = [gang * gang_size + k for k in range(gang_size)]
    gang_of.update(dict.fromkeys(ranks, gang))
    return ranks


def test_any_sequence_of_losses_and_joins_scores_every_batch_once() -> None:
    rng = random.Random(20261129)
    for _ in range(300):
        num_batches, gang_size = rng.randint(1, 40), rng.randint(1, 3)
        gang_of: dict[int, int] = {}
        live = [r for _ in range(rng.randint(1, 4)) for r in _gang(gang_of, gang_size)]
        held: dict[int, list[int]] = {}
        for _ in range(rng.randint(1, 6)):
            assigned = keep_eval_batches(
                num_batches, live, before=held, gang_of=gang_of.__getitem__
            )
            _check(assigned, num_batches, gang_of)
            for r in live:  # what a rank held and still holds, it scores again
                assert set(held.get(r, ())) <= set(assigned[r])
            held = _held(assigned)
            if rng.random() < 0.5 and len(live) > gang_size:
                lost = gang_of[rng.choice(live)]
                live = [r for r in live if gang_of[r] != lost]
            else:
                live += _gang(gang_of, gang_size)
