"""Row-wise optimizer state across a change of column sharding.

FBGEMM's row-wise Adagrad keeps one accumulator per row and per column
shard: the running sum over steps of the mean squared gradient over that
shard's columns. TorchRec exposes it as a 1-D tensor of ``rows * k``
values for a table cut into ``k`` column blocks (block ``j`` at
``[j * rows, (j + 1) * rows)``, blocks ordered by column offset), so
table-wise (``k = 1``) and column-wise layouts have different sizes and
torch.distributed.checkpoint cannot map one onto the other.

:func:`convert_rowwise_state` does: a new block takes the column-weighted
mean of the saved blocks it overlaps. The mean of squares over a union of
columns is the width-weighted mean of the per-block means, so the result is
exact whenever each new block is a union of saved blocks (column-wise ->
table-wise, or merging blocks); a new block inside one saved block (table-wise
-> column-wise) takes that block's value unchanged, the best estimate
available, as the per-column split was never recorded.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from raytrec.checkpoint.errors import CheckpointError

__all__ = ["convert_rowwise_state"]


def _check_tiling(blocks: Sequence[tuple[int, int]], dim: int, what: str) -> None:
    edge = 0
    for offset, width in blocks:
        if offset != edge or width <= 0:
            raise CheckpointError(
                f"{what} column blocks {list(blocks)} do not tile the {dim} columns"
            )
        edge += width
    if edge != dim:
        raise CheckpointError(f"{what} column blocks {list(blocks)} do not tile the {dim} columns")


def convert_rowwise_state(
    saved: torch.Tensor,
    *,
    rows: int,
    dim: int,
    saved_blocks: Sequence[tuple[int, int]],
    target_blocks: Sequence[tuple[int, int]],
) -> torch.Tensor:
    """Row-wise state laid out for ``saved_blocks`` -> laid out for ``target_blocks``.

    Blocks are ``(column offset, width)``, left to right, each tiling ``dim``
    columns. Returns a tensor of ``rows * len(target_blocks)`` values, in
    ``saved``'s dtype.
    """
    saved_blocks, target_blocks = sorted(saved_blocks), sorted(target_blocks)
    _check_tiling(saved_blocks, dim, "saved")
    _check_tiling(target_blocks, dim, "target")
    if saved.dim() != 1 or saved.numel() != rows * len(saved_blocks):
        raise CheckpointError(
            f"row-wise state has shape {list(saved.shape)}, expected [{rows * len(saved_blocks)}] "
            f"({rows} rows x {len(saved_blocks)} column blocks)"
        )
    segments = saved.reshape(len(saved_blocks), rows)
    out = torch.empty(len(target_blocks), rows, dtype=saved.dtype)
    for j, (t0, tw) in enumerate(target_blocks):
        overlaps = [
            (i, min(s0 + sw, t0 + tw) - max(s0, t0))
            for i, (s0, sw) in enumerate(saved_blocks)
            if min(s0 + sw, t0 + tw) > max(s0, t0)
        ]
        if len(overlaps) == 1:  # inside one saved block: its values, bit for bit
            out[j] = segments[overlaps[0][0]]
        else:
            acc = torch.zeros(rows, dtype=torch.float64)
            for i, width in overlaps:
                acc += segments[i].to(torch.float64) * (width / tw)
            out[j] = acc.to(saved.dtype)
    return out.reshape(-1)
