"""The run's ledger (raytrec.result.ledger, written and printed by raytrec.observability.summary)
over a Result as fit() returns it."""

from __future__ import annotations

import json
import os

import ray.train

from raytrec.api import Result
from raytrec.config import ScalingConfig, TrainConfig
from raytrec.elastic.events import EventLog, GangDropped, GangJoined, NodeDied, RankDied
from raytrec.elastic.workers import NODE_DIED, PEER_RELEASED
from raytrec.observability.metrics import IntervalMetrics
from raytrec.observability.summary import ledger_lines, write_ledger
from raytrec.result import ledger


def row(step: int, loss: float, auc: float, rows: int) -> IntervalMetrics:
    return IntervalMetrics(
        step=step,
        steps=4,
        loss=loss,
        samples_per_s=1.0,
        seconds=1.0,
        data_wait_fraction=0.0,
        sync_fraction=0.0,
        generation=0,
        gangs=2,
        elapsed_s=float(step),
        auc=auc,
        ne=1.0,
        rows=rows,
    )


def result(tmp_path: str, digests: dict[int, dict[str, str]]) -> Result:
    return Result(
        config=TrainConfig(scaling=ScalingConfig(num_workers=4, gang_size=2), num_steps=12),
        history=[row(4, 0.6, 0.70, 512), row(8, 0.5, 0.75, 512), row(12, 0.55, 0.72, 384)],
        final_state_path=f"{tmp_path}/final_model",
        run_dir=str(tmp_path),
        steps=12,
        wall_s=3.25,
        state_digests=digests,
        events=EventLog(
            [
                RankDied(at=2.0, step=2, job_rank=1, gang_id=0, cause="ActorDiedError: exited"),
                RankDied(at=2.0, step=2, job_rank=0, gang_id=0, cause=PEER_RELEASED),
                RankDied(at=5.0, step=5, job_rank=2, gang_id=1, cause=NODE_DIED),
                NodeDied(at=5.0, step=5, node=1, gang_ids=(1,)),
                GangDropped(at=5.0, step=5, gang_id=1, reason="node 1 died"),
                GangJoined(at=9.0, step=9, gang_id=2, generation=2),
            ]
        ),
        generation=2,
        committed_batches=[(0, 40), (100, 108)],
        committed_count=48,
        replayed_batches=[(100, 104)],
        lost_batches=0,
        checkpoint=ray.train.Checkpoint(f"{tmp_path}/checkpoints/checkpoint_0000000012"),
    )


AGREE = {
    0: {"shards": "a", "dense": "d"},
    1: {"shards": "b", "dense": "d"},
    4: {"shards": "a", "dense": "d"},
    5: {"shards": "b", "dense": "d"},
}


def test_the_ledger_counts_what_the_job_did(tmp_path: str) -> None:
    summary = ledger(result(tmp_path, AGREE))
    assert summary["steps"] == 12 and summary["stopped"] is None
    assert summary["rows"]["trained"] == 1408
    assert summary["batches"] == {
        "committed": 48,
        "committed_distinct": 48,
        "replayed": 4,
        "lost": 0,
        "rolled_back": 0,
    }
    assert summary["coordinator_restarts"] == 0
    # As a user counts them: rank 1's death and node 1's (rank 0 was ended by raytrec because
    # its gang lost rank 1; rank 2 died with its node); every failure event kept by kind.
    assert summary["failures"] == {
        "count": 2,
        "each": [
            {
                "step": 2,
                "kind": "rank_died",
                "what": "rank 1 died",
                "cause": "ActorDiedError: exited",
            },
            {"step": 5, "kind": "node_died", "what": "node 1 died"},
        ],
        "events": {"rank_died": 3, "node_died": 1},
        "ranks_released": [0],
    }
    assert (summary["gangs_dropped"], summary["gangs_joined"], summary["generations"]) == (1, 1, 3)
    assert summary["replica_check"] == {
        "passed": True,
        "ranks": 4,
        "distinct_shards": 2,
        "copies_per_shard": 2,
        "distinct_dense_states": 1,
    }
    assert summary["final"] == {"step": 12, "loss": 0.55, "auc": 0.72, "ne": 1.0}
    assert summary["best"]["loss"] == {"value": 0.5, "step": 8}
    assert summary["best"]["auc"] == {"value": 0.75, "step": 8}
    assert summary["artifacts"]["checkpoint"].endswith("checkpoint_0000000012")

    path = write_ledger(summary)
    assert path == os.path.join(tmp_path, "summary.json")
    with open(path) as f:
        assert json.load(f) == json.loads(json.dumps(summary))
    done, batches, final = ledger_lines(summary)
    assert done == (
        "[raytrec] ledger: 12 steps, 1,408 rows trained, 3 generations; failures: "
        "2 (rank 1 died, node 1 died)"
    )
    assert batches == (
        "[raytrec] batches: 48 committed (48 distinct), 4 replayed, 0 lost; replica check: "
        "passed (2 shards x 2 identical copies, one dense state on 4 ranks)"
    )
    assert final.startswith("[raytrec] final loss 0.5500, auc 0.7200, ne 1.0000; model: ")


