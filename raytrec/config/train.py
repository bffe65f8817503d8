"""Typed, validated configuration for a raytrec job.

One small frozen pydantic model per component (:mod:`raytrec.config.base`), each validated on
construction: a bad value fails on the driver, before any rank actor starts, with a
:class:`ConfigError` naming the key, the value and what is allowed. The model's and the data's
sections live in :mod:`raytrec.config.model` and :mod:`raytrec.data.config`; checks that need
two sections together (a feature that no table serves, fused Adam on CPU) live in
:class:`TrainConfig`. Knobs for tests and benchmarks (injected faults and stalls) sit apart, in
the ``testing`` section.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Literal

from annotated_types import Interval
from pydantic import model_validator

from raytrec.checkpoint.config import CheckpointConfig
from raytrec.cluster.domains import FailureDomain
from raytrec.cluster.topology import Layout, Topology, TopologyError
from raytrec.config.base import (
    ConfigError,
    ConfigModel,
    Lax,
    Name,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Seq,
    root,
)
from raytrec.config.model import (
    RESERVED_TABLE_NAMES,
    UVM_KERNELS,
    WEIGHTS_SUFFIX,
    IdsConfig,
    ModelConfig,
    ShardingType,
    TableConfig,
    criteo_tables,
)
from raytrec.data.config import ColumnsConfig, DataConfig
from raytrec.elastic.config import ElasticConfig
from raytrec.elastic.faults import FaultConfig, FaultSpec
from raytrec.sync.stragglers import StragglerSpec

__all__ = [
    "RESERVED_TABLE_NAMES",
    "WEIGHTS_SUFFIX",
    "ColumnsConfig",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "IdsConfig",
    "ModelConfig",
    "OptimizerConfig",
    "PublishConfig",
    "ScalingConfig",
    "ShardingConfig",
    "SyncConfig",
    "TableConfig",
    "TestingConfig",
    "TrainConfig",
    "criteo_tables",
    "validate_features",
]

EmbeddingOptimizer = Literal["sgd", "adagrad", "rowwise_adagrad", "adam"]
DenseOptimizer = Literal["sgd", "adagrad", "adam", "adamw"]
Backend = Literal["auto", "gloo", "nccl"]
EvalMetric = Literal["eval_auc", "eval_ne", "eval_log_loss"]
DenseSync = Literal["every_step", "with_schedule"]
SyncRows = Literal["all", "touched"]
TrainPipelineName = Literal["auto", "off", "sparse_dist", "semi_sync"]

#: Schedule levels (the job-wide one included) whose touched rows one rank can track.
MAX_TOUCHED_LEVELS = 15

# What TorchRec 1.8's planner offers a CPU compute device (checked on gloo).
CPU_SHARDING_TYPES: tuple[str, ...] = ("table_wise", "column_wise")
CPU_EMBEDDING_OPTIMIZERS: tuple[str, ...] = ("sgd", "adagrad", "rowwise_adagrad")
# The fused embedding optimizers whose FBGEMM kernels take a weight decay (EXACT_SGD and
# EXACT_ADAGRAD ignore it).
EMBEDDING_WEIGHT_DECAY: tuple[str, ...] = ("rowwise_adagrad", "adam")

#: The largest nice value Linux gives a process (``scaling.rank_niceness``).
MAX_NICENESS = 19


class OptimizerConfig(ConfigModel):
    """Fused (in-backward) embedding optimizer and the dense optimizer."""

    embedding: EmbeddingOptimizer = "adagrad"
    """The embedding tables' optimizer, fused into the backward pass by FBGEMM; CPU ranks take
    `sgd`, `adagrad` or `rowwise_adagrad`."""
    embedding_lr: PositiveFloat = 0.05
    """The embedding optimizer's learning rate."""
    dense: DenseOptimizer = "adagrad"
    """The dense parameters' optimizer (torch.optim); `adamw` is Adam with decoupled weight decay
    (`dense_weight_decay`)."""
    dense_lr: PositiveFloat = 0.05
    """The dense optimizer's learning rate."""
    eps: PositiveFloat = 1e-8
    """Both optimizers' epsilon (Adagrad, Adam, AdamW)."""
    dense_weight_decay: NonNegativeFloat = 0.0
    """Weight decay of the dense parameters (torch's weight_decay): an L2 penalty added to their
    gradient, or with `dense: adamw` decoupled decay (AdamW's, 0 unless set here)."""
    embedding_weight_decay: NonNegativeFloat = 0.0
    """Weight decay of the embedding rows a batch looks up, applied by FBGEMM's fused optimizer
    on GPU ranks: L2 (added to the gradient) for rowwise_adagrad, decoupled for adam; sgd and
    adagrad have none, and FBGEMM's CPU kernels ignore it."""

    @model_validator(mode="after")
    def _decay_is_supported(self) -> OptimizerConfig:
        if self.embedding_weight_decay and self.embedding not in EMBEDDING_WEIGHT_DECAY:
            raise ConfigError(
                f"optimizer.embedding_weight_decay={self.embedding_weight_decay!r} is not "
                f"supported by FBGEMM's fused {self.embedding!r} optimizer; allowed with "
                f"optimizer.embedding in {', '.join(map(repr, EMBEDDING_WEIGHT_DECAY))}, "
                "else set it to 0"
            )
        return self


