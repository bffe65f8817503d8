"""The job's shared state changes only as outcomes say (actors/job.py), and no part of the job
assigns to it: :func:`apply_outcome` is the one writer, of the batch accounting too."""

from __future__ import annotations

import ast
import pathlib

from actors.job import (
    AccountingRewound,
    Booked,
    CapChanged,
    Committed,
    DataEnds,
    GangsAccounted,
    GangsDropped,
    GangsDroppedFromBooks,
    GangsJoined,
    JobRecord,
    Joining,
    PointSaved,
    Prepared,
    RanksAdded,
    RanksForgotten,
    RanksLost,
    Rebuilding,
    Rebuilt,
    Regenerated,
    Reserved,
    Rewound,
    StreamsRestarted,
    StreamsRetired,
    StreamSwitched,
    apply_outcome,
)
from raytrec.cluster.topology import Topology
from raytrec.data.synthetic import batch_id
from raytrec.elastic.accounting import AccountingView, BatchAccounting, last_job_wide_sync
from raytrec.elastic.decisions import RollbackPoint
from raytrec.elastic.membership import Membership
from raytrec.elastic.report import RankReport

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOPO = Topology(world_size=6, gang_size=2, ranks_per_host=2)  # gang g: ranks 2g, 2g+1


def record(*, streams: bool = False) -> JobRecord:
    m = Membership.initial(TOPO)
    return JobRecord(
        membership=m,
        step=0,
        end_step=10,
        max_gangs=3,
        accounting=BatchAccounting(m.gang_ids, stream_id=batch_id if streams else None),
        last_save=(0, 0.0),
    )


def test_membership_outcomes() -> None:
    job = record()
    apply_outcome(job, Joining(frozenset({1, 2})))
    apply_outcome(job, GangsDropped((2,)))
    assert job.membership.gang_ids == (0, 1) and job.membership.generation == 1
    assert job.joining == {1}  # a dropped gang is no longer joining
    apply_outcome(job, Regenerated())
    assert job.membership.gang_ids == (0, 1) and job.membership.generation == 2
    gangs, reserved = job.membership.reserve([[0, 0]])
    apply_outcome(job, Reserved(reserved))
    apply_outcome(job, Rewound(4))
    apply_outcome(job, GangsJoined(gangs))
    assert job.membership.gang_ids == (0, 1, gangs[0].gang_id)
    assert (job.step, job.membership.generation) == (4, 3)


def test_booking_and_committing() -> None:
    job = record()
    for r in range(6):
        job.accounting.add_rank(r, shard=r, step=0)
    apply_outcome(job, Booked(3, synced_at=2))
    assert (job.step, job.membership.last_sync_step) == (3, 2)
    apply_outcome(job, Booked(5))
    assert (job.step, job.membership.last_sync_step) == (5, 2)
    apply_outcome(job, Committed())
    assert job.membership.last_sync_step == 5
    apply_outcome(job, Rewound(2, synced=False))
    assert (job.step, job.membership.last_sync_step) == (2, 5)
    fresh = BatchAccounting((0,), stream_id=None)
    apply_outcome(job, AccountingRewound(fresh))
    assert job.accounting is fresh


def test_data_ready_cap_and_rollback_point() -> None:
    job = record()
    apply_outcome(job, DataEnds(12))
    apply_outcome(job, Prepared(3))
    apply_outcome(job, CapChanged(2))
    assert (job.end_step, job.ready, job.max_gangs) == (12, 3, 2)
    point = RollbackPoint(uri="/runs/a/checkpoint_4", step=4, accounting={})
    apply_outcome(job, PointSaved(point, at=7.5))
    assert (job.point, job.last_save) == (point, (4, 7.5))
    again = RollbackPoint(uri=point.uri, step=4, accounting={}, restores=1)
    apply_outcome(job, Rebuilding(again))
    assert (job.point, job.last_save) == (again, (4, 7.5))
    apply_outcome(job, Rebuilt(4, at=9.0))
    assert job.last_save == (4, 9.0)


