"""The Ray Data datasource of a rank's indexed Parquet pipeline
(:meth:`raytrec.data.parquet_indexed.IndexedParquetShard`): one read task per piece of the
plan, in order. A module of its own so that importing the shard does not import Ray Data (a
rank reading other data never needs it)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import pyarrow as pa
import ray.data
from ray.data import ReadTask
from ray.data.block import BlockMetadata

from raytrec.data.parquet_gather import Gather
from raytrec.data.parquet_plan import Read

__all__ = ["PieceSource"]


class PieceSource(ray.data.Datasource):
    """A Ray Data datasource of one read task per piece (or gather), in the order given."""

    def __init__(self, pieces: list[Read], read: Callable[[Read], Iterator[pa.Table]]) -> None:
        super().__init__()
        self.pieces, self.read = pieces, read  # read: a piece's rows (parquet_indexed.read)

    def get_name(self) -> str:
        return "ParquetPieces"

    def estimate_inmemory_data_size(self) -> int | None:
        return None

    def get_read_tasks(
        self, parallelism: int, per_task_row_limit: int | None = None, data_context: object = None
    ) -> list[ReadTask]:
        # One task per piece whatever ``parallelism`` asks: the pieces are the plan's.
        return [
            ReadTask(
                functools.partial(self.read, p),
                BlockMetadata(
                    num_rows=p.rows,
                    size_bytes=None,
                    exec_stats=None,
                    input_files=p.paths if isinstance(p, Gather) else (p.path,),
                ),
            )
            for p in self.pieces
        ]