def test_the_replica_check_fails_on_any_differing_copy(tmp_path: str) -> None:
    shard = {**AGREE, 5: {"shards": "c", "dense": "d"}}
    assert ledger(result(tmp_path, shard))["replica_check"]["passed"] is False
    dense = {**AGREE, 4: {"shards": "a", "dense": "e"}}
    assert ledger(result(tmp_path, dense))["replica_check"]["passed"] is False
    assert "FAILED" in ledger_lines(ledger(result(tmp_path, dense)))[1]


def test_rows_trained_are_the_rows_of_the_committed_batches(tmp_path: str) -> None:
    """With a source that names its batches, the figure is the committed batches' rows (a
    failed interval's rows are in the model too, though no metrics row counted them)."""
    import dataclasses

    done = dataclasses.replace(result(tmp_path, AGREE), committed_rows=1500)
    summary = ledger(done)
    assert summary["rows"]["trained"] == 1500 and summary["rows"]["stepped"] == 1408
    assert "1,500 rows trained" in ledger_lines(summary)[0]


def test_a_failed_job_s_ledger_says_why_and_what_to_resume_from(tmp_path: str) -> None:
    summary = ledger(result(tmp_path, {}), failed="JobFailedError: shard 1 lost every copy")
    assert summary["ended"] == "failed" and summary["stopped"] is None
    assert summary["resume_from"].endswith("checkpoint_0000000012")
    last = ledger_lines(summary)[-1]
    assert last.startswith("[raytrec] failed at step 12 of 12: JobFailedError: shard 1 lost")
    assert "resume from checkpoint: " in last and last.endswith("summary.json")
    import dataclasses

    bare = dataclasses.replace(result(tmp_path, {}), checkpoint=None)
    assert "resume from checkpoint: none" in ledger_lines(ledger(bare, failed="x"))[-1]
    assert ledger(result(tmp_path, AGREE))["ended"] == "finished"


def test_steps_beyond_the_data_s_are_explained_on_the_ledger_line(tmp_path: str) -> None:
    """2 gangs x 2 ranks, 9 steps of data (36 batches): gang 1 missing for steps 5-8 and 4
    batches replayed take 12 steps (4 ranks x 12 steps - 2 x 4 = 36 + 4 batches)."""
    import dataclasses

    base = result(tmp_path, AGREE)
    history = [
        dataclasses.replace(m, gangs=g, end_step=e)
        for m, g, e in zip(base.history, (2, 1, 2), (9, 14, 12), strict=True)
    ]
    done = dataclasses.replace(
        base, config=base.config.replace(num_steps=9), history=history, committed_count=36
    )
    summary = ledger(done)
    assert summary["step_account"] == {
        "data_steps": 9,  # 36 batches committed by 4 ranks
        "end_step": 12,
        "gang_steps_missing": 4,
        "most_gangs_missing": 1,
        "gang_steps_extra": 0,
        "most_gangs_extra": 0,
        "batches_replayed": 4,
    }
    assert ledger_lines(summary)[0].startswith(
        "[raytrec] ledger: 9 steps of data in 12 steps (a gang was missing for 4 steps; 4 "
        "batches replayed), 1,408 rows trained"
    )
    # Stopped at step 8, when the data was to end at step 14: why it is not 9.
    stopped = dataclasses.replace(done, history=history[:2], steps=8)
    line = ledger_lines(ledger(stopped, stopped="StopRequested: asked"))[0]
    assert line.startswith(
        "[raytrec] ledger: 8 of 14 steps (a gang was missing for 4 steps; 4 batches replayed), "
    )
    # Two extra gangs for a while: fewer steps than the data's.
    grown = [dataclasses.replace(m, gangs=g) for m, g in zip(base.history, (2, 4, 4), strict=True)]
    fast = dataclasses.replace(
        base, config=base.config.replace(num_steps=16), history=grown, committed_count=64
    )
    assert ledger_lines(ledger(fast))[0].startswith(
        "[raytrec] ledger: 16 steps of data in 12 steps (extra gangs trained for 16 gang-steps, "
        "up to 2 at once; 4 batches replayed), "
    )


def test_a_job_whose_data_ends_before_num_steps_says_so(tmp_path: str) -> None:
    """num_steps asks for more than the data holds: 12 steps of data (48 batches, 4 ranks),
    all at full strength."""
    import dataclasses

    base = result(tmp_path, AGREE)
    history = [dataclasses.replace(m, end_step=12) for m in base.history]
    short = dataclasses.replace(base, config=base.config.replace(num_steps=20), history=history)
    assert ledger_lines(ledger(short))[0].startswith(
        "[raytrec] ledger: 12 steps (the data held 12 of the 20 steps asked for), 1,408 rows"
    )
    # Early stopping at step 12, with data up to step 20: not the data running out.
    history = [dataclasses.replace(m, end_step=20) for m in base.history]
    early = dataclasses.replace(short, history=history, stopped_early="eval_auc stopped improving")
    assert ledger_lines(ledger(early))[1].startswith("[raytrec] ledger: 12 steps, 1,408 rows")
