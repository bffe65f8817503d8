"""Back to a checkpoint after a total loss: the decision, and where rebuilt ranks read (pure).

A total loss is a failure that leaves some shard with no live copy: every gang lost a rank, or a
host under layout ``replicas_within_host`` took every copy of a shard with it. Re-forming on
survivors cannot help. With a committed checkpoint of this job (the last one it saved, or the
one it resumed from) the coordinator rebuilds the whole job at its initial shape from that
checkpoint instead of failing; :func:`decide_total_loss` says which, with a reason.

A :class:`RollbackPoint` is such a checkpoint together with the batch accounting at its step
(:meth:`~raytrec.elastic.accounting.BatchAccounting.snapshot`, also written into the
checkpoint's ``extra``). Rewinding to it forgets every batch committed after it: the model that
held them is gone. :func:`plan_streams` then says where each rebuilt rank reads, so that the
batches after the checkpoint are trained again, each once: rank ``i`` continues the stream the
checkpoint's ``i``-th live rank was reading.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from raytrec.checkpoint.config import CheckpointConfig
from raytrec.elastic.decisions import Fail, RollbackPoint, TotalLoss

__all__ = [
    "MAX_RESTORES",
    "RollbackPoint",
    "StreamStart",
    "decide_total_loss",
    "describe_total_loss",
    "plan_streams",
]

#: Rebuilds from one checkpoint, with no newer one saved in between, before the job gives up: a
#: loss that recurs before the next save would otherwise loop forever.
MAX_RESTORES = 3


def describe_total_loss(
    *,
    within_host: bool,
    lost_ranks: Sequence[int],
    failed_gangs: Sequence[int],
    dead_shards: Sequence[int],
) -> str:
    """What was lost, in words: the start of every reason about a total loss."""
    dead = f"replica groups {list(dead_shards)} lost every copy of their shard"
    if within_host:
        text = f"lost ranks {list(lost_ranks)} with layout 'replicas_within_host': " + (
            dead
            if dead_shards
            else f"gangs {list(failed_gangs)} failed, and this layout places the job as one "
            "unit, so a gang cannot be replaced on its own"
        )
        return text + " (layout 'replicas_across_hosts' re-forms on the surviving gangs instead)"
    text = f"lost ranks {list(lost_ranks)}: gangs {list(failed_gangs)} failed and no gang is left"
    return text + (f", so {dead}" if dead_shards else "")


def decide_total_loss(
    *,
    loss: str,
    point: RollbackPoint | None,
    restore: bool,
    checkpoint: CheckpointConfig,
    replayable: bool,
    step: int,
    lost_shards: tuple[int, ...] = (),
    lost_ranks: tuple[int, ...] = (),
    lost_gangs: tuple[int, ...] = (),
) -> TotalLoss | Fail:
    """What to do about a total loss described by ``loss``, at job step ``step``: a
    :class:`TotalLoss` with the ``point`` to rebuild from (and the ``lost_*`` given), or
    :class:`Fail` naming the setting that would have allowed recovery.

    ``point``: the checkpoint to go back to (None when there is none); ``restore``:
    ``elastic.restore_on_total_loss``; ``replayable``: whether the data source can name and
    rebuild its batches, which rewinding the data inside a running job needs.
    """
    resume = (
        f"; fit(..., resume_from_checkpoint={point.uri!r}) resumes from its last checkpoint"
        if point is not None
        else ""
    )
    if not restore:
        return Fail(
            reason=f"{loss}; elastic.restore_on_total_loss is off, so the job ends here{resume}",
            config_key="elastic.restore_on_total_loss",
            needs_checkpoint=True,
        )
    if point is None:
        if checkpoint.periodic:
            triggers = ", ".join(
                f"checkpoint.{k}={getattr(checkpoint, k):g}"
                for k in ("every_n_steps", "every_minutes")
                if getattr(checkpoint, k) is not None
            )
            why = f"none was saved yet ({triggers})"
        else:
            why = (
                "none is configured: with checkpoint.every_n_steps or checkpoint.every_minutes "
                "set, the job would have been rebuilt from its last checkpoint automatically"
            )
        return Fail(
            reason=f"{loss}; the job cannot go on without a checkpoint, and {why}",
            config_key="checkpoint.every_n_steps",
            needs_checkpoint=True,
        )
    if not replayable:
        return Fail(
            reason=f"{loss}; the data source cannot rebuild its batches by id, so the job "
            f"cannot rewind its data to the checkpoint of step {point.step} inside this run"
            f"{resume}",
            config_key="data.source",
            needs_checkpoint=True,
        )
    if point.restores >= MAX_RESTORES:
        return Fail(
            reason=f"{loss}; the checkpoint of step {point.step} was already restored "
            f"{point.restores} times with no newer checkpoint saved since, so the loss keeps "
            f"recurring{resume} once its cause is fixed",
            config_key="checkpoint.every_n_steps",
            needs_checkpoint=True,
        )
    return TotalLoss(
        point=point,
        lost_shards=lost_shards,
        lost_ranks=lost_ranks,
        lost_gangs=lost_gangs,
        reason=f"{loss}; rebuilding the job from the checkpoint of step {point.step} "
        f"({step - point.step} completed steps to redo)",
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class StreamStart:
    """Where one rebuilt rank reads: the ``replay`` batch ids first, then its own shard's
    stream from batch ``at``."""

    shard: int
    at: int
    replay: tuple[int, ...] = ()


def plan_streams(
    streams: Mapping[str, Any] | None,
    *,
    num_ranks: int,
    spare_shards: Sequence[int],
    step: int,
) -> tuple[StreamStart, ...]:
    """Where each of ``num_ranks`` rebuilt ranks (in gang order) reads after a rewind.

    ``streams`` is the ``"streams"`` part of an accounting snapshot: ``"live"``, one
    ``[shard, next batch, replay ids]`` per live rank of the checkpoint in gang order, and
    ``"retired"``, ``[shard, next batch]`` for shards no rank was reading. Rank ``i`` continues
    live stream ``i`` (its shard at its position, its unread replay batches first). Ranks past
    the live streams take the first ``spare_shards`` (the job's initial shards) no live stream
    holds, at their retired position, or 0 for a shard never read. Live streams past
    ``num_ranks`` stop where they are (their batches so far are all committed); their replay
    batches go round robin to the kept ranks, so none is left untrained.

    ``streams`` None (a source that cannot name its batches): the ranks take ``spare_shards`` in
    order, at ``step``, as a resume does.
    """
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    if streams is None:
        if len(spare_shards) < num_ranks:
            raise ValueError(f"{num_ranks} ranks but only {len(spare_shards)} spare shards")
        return tuple(StreamStart(shard=s, at=step) for s in spare_shards[:num_ranks])
    live = [(int(s), int(n), [int(i) for i in ids]) for s, n, ids in streams["live"]]
    retired = {int(s): int(n) for s, n in streams["retired"]}
    kept = live[:num_ranks]
    orphans = [i for _, _, ids in live[num_ranks:] for i in ids]
    for k, batch in enumerate(orphans):
        kept[k % len(kept)][2].append(batch)
    used = {s for s, _, _ in live}
    spare = [s for s in dict.fromkeys(spare_shards) if s not in used]
    missing = num_ranks - len(kept)
    if missing > len(spare):
        raise ValueError(
            f"{num_ranks} ranks, {len(kept)} live streams and only {len(spare)} spare shards"
        )
    starts = [StreamStart(shard=s, at=n, replay=tuple(ids)) for s, n, ids in kept]
    starts += [StreamStart(shard=s, at=retired.get(s, 0)) for s in spare[:missing]]
    return tuple(starts)
