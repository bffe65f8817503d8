"""The indexed Parquet assignment (pure, milliseconds to a second): every row of every epoch in
exactly one batch of one rank, batch ids unique and mapped back to their rows, resumes exact."""

from __future__ import annotations

import numpy as np
import pytest

from raytrec.data.parquet_plan import BatchPlan, Piece
from raytrec.data.parquet_recut import hand_off, recut, take_over
from raytrec.data.parquet_streams import (
    Part,
    Stream,
    remaining_rows,
    stream_batch_size,
    stream_epoch,
    stream_length,
    truncated,
)
from raytrec.data.synthetic import batch_id, split_batch_id


def random_plan(
    rng: np.random.Generator,
    *,
    files: int,
    max_groups: int,
    max_rows: int,
    num_shards: int,
    batch_size: int,
    epochs: int = 2,
    shuffle_seed: int | None = 5,
    shuffle_window_rows: int | None = None,
) -> BatchPlan:
    """Files of 1..max_groups row groups of 0..max_rows rows (empty row groups included)."""
    groups = [
        tuple(int(n) for n in rng.integers(0, max_rows + 1, rng.integers(1, max_groups + 1)))
        for _ in range(files)
    ]
    return BatchPlan(
        paths=tuple(f"/data/part-{i:05d}.parquet" for i in range(files)),
        row_groups=tuple(groups),
        num_shards=num_shards,
        batch_size=batch_size,
        epochs=epochs,
        shuffle_seed=shuffle_seed,
        shuffle_window_rows=shuffle_window_rows,
    )


def global_rows(plan: BatchPlan, piece: Piece) -> tuple[int, int]:
    """The piece's rows as [start, stop) in the concatenation of all files (listing order)."""
    f = plan.paths.index(piece.path)
    before = sum(sum(g) for g in plan.row_groups[:f])
    assert piece.file_row == sum(plan.row_groups[f][: piece.row_group]) + piece.start
    return before + piece.file_row, before + piece.file_row + piece.rows


def check_cover(plan: BatchPlan) -> dict[int, list[tuple[int, int]]]:
    """Every row in exactly one batch of one rank per epoch, and every batch as the plan sizes
    it; returns batch id -> its rows (global ranges)."""
    n, m = plan.rows_per_epoch, plan.steps_per_epoch
    rows_of: dict[int, list[tuple[int, int]]] = {}
    for epoch in range(plan.epochs):
        hits = np.zeros(n + 1, dtype=np.int64)  # a difference array: +1 at start, -1 at stop
        for rank in range(plan.num_shards):
            pieces = plan.pieces(rank, epoch * m, (epoch + 1) * m)
            steps: list[int] = []
            for p in pieces:
                group_rows = plan.row_groups[plan.paths.index(p.path)][p.row_group]
                assert 0 <= p.start < p.stop <= group_rows
                assert sum(p.counts) == p.rows and all(c > 0 for c in p.counts)
                a, b = global_rows(plan, p)
                hits[a] += 1
                hits[b] -= 1
                at = a
                for k, count in enumerate(p.counts):
                    step = p.step + k
                    if not steps or steps[-1] != step:
                        steps.append(step)
                    rows_of.setdefault(batch_id(rank, step), []).append((at, at + count))
                    at += count
            # Every step of the epoch, in order, each sized as batch_rows says.
            assert steps == list(range(epoch * m, (epoch + 1) * m))
            for step in steps:
                size = sum(b - a for a, b in rows_of[batch_id(rank, step)])
                assert size == plan.batch_size_of(rank, step)
                assert 1 <= size <= plan.batch_size
        assert (np.cumsum(hits)[:n] == 1).all(), f"epoch {epoch}: a row in 0 or 2 batches"
    return rows_of


