"""The fake ranks' model state: one copy per gang, as the batches trained into it.

A copy is the batches every replica holds since the last sync (a committed base, shared) plus the
gang's own since, and a dense state; hashes of those multisets stand for the state digests, so
heal verification and the final replica check behave as on real ranks. A sync merges every
copy's own batches into one new base; a heal clones a copy; a checkpoint keeps a clone.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

__all__ = ["EMPTY", "CommittedBase", "FakeUsageError", "ModelCopy", "mix", "sync_copies"]

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

    def batches(self) -> collections.Counter[int]:
        out: collections.Counter[int] = collections.Counter()
        node: CommittedBase | None = self
        while node is not None:
            out.update(node.added)
            node = node.parent
        return out


EMPTY = CommittedBase(None, (), 0)


@dataclasses.dataclass
class ModelCopy:
    """One gang's model copy: the committed base, its own batches since, its dense state."""

    base: CommittedBase
    own: list[int]
    own_digest: int
    dense: int

    def add(self, batch: int) -> None:
        self.own.append(batch)
        self.own_digest = (self.own_digest + mix(batch)) & _MASK

    def clone(self) -> ModelCopy:
        return ModelCopy(self.base, list(self.own), self.own_digest, self.dense)

    def batches(self) -> collections.Counter[int]:
        out = self.base.batches()
        out.update(self.own)
        return out


def sync_copies(copies: Sequence[ModelCopy]) -> None:
    """A job-wide sync: every copy ends up with the same base (all batches of all copies)."""
    bases = {c.base.digest for c in copies}
    if len(bases) != 1:
        raise FakeUsageError("replicas averaged from different states (a heal was missed)")
    added = tuple(b for c in copies for b in c.own)
    digest = (copies[0].base.digest + sum(c.own_digest for c in copies)) & _MASK
    base = CommittedBase(copies[0].base, added, digest)
    denses = sorted({c.dense for c in copies})
    dense = denses[0] if len(denses) == 1 else mix(hash(tuple(denses)) & _MASK)
    for c in copies:
        c.base, c.own, c.own_digest, c.dense = base, [], 0, dense
