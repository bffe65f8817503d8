"""What must hold after a fault schedule's job ended (:mod:`simulation.fault_space`): every batch
trained is in the final model once, none lost, each stream a gap-free prefix, replicas identical,
and with Parquet read by index every row of the job's data trained once.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from raytrec.data.parquet_streams import truncated
from raytrec.data.synthetic import split_batch_id
from simulation.doubles.fake_group import FakeWorkerGroup
from simulation.fault_schedule import BATCH_SIZE, Settings

if TYPE_CHECKING:
    from actors.coordinator import Coordinator
    from raytrec.elastic.run_record import RunSummary

__all__ = ["check_invariants"]


def check_invariants(
    summary: RunSummary, group: FakeWorkerGroup, job: Coordinator, s: Settings
) -> list[str]:
    """What is wrong with a finished job: every batch trained is in the final model once (the
    fake's record against the coordinator's committed ones), none lost, each stream's a gap-free
    prefix, replicas identical; with Parquet read by index, every row of the job's data trained
    (unless stopped early)."""
    problems: list[str] = []
    committed = [i for a, b in summary.committed_batches for i in range(a, b)]
    # A job stopped on request may hold replays not trained yet: its checkpoint books them
    # for a resume, and the summary counts them with the lost batches. So may a job on
    # re-shared rows that lost a gang in its last steps (a documented limit: replays the
    # others cannot even out, beyond the shortest rank's end).
    stopped = summary.stopped_by is not None
    pending = job.state.accounting.replay_pending() if stopped or s.data == "reshared" else 0
    if summary.lost_batches != pending:
        problems.append(f"{summary.lost_batches - pending} batches lost")
    if not summary.committed_count == len(committed) == len(set(committed)):
        problems.append(
            f"committed {summary.committed_count}, listed {len(committed)}, "
            f"distinct {len(set(committed))}"
        )
    if summary.final_state_path is not None:
        model = group.model_batches(summary.final_state_path)
        # A share of a batch lost with a gang (a hierarchical schedule's lower-level sync).
        partial = sorted(b for b, n in model.items() if n != int(n))
        if partial:
            problems.append(
                f"batches in the final model in part: "
                f"{[(split_batch_id(b), str(model[b])) for b in partial[:5]]}"
            )
        model = collections.Counter({b: int(n) for b, n in model.items()})
        if not partial and model != collections.Counter(committed):
            extra = sorted((model - collections.Counter(committed)).elements())[:5]
            missing = sorted((collections.Counter(committed) - model).elements())[:5]
            problems.append(
                f"the final model differs from the committed batches: in the model only "
                f"{[split_batch_id(i) for i in extra]}, committed only "
                f"{[split_batch_id(i) for i in missing]}"
            )
    elif committed:
        problems.append("batches committed but no final model saved")
    # Those replays are the only batches a stream may miss before its committed ones.
    queued: list[int] = []
    if pending and job.state.accounting.streams is not None:
        queued = [i for r in job.ranks.live() for i in job.state.accounting.streams.position(r)[2]]
        if len(queued) != pending:
            problems.append(f"{pending} replays pending, {len(queued)} queued on the ranks")
    steps: dict[int, list[int]] = {}
    for i in [*committed, *queued]:
        shard, step = split_batch_id(i)
        steps.setdefault(shard, []).append(step)
    for shard, taken in steps.items():
        if sorted(taken) != list(range(len(taken))):
            problems.append(f"stream {shard} has gaps")
    replayed = {i for a, b in summary.replayed_batches for i in range(a, b)}
    if len(replayed - set(committed)) > pending:
        problems.append("replayed batches not committed")
    if len({d["dense"] for d in summary.state_digests.values()}) > 1:
        problems.append("dense states differ")
    table = job.streams.table
    if table is not None and not stopped and not pending and not problems:
        problems += _rows_once(table, committed, s)
    return problems


def _rows_once(table: Any, committed: list[int], s: Settings) -> list[str]:
    """Every row of the job's data (each initial rank's first ``num_steps`` batches) is in
    exactly one committed batch."""
    shard = table.shard(0)
    firsts: dict[str, int] = {}
    at = 0
    for path, groups in zip(shard.paths, shard.row_groups, strict=True):
        firsts[path] = at
        at += sum(groups)

    def rows(counts: Mapping[int, int], shard: Any) -> collections.Counter[tuple[int, int]]:
        """The rows, as (epoch, row), of the first ``counts[s]`` batches of each stream ``s``."""
        out: collections.Counter[tuple[int, int]] = collections.Counter()
        plan = shard.plan(BATCH_SIZE)
        for sid, n in counts.items():
            for part in truncated(shard.stream(BATCH_SIZE, sid), n):
                for p in plan.stream_pieces((part,), 0, part.count):
                    start = firsts[p.path] + p.file_row
                    out.update((part.epoch, r) for r in range(start, start + p.rows))
        return out

    # Committed batches are a gap-free prefix of each stream (checked before).
    taken = collections.Counter(split_batch_id(i)[0] for i in committed)
    # The plan's own streams: a join may have cut the initial ones short in the table.
    initial = dataclasses.replace(table.template, index=0, streams={})
    trained = rows(taken, shard)
    expected = rows(dict.fromkeys(range(s.world), s.num_steps), initial)
    if trained == expected:
        return []
    twice = sum(1 for n in trained.values() if n > 1)
    missing = len(set(expected) - set(trained))
    extra = len(set(trained) - set(expected))
    return [f"rows: {twice} trained twice, {missing} never, {extra} not the job's"]
