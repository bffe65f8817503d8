"""Sync traffic arithmetic (:mod:`raytrec.sync.traffic`) and touched-row bookkeeping
(:class:`raytrec.engine.touched_rows.TouchedRows`) on a real FBGEMM CPU kernel."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
)

from raytrec.engine import touched_rows
from raytrec.engine.touched_rows import TouchedRows, shard_bytes, syncs_whole
from raytrec.sync.traffic import (
    agreement,
    allgather_bytes,
    allreduce_bytes,
    expected_sync_bytes,
    touched_share,
)


def test_ring_costs() -> None:
    assert allreduce_bytes(1000, 2) == 1000  # each member sends half, twice
    assert allreduce_bytes(1000, 4) == 1500
    assert allreduce_bytes(1000, 1) == 0
    assert allgather_bytes(8, 3) == 16


def test_agreement_picks_the_cheaper_exchange() -> None:
    # 8,000 rows: a bitmap is 1,000 bytes (sent whole by each of 2 members); ids 8 bytes each.
    assert agreement(8000, 125, 2, 0.5) == "ids"
    assert agreement(8000, 126, 2, 0.5) == "bitmap"
    assert agreement(8000, 0, 2, 0.5) == "none"
    assert agreement(8000, 4001, 2, 0.5) == "whole"
    # Many members: the ids all-gather grows with them, the bitmap all-reduce does not.
    assert agreement(8000, 50, 64, 0.5) == "bitmap"
    assert agreement(8000, 50, 64, 0.5, bitmap=False) == "ids"  # NCCL: no bitwise OR


def test_touched_share_matches_sampling() -> None:
    assert touched_share(1, 10) == pytest.approx(0.1)
    assert touched_share(0, 10) == 0.0
    rows, lookups = 5000, 3000
    rng = random.Random(0)
    drawn = [len({rng.randrange(rows) for _ in range(lookups)}) / rows for _ in range(20)]
    assert touched_share(lookups, rows) == pytest.approx(sum(drawn) / len(drawn), rel=0.01)
    assert touched_share(10**9, 10**6) == pytest.approx(1.0)


def test_expected_bytes() -> None:
    full = expected_sync_bytes(rows=1000, row_bytes=100, members=2, share=None)
    assert full == 100_000
    # Past max_share the shard goes whole, plus the 8-byte count exchange.
    assert expected_sync_bytes(rows=1000, row_bytes=100, members=2, share=0.9) == full + 8
    # 1% each of 2 members: union 1 - 0.99**2 of the rows, ids exchanged (80 bytes).
    union = 1000 * (1 - 0.99**2)
    got = expected_sync_bytes(rows=1000, row_bytes=100, members=2, share=0.01)
    assert got == pytest.approx(8 + 80 + union * 100)
    assert math.isclose(expected_sync_bytes(rows=10, row_bytes=4, members=2, share=0.0), 8)


def kernel() -> SplitTableBatchedEmbeddingBagsCodegen:
    """Two tables (10 and 6 rows) looked up by three features: 0 -> table 0, 1 and 2 -> table 1."""
    spec = [(rows, 4, EmbeddingLocation.HOST, ComputeDevice.CPU) for rows in (10, 6)]
    return SplitTableBatchedEmbeddingBagsCodegen(
        spec,
        feature_table_map=[0, 1, 1],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
    )


def lookup(tbe: SplitTableBatchedEmbeddingBagsCodegen, bags: list[list[int]]) -> None:
    """One batch of 2 bags per feature (6 bags, feature-major), with the gradient flowing."""
    indices = torch.tensor([i for bag in bags for i in bag], dtype=torch.int64)
    offsets = torch.tensor([0, *itertools.accumulate(len(b) for b in bags)], dtype=torch.int64)
    tbe(indices=indices, offsets=offsets).sum().backward()


def test_the_hook_records_each_tables_local_rows_by_level() -> None:
    tbe = kernel()
    touched = TouchedRows([tbe], levels=2)
    lookup(tbe, [[1, 3], [], [0], [5], [2, 2], []])
    assert touched.rows(0, 0, optimizer_state=False).tolist() == [1, 3]
    assert touched.rows(1, 1, optimizer_state=True).tolist() == [0, 2, 5]
    with torch.no_grad():  # scoring changes no row: not recorded
        tbe(indices=torch.tensor([9]), offsets=torch.tensor([0, 1, 1, 1, 1, 1, 1]))
    assert touched.rows(0, 1, optimizer_state=True).tolist() == [1, 3]

    # No sync yet in generation 0: nothing is trusted.
    assert not touched.valid(0, optimizer_state=False, generation=0)
    # A weights-only sync at level 0 clears level 0's weights bits only.
    touched.synced(0, optimizer_state=False, generation=0)
    assert touched.valid(0, optimizer_state=False, generation=0)
    assert not touched.valid(0, optimizer_state=True, generation=0)
    assert not touched.valid(1, optimizer_state=False, generation=0)
    assert touched.rows(0, 0, optimizer_state=False).numel() == 0
    assert touched.rows(0, 0, optimizer_state=True).tolist() == [1, 3]
    assert touched.rows(0, 1, optimizer_state=False).tolist() == [1, 3]
    # A later lookup counts at every level; a level-1 state sync clears both levels.
    lookup(tbe, [[7], [], [], [4], [], []])
    assert touched.rows(0, 0, optimizer_state=False).tolist() == [7]
    touched.synced(1, optimizer_state=True, generation=0)
    for level in (0, 1):
        for state in (False, True):
            assert touched.valid(level, optimizer_state=state, generation=0)
            assert touched.rows(0, level, optimizer_state=state).numel() == 0
            assert touched.rows(1, level, optimizer_state=state).numel() == 0
        # A new generation, a heal or a checkpoint load: the next sync is full.
        assert not touched.valid(level, optimizer_state=False, generation=1)
    touched.forget()
    assert not touched.valid(0, optimizer_state=False, generation=0)
    touched.close()
    lookup(tbe, [[8], [], [], [], [], []])
    assert touched.rows(0, 0, optimizer_state=False).numel() == 0


def test_whole_sync_is_decided_from_the_shards_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    tbe = kernel()  # 16 rows of 4 fp32 weights; row-wise Adagrad keeps one fp32 a row
    assert shard_bytes([tbe], optimizer_state=False) == 16 * 4 * 4
    assert shard_bytes([tbe], optimizer_state=True) == 16 * 4 * 4 + 16 * 4
    lookup(tbe, [[1, 3], [], [0], [5], [2, 2], []])  # stepping changes no shape
    assert shard_bytes([tbe], optimizer_state=True) == 16 * 4 * 4 + 16 * 4
    assert syncs_whole(touched_rows.WHOLE_SYNC_BELOW_BYTES - 1)
    assert not syncs_whole(touched_rows.WHOLE_SYNC_BELOW_BYTES)
    monkeypatch.setattr(touched_rows, "WHOLE_SYNC_BELOW_BYTES", 321)  # read at each call
    assert syncs_whole(320) and not syncs_whole(321)