@pytest.mark.parametrize(
    ("num_shards", "batch_size", "shuffle_seed"),
    [(1, 64, None), (3, 50, None), (7, 33, 1), (16, 8, 2), (5, 2, None), (64, 100, 3)],
)
def test_every_row_of_every_epoch_in_exactly_one_batch_of_one_rank(
    num_shards: int, batch_size: int, shuffle_seed: int | None
) -> None:
    rng = np.random.default_rng(num_shards * 1000 + batch_size)
    plan = random_plan(
        rng,
        files=23,
        max_groups=6,
        max_rows=400,
        num_shards=num_shards,
        batch_size=batch_size,
        epochs=2,
        shuffle_seed=shuffle_seed,
    )
    rows_of = check_cover(plan)
    # Ids: one per (rank, step), all distinct, each mapping back to its rank and step.
    assert len(rows_of) == num_shards * plan.num_steps
    for i in rows_of:
        rank, step = split_batch_id(i)
        assert 0 <= rank < num_shards and 0 <= step < plan.num_steps
        # The id alone gives back the batch's rows.
        assert rows_of[i] == [global_rows(plan, p) for p in plan.pieces(rank, step, step + 1)]


def test_batches_hold_exactly_batch_size_when_it_divides_the_share() -> None:
    plan = BatchPlan(
        paths=("a", "b"),
        row_groups=((1000, 600), (448,)),
        num_shards=4,
        batch_size=64,
        epochs=1,
    )  # 2048 rows: 512 per rank, 8 batches of 64
    assert plan.steps_per_epoch == 8
    assert {plan.batch_size_of(r, s) for r in range(4) for s in range(8)} == {64}
    # Shares that differ by a row: the same number of batches, none above batch_size.
    odd = BatchPlan(paths=("a",), row_groups=((2051,),), num_shards=4, batch_size=64, epochs=1)
    sizes = [[odd.batch_size_of(r, s) for s in range(odd.steps_per_epoch)] for r in range(4)]
    assert [sum(s) for s in sizes] == [512, 513, 513, 513]
    assert all(len(s) == 9 and max(s) <= 64 and min(s) >= 56 for s in sizes)


def test_at_production_size_4096_ranks() -> None:
    rng = np.random.default_rng(0)
    plan = BatchPlan(
        paths=tuple(f"f{i}" for i in range(2000)),
        row_groups=tuple(tuple(int(n) for n in rng.integers(200, 600, 10)) for _ in range(2000)),
        num_shards=4096,
        batch_size=256,
        epochs=1,
        shuffle_seed=7,
    )
    n, m = plan.rows_per_epoch, plan.steps_per_epoch
    assert m == 8  # ~8M rows: shares of ~1950 rows
    hits = np.zeros(n + 1, dtype=np.int32)
    firsts = np.r_[0, np.cumsum([sum(g) for g in plan.row_groups])]
    index = {p: i for i, p in enumerate(plan.paths)}
    for rank in range(plan.num_shards):
        for p in plan.pieces(rank, 0, m):
            a = firsts[index[p.path]] + p.file_row
            hits[a] += 1
            hits[a + p.rows] -= 1
    assert (np.cumsum(hits)[:n] == 1).all()


def test_shuffled_orders_are_seeded_per_epoch() -> None:
    rng = np.random.default_rng(1)
    kw = {"files": 40, "max_groups": 4, "max_rows": 50, "num_shards": 4, "batch_size": 16}
    plan = random_plan(rng, **kw, epochs=3, shuffle_seed=9)
    again = random_plan(np.random.default_rng(1), **kw, epochs=3, shuffle_seed=9)
    orders = [plan.epoch_order(e).tolist() for e in range(3)]
    assert orders == [again.epoch_order(e).tolist() for e in range(3)]  # reproducible
    assert orders[0] != orders[1] != orders[2]  # and drawn afresh every epoch
    assert all(sorted(o) == list(range(len(o))) for o in orders)
    plain = random_plan(np.random.default_rng(1), **kw, epochs=3, shuffle_seed=None)
    assert all(plain.epoch_order(e).tolist() == sorted(orders[0]) for e in range(3))
    # Rank 0 reads other rows in each epoch.
    m = plan.steps_per_epoch
    firsts = [plan.pieces(0, e * m, e * m + 1)[0] for e in range(3)]
    assert len({(p.path, p.row_group, p.start) for p in firsts}) > 1


