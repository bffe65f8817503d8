"""The one error type of checkpointing.

Every problem with a checkpoint (missing, not committed, corrupt, or made
for a different model) is a :class:`CheckpointError` whose message names the
checkpoint and what does not match, with the saved and the expected value.
It is raised on every rank of the gang that asked, and always before any
live tensor has been overwritten.
"""

from __future__ import annotations

__all__ = ["CheckpointError"]


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, found, read or loaded into this model."""
