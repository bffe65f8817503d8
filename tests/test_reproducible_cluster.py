"""``seed`` makes a run reproducible: two CPU runs with the same seed and shape end with
bitwise-identical weights and optimizer state on every rank (without the seeded embedding
initialisation this test failed: the runs started from different tables). The second run
also evaluates on held-out rows at every sync boundary: evaluation changes no weight and no
optimizer state, or its digests would differ from the first's.

Every source of randomness is a function of ``seed``: the dense layers' initialisation, the
embedding tables' (each rank of the first gang initialises its own shards from a generator
seeded by ``seed`` and its gang rank; every other gang copies that gang), and the generated
data. Collectives run in a fixed order among a fixed set of ranks.
"""

from __future__ import annotations

import pathlib

import pytest

from raytrec.api import fit
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

    def run(seed: int, name: str, evaluate: bool = False) -> dict[int, dict[str, str]]:
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
        return result.state_digests

    first, second = run(3, "a"), run(3, "b", evaluate=True)
    assert first == second
    assert len({d["shards"] for d in first.values()}) == 2  # 2 shards, each on 2 replicas
