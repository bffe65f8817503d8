"""The job's shared state changes only as outcomes say (actors/job.py), and no part of the job
assigns to it: :func:`apply_outcome` is the one writer."""

from __future__ import annotations

import ast
import pathlib

from actors.job import (
    AccountingRewound,
    Booked,
    CapChanged,
    Committed,
    DataEnds,
    GangsDropped,
    GangsJoined,
    JobRecord,
    Joining,
    PointSaved,
    Prepared,
    Rebuilding,
    Rebuilt,
    Regenerated,
    Reserved,
    Rewound,
    apply_outcome,
)
from raytrec.cluster.topology import Topology
from raytrec.elastic.accounting import BatchAccounting
from raytrec.elastic.decisions import RollbackPoint
from raytrec.elastic.membership import Membership

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOPO = Topology(world_size=6, gang_size=2, ranks_per_host=2)  # gang g: ranks 2g, 2g+1


def record() -> JobRecord:
    m = Membership.initial(TOPO)
    return JobRecord(
        membership=m,
        step=0,
        end_step=10,
        max_gangs=3,
        accounting=BatchAccounting(m.gang_ids, stream_id=None),
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