class ShardingConfig(ConfigModel):
    """How TorchRec shards each table inside a gang."""

    sharding_type: ShardingType = "table_wise"
    """The sharding type of every table without its own `sharding_types`; CPU ranks take
    `table_wise` and `column_wise`."""
    device_memory_gib: PositiveFloat | None = None
    """The device memory per GPU rank that TorchRec's planner may fill (its `Topology.hbm_cap`),
    in GiB; null: the GPU's own memory, read from a GPU of the cluster before any rank starts.
    The planner refuses a plan that does not fit: keep the largest tables in host memory with
    `model.tables[*].compute_kernel`."""


class ScalingConfig(ConfigModel):
    """How many gangs of how many ranks, where they run, and on what device."""

    num_workers: PositiveInt = 4
    """Ranks in the job (T), as in Ray Train's ScalingConfig."""
    gang_size: PositiveInt = 2
    """Ranks holding one copy of the model (L), a divisor of num_workers; the job has
    num_workers / gang_size gangs."""
    ranks_per_host: PositiveInt | None = None
    """Ranks of the job placed on one host; null: one gang per host."""
    layout: Lax[Layout] = Layout.REPLICAS_ACROSS_HOSTS
    """How gangs and replica groups lie over the ranks: `replicas_across_hosts` (gangs packed
    onto hosts, so losing a host loses whole gangs) or `replicas_within_host` (TorchRec's 2D
    layout: replica syncs stay on one host)."""
    use_gpu: bool = False
    """One GPU per rank."""
    cpus_per_rank: PositiveFloat = 1.0
    """CPUs each rank actor reserves."""
    backend: Backend = "auto"
    """The process groups' backend; `auto`: nccl on GPU ranks, gloo on CPU ranks."""
    rank_niceness: Annotated[int, Interval(ge=0, le=MAX_NICENESS)] | None = 0
    """The rank processes' nice increment over the raylet (0-19; 0: as the raylet, as torchrun's
    workers run); null: Ray's default for workers (15)."""
    failure_domain: str = "node"
    """What fails together: `node` (each node alone) or `label:<key>` (the nodes sharing a value
    of the Ray node label `<key>`, e.g. `label:rack` for nodes started with `ray start --labels
    rack=r1`). With `replicas_across_hosts` each gang is placed in a domain no other gang of the
    job holds while the cluster has room, else shared with a `domain_shared` event
    (docs/fault_tolerance.md, "Failure domains")."""

    @model_validator(mode="after")
    def _fits(self) -> ScalingConfig:
        if self.gang_size > self.num_workers:
            raise ConfigError(
                f"scaling.gang_size={self.gang_size} is larger than "
                f"scaling.num_workers={self.num_workers}; allowed: a divisor of num_workers"
            )
        if self.num_workers % self.gang_size:
            divisors = [d for d in range(1, self.num_workers + 1) if self.num_workers % d == 0]
            raise ConfigError(
                f"scaling.gang_size={self.gang_size} does not divide "
                f"scaling.num_workers={self.num_workers}; allowed gang sizes: {divisors}"
            )
        if self.backend == "nccl" and not self.use_gpu:
            raise ConfigError("scaling.backend='nccl' needs scaling.use_gpu=True")
        try:
            FailureDomain.parse(self.failure_domain)
        except ValueError as e:
            raise ConfigError(f"scaling.failure_domain: {e}") from None
        try:
            self.topology()
        except TopologyError as e:
            raise ConfigError(f"scaling: {e}") from None
        return self

    @property
    def world_size(self) -> int:
        return self.num_workers

    @property
    def num_gangs(self) -> int:
        return self.num_workers // self.gang_size

    @property
    def resolved_backend(self) -> str:
        if self.backend != "auto":
            return self.backend
        return "nccl" if self.use_gpu else "gloo"

    def domain(self) -> FailureDomain:
        """The failure domain the gangs are kept apart by."""
        return FailureDomain.parse(self.failure_domain)

    def topology(self) -> Topology:
        return Topology(
            world_size=self.world_size,
            gang_size=self.gang_size,
            ranks_per_host=self.ranks_per_host or self.gang_size,
            layout=self.layout,
        )


