"""The total-loss decision and where rebuilt ranks read after a rewind (pure)."""

from __future__ import annotations

import pytest

from raytrec.checkpoint.config import CheckpointConfig
from raytrec.elastic.decisions import Fail, TotalLoss
from raytrec.elastic.rollback import (
    MAX_RESTORES,
    RollbackPoint,
    decide_total_loss,
    describe_total_loss,
    plan_streams,
)

POINT = RollbackPoint(uri="/runs/a/checkpoints/checkpoint_0000000400", step=400, accounting={})
EVERY_100 = CheckpointConfig(every_n_steps=100)
LOSS = "lost ranks [3]: gangs [0, 1] failed and no gang is left"


def decide(**changes: object) -> TotalLoss | Fail:
    args: dict[str, object] = {
        "loss": LOSS,
        "point": POINT,
        "restore": True,
        "checkpoint": EVERY_100,
        "replayable": True,
        "step": 437,
    }
    args.update(changes)
    return decide_total_loss(**args)  # type: ignore[arg-type]


def test_a_checkpoint_means_rebuild_and_says_how_much_is_redone() -> None:
    d = decide()
    assert isinstance(d, TotalLoss) and d.point == POINT
    assert d.reason == (
        f"{LOSS}; rebuilding the job from the checkpoint of step 400 (37 completed steps to redo)"
    )


def test_no_checkpoint_configured_says_one_would_have_allowed_recovery() -> None:
    d = decide(point=None, checkpoint=CheckpointConfig())
    assert isinstance(d, Fail)
    assert d.reason.startswith(f"{LOSS}; the job cannot go on without a checkpoint, and none")
    assert "with checkpoint.every_n_steps or checkpoint.every_minutes set, the job would have " in (
        d.reason
    )


def test_no_checkpoint_saved_yet_names_the_triggers() -> None:
    d = decide(point=None, checkpoint=CheckpointConfig(every_n_steps=100, every_minutes=30))
    assert isinstance(d, Fail)
    assert d.reason.endswith(
        "none was saved yet (checkpoint.every_n_steps=100, checkpoint.every_minutes=30)"
    )


def test_restore_switched_off_fails_and_names_the_checkpoint_to_resume_from() -> None:
    d = decide(restore=False)
    assert isinstance(d, Fail)
    assert "elastic.restore_on_total_loss is off" in d.reason
    assert f"resume_from_checkpoint='{POINT.uri}'" in d.reason


def test_a_source_that_cannot_replay_is_not_rewound_inside_the_run() -> None:
    d = decide(replayable=False)
    assert isinstance(d, Fail)
    assert "cannot rebuild its batches by id" in d.reason and POINT.uri in d.reason


def test_a_loss_that_keeps_recurring_before_a_new_save_gives_up() -> None:
    assert isinstance(decide(point=RollbackPoint(uri="u", step=4, accounting={})), TotalLoss)
    again = RollbackPoint(uri="u", step=4, accounting={}, restores=MAX_RESTORES)
    d = decide(point=again)
    assert isinstance(d, Fail)
    assert f"already restored {MAX_RESTORES} times with no newer checkpoint" in d.reason


def test_the_loss_is_described_by_layout() -> None:
    within = describe_total_loss(
        within_host=True, lost_ranks=[10, 11], failed_gangs=[0, 1], dead_shards=[5]
    )
    assert within.startswith(
        "lost ranks [10, 11] with layout 'replicas_within_host': replica groups [5] lost every "
        "copy of their shard"
    )
    one_rank = describe_total_loss(
        within_host=True, lost_ranks=[3], failed_gangs=[1], dead_shards=[]
    )
    assert "gangs [1] failed, and this layout places the job as one unit" in one_rank
    across = describe_total_loss(
        within_host=False, lost_ranks=[0, 1, 2, 3], failed_gangs=[0, 1], dead_shards=[0, 1]
    )
    assert across == (
        "lost ranks [0, 1, 2, 3]: gangs [0, 1] failed and no gang is left, so replica groups "
        "[0, 1] lost every copy of their shard"
    )


def streams(live: list[list[object]], retired: list[list[int]]) -> dict[str, object]:
    return {"live": live, "retired": retired}


def test_every_live_stream_continues_in_order_and_spares_fill_the_rest() -> None:
    # 4096 ranks before, 1024 of them (shards 0..1023) stopped earlier at 50 batches.
    live = [[s, 400, []] for s in range(1024, 4096)]
    retired = [[s, 50] for s in range(1024)]
    starts = plan_streams(
        streams(live, retired), num_ranks=4096, spare_shards=range(4096), step=400
    )
    assert [(s.shard, s.at) for s in starts[:3072]] == [(s, 400) for s in range(1024, 4096)]
    assert [(s.shard, s.at) for s in starts[3072:]] == [(s, 50) for s in range(1024)]
    assert len({s.shard for s in starts}) == 4096  # no shard read twice


def test_streams_past_the_rebuilt_job_stop_and_their_replays_are_spread() -> None:
    # Grown to 3 gangs of 2 before the checkpoint; rebuilt at the initial 2 gangs.
    live = [[0, 9, [100]], [1, 9, []], [2, 9, []], [3, 9, [101]], [6, 3, [102, 103]], [7, 3, []]]
    starts = plan_streams(streams(live, []), num_ranks=4, spare_shards=range(4), step=9)
    assert [(s.shard, s.at, s.replay) for s in starts] == [
        (0, 9, (100, 102)),
        (1, 9, (103,)),
        (2, 9, ()),
        (3, 9, (101,)),
    ]
    replays = sorted(i for s in starts for i in s.replay)
    assert replays == [100, 101, 102, 103]  # none dropped, none twice


def test_a_shard_never_read_starts_at_zero() -> None:
    starts = plan_streams(streams([[0, 5, []]], []), num_ranks=2, spare_shards=[0, 1], step=5)
    assert [(s.shard, s.at) for s in starts] == [(0, 5), (1, 0)]


def test_without_batch_ids_ranks_start_at_the_checkpoint_step_like_a_resume() -> None:
    starts = plan_streams(None, num_ranks=3, spare_shards=[0, 1, 2], step=40)
    assert [(s.shard, s.at, s.replay) for s in starts] == [(0, 40, ()), (1, 40, ()), (2, 40, ())]


def test_too_few_shards_is_an_error() -> None:
    with pytest.raises(ValueError, match="1 live streams and only 0 spare shards"):
        plan_streams(streams([[0, 5, []]], []), num_ranks=2, spare_shards=[0], step=5)
