"""Agreement within a gang: a checkpoint step succeeds on every rank or fails on every rank.

Save and load are collectives over the gang world (the default process
group in a rank process). :func:`on_rank0` runs a step on gang rank 0 and
hands its result, or its error, to every rank; :func:`agree` runs a step on
every rank and raises on all of them if any failed. So no rank copies state
into the model or reports a commit while another has failed, and none is
left waiting in a collective the others have abandoned.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from raytrec.checkpoint.errors import CheckpointError

__all__ = ["agree", "describe", "on_rank0"]

T = TypeVar("T")


def describe(e: BaseException) -> str:
    """One line per failure; DCP gathers every rank's failure into one exception."""

    def first_line(x: BaseException) -> str:
        lines = str(x).strip().splitlines()
        return f"{type(x).__name__}: {lines[0][:200] if lines else ''}"

    if isinstance(e, CheckpointException):
        return "; ".join(f"gang rank {r}: {first_line(x)}" for r, (x, _) in e.failures.items())
    return first_line(e)


def on_rank0(fn: Callable[[], T]) -> T:
    """Runs ``fn`` on gang rank 0 and gives its result (or its error) to every rank."""
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", fn())
        except (Exception, CheckpointException) as e:
            box[0] = ("error", str(e) if isinstance(e, CheckpointError) else describe(e))
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise CheckpointError(value)
    return value


def agree(fn: Callable[[], T]) -> T:
    """Runs ``fn`` on every rank; raises on all of them if it failed on any."""
    result: T | None = None
    error: str | None = None
    try:
        result = fn()
    except CheckpointError as e:
        error = str(e)
    except (Exception, CheckpointException) as e:  # DCP's exception is a BaseException
        error = describe(e)
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    if error is not None:
        raise CheckpointError(error)
    for rank, other in enumerate(errors):
        if other is not None:
            raise CheckpointError(f"gang rank {rank}: {other}")
    return result  # type: ignore[return-value]
