"""Vocabularies of categorical features, counted from the training data before training.

A feature with ``data.columns.categorical[feature] = "vocabulary"`` has its categories counted over
every training file (only its column is read, row group by row group, so memory holds the counts,
not the data), and :func:`~raytrec.data.spec.fit_vocabulary` keeps the ``num_embeddings - 1`` most
frequent ones seen at least ``data.vocabulary_min_count`` times. The vocabulary then lives in the
job's :class:`~raytrec.data.spec.FeatureSpec`: the Ray Data preprocessing encodes with it, and
every checkpoint, final model and export carries it in its model spec, so evaluate, predict and a
loaded model encode new rows the same way.

The counting runs on the driver (one process): a pass over the categorical columns of the data.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raytrec.data.arrow_kjt import BadInputError

__all__ = ["count_categories"]


def _flat_strings(arr: pa.Array | pa.ChunkedArray) -> pa.Array:
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks else pa.array([], type=arr.type)
    if pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
        arr = pc.list_flatten(arr)
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    arr = arr.drop_null()
    if not (pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)):
        arr = arr.cast(pa.string())
    return arr


def count_categories(
    fs: pafs.FileSystem, files: list[str], columns: Mapping[str, str]
) -> dict[str, collections.Counter[str]]:
    """Feature -> how often each category (as text) appears in its column (``columns``: feature
    -> column) over ``files``. A file without the column is named in a :class:`BadInputError`."""
    counts = {feature: collections.Counter[str]() for feature in columns}
    wanted = sorted(set(columns.values()))
    for path in files:
        with fs.open_input_file(path) as handle:
            reader = pq.ParquetFile(handle)
            missing = [c for c in wanted if c not in reader.schema_arrow.names]
            if missing:
                raise BadInputError(
                    "missing_column",
                    "no such column (a categorical feature's)",
                    file=path,
                    column=missing[0],
                )
            for group in range(reader.num_row_groups):
                table = reader.read_row_group(group, columns=wanted)
                for feature, column in columns.items():
                    found = pc.value_counts(_flat_strings(table.column(column)))
                    values = found.field("values").to_pylist()
                    times = found.field("counts").to_pylist()
                    counts[feature].update(dict(zip(values, times, strict=True)))
    return counts