def _multiples(base: int, first: int) -> str:
    return ", ".join(str(base * k) for k in range(first, first + 3)) + ", ..."


def _check_sync_levels(levels: tuple[tuple[int, int], ...], sync_every: int) -> None:
    """The lower levels of a hierarchy nest: periods and group sizes each divide the next."""
    for i, (_, group_size) in enumerate(levels):
        if group_size < 2:
            raise ConfigError(
                f"sync.levels[{i}].group_size={group_size} must be at least 2 gangs; "
                "a single gang is already averaged every step inside itself"
            )
    for i in range(1, len(levels)):
        (p0, s0), (p1, s1) = levels[i - 1], levels[i]
        if p1 <= p0 or p1 % p0:
            raise ConfigError(
                f"sync.levels[{i}].period={p1} must be a multiple of, and larger than, "
                f"sync.levels[{i - 1}].period={p0}; allowed: {_multiples(p0, 2)}"
            )
        if s1 <= s0 or s1 % s0:
            raise ConfigError(
                f"sync.levels[{i}].group_size={s1} must be a multiple of, and larger than, "
                f"sync.levels[{i - 1}].group_size={s0}, so each group is a union of whole "
                f"lower-level groups; allowed: {_multiples(s0, 2)}"
            )
    if levels:
        top = levels[-1][0]
        if sync_every <= top or sync_every % top:
            raise ConfigError(
                f"sync.sync_every={sync_every} (the job-wide level) must be a multiple of, and "
                f"larger than, the last level's period sync.levels[{len(levels) - 1}].period="
                f"{top}; allowed: {_multiples(top, 2)}"
            )