def test_the_accounting_outcomes_book_what_its_methods_book() -> None:
    """The books of a loss (gang 2 dies at step 5 after a sync at 2; its batches trained after
    it go to the survivors), kept once through the accounting's own methods and once through
    its pure queries and the outcomes the loop applies: the same books, the same replays."""
    direct, job = BatchAccounting((0, 1, 2), stream_id=batch_id), record(streams=True)
    ranks_of = {g: [2 * g, 2 * g + 1] for g in range(3)}

    def mine(r: int, steps: range) -> RankReport:
        return RankReport(
            rank=r, step=steps[-1], trained=tuple((s, batch_id(r, s - 1)) for s in steps)
        )

    def even(s: int) -> bool:
        return s % 2 == 0

    for r in range(6):
        direct.add_rank(r, shard=r, step=0)
    apply_outcome(job, RanksAdded({r: r for r in range(6)}, 0))
    reports = [mine(r, range(1, 4)) for r in range(6)]
    synced = direct.record(
        reports,
        gang_of=lambda r: r // 2,
        live_gangs=(0, 1, 2),
        last_sync_step=0,
        is_job_wide_sync=even,
    )
    assert synced == last_job_wide_sync(reports, last_sync_step=0, is_job_wide_sync=even) == 2
    apply_outcome(job, Booked(3, synced, tuple(reports)))
    lost = direct.lost_rank_reports([4, 5], fail_step=5)
    assert job.accounting.reports_of_lost([4, 5], fail_step=5) == lost
    apply_outcome(job, RanksLost(tuple(lost)))
    reports = [mine(r, range(4, 6)) for r in range(4)] + lost
    direct.record(
        reports,
        gang_of=lambda r: r // 2,
        live_gangs=(0, 1, 2),
        last_sync_step=2,
        is_job_wide_sync=even,
        completed_through=3,
    )
    apply_outcome(job, Booked(5, None, tuple(reports)))
    replays = direct.apply_drop(
        direct.plan_drop([2], [0, 1], ranks_of=ranks_of.__getitem__, dense_through=4)
    )
    plan = job.accounting.plan_drop([2], [0, 1], ranks_of=ranks_of.__getitem__, dense_through=4)
    assert plan.replays == replays and sum(map(len, replays.values())) == 2 * 3  # steps 3..5
    apply_outcome(job, GangsDroppedFromBooks(plan))
    apply_outcome(job, GangsDropped((2,)))
    ids = [i for queued in replays.values() for i in queued]
    assert job.accounting.embedding_only(ids) == direct.embedding_only(ids)
    assert len(direct.embedding_only(ids)) == 2 * 2  # trained at steps 3 and 4
    assert job.accounting.replay_pending() == direct.replay_pending() == len(ids)
    direct.commit([0, 1])
    apply_outcome(job, Committed())
    # Streams switched, restarted and retired; a gang added, a rank that never trained.
    direct.switch_stream(0, shard=9, old_ends_at=20)
    direct.restart(1, at=7)
    direct.retire_streams({8: 3})
    direct.add_gangs([5])
    direct.add_rank(10, shard=10, step=5)
    direct.forget_rank(10)
    for outcome in (
        StreamSwitched(0, shard=9, old_ends_at=20),
        StreamsRestarted((1,), at=7),
        StreamsRetired({8: 3}),
        GangsAccounted((5,)),
        RanksAdded({10: 10}, 5),
        RanksForgotten((10,)),
    ):
        apply_outcome(job, outcome)
    assert job.accounting.snapshot(range(4)) == direct.snapshot(range(4))
    assert job.accounting.reported_step == direct.reported_step
    assert job.accounting.ledger.gang_ids == direct.ledger.gang_ids == (0, 1, 5)


#: The fields of JobRecord.
FIELDS = set(JobRecord.__dataclass_fields__)


def assignments_to_the_record(tree: ast.AST) -> list[str]:
    """``x.state.f = ...`` / ``x.view.f = ...`` (or augmented) for a field ``f`` of the record."""
    found = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for t in targets:
            for n in ast.walk(t):
                if (
                    isinstance(n, ast.Attribute)
                    and n.attr in FIELDS
                    and isinstance(n.value, ast.Attribute)
                    and n.value.attr in {"state", "view"}
                ):
                    found.append(ast.unparse(t))
    return found


def test_the_finder_sees_an_assignment() -> None:
    tree = ast.parse("self.job.view.step = 3\nself.state.ready += 1\nstep = self.state.step")
    assert assignments_to_the_record(tree) == ["self.job.view.step", "self.state.ready"]


def test_no_module_of_actors_assigns_to_the_shared_state() -> None:
    found = {
        str(p.relative_to(ROOT)): hits
        for p in sorted((ROOT / "actors").glob("*.py"))
        if (hits := assignments_to_the_record(ast.parse(p.read_text())))
    }
    assert found == {}


#: What changes the batch accounting: its methods less the queries a part may call.
CHANGES = (
    {name for name, f in vars(BatchAccounting).items() if callable(f) and not name.startswith("_")}
    - set(vars(AccountingView))
    - {"committed", "committed_count", "replayed", "replay_pending"}
)


def calls_that_change_the_accounting(tree: ast.AST) -> list[str]:
    """``<...>.accounting.m(...)`` for a method ``m`` that changes the accounting."""
    return [
        ast.unparse(n.func)
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr in CHANGES
        and ast.unparse(n.func.value).endswith("accounting")
    ]


def test_only_apply_outcome_changes_the_accounting() -> None:
    assert {"record", "apply_drop", "add_rank", "switch_stream"} <= CHANGES
    assert not CHANGES & {"snapshot", "plan_drop", "reports_of_lost", "embedding_only"}
    tree = ast.parse(
        "self.job.view.accounting.apply_drop(plan)\nx = self.state.accounting.snapshot([])"
    )
    assert calls_that_change_the_accounting(tree) == ["self.job.view.accounting.apply_drop"]
    found = {
        str(p.relative_to(ROOT)): hits
        for p in sorted((ROOT / "actors").glob("*.py"))
        if (hits := calls_that_change_the_accounting(ast.parse(p.read_text())))
    }
    assert found == {"actors/job.py": ["job.accounting.book", "job.accounting.commit"]}
