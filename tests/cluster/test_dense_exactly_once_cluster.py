"""Every row's gradient is in the final model exactly once, embeddings and dense parameters
alike, through a rank death and through a node loss with dense gradients averaged every step
(``sync.dense="every_step"``, the default), and through a rank death with dense parameters
averaged with the schedule (``"with_schedule"``).

The model counts: each row has an id of its own, looked up in a one-feature table whose weights
start at zero (``t_cat_0``, column 0 of each id's embedding) and in a dense vector ``hits`` with
one entry per id. Its loss is the sum of both over the batch, so with SGD at learning rate 1 a
row trained once moves its embedding entry and its ``hits`` entry by -1 on the rank that trains
it. Averaging then scales that by the number of live gangs: the dense all-reduce at the step
that applies the row's dense gradient, the replica sync that commits its embedding update. The
test derives each row's expected value from the job's own record (the batches it committed, the
generation that began at the failure and the step whose dense update the survivors kept) and
compares it with the final model, every id of the table included.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import ray.cloudpickle
import torch
from ray.cluster_utils import Cluster
from test_elastic_cluster import assert_every_batch_once, assert_replicas_agree
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torchrec.datasets.utils import Batch
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from raytrec.api import Result, fit
from raytrec.config import (
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    ScalingConfig,
    SyncConfig,
    TableConfig,
    TestingConfig,
    TrainConfig,
)
from raytrec.data.synthetic import SyntheticCriteo, split_batch_id
from raytrec.elastic.config import ElasticConfig
from raytrec.elastic.events import FailedStepSettled, GenerationStarted, NodeDied
from raytrec.elastic.faults import FaultKind, FaultSpec
from raytrec.models import embedding_bag_configs
from raytrec.testing import NodeRemover, simulated_cluster

pytestmark = pytest.mark.cluster

# The model and the source travel to the rank actors by value (they cannot import this file).
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

B = 2  # rows per batch
MAX_BATCHES = 32  # batches per shard the table has ids for
SHARDS = 4  # at most 4 ranks
NUM_IDS = SHARDS * MAX_BATCHES * B
SYNC_EVERY = 4


def row_ids(shard: int, index: int) -> np.ndarray:
    """The ids of the rows of batch ``index`` of shard ``shard``."""
    return (shard * MAX_BATCHES + index) * B + np.arange(B)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CountingSource(SyntheticCriteo):
    """One sparse feature whose single id per row is the row's own id; replayable by batch id
    like the synthetic stream it extends."""

    def make_batch(self, shard: int, step: int, batch_size: int) -> Batch:
        assert batch_size == B and step < MAX_BATCHES and shard < SHARDS, (shard, step)
        ids = torch.from_numpy(row_ids(shard, step))
        return Batch(
            dense_features=torch.zeros(B, 1),
            sparse_features=KeyedJaggedTensor(
                keys=["cat_0"], values=ids, lengths=torch.ones(B, dtype=torch.int32), stride=B
            ),
            labels=torch.zeros(B),
        )


class CountingModel(nn.Module):
    """Loss: each row's embedding entry plus its ``hits`` entry; both gradients are 1 per row."""

    def __init__(self, cfg: ModelConfig, device: torch.device) -> None:
        super().__init__()
        tables = [
            dataclasses.replace(t, init_fn=nn.init.zeros_) for t in embedding_bag_configs(cfg)
        ]
        self.ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
        self.hits = nn.Parameter(torch.zeros(NUM_IDS, device=device))

    def forward(self, batch: Batch) -> Any:
        kjt = batch.sparse_features
        emb = self.ebc(kjt).values()[:, 0]
        dense = self.hits[kjt.values()]
        loss = emb.sum() + dense.sum()
        return loss, (loss.detach(), (emb + dense).detach(), batch.labels)


def counting_factory(cfg: ModelConfig, num_dense: int, device: torch.device, seed: int) -> Any:
    return CountingModel(cfg, device)


def counting_job(tmp_path: str, **kw: Any) -> TrainConfig:
    base: dict[str, Any] = {
        "model": ModelConfig(
            tables=(
                TableConfig(
                    name="t_cat_0", num_embeddings=NUM_IDS, embedding_dim=4, features=("cat_0",)
                ),
            ),
            dense_arch_layers=(4,),  # the model has no dense layers; the tables' width
        ),
        "scaling": ScalingConfig(num_workers=2, gang_size=1),
        "sync": SyncConfig(sync_every=SYNC_EVERY),  # dense="every_step", the default
        "optimizer": OptimizerConfig(embedding="sgd", embedding_lr=1.0, dense="sgd", dense_lr=1.0),
        "data": DataConfig(batch_size=B),
        # No replacement gang: the survivor trains alone to the end.
        "elastic": ElasticConfig(
            grow=False, step_timeout_s=30, collective_timeout_s=10, poll_s=0.2
        ),
        "num_steps": 14,
        "log_every": 2,
        "storage_path": str(tmp_path),
    }
    base.update(kw)
    return TrainConfig(**base)


