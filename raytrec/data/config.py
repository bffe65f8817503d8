"""The data's config: where training rows come from (:class:`DataConfig`) and which Parquet
columns hold a row's parts (:class:`ColumnsConfig`); see :mod:`raytrec.config.base`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from raytrec.config.base import (
    ConfigError,
    ConfigModel,
    Name,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Seq,
)

__all__ = ["ColumnsConfig", "DataConfig", "GrowingConfig"]

ReadAhead = Literal["auto", "background", "inline"]
DataSourceKind = Literal["synthetic", "parquet", "generated"]
OnBadRows = Literal["error", "skip"]
ParquetRead = Literal["indexed"]
#: Why ``data.parquet_read: streaming`` is refused (it was retired).
STREAMING_RETIRED = (
    "data.parquet_read='streaming' was retired: a lost gang's unsynced batches went untrained, "
    "a resume skipped to other rows, and it read 3.3x fewer rows per second than 'indexed', "
    "which is exact across losses, resizes and resumes and reads growing sources "
    "(docs/data.md); delete the key"
)
CategoryEncoding = Literal["vocabulary", "hash"]
IdPolicyName = Literal["modulo", "hash", "strict"]


class ColumnsConfig(ConfigModel):
    """Which Parquet columns hold a row's parts. The defaults are raytrec's own layout, so only
    what differs needs naming."""

    label: Name = "label"
    """The label column (0/1)."""
    row_id: Name | None = "row_id"
    """An integer column naming each row (in error messages, predict's output and the
    consumption logs); null: the data has none, and rows are named by their file and their
    index in it."""
    dense: Seq[Name] | None = None
    """The dense (numeric) input columns, in order; null: `dense_0` .. `dense_{num_dense-1}`;
    an empty list: no dense input."""
    features: dict[str, Name] = Field(default={})
    """Sparse feature -> the column holding its ids (a list per row, or one value per row); a
    feature not named here reads the column of its own name."""
    categorical: dict[str, CategoryEncoding] = Field(default={})
    """Sparse feature -> how the categories in its column (strings, or integers used as
    categories) become ids: `vocabulary` (the most frequent values of the training data get ids
    1.., every other value id 0; the vocabulary is saved with the model) or `hash` (a stable
    hash modulo the table's rows; for a table with managed ids the 64-bit hash itself). Features
    not named here hold integer ids, mapped by `data.id_policy`."""


class GrowingConfig(ConfigModel):
    """A Parquet directory that keeps growing while the job trains (docs/continuous.md). Files
    must appear whole, under their final name (write them elsewhere, or under a name starting
    with `.` or `_`, then rename them into place), and never change once there."""

    poll_s: PositiveFloat = 5.0
    """Seconds between two listings of `data.path` for new files."""
    idle_stop_s: PositiveFloat | None = None
    """Stop once every row seen is trained and no new file has appeared for this many
    seconds; null: wait for new files until stopped on request (or `max_files`)."""
    max_files: PositiveInt | None = None
    """Train at most this many files (in the order they are found, the files of one listing in
    sorted order) and stop once they are trained; null: no end of this kind."""


class DataConfig(ConfigModel):
    """Where training rows come from and how each rank batches them.

    With `num_steps: null` the job trains every batch of `epochs` passes over Parquet data
    (`parquet`, `generated`), and no more.
    """

    batch_size: PositiveInt = 256
    """Rows per rank per step."""
    source: DataSourceKind = "synthetic"
    """The stream when `fit` is given no source object. `synthetic`: rows generated in each
    rank, no I/O; endless, so `epochs` does not apply. `parquet`: the Parquet files at `path`,
    read by Ray Data (`parquet_read`); columns: `dense_0` .. `dense_{num_dense-1}` (numbers), one
    id-list column per sparse feature named like the feature, `<feature>_weights`
    (`list<float>`) for each feature of a weighted table, `label` and `row_id` (`columns` maps
    your own names). `generated`: Parquet written once from the synthetic teacher model (its
    oracle AUC known) into `path`, then read like `parquet` (its ids span the largest table and
    are folded into smaller ones: `id_policy: modulo`)."""
    path: Name | None = None
    """The Parquet data: a file, a directory or a pyarrow URI such as `s3://bucket/prefix`.
    Needed by `source: parquet`; for `source: generated` null means
    `<storage_path>/data/<a name from the sizes>`, reused when already there."""
    epochs: PositiveInt = 1
    """Passes over Parquet data."""
    shuffle_seed: NonNegativeInt | None = None
    """Null: files in sorted order; else a seeded order of row groups per epoch."""
    shuffle_window_rows: PositiveInt | None = None
    """Shuffles rows, not only row groups (needs `shuffle_seed`): each epoch's rows, in the
    seeded row-group order, are cut into windows of this many consecutive rows, and the rows of
    each window are permuted (seeded by `shuffle_seed`, the epoch and the window). Read by index,
    the order is a pure function of the seed and the data, so replays and resumes read the same
    rows. Null: rows keep their order within a row group."""
    on_bad_rows: OnBadRows = "error"
    """`skip` drops rows holding a bad value and counts them; `error` fails the job."""
    parquet_read: ParquetRead = "indexed"
    """How ranks read Parquet: `indexed`, each rank its own batches, each batch at a fixed place
    in the data, so a lost gang's uncommitted batches are read again by the survivors and a
    resume from a checkpoint continues on the same rows. (`streaming`, one Ray Data pipeline
    cut among the ranks, was retired: docs/data.md.)"""
    growing: GrowingConfig | None = None
    """The files at `path` keep coming while the job trains (a directory of partitions such
    as `day=2026-11-27/`): each new file is found by a listing every `growing.poll_s`, and its
    rows are shared among the ranks and trained exactly once. Needs `source: parquet`,
    `epochs: 1` and no `shuffle_seed`; the job runs until stopped on request or by
    `growing.idle_stop_s` / `growing.max_files`, and `num_steps` is the steps of the files
    there at the start. Null: the files are fixed."""
    id_policy: IdPolicyName = "strict"
    """How integer ids map into a table's rows: `strict` (an id outside [0, num_embeddings) is
    bad input), `modulo` (folded into range) or `hash` (hashed into range). The features of a
    table with managed ids (`model.tables[].ids.policy: managed`) keep their raw int64 ids
    whatever this says."""
    num_dense: NonNegativeInt | None = None
    """Dense columns of a Parquet source (`dense_0` ..); null: 13, or as many as `columns.dense`
    names; 0: none (model.arch `deepfm` or `two_tower` only)."""
    columns: ColumnsConfig = ColumnsConfig()
    """Which Parquet columns hold a row's parts."""
    vocabulary_min_count: PositiveInt = 1
    """A category must appear this many times in the training data to get a vocabulary id."""
    generated_files: PositiveInt = 4
    """Files `source: generated` writes."""
    generated_rows: PositiveInt | None = None
    """Rows per epoch of `source: generated`; null: enough for `num_steps` steps."""
    generated_held_out_rows: NonNegativeInt = 0
    """Rows of a held-out split of `source: generated`: the same teacher, other rows, written
    beside the training data and evaluated on unless `eval.path` is set; 0: none."""
    prefetch_batches: NonNegativeInt = 4
    """Batches each rank fetches ahead of training."""
    read_ahead: ReadAhead = "auto"
    """Where a rank makes its batches: `background` (a read-ahead thread, overlapping
    training), `inline` (between intervals, on the training thread), `auto` (background on GPU
    ranks, inline on CPU ranks, where a thread competes with training for the cores)."""

    @model_validator(mode="before")
    @classmethod
    def _not_retired(cls, data: object) -> object:
        if isinstance(data, dict) and data.get("parquet_read") == "streaming":
            raise ConfigError(STREAMING_RETIRED)
        return data

    @model_validator(mode="after")
    def _consistent(self) -> DataConfig:
        named = self.columns.dense
        if self.num_dense is None:
            # Resolved once here, so every reader sees a number.
            object.__setattr__(self, "num_dense", 13 if named is None else len(named))
        elif named is not None and self.num_dense != len(named):
            raise ConfigError(
                f"data.num_dense={self.num_dense} but data.columns.dense names {len(named)} "
                "columns; leave num_dense out"
            )
        if self.shuffle_window_rows is not None and self.shuffle_seed is None:
            raise ConfigError(
                f"data.shuffle_window_rows={self.shuffle_window_rows} needs "
                "data.shuffle_seed: the rows' order is drawn from it"
            )
        if self.growing is not None:
            problems = [
                f"data.{key}={value!r}"
                for key, value, ok in (
                    ("source", self.source, self.source == "parquet"),
                    ("epochs", self.epochs, self.epochs == 1),
                    ("shuffle_seed", self.shuffle_seed, self.shuffle_seed is None),
                )
                if not ok
            ]
            if problems:
                raise ConfigError(
                    "data.growing needs data.source='parquet', epochs=1 "
                    f"and no shuffle_seed (new rows go after the old): {', '.join(problems)}"
                )
        if self.source == "parquet" and not self.path:
            raise ConfigError("data.path must name Parquet files when data.source='parquet'")
        return self
