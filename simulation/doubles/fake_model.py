"""The fake ranks' model state: one copy per gang, as the batches trained into it.

A copy is the batches every replica holds since the last sync (a committed base, shared) plus the
gang's own since, and a dense state; hashes of those multisets stand for the state digests, so
heal verification and the final replica check behave as on real ranks. A sync merges every
copy's own batches into one new base; a heal clones a copy; a checkpoint keeps a clone.

A lower-level sync of a hierarchical schedule averages a group's copies: each member then holds
every member's batches since the base in part (``shared``: batch -> the share of its update, a
fraction). A job-wide sync adds up the shares; a batch whose shares do not add up to whole
updates (a share lost with a gang) stays in the base in part, so the final model shows it.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Collection, Sequence
from fractions import Fraction

__all__ = [
    "EMPTY",
    "CommittedBase",
    "FakeUsageError",
    "ModelCopy",
    "average_group",
    "mix",
    "sync_copies",
]

_MASK = (1 << 64) - 1


class FakeUsageError(AssertionError):
    """The coordinator made a call that would hang or crash on real ranks."""


def mix(value: int) -> int:
    """A 64-bit hash of an int (splitmix64's finalizer); sums of it hash multisets."""
    z = (value + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


@dataclasses.dataclass(frozen=True)
class CommittedBase:
    """Batches committed into every replica at a sync: a chain, so a sync costs what it adds."""

    parent: CommittedBase | None
    added: tuple[int, ...]
    digest: int
    #: Batches added in part (shares that do not add up to a whole update).
    parts: tuple[tuple[int, Fraction], ...] = ()

    def batches(self) -> collections.Counter[int]:
        """Batch -> how many times it is in the model (a fraction for one there in part)."""
        out: collections.Counter[int] = collections.Counter()
        node: CommittedBase | None = self
        while node is not None:
            out.update(node.added)
            for batch, share in node.parts:
                out[batch] += share  # type: ignore[assignment]
            node = node.parent
        return out


EMPTY = CommittedBase(None, (), 0)


@dataclasses.dataclass
class ModelCopy:
    """One gang's model copy: the committed base, its own batches since, its dense state."""

    base: CommittedBase
    own: list[int]
    own_digest: int  # of ``own`` and ``shared``
    dense: int
    #: Since the base, from a lower-level sync: batch -> the share of its update this copy holds.
    shared: dict[int, Fraction] = dataclasses.field(default_factory=dict)

    def add(self, batch: int) -> None:
        self.own.append(batch)
        self.own_digest = (self.own_digest + mix(batch)) & _MASK

    def clone(self) -> ModelCopy:
        return ModelCopy(self.base, list(self.own), self.own_digest, self.dense, dict(self.shared))

    def batches(self) -> collections.Counter[int]:
        out = self.base.batches()
        out.update(self.own)
        for batch, share in self.shared.items():
            out[batch] += share  # type: ignore[assignment]
        return out


def _same_base(copies: Sequence[ModelCopy]) -> None:
    if len({c.base.digest for c in copies}) != 1:
        raise FakeUsageError("replicas averaged from different states (a heal was missed)")


def _dense(copies: Sequence[ModelCopy]) -> int:
    denses = sorted({c.dense for c in copies})
    return denses[0] if len(denses) == 1 else mix(hash(tuple(denses)) & _MASK)


def _shares(copies: Sequence[ModelCopy]) -> dict[int, Fraction]:
    """Batch -> the updates of it the copies' shared parts hold together."""
    out: dict[int, Fraction] = {}
    for c in copies:
        for batch, share in c.shared.items():
            out[batch] = out.get(batch, Fraction(0)) + share
    return out


def sync_copies(copies: Sequence[ModelCopy], *, without: Collection[int] = ()) -> None:
    """A job-wide sync: every copy ends up with the same base (all batches of all copies). The
    copies at the indexes ``without`` roll back: they take the others' mean and add nothing."""
    _same_base(copies)
    kept = [c for i, c in enumerate(copies) if i not in without]
    shares = _shares(kept)
    whole = [b for c in kept for b in c.own]
    parts: list[tuple[int, Fraction]] = []
    if shares:
        counts = collections.Counter(whole)
        whole = [b for b in whole if b not in shares]
        for batch, share in sorted(shares.items()):
            total = share + counts[batch]
            if total.denominator == 1:
                whole += [batch] * int(total)
            else:
                parts.append((batch, total))
    digest = (copies[0].base.digest + sum(c.own_digest for c in kept)) & _MASK
    base = CommittedBase(copies[0].base, tuple(whole), digest, tuple(parts))
    dense = _dense(kept)
    for c in copies:
        c.base, c.own, c.own_digest, c.dense, c.shared = base, [], 0, dense, {}


def average_group(copies: Sequence[ModelCopy]) -> None:
    """A lower-level sync of one group: every copy holds each member's batches since the base in
    part, a share of ``1 / len(copies)`` per copy that trained it."""
    _same_base(copies)
    shares = _shares(copies)
    for c in copies:
        for batch in c.own:
            shares[batch] = shares.get(batch, Fraction(0)) + 1
    mean = {b: share / len(copies) for b, share in sorted(shares.items())}
    digest = mix(hash(tuple(mean.items())) & _MASK)
    dense = _dense(copies)
    for c in copies:
        c.own, c.own_digest, c.dense, c.shared = [], digest, dense, dict(mean)