def fit_counting(config: TrainConfig, **kw: Any) -> Result:
    """``fit`` with the counting source and model, on the cluster the test set up."""
    return fit(
        config,
        source=CountingSource(num_dense=1, num_sparse=1),
        model_factory=counting_factory,
        shutdown_ray=False,
        **kw,
    )


def final_counts(result: Result) -> tuple[np.ndarray, np.ndarray]:
    """Column 0 of the final embedding table and the final ``hits``, per id."""
    assert result.final_state_path is not None
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.pt")
        dcp_to_torch_save(result.final_state_path, path)
        state = torch.load(path, weights_only=False)
    (table,) = [v for k, v in state.items() if k.endswith("t_cat_0.weight")]
    (hits,) = [v for k, v in state.items() if k.endswith("hits")]
    return table[:, 0].numpy(), hits.numpy()


def expected_counts(result: Result) -> tuple[np.ndarray, np.ndarray]:
    """What each id's embedding entry and ``hits`` entry must hold if every row's gradient is
    in the model exactly once, from the job's own record:

    - the batches committed (each once: ``assert_every_batch_once``), each first trained at step
      ``index + 1`` of its shard when that is before the failure, else after it;
    - the failure: the step ``k`` the new generation began at, the live gangs before and after,
      and the survivors that rolled back (``FailedStepSettled.rolled_back``, under
      ``sync.levels``: they took the other survivors' mean at the re-forming's sync);
    - ``dense_through``, the last step whose dense update the survivors kept: k - 1 or k with
      dense gradients averaged every step, the last job-wide sync with dense parameters
      averaged with the schedule (the dense side then follows the embeddings' rule).

    A row's dense gradient counts at the generation of the step that applied it: its first
    training when that step is at most ``dense_through``, else after the failure (a lost gang's
    row replayed, a survivor's row of the failed step finished among the survivors). Its
    embedding update counts at the generation of the sync that committed it: the last job-wide
    sync before the failure, the re-forming's sync among the survivors that did not roll back
    (their own pending rows), or a sync after it (every replayed row).
    """
    (reform,) = [
        e for e in result.events.of(GenerationStarted) if e.reason.startswith("lost gangs")
    ]
    (before,) = [
        e for e in result.events.of(GenerationStarted) if e.generation == reform.generation - 1
    ]
    (settled,) = result.events.of(FailedStepSettled)
    # A rank's batch enters as the mean over the gang's ranks (DDP for dense gradients, and
    # TorchRec's backward all-to-all divides embedding gradients by the gang size), then the
    # mean over the gangs.
    per_gang = result.config.scaling.gang_size
    k = reform.step
    n_before, n_after = per_gang * len(before.gang_ids), per_gang * len(reform.gang_ids)
    # Under sync.levels, survivors that had averaged with the lost gang since the last job-wide
    # sync roll back: the re-forming's sync is the mean of the others' copies (the clean
    # survivors), and the rolled-back gangs' rows since are replayed like the lost gang's.
    clean = [g for g in reform.gang_ids if g not in settled.rolled_back]
    n_clean = per_gang * len(clean)
    committed_through = SYNC_EVERY * ((k - 1) // SYNC_EVERY)
    if result.config.sync.dense == "every_step":
        assert settled.step == k and settled.dense_through in (k - 1, k), settled
    else:
        assert settled.dense_through == committed_through and not settled.finished
    emb = np.zeros(NUM_IDS)
    dense = np.zeros(NUM_IDS)
    for a, b in result.committed_batches:
        for i in range(a, b):
            shard, index = split_batch_id(i)
            first = index + 1 if index + 1 <= k else None  # None: first trained after k
            ids = row_ids(shard, index)
            committed = first is not None and first <= committed_through
            kept = first is not None and shard // per_gang in clean  # a clean survivor's row
            emb[ids] -= 1.0 / (n_before if committed else n_clean if kept else n_after)
            dense_early = first is not None and first <= settled.dense_through
            dense[ids] -= 1.0 / (n_before if dense_early else n_after)
    return emb, dense


def assert_every_row_once(result: Result) -> None:
    assert_every_batch_once(result)
    assert_replicas_agree(result)
    assert result.replayed_batches  # the lost gang had uncommitted batches
    emb, dense = final_counts(result)
    want_emb, want_dense = expected_counts(result)
    wrong_emb = np.flatnonzero(~np.isclose(emb, want_emb, atol=1e-5))
    wrong_dense = np.flatnonzero(~np.isclose(dense, want_dense, atol=1e-5))
    # (found, expected) -> how many ids
    found = collections.Counter(zip(emb[wrong_emb], want_emb[wrong_emb], strict=True))
    assert not len(wrong_emb), f"embedding entries: {found}"
    found = collections.Counter(zip(dense[wrong_dense], want_dense[wrong_dense], strict=True))
    assert not len(wrong_dense), f"dense entries: {found}"


@pytest.mark.parametrize(
    ("dense", "failed_step", "pipeline"),
    [
        ("every_step", 7, "off"),
        # TorchRec's train pipeline: both ranks hold step 8's batch in flight when rank 1 dies
        # at step 7; the survivor's goes back to its feed, the lost rank's is replayed.
        ("every_step", 7, "sparse_dist"),
        ("with_schedule", 8, "off"),
    ],
)
def test_a_rank_death_leaves_every_row_in_the_model_once(
    local_ray: None, tmp_path: str, dense: str, failed_step: int, pipeline: str
) -> None:
    # On the shared cluster: two gangs of one rank, no replacement gang (elastic.grow=False).
    # Rank 1 exits as it starts step 7. Dense gradients averaged every step: its batches of
    # steps 5 and 6 reached the survivor's dense parameters through the all-reduce, its
    # embedding updates since the sync at step 4 are lost, and the survivor's own step 7 loses
    # its dense update with the all-reduce. Dense parameters averaged with the schedule: the
    # survivor notices at the sync of step 8, and the lost gang's dense changes since step 4
    # are gone with its embedding updates.
    config = counting_job(
        tmp_path,
        sync=SyncConfig(sync_every=SYNC_EVERY, dense=dense),  # type: ignore[arg-type]
        testing=TestingConfig(faults=(FaultSpec(kind=FaultKind.KILL_RANK, step=7, rank=1),)),
        train_pipeline=pipeline,
    )
    result = fit_counting(config)

    assert result.steps == 14 and result.history[-1].gangs == 1
    reforms = [e for e in result.events.of(GenerationStarted) if e.generation]
    assert [e.step for e in reforms] == [failed_step], result.events
    (settled,) = result.events.of(FailedStepSettled)
    # Every step: the lost rank's batches of steps 5 and 6 are replayed embedding-only, and the
    # survivor finished its step 7. With the schedule: every replay updates both.
    want = (2, True) if dense == "every_step" else (0, False)
    assert (settled.embedding_only, settled.finished) == want, settled
    assert_every_row_once(result)


def test_a_rank_death_under_a_hierarchical_schedule_leaves_every_row_in_the_model_once(
    local_ray: None, tmp_path: str
) -> None:
    # Four gangs of one rank: groups {0, 1} and {2, 3} average every 2 steps, all four every 4.
    # Rank 1 exits as it starts step 7, after its group's sync at step 6 mixed its copy with
    # gang 0's: gang 0 holds half of rank 1's rows of steps 5 and 6, and rank 1 took half of
    # gang 0's with it. Gang 0 rolls back: the re-forming's sync is the mean of gangs 2 and 3,
    # and gang 0's batches of steps 5 to 7 are replayed with rank 1's.
    config = counting_job(
        tmp_path,
        scaling=ScalingConfig(num_workers=4, gang_size=1),
        sync=SyncConfig(sync_every=SYNC_EVERY, levels=((2, 2),)),
        testing=TestingConfig(faults=(FaultSpec(kind=FaultKind.KILL_RANK, step=7, rank=1),)),
    )
    result = fit_counting(config)

    assert result.steps == 14 and result.history[-1].gangs == 3
    (settled,) = result.events.of(FailedStepSettled)
    # Dense gradients are averaged every step: rank 1's batches of steps 5 and 6 and gang 0's
    # of steps 5 to 7 (step 7 finished among the survivors) are replayed embedding-only.
    assert (settled.rolled_back, settled.embedding_only, settled.finished) == ((0,), 5, True)
    assert_every_row_once(result)


@pytest.fixture
def two_nodes() -> Iterator[Cluster]:
    with simulated_cluster(2, cpus_per_node=2) as c:  # one gang of two ranks per node
        yield c


def test_a_node_loss_leaves_every_row_in_the_model_once(two_nodes: Cluster, tmp_path: str) -> None:
    # Gangs of two ranks: the survivor's ranks replay the lost gang's batches round-robin, so
    # in one step one rank may train an embedding-only replay beside a full one.
    config = counting_job(
        tmp_path,
        scaling=ScalingConfig(num_workers=4, gang_size=2),
        # Slow steps, so the removal (done by the driver once it sees step 4) lands mid-run.
        testing=TestingConfig(
            faults=(FaultSpec(kind=FaultKind.SLOW_RANK, step=5, rank=0, stall_s=0.4, steps=6),)
        ),
    )
    remover = NodeRemover(cluster=two_nodes, at_step=4, job_rank=2)
    result = fit_counting(config, on_progress=remover)

    assert result.steps == 14 and result.history[-1].gangs == 1
    assert [e.kind for e in result.events.of(NodeDied)] == ["node_died"]
    assert_every_row_once(result)
