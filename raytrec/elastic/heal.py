"""Whether a gang healed: its state compared with the peer it copied, before any averaging.

A joining gang receives every shard's weights and optimizer state and the dense state from one
live peer gang over the replica plane. Right after that broadcast (before the gang trains or
syncs, which would average a wrong copy into every replica and hide it), each of its ranks must
hold exactly what the peer's rank at the same shard position holds. :func:`failed_heals` says
which gangs do not; the coordinator drops those and places them again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from raytrec.elastic.membership import Membership

if TYPE_CHECKING:
    from raytrec.elastic.rank_protocol import StateDigest

__all__ = ["failed_heals", "replicas_disagree"]


def failed_heals(
    membership: Membership,
    *,
    peer: int,
    joined: Sequence[int],
    digests: Mapping[int, StateDigest],
) -> dict[int, tuple[int, ...]]:
    """Gang id -> its ranks whose digests differ from the peer's rank at the same shard
    position, for every gang of ``joined`` that did not heal exactly; ``digests`` holds the
    peer's and the joined gangs' ranks (job rank -> digests)."""
    source = membership.gang(peer).ranks
    failed: dict[int, tuple[int, ...]] = {}
    for gid in joined:
        bad = tuple(
            slot.job_rank
            for slot in membership.gang(gid).ranks
            if digests[slot.job_rank] != digests[source[slot.gang_rank].job_rank]
        )
        if bad:
            failed[gid] = bad
    return failed


def replicas_disagree(membership: Membership, digests: Mapping[int, StateDigest]) -> str | None:
    """After the job's final sync every replica group holds one copy of its shard and every rank
    the same dense state; returns what differs, or None."""
    for group in membership.replica_groups:
        members = [m.job_rank for m in group]
        if len({digests[r]["shards"] for r in members}) != 1:
            return f"replica group of ranks {members} disagrees after the final sync"
    if len({d["dense"] for d in digests.values()}) != 1:
        return "dense parameters differ between ranks after the final step"
    return None