class SyncConfig(ConfigModel):
    """When, and among which gangs, replicas average their state.

    The top level of the schedule is the job-wide sync every `sync_every` steps (all live
    gangs). `levels` adds lower levels beneath it for hierarchical SGD. At a step only the
    highest level that is due syncs. With no levels this is local SGD every `sync_every` steps
    (1: synchronous).
    """

    sync_every: PositiveInt = 4
    """Steps between job-wide syncs of all live gangs."""
    sync_optimizer_state: bool = True
    """Average the fused embedding optimizer's state with the embeddings."""
    levels: Seq[Lax[tuple[PositiveInt, PositiveInt]]] = ()
    """Lower levels of a hierarchical schedule: `[period, group_size]` pairs, the group size
    counted in gangs, e.g. `[[2, 8], [4, 32]]` with `sync_every: 8` syncs groups of 8 gangs
    every 2 steps, of 32 every 4 and all every 8. Periods and group sizes each divide the
    next, so levels nest."""
    warmup_steps: NonNegativeInt = 0
    """Steps 1..warmup_steps sync job-wide every step first."""
    optimizer_state_every: PositiveInt | None = None
    """Null: the fused optimizer state is averaged with every sync (when
    `sync_optimizer_state`); k: only at syncs on multiples of k (a delayed optimizer-state
    schedule)."""
    dense: DenseSync = "every_step"
    """`every_step` averages dense gradients over all live gangs every step, so dense
    parameters are identical everywhere; `with_schedule` averages dense gradients only inside
    the gang (DDP) and averages dense parameters and dense optimizer state at the schedule's
    syncs, in the same groups as the embeddings, so a slow gang stalls only its group."""

    rows: SyncRows = "touched"
    """`touched` (the default) averages only the rows some member of the syncing group looked
    up since that level's last sync (the same result as `all`: untouched rows are identical
    already), with a full average at each level's first sync of a generation and after a heal
    or a checkpoint load; a rank whose shards' sync would carry under 2 MB averages them whole
    in one all-reduce, as `all` does, since agreeing on the rows costs more than it saves
    there. `all` averages every row of every embedding shard at each sync."""
    touched_max_share: Annotated[float, Interval(gt=0, le=1)] = 0.5
    """With `rows: touched`: a shard of which some member touched more than this share of the
    rows is averaged whole."""

    @model_validator(mode="after")
    def _schedule_nests(self) -> SyncConfig:
        _check_sync_levels(self.levels, self.sync_every)
        if self.rows == "touched" and len(self.levels) + 1 > MAX_TOUCHED_LEVELS:
            raise ConfigError(
                f"sync.rows=touched tracks touched rows per schedule level, at most "
                f"{MAX_TOUCHED_LEVELS} levels with the job-wide one; sync.levels has "
                f"{len(self.levels)} (fewer levels, or sync.rows=all, which tracks none)"
            )
        every = self.optimizer_state_every
        if every is not None:
            if not self.sync_optimizer_state:
                raise ConfigError(
                    f"sync.optimizer_state_every={every} needs sync.sync_optimizer_state=True"
                )
            first = self.periods[0]
            if every % first:
                raise ConfigError(
                    f"sync.optimizer_state_every={every} must be a multiple of the shortest "
                    f"sync period {first}, so optimizer state travels with a sync; allowed: "
                    f"{_multiples(first, 1)}"
                )
        return self

    @property
    def periods(self) -> tuple[int, ...]:
        """Every level's period, lowest level first, ending with ``sync_every``."""
        return (*(p for p, _ in self.levels), self.sync_every)


class EvalConfig(ConfigModel):
    """Evaluation on held-out rows while the job trains."""

    path: Name | None = None
    """Held-out Parquet in the training data's schema (a file or directory); null evaluates
    nothing. `fit(..., eval_source=PATH)` sets it too."""
    every_n_steps: PositiveInt | None = None
    """Evaluate at the first interval boundary at or after every this many steps, and always
    at the end; null: at the end only."""
    batch_size: PositiveInt | None = None
    """Rows per rank per evaluation step; null: `data.batch_size`."""
    max_rows: PositiveInt | None = None
    """Evaluate on the first this many rows only; null: every row."""
    early_stopping_patience: PositiveInt | None = None
    """Stop the job once `early_stopping_metric` has not improved on its best by more than
    `early_stopping_min_delta` for this many evaluations in a row (it ends like a finished job:
    synced, checkpointed when checkpoints are configured, saved); null: never. Needs
    `every_n_steps`."""
    early_stopping_metric: EvalMetric = "eval_auc"
    """`eval_auc` (higher is better), `eval_ne` or `eval_log_loss` (lower is better)."""
    early_stopping_min_delta: NonNegativeFloat = 0.0
    """The least change of `early_stopping_metric` that counts as an improvement."""

    @model_validator(mode="after")
    def _patience_needs_evaluations(self) -> EvalConfig:
        if self.early_stopping_patience is not None and self.every_n_steps is None:
            raise ConfigError(
                "eval.early_stopping_patience needs eval.every_n_steps: without it the model "
                "is evaluated at the end only"
            )
        return self


class PublishConfig(ConfigModel):
    """The model published for serving while the job trains: a base export, then numbered
    deltas beside it (the rows changed since the last publish, and the dense parameters)."""

    every_n_steps: PositiveInt | None = None
    """Publish at the first interval boundary at or after every this many steps, and at the
    end: the first publish writes the base export, each later one a delta; null: never."""
    dir: Name | None = None
    """Where the base export and its `deltas/` go (a local or shared directory the job's
    coordinator and ranks can write); null: `serving/` in the run directory. A directory that
    holds a base already (a resumed job) gets the next delta of its sequence, the first
    carrying every row."""