def test_a_range_of_steps_is_the_steps_one_by_one() -> None:
    plan = random_plan(
        np.random.default_rng(2), files=9, max_groups=3, max_rows=300, num_shards=3, batch_size=40
    )

    def rows(pieces: list[Piece]) -> list[tuple[str, int, int]]:
        return [(p.path, p.row_group, r) for p in pieces for r in range(p.start, p.stop)]

    for rank in range(3):
        for start in (0, 1, plan.steps_per_epoch - 1, plan.steps_per_epoch + 2):
            whole = rows(plan.pieces(rank, start, plan.num_steps))
            one_by_one = [
                r for s in range(start, plan.num_steps) for r in rows(plan.pieces(rank, s, s + 1))
            ]
            assert whole == one_by_one
    assert plan.pieces(0, 3, 3) == []


def test_plans_that_would_leave_a_batch_empty_are_refused() -> None:
    with pytest.raises(ValueError, match="the data has 3 rows, fewer than the 4 ranks"):
        BatchPlan(paths=("a",), row_groups=((3,),), num_shards=4, batch_size=8, epochs=1)
    # 9 rows over 2 ranks in batches of 1: 5 batches each, and the share of 4 rows cannot fill 5.
    with pytest.raises(ValueError, match="a batch would be empty"):
        BatchPlan(paths=("a",), row_groups=((9,),), num_shards=2, batch_size=1, epochs=1)
    with pytest.raises(ValueError, match=r"BatchPlan.row_groups must be one tuple per path"):
        BatchPlan(paths=("a", "b"), row_groups=((9,),), num_shards=1, batch_size=1, epochs=1)
    plan = BatchPlan(paths=("a",), row_groups=((9,),), num_shards=1, batch_size=4, epochs=2)
    with pytest.raises(ValueError, match=r"step must be in \[0, 6\)"):
        plan.batch_rows(0, 6)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 1\)"):
        plan.share(1)


# -- re-sharing the rows left after a membership change -------------------------------------


def stream_rows(plan: BatchPlan, stream: Stream, k0: int, k1: int) -> list[tuple[int, int]]:
    """Global row ranges of batches [k0, k1) of ``stream``, checking the pieces on the way."""
    out = []
    for p in plan.stream_pieces(stream, k0, k1):
        assert sum(p.counts) == p.rows and all(c > 0 for c in p.counts)
        out.append(global_rows(plan, p))
    return out


def test_recut_of_whole_epochs_is_the_plan_s_own_cut() -> None:
    plan = random_plan(
        np.random.default_rng(3), files=7, max_groups=3, max_rows=200, num_shards=5, batch_size=24
    )
    whole = {e: [(0, plan.rows_per_epoch)] for e in range(plan.epochs)}
    shared = recut(whole, queued=[0] * 5, batch_size=24)
    assert shared.left_over == 0
    for rank, stream in enumerate(shared.streams):
        assert stream == plan.stream(rank)
        assert plan.stream_pieces(stream, 0, plan.num_steps) == plan.pieces(rank, 0, plan.num_steps)


class RowHits:
    """How often each row of each epoch of ``plan`` was in a trained batch of at most ``batch``
    rows (one difference array per epoch)."""

    def __init__(self, plan: BatchPlan, batch: int) -> None:
        self.plan, self.batch = plan, batch
        self.hits = [np.zeros(plan.rows_per_epoch + 1, dtype=np.int64) for _ in range(plan.epochs)]

    def train(self, stream: Stream, k0: int, k1: int) -> None:
        for k in range(k0, k1):
            assert 1 <= stream_batch_size(stream, k) <= self.batch
            epoch = stream_epoch(stream, k)
            for a, b in stream_rows(self.plan, stream, k, k + 1):
                self.hits[epoch][a] += 1
                self.hits[epoch][b] -= 1

    def assert_each_once(self) -> None:
        for epoch, h in enumerate(self.hits):
            assert (np.cumsum(h)[: self.plan.rows_per_epoch] == 1).all(), f"epoch {epoch}"


