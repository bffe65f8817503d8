"""MovieLens-100k as Parquet splits in raytrec's layout, read offline from an installed package.

The 100,000 ratings of MovieLens-100k (943 users, 1,682 movies) ship inside RecBole's wheel
(``recbole/dataset_example/ml-100k/``, pinned in ``requirements/dev.lock``); this module reads
those tab-separated atomic files straight from the package's directory, without importing the
package. Each rating becomes one row: the user's and the movie's ids and side features as
strings (for ``columns.categorical``: vocabularies or hashing), the movie's genres as a list of
strings, and ``label = rating >= 4`` (RecBole's ``threshold: {rating: 4}``).

The split is RecBole's default for its context-aware models on ml-100k (``eval_args``:
``split: {RS: [0.8, 0.1, 0.1]}, order: RO, group_by: none``): every row in a random order, then
the first 80% for training, the next 10% for validation, the last 10% for test. The order is a
permutation drawn from ``numpy.random.default_rng(seed)``, so the same seed gives the same
splits; it is not RecBole's own permutation (that one comes from torch's generator after
RecBole's other draws), so the two splits hold different rows of the same protocol.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv
import pyarrow.parquet as pq

__all__ = [
    "DATA_ENV",
    "FEATURES",
    "SPLITS",
    "MovieLensSplits",
    "find_ml100k",
    "read_ml100k",
    "split_indices",
    "write_ml100k_splits",
]

#: Names a directory holding ``ml-100k.inter``, ``.user`` and ``.item``, ahead of the package.
DATA_ENV = "RAYTREC_ML100K_DIR"
#: The package whose wheel ships the files, and their folder inside it.
PACKAGE, PACKAGE_DIR = "recbole", ("dataset_example", "ml-100k")
#: The sparse features written, one string column each (``genres`` a list of strings):
#: RecBole's context-aware ml-100k set (``user_id, age, gender, occupation`` of the user,
#: ``item_id, release_year, class`` of the movie) and the first three digits of the zip code.
FEATURES = (
    "user_id",
    "item_id",
    "age",
    "gender",
    "occupation",
    "zip_prefix",
    "release_year",
    "genres",
)
SPLITS = ("train", "validation", "test")
RATIOS = (0.8, 0.1, 0.1)
#: RecBole's default seed.
DEFAULT_SEED = 2020


def find_ml100k(directory: str | None = None) -> str:
    """The folder of the ml-100k atomic files: ``directory`` if given, else ``$RAYTREC_ML100K_DIR``,
    else ``recbole/dataset_example/ml-100k`` of the installed package (located, not imported).
    Raises ``FileNotFoundError`` naming what was looked for."""
    directory = directory or os.environ.get(DATA_ENV)
    if not directory:
        spec = importlib.util.find_spec(PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                f"MovieLens-100k not found: the {PACKAGE!r} package is not installed (pinned in "
                f"requirements/dev.lock; `./dev.sh setup` installs it), and {DATA_ENV} is unset"
            )
        directory = os.path.join(next(iter(spec.submodule_search_locations)), *PACKAGE_DIR)
    missing = [
        f"ml-100k.{s}"
        for s in ("inter", "user", "item")
        if not os.path.isfile(os.path.join(directory, f"ml-100k.{s}"))
    ]
    if missing:
        raise FileNotFoundError(f"MovieLens-100k not found: {directory} lacks {missing}")
    return directory


def _atomic(path: str) -> pa.Table:
    """One RecBole atomic file: tab-separated, a ``name:type`` header, every column as text."""
    with open(path, encoding="utf-8", errors="replace") as f:
        names = [c.split(":")[0] for c in f.readline().rstrip("\n").split("\t")]
    return pcsv.read_csv(
        path,
        read_options=pcsv.ReadOptions(column_names=names, skip_rows=1, encoding="latin-1"),
        parse_options=pcsv.ParseOptions(delimiter="\t", quote_char=False),
        convert_options=pcsv.ConvertOptions(
            column_types=dict.fromkeys(names, pa.string()),
            strings_can_be_null=True,
            quoted_strings_can_be_null=False,
        ),
    )


def read_ml100k(directory: str | None = None) -> pa.Table:
    """Every rating as one row in the order of ``ml-100k.inter``: ``row_id`` (that order), the
    :data:`FEATURES` as strings (``genres`` a list of strings; an unknown release year null),
    ``rating`` (1-5), ``timestamp`` and ``label`` (1 where ``rating >= 4``, else 0)."""
    directory = find_ml100k(directory)
    inter, user, item = (
        _atomic(os.path.join(directory, f"ml-100k.{s}")) for s in ("inter", "user", "item")
    )
    users = {c: user[c].to_pylist() for c in ("age", "gender", "occupation", "zip_code")}
    user_row = {u: i for i, u in enumerate(user["user_id"].to_pylist())}
    item_row = {m: i for i, m in enumerate(item["item_id"].to_pylist())}
    u = np.array([user_row[x] for x in inter["user_id"].to_pylist()])
    m = np.array([item_row[x] for x in inter["item_id"].to_pylist()])
    years = item["release_year"].to_pylist()
    genres = [(g or "").split() for g in item["class"].to_pylist()]
    rating = pc.cast(inter["rating"], pa.float64()).to_numpy().astype(np.int8)
    zips = [z[:3] if z else None for z in users["zip_code"]]
    return pa.table(
        {
            "row_id": pa.array(np.arange(inter.num_rows, dtype=np.int64)),
            "user_id": inter["user_id"],
            "item_id": inter["item_id"],
            "age": pa.array([users["age"][i] for i in u], pa.string()),
            "gender": pa.array([users["gender"][i] for i in u], pa.string()),
            "occupation": pa.array([users["occupation"][i] for i in u], pa.string()),
            "zip_prefix": pa.array([zips[i] for i in u], pa.string()),
            "release_year": pa.array([years[i] for i in m], pa.string()),
            "genres": pa.array([genres[i] for i in m], pa.list_(pa.string())),
            "rating": pa.array(rating),
            "timestamp": pc.cast(inter["timestamp"], pa.float64()).cast(pa.int64()),
            "label": pa.array((rating >= 4).astype(np.int8)),
        }
    )


def split_indices(
    rows: int, seed: int = DEFAULT_SEED, ratios: tuple[float, ...] = RATIOS
) -> tuple[np.ndarray, ...]:
    """Row indices of each split: a seeded random order cut by ``ratios``, with RecBole's counts
    (``int(ratio * rows)`` for every split after the first, the rest to the first)."""
    order = np.random.default_rng(seed).permutation(rows)
    counts = [int(r * rows) for r in ratios]
    counts[0] = rows - sum(counts[1:])
    return tuple(np.split(order, np.cumsum(counts)[:-1]))


@dataclasses.dataclass(frozen=True, kw_only=True)
class MovieLensSplits:
    """What :func:`write_ml100k_splits` wrote: the folder of each split and its row count."""

    paths: dict[str, str]
    rows: dict[str, int]
    positive_share: dict[str, float]


def write_ml100k_splits(
    out: str,
    *,
    source: str | None = None,
    seed: int = DEFAULT_SEED,
    files: int = 4,
    row_group_rows: int = 5000,
) -> MovieLensSplits:
    """Writes ``out/train``, ``out/validation`` and ``out/test`` (``files`` Parquet files each,
    rows in the split's random order) from the ml-100k files at ``source`` (see
    :func:`find_ml100k`)."""
    table = read_ml100k(source)
    paths, rows, positive = {}, {}, {}
    for name, idx in zip(SPLITS, split_indices(table.num_rows, seed), strict=True):
        part = table.take(pa.array(idx))
        folder = os.path.join(out, name)
        os.makedirs(folder, exist_ok=True)
        for k, chunk in enumerate(np.array_split(np.arange(part.num_rows), files)):
            pq.write_table(
                part.slice(int(chunk[0]), len(chunk)) if len(chunk) else part.slice(0, 0),
                os.path.join(folder, f"part-{k}.parquet"),
                row_group_size=row_group_rows,
            )
        paths[name], rows[name] = folder, part.num_rows
        positive[name] = float(pc.mean(pc.cast(part["label"], pa.float64())).as_py())
    return MovieLensSplits(paths=paths, rows=rows, positive_share=positive)