class TestingConfig(ConfigModel):
    """For tests, demos and benchmarks only: faults and stalls the job injects into itself.
    A production job leaves this section out."""

    __test__ = False  # not a pytest test class

    faults: Seq[FaultSpec] = ()
    """Faults the ranks carry out on themselves at given steps (kill, hang, slow a rank; a
    corrupt heal), e.g. `[{kind: kill_rank, step: 120, rank: 3}]`, and `kill_coordinator`
    (the coordinator SIGKILLs its own process, once per run); see the fault tolerance
    guide. `remove_node` is refused: a rank cannot take its node out of the cluster."""
    stragglers: StragglerSpec | None = None
    """Random stalls of ranks, for straggler experiments; null: none."""

    @property
    def fault_plan(self) -> FaultConfig:
        """``faults`` as a plan that answers which fault fires where."""
        return FaultConfig(faults=self.faults)


@root
class TrainConfig(ConfigModel):
    """Everything one training job needs, apart from the data source."""

    model: ModelConfig = ModelConfig()
    """The model and its embedding tables."""
    optimizer: OptimizerConfig = OptimizerConfig()
    """The embedding and dense optimizers."""
    sharding: ShardingConfig = ShardingConfig()
    """How tables are sharded inside a gang."""
    scaling: ScalingConfig = ScalingConfig()
    """Ranks, gangs, hosts and devices."""
    sync: SyncConfig = SyncConfig()
    """The schedule on which gangs average their state."""
    data: DataConfig = DataConfig()
    """The training data and its batches."""
    elastic: ElasticConfig = ElasticConfig()
    """Size bounds and failure handling."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    """Checkpoint triggers and retention."""
    eval: EvalConfig = EvalConfig()
    """Held-out evaluation while training."""
    publish: PublishConfig = PublishConfig()
    """The model published for serving as a base export and deltas."""
    num_steps: PositiveInt | None = None
    """Steps every rank trains; null: every batch of `data.epochs` passes over Parquet data
    (`data.source` `parquet` or `generated`), worked out from the files before training. The
    endless synthetic source needs it set."""
    train_pipeline: TrainPipelineName = "auto"
    """How a rank runs its steps: `sparse_dist` is TorchRec's `TrainPipelineSparseDist` (the next
    batch's copy to the device and its input all-to-all overlap this batch's forward and
    backward); `semi_sync` is `TrainPipelineSemiSync` (also the next batch's embedding lookup,
    one step stale, after TorchRec's 900 synchronous batches; GPU ranks only); `off` runs each
    step on its own. The pipeline is drained at every replica sync with another gang and at the
    end of every interval, so checkpoints, evaluations, drains and membership changes see no
    batch in flight. `auto`: `sparse_dist` on GPU ranks, `off` on CPU ranks."""
    log_every: PositiveInt = 20
    """Steps per interval: a metrics row (and a progress line) every this many steps."""
    seed: NonNegativeInt = 0
    """Seeds the dense and embedding initialisation and generated data: two CPU runs with the
    same seed, config and shape end with bitwise-identical weights."""
    storage_path: Name = "runs"
    """Where run directories go: a local path or any fsspec URI; a relative path under
    `ray job submit` goes under `~/raytrec_results/`."""
    name: Name = "raytrec"
    """The job's name, the start of its run directory's name."""
    testing: TestingConfig = TestingConfig()
    """Tests and benchmarks only: injected faults and stalls."""

    @model_validator(mode="after")
    def _sections_agree(self) -> TrainConfig:
        if (
            self.num_steps is None
            and self.data.source == "generated"
            and self.data.generated_rows is None
        ):
            raise ConfigError(
                "num_steps=None takes the job's length from the data, and data.source="
                "'generated' sizes its data from num_steps: set data.generated_rows or num_steps"
            )
        self.elastic.resolved_max_gangs(self.scaling.num_gangs)  # min <= initial <= max
        self.testing.fault_plan.check_targets(
            num_ranks=self.scaling.world_size,
            num_gangs=self.scaling.num_gangs,
            num_nodes=self.scaling.topology().num_hosts,
        )
        if not self.scaling.use_gpu:
            self._check_cpu_kernels()
        managed = [t.name for t in self.model.tables if t.managed]
        if managed and self.publish.every_n_steps is not None:
            raise ConfigError(
                f"publish.every_n_steps cannot be set with managed ids (model.tables {managed}): "
                "published deltas carry rows, not the id maps that say whose rows they are"
            )
        if self.data.source in ("parquet", "generated"):
            assert self.data.num_dense is not None  # DataConfig resolves it
            self.model.check_num_dense(self.data.num_dense)
        return self

    def _check_cpu_kernels(self) -> None:
        if self.optimizer.embedding not in CPU_EMBEDDING_OPTIMIZERS:
            raise ConfigError(
                f"optimizer.embedding={self.optimizer.embedding!r} cannot run on CPU ranks: "
                "FBGEMM's CPU kernels refuse it ('Optimizer adam is not supported in CPU "
                f"mode'); on CPU use one of {', '.join(map(repr, CPU_EMBEDDING_OPTIMIZERS))}, "
                "or set scaling.use_gpu=True"
            )
        if self.train_pipeline == "semi_sync":
            raise ConfigError(
                "train_pipeline='semi_sync' cannot run on CPU ranks: TorchRec's "
                "TrainPipelineSemiSync records its batches on CUDA streams; on CPU use 'off' or "
                "'sparse_dist', or set scaling.use_gpu=True"
            )
        for t in self.model.tables:
            if t.compute_kernel in UVM_KERNELS:
                raise ConfigError(
                    f"model.tables[{t.name}].compute_kernel={t.compute_kernel!r} cannot run on "
                    "CPU ranks: UVM is GPU memory mapped from the host; CPU ranks keep every "
                    "table in RAM with compute_kernel='fused', or set scaling.use_gpu=True"
                )
        if self.optimizer.embedding_weight_decay:
            raise ConfigError(
                f"optimizer.embedding_weight_decay={self.optimizer.embedding_weight_decay!r} "
                "cannot run on CPU ranks: FBGEMM's CPU kernels ignore it; set it to 0, or "
                "set scaling.use_gpu=True (or use optimizer.dense_weight_decay)"
            )
        for field, kinds in self.sharding_choices():
            for kind in kinds:
                if kind not in CPU_SHARDING_TYPES:
                    raise ConfigError(
                        f"{field}={kind!r} has no CPU kernel in TorchRec 1.8's planner; on "
                        f"CPU use one of {', '.join(map(repr, CPU_SHARDING_TYPES))}, or set "
                        "scaling.use_gpu=True"
                    )

    def sharding_choices(self) -> list[tuple[str, tuple[str, ...]]]:
        """``(config field, sharding types)`` the planner may use: each table's own
        ``sharding_types``, else ``sharding.sharding_type``."""
        default = ("sharding.sharding_type", (self.sharding.sharding_type,))
        return [
            (f"model.tables[{t.name}].sharding_types", t.sharding_types)
            if t.sharding_types is not None
            else default
            for t in self.model.tables
        ]

    @property
    def resolved_pipeline(self) -> str:
        """``train_pipeline`` resolved: ``sparse_dist``, ``semi_sync`` or ``off``."""
        if self.train_pipeline == "auto":
            return "sparse_dist" if self.scaling.use_gpu else "off"
        return self.train_pipeline

    @property
    def feed_in_background(self) -> bool:
        """``data.read_ahead`` resolved: whether ranks make batches on a read-ahead thread."""
        if self.data.read_ahead == "auto":
            return self.scaling.use_gpu
        return self.data.read_ahead == "background"


def validate_features(model: ModelConfig, source_features: Sequence[str]) -> None:
    """Every sparse feature of the data is served by a table, and the other way round."""
    served = set(model.features)
    unserved = [f for f in source_features if f not in served]
    if unserved:
        raise ConfigError(
            f"sparse features {unserved} from the data source are served by no table "
            f"(model.tables[*].features serves {sorted(served)})"
        )
    missing = [f for f in model.features if f not in set(source_features)]
    if missing:
        raise ConfigError(
            f"model.tables[*].features names {missing}, which the data source does not provide "
            f"(it provides {list(source_features)})"
        )