def _random_streams(
    seed: int, *, num_shards: int
) -> tuple[np.random.Generator, int, BatchPlan, list[Stream], RowHits]:
    """A random 2-epoch plan over 8 files, its shards' streams and a row counter for it."""
    rng = np.random.default_rng(seed)
    batch = int(rng.integers(3, 40))
    plan = random_plan(
        rng, files=8, max_groups=3, max_rows=300, num_shards=num_shards, batch_size=batch, epochs=2
    )
    return rng, batch, plan, [plan.stream(r) for r in range(num_shards)], RowHits(plan, batch)


@pytest.mark.parametrize("seed", range(6))
def test_rows_left_are_shared_once_and_every_rank_ends_at_the_same_step(seed: int) -> None:
    """Ranks stop at random places of their streams (some lost, some queueing replays); the
    rows none trained are cut again among the survivors, and again after a second change: over
    the epochs every row is in exactly one trained batch, batches hold 1..B rows, and all
    survivors have as many batches left (replays counted)."""
    rng, batch, _, streams, rows = _random_streams(seed, num_shards=6)
    train = rows.train

    for _ in range(2):  # two membership changes
        taken = [int(rng.integers(0, stream_length(s) + 1)) for s in streams]
        for s, k in zip(streams, taken, strict=True):
            train(s, 0, k)
        remaining: dict[int, list[tuple[int, int]]] = {}
        for s, k in zip(streams, taken, strict=True):
            for epoch, runs in remaining_rows(s, k).items():
                remaining.setdefault(epoch, []).extend(runs)
        survivors = int(rng.integers(1, 8))
        queued = [int(q) for q in rng.integers(0, 3, survivors)]
        shared = recut(remaining, queued=queued, batch_size=batch)
        assert shared.left_over == 0
        lengths = {q + stream_length(s) for q, s in zip(queued, shared.streams, strict=True)}
        assert len(lengths) == 1, lengths
        streams = list(shared.streams)
        plan_rows = sum(b - a for runs in remaining.values() for a, b in runs)
        assert sum(sum(p.total for p in s) for s in streams) == plan_rows
    for s in streams:
        train(s, 0, stream_length(s))
    rows.assert_each_once()


