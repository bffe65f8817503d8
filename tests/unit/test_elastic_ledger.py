"""Row ranges and the exactly-once ledger, checked against plain Python sets and Counters."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from raytrec.elastic.ledger import DataLedger, LedgerError
from raytrec.elastic.rows import RowRanges, coverage, layered, split_balanced


def random_ranges(rng: random.Random, n: int, hi: int) -> list[tuple[int, int]]:
    out = []
    for _ in range(n):
        a = rng.randrange(hi)
        out.append((a, min(hi, a + rng.randrange(1, 40))))
    return out


def ids_of(ranges: list[tuple[int, int]]) -> set[int]:
    return {i for a, b in ranges for i in range(a, b)}


def test_row_ranges_merge_and_set_algebra_match_python_sets() -> None:
    rng = random.Random(0)
    for _ in range(200):
        x, y = random_ranges(rng, 8, 300), random_ranges(rng, 8, 300)
        a, b = RowRanges(tuple(x)), RowRanges(tuple(y))
        assert set(a) == ids_of(x) and a.count == len(ids_of(x))
        assert set(a.union(b)) == ids_of(x) | ids_of(y)
        assert set(a.difference(b)) == ids_of(x) - ids_of(y)
        assert set(a.difference(a.difference(b))) == ids_of(x) & ids_of(y)
        # Normal form: sorted, disjoint, not touching.
        assert all(p[1] < q[0] for p, q in zip(a.ranges, a.ranges[1:], strict=False))
    assert RowRanges.of((5, 7), (0, 2), (2, 3)).ranges == ((0, 3), (5, 7))
    with pytest.raises(ValueError, match=r"row range \[4, 2\)"):
        RowRanges.of((4, 2))


def test_coverage_finds_missing_and_duplicated_ids() -> None:
    rng = random.Random(1)
    for _ in range(200):
        ranges = random_ranges(rng, 12, 250)
        counts = Counter(i for a, b in ranges for i in range(a, b))
        missing, doubled = coverage(ranges, total=200)
        assert set(missing) == {i for i in range(200) if counts[i] == 0}
        assert set(doubled) == {i for i, c in counts.items() if c >= 2}


def test_layered_keeps_every_multiplicity_in_few_ranges() -> None:
    rng = random.Random(2)
    for _ in range(200):
        ranges = random_ranges(rng, 12, 250)
        counts = Counter(i for a, b in ranges for i in range(a, b))
        out = layered(ranges)
        assert Counter(i for a, b in out for i in range(a, b)) == counts
    # Once everywhere: one merged set, as RowRanges would give.
    assert layered([(5, 7), (0, 2), (2, 5)]) == ((0, 7),)
    assert layered([(0, 4), (2, 6)]) == ((0, 6), (2, 4))


def test_a_snapshot_rewinds_the_ledger_to_its_sync_boundary() -> None:
    ledger = DataLedger(100, [0, 1])
    ledger.consume(0, 0, RowRanges.of((0, 10)))
    ledger.consume(1, 0, RowRanges.of((10, 20)))
    ledger.commit([0, 1])
    saved = ledger.snapshot()
    ledger.consume(0, 0, RowRanges.of((20, 30)))
    ledger.commit([0, 1])
    assert ledger.committed(0) == RowRanges.of((0, 30))
    ledger.rewind(saved, [5])
    assert ledger.committed(0) == RowRanges.of((0, 20)) and ledger.gang_ids == (5,)
    ledger.assign_replay(5, 0, RowRanges.of((40, 42)))
    assert ledger.replay_due(5) == {0: RowRanges.of((40, 42))}
    ledger.consume(5, 0, RowRanges.of((40, 42)))
    with pytest.raises(LedgerError, match=r"gangs \[5\] have pending rows"):
        ledger.snapshot()


@pytest.mark.parametrize("parts", [1, 2, 3, 7, 511])
def test_split_is_balanced_contiguous_and_cuts_few_ranges(parts: int) -> None:
    rng = random.Random(parts)
    items = [(e, r) for e in (0, 1) for r in RowRanges(tuple(random_ranges(rng, 30, 5000))).ranges]
    shares = split_balanced(items, parts)
    sizes = [sum(b - a for _, (a, b) in s) for s in shares]
    total = sum(b - a for _, (a, b) in items)
    assert sum(sizes) == total and max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the first shares take the extra row
    flat = [x for s in shares for x in s]
    # Concatenating the shares gives back the input, in order.
    joined = RowRanges(tuple(r for e, r in flat if e == 0))
    assert joined == RowRanges(tuple(r for e, r in items if e == 0))
    cut = len(flat) - len(items)
    assert 0 <= cut <= parts - 1
    assert split_balanced(items, parts) == shares


def test_exactly_once_holds_through_a_drop_and_replay() -> None:
    ledger = DataLedger(1000, [0, 1, 2, 3])
    for step in range(5):
        for g in range(4):
            start = (step * 4 + g) * 40
            ledger.consume(g, 0, RowRanges.of((start, start + 40)))
        if step == 1:
            ledger.commit([0, 1, 2, 3])
    # Gang 2 read [80,120), [240,280), [400,440) since its last sync at step 1 (the 2nd step).
    assert ledger.pending(2) == {0: RowRanges.of((400, 440), (560, 600), (720, 760))}
    plan = ledger.drop([2], survivors=[0, 1, 3])
    assert plan.dropped == (2,)
    assert [plan.rows_of(g) for g in (0, 1, 3)] == [40, 40, 40]
    assert plan.shares[0] == {0: RowRanges.of((400, 440))}
    assert ledger.replayed(0) == RowRanges.of((400, 440), (560, 600), (720, 760))
    assert ledger.replay_due(1) == {0: RowRanges.of((560, 600))}
    # Survivors read their replay share (and then fresh rows), then sync.
    ledger.consume(0, 0, RowRanges.of((400, 440)))
    ledger.consume(1, 0, RowRanges.of((560, 600)))
    ledger.consume(3, 0, RowRanges.of((720, 760), (800, 1000)))
    assert ledger.replay_due(1) == {} and ledger.replay_due(3) == {}
    ledger.commit([0, 1, 3])
    report = ledger.check_exactly_once(0)
    assert report.ok and report.committed == 1000


def test_exactly_once_check_catches_a_lost_and_a_doubled_row() -> None:
    ledger = DataLedger(100, [0, 1])
    ledger.consume(0, 0, RowRanges.of((0, 50)))
    ledger.consume(1, 0, RowRanges.of((50, 57), (58, 100)))  # row 57 never read
    ledger.consume(1, 0, RowRanges.of((10, 11)))  # row 10 read by both gangs
    ledger.commit([0, 1])
    report = ledger.check_exactly_once(0)
    assert not report.ok
    assert report.missing == RowRanges.of((57, 58))
    assert report.duplicated == RowRanges.of((10, 11))
    assert report.committed == 100
    # One gang reading a row twice is caught too: pending rows are not merged.
    solo = DataLedger(10, [0])
    solo.consume(0, 0, RowRanges.of((0, 10)))
    solo.consume(0, 0, RowRanges.of((3, 4)))
    solo.commit([0])
    assert solo.check_exactly_once(0).duplicated == RowRanges.of((3, 4))
    # Rows of a dropped gang that nobody replays are missing.
    lossy = DataLedger(10, [0, 1])
    lossy.consume(0, 0, RowRanges.of((0, 5)))
    lossy.consume(1, 0, RowRanges.of((5, 10)))
    lossy.drop([1], survivors=[0])
    lossy.commit([0])
    assert lossy.check_exactly_once(0).missing == RowRanges.of((5, 10))


def test_unread_replay_of_a_dropped_survivor_goes_back_to_the_pool() -> None:
    ledger = DataLedger(10_000, range(5))
    ledger.consume(4, 0, RowRanges.of((0, 900)))
    ledger.drop([4], survivors=[0, 1, 2, 3])  # 225 rows each
    assert ledger.replay_due(2) == {0: RowRanges.of((450, 675))}
    ledger.consume(2, 0, RowRanges.of((450, 500), (5000, 5010)))
    plan = ledger.drop([2], survivors=[0, 1, 3])
    # Pool: 60 rows read by gang 2 since its last sync plus its 175 unread replay rows.
    assert plan.total_rows == 60 + 175
    assert [plan.rows_of(g) for g in (0, 1, 3)] == [79, 78, 78]
    assert ledger.replay_due(0)[0].count == 225 + 79


def test_random_histories_match_a_counter_reference() -> None:
    """Random consume/commit/drop histories: the ledger's committed rows equal a reference that
    tracks every id with a Counter and replays a dropped gang's ids as a set."""
    rng = random.Random(7)
    n = 2000
    for trial in range(15):
        gangs = list(range(6))
        ledger = DataLedger(n, gangs)
        pending: dict[int, Counter[int]] = {g: Counter() for g in gangs}
        due: dict[int, set[int]] = {g: set() for g in gangs}
        committed: Counter[int] = Counter()
        for _ in range(60):
            op = rng.random()
            if op < 0.6:
                g = rng.choice(gangs)
                x = random_ranges(rng, 2, n)
                if due[g] and rng.random() < 0.5:
                    x.append((min(due[g]), min(due[g]) + 1))
                ledger.consume(g, 0, RowRanges(tuple(x)))  # one call reads a set of rows
                pending[g].update(ids_of(x))
                due[g] -= ids_of(x)
            elif op < 0.85:
                some = rng.sample(gangs, rng.randrange(1, len(gangs) + 1))
                ledger.commit(some)
                for g in some:
                    committed.update(pending[g])
                    pending[g] = Counter()
            elif len(gangs) > 1:
                g = rng.choice(gangs)
                gangs.remove(g)
                pool = set(pending.pop(g)) | due.pop(g)
                plan = ledger.drop([g], survivors=gangs)
                assert plan.total_rows == len(pool)
                got = set()
                for s in gangs:
                    share = set(plan.shares[s].get(0, RowRanges()))
                    got |= share
                    due[s] |= share
                assert got == pool
                sizes = [plan.rows_of(s) for s in gangs]
                assert max(sizes) - min(sizes) <= 1
        for g in gangs:
            assert ledger.pending_rows(g) == sum(pending[g].values())
            assert set(ledger.replay_due(g).get(0, RowRanges())) == due[g]
        report = ledger.check_exactly_once(0)
        assert report.committed == sum(committed.values()), trial
        assert set(report.missing) == {i for i in range(n) if committed[i] == 0}
        assert set(report.duplicated) == {i for i, c in committed.items() if c > 1}


def test_ledger_errors() -> None:
    ledger = DataLedger(100, [0, 1])
    with pytest.raises(LedgerError, match=r"gang 7 is not in the ledger; known gangs: \[0, 1\]"):
        ledger.consume(7, 0, RowRanges.of((0, 1)))
    with pytest.raises(LedgerError, match=r"consumed rows up to 100, but an epoch has ids 0..99"):
        ledger.consume(0, 0, RowRanges.of((90, 101)))
    with pytest.raises(LedgerError, match=r"gang 1 cannot both be dropped and survive"):
        ledger.drop([1], survivors=[0, 1])
    ledger.consume(1, 0, RowRanges.of((0, 3)))
    with pytest.raises(LedgerError, match=r"leaves no survivor to replay their 3 pending rows"):
        ledger.drop([0, 1], survivors=[])
    with pytest.raises(LedgerError, match=r"gang 0 is already in the ledger"):
        ledger.add_gangs([0])
