"""A drifting planted teacher: raw 63-bit ids whose live population shifts day by day, written as
day partitions (``day=YYYY-MM-DD/part-*.parquet``).

Each sparse feature has ``live_ids`` ids alive at any time, out of a sequence ``j = 0, 1, 2, ...``:
at time ``t`` (in days) the live ids are ``j`` in ``[s, s + live_ids)`` with
``s = floor(t * live_ids * turnover)``, so every day a share ``turnover`` of the live ids stops
appearing for good and as many new ones appear. Every id lives ``1 / turnover`` days, and after
``T`` days ``live_ids * (1 + T * turnover)`` ids have been seen. Popularity belongs to a slot, not
to an id: slot ``c`` (a truncated power law over ``[0, live_ids)``, slot 0 the most popular) holds
the live ``j`` with ``j = p(c) (mod live_ids)``, ``p`` a fixed random permutation per feature, so a
retiring id hands its traffic to a new one, and popular slots change hands at times spread evenly.

The id a row carries is ``splitmix64(j ^ salt) >> 1``: a large, sparse non-negative int64, as
hashed production ids are, never ``0..N``. The teacher's logit is a dense linear part plus, per
feature, a planted weight of the raw id (a hash of it, ~N(0, ``sparse_logit_std**2 / F``)), so a
model that gives two ids one row loses AUC. Rows of day ``d`` come from
``np.random.default_rng([seed, d, chunk, 7])`` alone: a day can be written on its own, later, or
again, with the same rows (``row_id = d * rows_per_day + i``), which is how partitions land over
time.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import math
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raytrec.data.generate import (
    _CHUNK_ROWS,
    META_FILE,
    _click_prob,
    _split_evenly,
    auc,
    check_layout,
)
from raytrec.data.synthetic import (
    _U64,
    _hash_normal,
    _sigmoid,
    _splitmix64,
    click_rate_intercept,
    require,
)

__all__ = ["DriftingData", "DriftingTeacher", "day_dir", "write_drifting_parquet"]

_CALIBRATION_ROWS = 16_384
_ID_MASK = _U64((1 << 63) - 1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DriftingTeacher:
    """The drifting rows and their planted teacher (module doc). One id per (row, feature)."""

    num_dense: int = 13
    num_sparse: int = 8
    live_ids: int = 1_000  # ids alive per feature at any time
    turnover: float = 0.25  # share of the live ids replaced per day
    zipf_alpha: float = 1.05  # power law of slot popularity
    dense_logit_std: float = 0.5
    sparse_logit_std: float = 2.0  # of the sum over features of the per-id weights
    seed: int = 0
    feature_prefix: str = "cat_"

    def __post_init__(self) -> None:
        check = functools.partial(require, self)
        check("num_dense", self.num_dense >= 0, ">= 0")
        check("num_sparse", self.num_sparse >= 1, ">= 1")
        check("live_ids", self.live_ids >= 1, ">= 1")
        check("turnover", 0.0 <= self.turnover <= 1.0, "in [0, 1]")
        check("zipf_alpha", self.zipf_alpha > 1.0, "> 1")
        check("dense_logit_std", self.dense_logit_std >= 0.0, ">= 0")
        check("sparse_logit_std", self.sparse_logit_std >= 0.0, ">= 0")
        check("seed", self.seed >= 0, ">= 0")

    @property
    def sparse_features(self) -> tuple[str, ...]:
        return tuple(f"{self.feature_prefix}{i}" for i in range(self.num_sparse))

    def ids_seen(self, days: float) -> int:
        """Ids per feature alive at some time in ``[0, days)`` (each seen if popular enough)."""
        return self.live_ids + math.ceil(days * self.live_ids * self.turnover)

    def raw_ids(self, feature: int, index: np.ndarray) -> np.ndarray:
        """The raw int64 id of sequence index ``index`` (uint64 or int64) of ``feature``."""
        salt = self._salts[feature]
        return (_splitmix64(np.asarray(index).astype(_U64) ^ salt) & _ID_MASK).astype(np.int64)

    def rows(
        self, times: np.ndarray, rng: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Rows at ``times`` (days, float64 ``[B]``): dense float32 ``[B, D]``, raw ids int64
        ``[F, B]``, labels float32 ``[B]`` and the teacher's click probability float32 ``[B]``."""
        dense, ids = self._draw(times, rng)
        logits = self._logits(dense, ids) + self._intercept
        labels = (rng.random(len(times)) < _sigmoid(logits)).astype(np.float32)
        return dense, ids, labels, _click_prob(logits)

    def _draw(self, times: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        n = len(times)
        dense = rng.standard_normal((n, self.num_dense)).astype(np.float32)
        start = np.floor(times * self.live_ids * self.turnover).astype(np.int64)
        live = self.live_ids
        # Inverse CDF of a power law x^-alpha on [1, live + 1), floored: slot k ~ (k+1)^-alpha.
        mass = 1.0 - (live + 1.0) ** (1.0 - self.zipf_alpha)
        x = (1.0 - rng.random((self.num_sparse, n)) * mass) ** (1.0 / (1.0 - self.zipf_alpha))
        slot = np.minimum(x.astype(np.int64) - 1, live - 1)
        # A slot's place in the window is a fixed permutation of its popularity rank, so the
        # popular slots hand over to new ids at times spread over the days, not all at once.
        place = np.take_along_axis(self._places, slot, axis=1)
        index = start + (place - start) % live  # the live id of each slot
        return dense, np.stack([self.raw_ids(f, index[f]) for f in range(self.num_sparse)])

    def _logits(self, dense: np.ndarray, ids: np.ndarray) -> np.ndarray:
        weights = self._weight_salts[:, None] ^ ids.astype(_U64)
        bias = _hash_normal(_splitmix64(weights.reshape(-1))).reshape(ids.shape)
        sparse = bias.sum(axis=0) * (self.sparse_logit_std / math.sqrt(self.num_sparse))
        return dense.astype(np.float64) @ self._dense_weight + sparse

    @functools.cached_property
    def _salts(self) -> np.ndarray:
        rng = np.random.default_rng([self.seed, 0, 0, 11])
        return _splitmix64(rng.integers(0, 2**63, self.num_sparse, dtype=np.int64).astype(_U64))

    @functools.cached_property
    def _places(self) -> np.ndarray:
        rng = np.random.default_rng([self.seed, 0, 0, 14])
        return np.stack([rng.permutation(self.live_ids) for _ in range(self.num_sparse)])

    @functools.cached_property
    def _weight_salts(self) -> np.ndarray:
        return _splitmix64(self._salts ^ _U64(0x5DEECE66D))

    @functools.cached_property
    def _dense_weight(self) -> np.ndarray:
        rng = np.random.default_rng([self.seed, 0, 0, 12])
        scale = self.dense_logit_std / math.sqrt(max(self.num_dense, 1))
        return rng.standard_normal(self.num_dense) * scale

    @functools.cached_property
    def _intercept(self) -> float:
        # Chosen so the click rate is 25% at the start (drift moves it a little).
        rng = np.random.default_rng([self.seed, 0, 0, 13])
        return click_rate_intercept(self._logits(*self._draw(np.zeros(_CALIBRATION_ROWS), rng)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class DriftingData:
    """What :func:`write_drifting_parquet` wrote: its files (in ``row_id`` order), rows, the
    oracle AUC over them and each day's, and per feature the distinct ids the rows carry."""

    paths: tuple[str, ...]
    rows: int
    oracle_auc: float
    day_oracle_auc: tuple[float, ...]
    ids_seen: tuple[int, ...]


def day_dir(start_date: str, day: int) -> str:
    """The partition directory of day ``day`` counted from ``start_date`` (``YYYY-MM-DD``)."""
    date = datetime.date.fromisoformat(start_date) + datetime.timedelta(days=day)
    return f"day={date.isoformat()}"


def _table(teacher: DriftingTeacher, rows: tuple[np.ndarray, ...], row_id_start: int) -> pa.Table:
    dense, ids, labels, prob = rows
    n = len(labels)
    columns: dict[str, pa.Array] = {
        f"dense_{j}": pa.array(dense[:, j], pa.float32()) for j in range(teacher.num_dense)
    }
    offsets = pa.array(np.arange(n + 1, dtype=np.int32), pa.int32())
    for name, feature_ids in zip(teacher.sparse_features, ids, strict=True):
        columns[name] = pa.ListArray.from_arrays(offsets, pa.array(feature_ids, pa.int64()))
    columns["label"] = pa.array(labels, pa.float32())
    columns["row_id"] = pa.array(np.arange(row_id_start, row_id_start + n), pa.int64())
    columns["click_prob"] = pa.array(prob, pa.float32())
    return pa.table(columns)


def write_drifting_parquet(
    out_dir: str | os.PathLike[str],
    *,
    teacher: DriftingTeacher,
    days: int,
    rows_per_day: int,
    first_day: int = 0,
    files_per_day: int = 1,
    row_groups_per_file: int = 1,
    start_date: str = "2026-01-01",
) -> DriftingData:
    """Writes days ``first_day .. first_day + days - 1`` of ``teacher``'s rows, ``rows_per_day``
    each, as ``out_dir/day=YYYY-MM-DD/part-NNNNN.parquet`` (``files_per_day`` files of
    ``row_groups_per_file`` row groups), plus ``out_dir/_meta.json``. Columns as
    :func:`~raytrec.data.generate.write_synthetic_parquet`'s, each list holding one id."""
    check_layout(
        rows=rows_per_day,
        files=files_per_day,
        row_groups_per_file=row_groups_per_file,
        names=("rows_per_day", "files_per_day", "row_groups_per_file"),
    )
    if days < 1 or first_day < 0:
        raise ValueError(f"days must be >= 1 and first_day >= 0, got {days!r} and {first_day!r}")
    out = os.fspath(out_dir)
    paths: list[str] = []
    probs: list[np.ndarray] = []
    labels: list[np.ndarray] = []
    day_oracle: list[float] = []
    seen: list[set[int]] = [set() for _ in range(teacher.num_sparse)]
    for day in range(first_day, first_day + days):
        folder = os.path.join(out, day_dir(start_date, day))
        os.makedirs(folder, exist_ok=True)
        i, chunk = 0, 0  # the day's row and chunk counters
        day_probs: list[np.ndarray] = []
        day_labels: list[np.ndarray] = []
        for k, file_rows in enumerate(_split_evenly(rows_per_day, files_per_day)):
            path = os.path.join(folder, f"part-{k:05d}.parquet")
            writer: pq.ParquetWriter | None = None
            try:
                for group_rows in _split_evenly(file_rows, row_groups_per_file):
                    chunks: list[pa.Table] = []
                    for chunk_rows in _split_evenly(group_rows, -(-group_rows // _CHUNK_ROWS)):
                        rng = np.random.default_rng([teacher.seed, day, chunk, 7])
                        times = day + (np.arange(i, i + chunk_rows) + 0.5) / rows_per_day
                        rows = teacher.rows(times, rng)
                        chunks.append(_table(teacher, rows, day * rows_per_day + i))
                        for f, ids in enumerate(rows[1]):
                            seen[f].update(np.unique(ids).tolist())
                        day_labels.append(rows[2])
                        day_probs.append(rows[3])
                        i, chunk = i + chunk_rows, chunk + 1
                    table = pa.concat_tables(chunks)
                    if writer is None:
                        writer = pq.ParquetWriter(path, table.schema)
                    writer.write_table(table, row_group_size=table.num_rows)
            finally:
                if writer is not None:
                    writer.close()
            paths.append(path)
        day_oracle.append(_oracle(np.concatenate(day_probs), np.concatenate(day_labels)))
        probs += day_probs
        labels += day_labels
    oracle = _oracle(np.concatenate(probs), np.concatenate(labels))
    written = DriftingData(
        paths=tuple(paths),
        rows=days * rows_per_day,
        oracle_auc=oracle,
        day_oracle_auc=tuple(day_oracle),
        ids_seen=tuple(len(s) for s in seen),
    )
    meta = {
        "drifting": {f.name: getattr(teacher, f.name) for f in dataclasses.fields(DriftingTeacher)},
        "first_day": first_day,
        "days": days,
        "rows_per_day": rows_per_day,
        "start_date": start_date,
        "seed": teacher.seed,
        "rows": written.rows,
        "oracle_auc": None if math.isnan(oracle) else oracle,
        "day_oracle_auc": [None if math.isnan(x) else x for x in day_oracle],
        "ids_seen": list(written.ids_seen),
        "paths": [os.path.relpath(p, out) for p in paths],
    }
    with open(os.path.join(out, META_FILE), "w") as handle:
        json.dump(meta, handle, indent=2)
        handle.write("\n")
    return written


def _oracle(probs: np.ndarray, labels: np.ndarray) -> float:
    both_classes = 0 < labels.sum() < len(labels)
    return auc(probs, labels) if both_classes else math.nan
