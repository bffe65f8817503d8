"""Bytes a replica sync moves: ring-collective costs, the touched-row agreement rule, and a
model of sync bytes per training step.

Every figure is bytes one member of a replica group sends, with ring collectives (gloo's and
NCCL's large-message algorithms): an all-reduce of ``B`` bytes among ``n`` members sends
``2 (n - 1) / n * B``, an all-gather of ``B`` bytes from each sends ``(n - 1) * B``.

The model (:func:`expected_sync_bytes`) assumes each member touches a uniformly random share of
a shard's rows, independently. Real ids are skewed (a few rows take most lookups), which makes
the union smaller, so for touched syncs the model is an upper bound.
"""

from __future__ import annotations

import math
from typing import Literal

__all__ = [
    "Agreement",
    "agreement",
    "allgather_bytes",
    "allreduce_bytes",
    "expected_sync_bytes",
    "touched_share",
]

#: How a replica group agrees on a shard's touched rows (see :func:`agreement`).
Agreement = Literal["none", "ids", "bitmap", "whole"]


def allreduce_bytes(nbytes: float, members: int) -> int:
    """Bytes one member sends in a ring all-reduce of ``nbytes``."""
    return round(2 * (members - 1) * nbytes / members)


def allgather_bytes(nbytes: float, members: int) -> int:
    """Bytes one member sends in a ring all-gather of ``nbytes`` from each member."""
    return round((members - 1) * nbytes)


def agreement(
    rows: int, most: int, members: int, max_share: float, *, bitmap: bool = True
) -> Agreement:
    """How a shard of ``rows`` rows, of which some member touched ``most`` (the most of any),
    is synced: ``whole`` past ``max_share`` of its rows (the average of every row); ``none``
    when nobody touched it; otherwise the union is agreed by the cheaper of an all-gather of
    the ids (8 bytes each, padded to ``most``) and an OR-all-reduce of a bitmap of the rows
    (``bitmap=False``: ids only, as over NCCL, which has no bitwise reductions)."""
    if most > max_share * rows:
        return "whole"
    if most == 0:
        return "none"
    ids = allgather_bytes(8 * most, members)
    bits = allreduce_bytes(math.ceil(rows / 8), members)
    return "ids" if not bitmap or ids <= bits else "bitmap"


def touched_share(lookups: float, rows: int) -> float:
    """The expected share of ``rows`` rows that ``lookups`` uniformly random lookups touch."""
    if rows <= 0:
        return 0.0
    return -math.expm1(lookups * math.log1p(-1 / rows)) if rows > 1 else float(lookups > 0)


def expected_sync_bytes(
    *,
    rows: int,
    row_bytes: int,
    members: int,
    share: float | None,
    max_share: float = 0.5,
) -> float:
    """Bytes one member sends to sync one shard of ``rows`` rows of ``row_bytes`` each (weights
    and optimizer state as the all-reduce carries them), each member having touched a uniformly
    random ``share`` of the rows (None: ``sync.rows: all``). The agreement's count exchange (8
    bytes a shard) is included."""
    if share is None:
        return allreduce_bytes(rows * row_bytes, members)
    most = share * rows
    how = agreement(rows, math.ceil(most), members, max_share)
    counts = allgather_bytes(8, members)
    if how == "whole":
        return counts + allreduce_bytes(rows * row_bytes, members)
    if how == "none":
        return counts
    union = rows * -math.expm1(members * math.log1p(-share)) if share < 1 else rows
    agree = (
        allgather_bytes(8 * most, members)
        if how == "ids"
        else allreduce_bytes(math.ceil(rows / 8), members)
    )
    return counts + agree + allreduce_bytes(union * row_bytes, members)