@pytest.mark.parametrize("seed", range(6))
def test_a_join_hands_off_the_ends_of_the_survivors_streams(seed: int) -> None:
    """Survivors in lockstep (as many batches left, replays counted) keep their streams' next
    batches unchanged and give some away; joining ranks get the rest: every rank ends at the
    same step, batches hold 1..B rows, and every row of every epoch is trained once."""
    rng, batch, plan, streams, rows = _random_streams(seed, num_shards=4)
    train = rows.train

    at = int(rng.integers(0, plan.num_steps // 2))
    for s in streams:
        train(s, 0, at)
    joining = int(rng.integers(1, 5))
    handoff = hand_off([(s, at, 0) for s in streams], joining=joining, batch_size=batch)
    assert handoff is not None
    k = handoff.batches
    assert k < plan.num_steps - at  # the survivors gave some batches away
    for old, kept in zip(streams, handoff.kept, strict=True):
        assert stream_length(kept) == at + k
        assert plan.stream_pieces(kept, 0, at + k) == plan.stream_pieces(old, 0, at + k)
        train(kept, at, at + k)
    assert [stream_length(s) for s in handoff.streams] == [k] * joining
    for s in handoff.streams:
        train(s, 0, k)
    rows.assert_each_once()


@pytest.mark.parametrize("seed", range(12))
def test_a_loss_s_rows_are_taken_over_after_the_survivors_current_parts(seed: int) -> None:
    """Two losses in a row, each at a random step: the survivors (some queueing replays) read on
    to the end of the part they are in, unchanged, and then the rows after those and the lost
    ranks' rows left; every survivor ends at the same step, epochs stay in order in every
    stream, and over the job every row of every epoch is trained once. Where the rows after
    the kept batches cannot even the survivors out, there is no plan (and recut is used)."""
    rng, batch, _, streams, rows = _random_streams(seed, num_shards=6)
    at = [0] * len(streams)
    queued = [0] * len(streams)
    planned = 0
    for _ in range(2):
        if len(streams) == 1:
            break
        left = [q + stream_length(s) - k for s, k, q in zip(streams, at, queued, strict=True)]
        steps = int(rng.integers(0, min(left) + 1))
        for i, s in enumerate(streams):  # every rank trains ``steps``: replays first
            own = max(0, steps - queued[i])
            rows.train(s, at[i], at[i] + own)
            at[i] += own
            queued[i] = max(0, queued[i] - steps)
        lost = sorted(rng.choice(len(streams), int(rng.integers(1, len(streams))), replace=False))
        orphaned: dict[int, list[tuple[int, int]]] = {}
        for i in lost:
            for epoch, runs in remaining_rows(streams[i], at[i]).items():
                orphaned.setdefault(epoch, []).extend(runs)
        kept = [i for i in range(len(streams)) if i not in lost]
        new_queued = [queued[i] + int(rng.integers(0, 3)) for i in kept]  # the lost's replays
        survivors = [(streams[i], at[i], q) for i, q in zip(kept, new_queued, strict=True)]
        plan = take_over(survivors, orphaned, batch_size=batch)
        if plan is None:  # what the coordinator does then: every row left cut again
            for s, k, _ in survivors:
                for epoch, runs in remaining_rows(s, k).items():
                    orphaned.setdefault(epoch, []).extend(runs)
            shared = recut(orphaned, queued=new_queued, batch_size=batch)
            assert shared.left_over == 0
            streams, at, queued = list(shared.streams), [0] * len(kept), new_queued
            continue
        planned += 1
        for (old, k, _), new, keep in zip(survivors, plan.streams, plan.keep, strict=True):
            assert k <= keep <= stream_length(old)
            assert truncated(new, keep) == truncated(old, keep)  # read on, unchanged
            epochs = [p.epoch for p in new]
            assert epochs == sorted(epochs)
        ends = zip(survivors, plan.streams, strict=True)
        assert {q + stream_length(s) - k for (_, k, q), s in ends} == {plan.batches}
        streams, at, queued = list(plan.streams), [k for _, k, _ in survivors], new_queued
    assert planned  # the first loss always has a plan with these seeds
    for s, k in zip(streams, at, strict=True):
        rows.train(s, k, stream_length(s))
    rows.assert_each_once()


def test_a_hand_off_needs_survivors_in_lockstep_and_rows_enough() -> None:
    plan = BatchPlan(paths=("a",), row_groups=((40,),), num_shards=2, batch_size=4, epochs=1)
    s0, s1 = plan.stream(0), plan.stream(1)  # 5 batches of 4 rows each
    assert hand_off([(s0, 0, 0), (s1, 1, 0)], joining=1, batch_size=4) is None  # uneven
    # One batch left each: 2 batches' rows cannot give a third rank a batch and keep one each.
    assert hand_off([(s0, 4, 0), (s1, 4, 0)], joining=1, batch_size=4) is None
    # A survivor with replays queued keeps at least those.
    handoff = hand_off([(s0, 3, 2), (s1, 1, 0)], joining=2, batch_size=4)
    assert handoff is not None and handoff.batches == 2
    assert stream_length(handoff.kept[0]) == 3 and stream_length(handoff.kept[1]) == 3
    assert handoff.rows == 2 * 4 + 2 * 4


def test_recut_cannot_fill_a_batch_per_rank_from_too_few_rows() -> None:
    shared = recut({0: [(10, 12)], 1: [(0, 9)]}, queued=[0, 0, 0], batch_size=4)
    assert shared.left_over == 2  # 2 rows of epoch 0 for 3 ranks
    assert [stream_length(s) for s in shared.streams] == [1, 1, 1]  # epoch 1: 3 rows each
    with pytest.raises(ValueError, match=r"rows 3..6 given out twice"):
        recut({0: [(0, 5), (3, 6)]}, queued=[0], batch_size=4)
    part = shared.streams[0][0]
    assert Part.from_json(part.to_json()) == part


# -- rows shuffled within a window -------------------------------------------------------------


def epoch_rows(plan: BatchPlan, epoch: int) -> list[tuple[str, int]]:
    """Every rank's rows of ``epoch`` in step order, as (file, index in the file)."""
    m = plan.steps_per_epoch
    return [
        (p.path, p.file_row + i)
        for rank in range(plan.num_shards)
        for p in plan.pieces(rank, epoch * m, (epoch + 1) * m)
        for i in range(p.rows)
    ]


@pytest.mark.parametrize(
    ("num_shards", "batch_size", "window"), [(1, 64, 500), (3, 50, 97), (7, 33, 1), (16, 8, 4000)]
)
def test_a_shuffle_window_keeps_every_row_once_per_epoch(
    num_shards: int, batch_size: int, window: int
) -> None:
    rng = np.random.default_rng(num_shards * 1000 + batch_size)
    plan = random_plan(
        rng,
        files=23,
        max_groups=6,
        max_rows=400,
        num_shards=num_shards,
        batch_size=batch_size,
        shuffle_window_rows=window,
    )
    rows_of = check_cover(plan)  # pieces are where each batch's rows are: every row once
    for i in list(rows_of)[:: max(1, len(rows_of) // 50)]:
        rank, step = split_batch_id(i)
        assert rows_of[i] == [global_rows(plan, p) for p in plan.pieces(rank, step, step + 1)]


def test_the_window_order_is_a_pure_function_of_seed_epoch_and_data() -> None:
    def plan(seed: int, window: int | None = 300) -> BatchPlan:
        return random_plan(
            np.random.default_rng(0),
            files=5,
            max_groups=4,
            max_rows=200,
            num_shards=3,
            batch_size=32,
            shuffle_seed=seed,
            shuffle_window_rows=window,
        )

    first = [epoch_rows(plan(7), e) for e in range(2)]
    assert first == [epoch_rows(plan(7), e) for e in range(2)]  # a fresh plan: the same order
    assert first[0] != first[1]  # drawn again every epoch
    assert first[0] != epoch_rows(plan(8), 0)  # another seed, another order
    # The same row groups in the same order: the window changes which row is at each place.
    unwindowed = epoch_rows(plan(7, None), 0)
    assert sorted(first[0]) == sorted(unwindowed) and first[0] != unwindowed
    with pytest.raises(ValueError, match="shuffle_window_rows"):
        plan_without_seed = dict(paths=("a",), row_groups=((10,),), num_shards=1, batch_size=2)
        BatchPlan(**plan_without_seed, epochs=1, shuffle_window_rows=4)  # type: ignore[arg-type]


def test_rows_cross_row_groups_within_their_window_only() -> None:
    # 12 row groups of 50 rows in 3 files; windows of 200 rows: 4 row groups each.
    plan = BatchPlan(
        paths=("a", "b", "c"),
        row_groups=((50,) * 4,) * 3,
        num_shards=2,
        batch_size=25,
        epochs=1,
        shuffle_seed=3,
        shuffle_window_rows=200,
    )
    order = plan.epoch_order(0)
    unit_of_place = np.repeat(order, 50)  # the row group at each place before the window shuffle
    for k in range(3):
        rows = plan.window_rows(0, 200 * k, 200 * (k + 1))
        assert sorted(rows.tolist()) == list(range(200 * k, 200 * (k + 1)))  # stays in its window
        units = unit_of_place[rows]
        assert set(units.tolist()) == set(order[4 * k : 4 * (k + 1)].tolist())
        # Mixed: the first batch of the window already holds rows of 3 or 4 of its row groups.
        assert len(set(units[:25].tolist())) >= 3
    # A read holds one window's rows at most, and a batch is read from its window(s) only.
    stream = plan.stream(0)
    reads = plan.stream_reads(stream, 0, plan.steps_per_epoch)
    assert [r.rows for r in reads] == [200, 100]  # rank 0's 300 rows: windows 0 and 1
    assert all(sum(x.rows for x in r.reads) <= 200 for r in reads)  # type: ignore[union-attr]
    assert plan.stream_reads(stream, 0, 1)[0].rows == 25


def test_without_a_window_reads_are_the_pieces() -> None:
    plan = random_plan(
        np.random.default_rng(4), files=6, max_groups=3, max_rows=90, num_shards=2, batch_size=16
    )
    stream = plan.stream(1)
    assert plan.stream_reads(stream, 3, 17) == plan.stream_pieces(stream, 3, 17)
    assert (plan.window_rows(1, 10, 40) == np.arange(10, 40)).all()
