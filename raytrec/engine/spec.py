"""What a rank is given to build itself: its place in the job and the job's store.

:class:`RankSpec` is made on the driver and sent to the rank actor; :class:`StoreAddress`
names the rendezvous store that the coordinator hosts. The seeds a rank draws its random
state from are pure functions of the job's seed and the rank's place.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import TYPE_CHECKING

import numpy as np
import torch.distributed as dist
from torchrec.distributed.types import ShardingPlan

from raytrec.config import TrainConfig
from raytrec.data.spec import FeatureSpec
from raytrec.models import ModelFactory, build_train_model

if TYPE_CHECKING:
    from raytrec.serving.model_spec import ModelSpec

__all__ = ["RankSpec", "StoreAddress", "dropout_seed", "embedding_seed"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class StoreAddress:
    """Where the job's rendezvous store (hosted by the coordinator) listens, and the job's
    secret: every key the job writes or reads lies under it, so a client outside the job (who
    can reach the port but was not handed the secret through Ray) can neither read the job's
    keys nor write one the job would read."""

    host: str
    port: int
    secret: str = ""

    def connect(self, timeout: timedelta) -> dist.Store:
        """A client of the store, seeing the job's keys only."""
        store = dist.TCPStore(self.host, self.port, is_master=False, timeout=timeout)
        return dist.PrefixStore(self.secret, store) if self.secret else store


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankSpec:
    """Everything a rank needs to build itself; picklable, sent to the rank actor."""

    rank: int  # position in the job
    gang: int
    gang_rank: int
    gang_size: int
    config: TrainConfig
    plan: ShardingPlan
    num_dense: int
    store: StoreAddress
    model_factory: ModelFactory = build_train_model
    timeout_s: float = 120.0  # collectives (failure detection); rendezvous waits longer
    # The row layout the job trains on (column names, vocabularies); None: raytrec's own
    # Parquet layout for the config. Saved with every checkpoint and final model.
    features: FeatureSpec | None = None

    def model_spec(self) -> ModelSpec:
        """What rebuilds this model outside training (written beside its saved state)."""
        from raytrec.serving.model_spec import ModelSpec

        if self.features is None:
            return ModelSpec.for_config(self.config, self.num_dense)
        return ModelSpec(model=self.config.model, num_dense=self.num_dense, features=self.features)


def embedding_seed(seed: int, gang_rank: int) -> int:
    """The seed of the embedding shards a rank initialises: one seed per place in a gang,
    none equal to the dense layers' (``seed`` itself)."""
    return seed * 1_000_003 + gang_rank + 1


def dropout_seed(seed: int, rank: int) -> int:
    """The seed of job rank ``rank``'s dropout masks (``model.dropout``)."""
    return int(np.random.SeedSequence([seed, rank, 0xD5]).generate_state(1)[0])
