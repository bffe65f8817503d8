"""``seed`` makes a run reproducible: two CPU runs with the same seed and shape end with
bitwise-identical weights and optimizer state on every rank (without the seeded embedding
initialisation this test failed: the runs started from different tables). The second run
also evaluates on held-out rows at every sync boundary: evaluation changes no weight and no
optimizer state, or its digests would differ from the first's.

Every source of randomness is a function of ``seed``: the dense layers' initialisation, the
embedding tables' (each rank of the first gang initialises its own shards from a generator
seeded by ``seed`` and its gang rank; every other gang copies that gang), and the generated
data. Collectives run in a fixed order among a fixed set of ranks. A third run, with another seed,
ends with other weights (the seed reaches the model; ``test_parquet_replay_cluster`` holds the
same for Parquet read through Ray Data, with a rank killed by a fault plan).
"""

from __future__ import annotations

import os
import pathlib
import tempfile

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from raytrec.api import Result, fit
from raytrec.config import (
    DataConfig,
    EvalConfig,
    ModelConfig,
    ScalingConfig,
    TrainConfig,
    criteo_tables,
)
from raytrec.data.generate import write_synthetic_parquet

pytestmark = pytest.mark.cluster


def test_the_same_seed_gives_bitwise_identical_final_weights(
    local_ray: None, tmp_path: pathlib.Path
) -> None:
    held_out = tmp_path / "held_out"
    write_synthetic_parquet(held_out, rows=256, files=1, row_groups_per_file=1, num_embeddings=200)

    def run(seed: int, name: str, evaluate: bool = False) -> Result:
        config = TrainConfig(
            model=ModelConfig(tables=criteo_tables(num_features=8, num_embeddings=200)),
            scaling=ScalingConfig(num_workers=4, gang_size=2),
            data=DataConfig(batch_size=32),
            # Evaluated at steps 4 and 8, both sync boundaries (sync_every=4).
            eval=EvalConfig(path=str(held_out) if evaluate else None, every_n_steps=4),
            num_steps=8,
            log_every=4,
            seed=seed,
            name=name,
            storage_path=str(tmp_path),
        )
        result = fit(config, shutdown_ray=False)
        assert sum(m.eval_rows is not None for m in result.history) == (2 if evaluate else 0)
        return result

    first, second = run(3, "a"), run(3, "b", evaluate=True)
    assert first.state_digests == second.state_digests
    assert len({d["shards"] for d in first.state_digests.values()}) == 2  # 2 shards x 2 replicas
    same = final_state(first)
    assert_same_state(same, final_state(second))
    other = final_state(run(4, "c"))
    assert other.keys() == same.keys()
    differ = [k for k in same if not torch.equal(same[k], other[k])]
    # Every table and dense layer starts from the seed: all of them end elsewhere.
    weights = [k for k in same if k.endswith((".weight", ".bias"))]
    assert weights and set(weights) <= set(differ), sorted(set(weights) - set(differ))


def final_state(result: Result) -> dict[str, torch.Tensor]:
    """Every tensor of the run's final model (its weights: the optimizer state is not in it,
    ``Result.state_digests`` covers that), unsharded."""
    assert result.final_state_path is not None
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "state.pt")
        dcp_to_torch_save(result.final_state_path, path)
        state = torch.load(path, weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """``a`` and ``b`` hold the same tensors, bit for bit (NaNs included)."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    assert any(k.endswith(".weight") for k in a), sorted(a)
    differ = [
        k
        for k in a
        if a[k].dtype != b[k].dtype
        or a[k].shape != b[k].shape
        or not torch.equal(bits(a[k]), bits(b[k]))
    ]
    assert not differ, f"tensors that differ between the runs: {differ}"


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)
