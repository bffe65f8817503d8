"""Whether a gang healed: its state compared with the peer it copied, before any averaging.

A joining gang receives every shard's weights and optimizer state and the dense state from one
live peer gang over the replica plane. Right after that broadcast (before the gang trains or
syncs, which would average a wrong copy into every replica and hide it), each of its ranks must
hold exactly what the peer's rank at the same shard position holds. :func:`failed_heals` says
which gangs do not; the coordinator drops those and places them again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from raytrec.elastic.membership import Membership

__all__ = ["failed_heals"]

Digests = Mapping[str, str]  # "shards" and "dense" content hashes of one rank's state


def failed_heals(
    membership: Membership,
    *,
    peer: int,
    joined: Sequence[int],
    digests: Mapping[int, Digests],
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
