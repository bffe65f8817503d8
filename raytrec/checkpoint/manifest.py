"""What a checkpoint holds, as one JSON document written last: the manifest.

The manifest names the model the checkpoint was made for (its
:class:`ModelSignature`: tables with their sizes, optimizer kinds, dense
parameter shapes), the layout it was written from (gang size, number of
gangs, sharding type, each table's shards), the step and generation, every
data file with its size, and the caller's JSON ``extra`` (data position and
accounting). Loading reads it before anything else: a checkpoint for another
model is refused by :func:`check_compatible` with every difference named,
before a single tensor is read. Gang size, number of gangs and sharding type
may differ between save and load; that is resharding, not a mismatch.

Pure code: no files, no torch.distributed.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

from raytrec.checkpoint.errors import CheckpointError
from raytrec.config import TrainConfig

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "Manifest",
    "ModelSignature",
    "TableShard",
    "TableSpec",
    "check_compatible",
    "mismatches",
    "signature_for",
]

FORMAT = "raytrec-checkpoint"
FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class TableShard:
    """One shard of a table as it was laid out when saved (global offsets and sizes)."""

    row_offset: int
    col_offset: int
    rows: int
    cols: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class TableSpec:
    """One embedding table; ``shards`` describes the saved layout (empty when not known)."""

    name: str
    num_embeddings: int
    embedding_dim: int
    shards: tuple[TableShard, ...] = ()

    def column_shards(self) -> list[tuple[int, int]]:
        """``(column offset, width)`` of each column block, left to right."""
        return sorted({(s.col_offset, s.cols) for s in self.shards})


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSignature:
    """What must be equal between the saved model and the model that loads it."""

    arch: str
    tables: tuple[TableSpec, ...]
    embedding_optimizer: str
    dense_optimizer: str
    dense_params: Mapping[str, tuple[int, ...]]

    def table(self, name: str) -> TableSpec:
        for t in self.tables:
            if t.name == name:
                return t
        raise KeyError(name)


def signature_for(
    config: TrainConfig,
    dense_params: Mapping[str, Sequence[int]],
    shards: Mapping[str, Sequence[TableShard]] | None = None,
) -> ModelSignature:
    """The signature of the model ``config`` builds, with its dense parameter shapes."""
    shards = shards or {}
    return ModelSignature(
        arch=config.model.arch,
        tables=tuple(
            TableSpec(
                name=t.name,
                num_embeddings=t.num_embeddings,
                embedding_dim=t.embedding_dim,
                shards=tuple(shards.get(t.name, ())),
            )
            for t in config.model.tables
        ),
        embedding_optimizer=config.optimizer.embedding,
        dense_optimizer=config.optimizer.dense,
        dense_params={name: tuple(shape) for name, shape in dense_params.items()},
    )


def mismatches(saved: ModelSignature, expected: ModelSignature) -> list[str]:
    """Every difference between a saved signature and this model's, one line each."""
    out: list[str] = []
    if saved.arch != expected.arch:
        out.append(f"model arch: saved {saved.arch!r}, expected {expected.arch!r}")
    for field in ("embedding_optimizer", "dense_optimizer"):
        a, b = getattr(saved, field), getattr(expected, field)
        if a != b:
            out.append(f"{field.replace('_', ' ')}: saved {a!r}, expected {b!r}")
    saved_tables = {t.name: t for t in saved.tables}
    for t in expected.tables:
        s = saved_tables.get(t.name)
        if s is None:
            out.append(f"table {t.name!r}: in this model but missing from the checkpoint")
            continue
        for field in ("num_embeddings", "embedding_dim"):
            a, b = getattr(s, field), getattr(t, field)
            if a != b:
                out.append(f"table {t.name!r} {field}: saved {a}, expected {b}")
    names = {t.name for t in expected.tables}
    out += [
        f"table {name!r}: in the checkpoint but not in this model"
        for name in saved_tables
        if name not in names
    ]
    for name, shape in expected.dense_params.items():
        if name not in saved.dense_params:
            out.append(f"dense parameter {name!r}: in this model but missing from the checkpoint")
        elif tuple(saved.dense_params[name]) != tuple(shape):
            out.append(
                f"dense parameter {name!r} shape: saved {list(saved.dense_params[name])}, "
                f"expected {list(shape)}"
            )
    out += [
        f"dense parameter {name!r}: in the checkpoint but not in this model"
        for name in saved.dense_params
        if name not in expected.dense_params
    ]
    return out


def check_compatible(saved: ModelSignature, expected: ModelSignature, *, where: str) -> None:
    """Raises :class:`CheckpointError` listing every mismatch, if there is any."""
    found = mismatches(saved, expected)
    if found:
        raise CheckpointError(f"checkpoint {where} does not fit this model: {'; '.join(found)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Manifest:
    """The manifest of one checkpoint."""

    step: int
    generation: int
    gang_size: int
    num_gangs: int
    sharding_type: str
    signature: ModelSignature
    files: Mapping[str, int]  # data file (relative path) -> size in bytes
    extra: Mapping[str, Any]
    created_unix: float
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        sig = self.signature
        doc = {
            "format": FORMAT,
            "format_version": self.format_version,
            "step": self.step,
            "generation": self.generation,
            "created_unix": self.created_unix,
            "gang_size": self.gang_size,
            "num_gangs": self.num_gangs,
            "sharding_type": self.sharding_type,
            "model_arch": sig.arch,
            "embedding_optimizer": sig.embedding_optimizer,
            "dense_optimizer": sig.dense_optimizer,
            "tables": [
                {
                    "name": t.name,
                    "num_embeddings": t.num_embeddings,
                    "embedding_dim": t.embedding_dim,
                    "shards": [[s.row_offset, s.col_offset, s.rows, s.cols] for s in t.shards],
                }
                for t in sig.tables
            ],
            "dense_params": {name: list(shape) for name, shape in sig.dense_params.items()},
            "files": dict(self.files),
            "extra": self.extra,
        }
        return json.dumps(doc, indent=1, sort_keys=False)

    @staticmethod
    def from_json(text: str | bytes, *, where: str) -> Manifest:
        """Parses a manifest; anything malformed is a :class:`CheckpointError` naming ``where``."""
        try:
            doc = json.loads(text)
        except (ValueError, UnicodeDecodeError) as e:
            raise CheckpointError(
                f"checkpoint {where} is corrupt: its manifest is not valid JSON ({e})"
            ) from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise CheckpointError(
                f"checkpoint {where} is corrupt: its manifest is not a {FORMAT} manifest"
            )
        version = doc.get("format_version")
        if version != FORMAT_VERSION:
            raise CheckpointError(
                f"checkpoint {where} has format_version {version!r}; this raytrec reads "
                f"format_version {FORMAT_VERSION}"
            )
        try:
            signature = ModelSignature(
                arch=str(doc["model_arch"]),
                tables=tuple(
                    TableSpec(
                        name=str(t["name"]),
                        num_embeddings=int(t["num_embeddings"]),
                        embedding_dim=int(t["embedding_dim"]),
                        shards=tuple(
                            TableShard(row_offset=r0, col_offset=c0, rows=nr, cols=nc)
                            for r0, c0, nr, nc in t["shards"]
                        ),
                    )
                    for t in doc["tables"]
                ),
                embedding_optimizer=str(doc["embedding_optimizer"]),
                dense_optimizer=str(doc["dense_optimizer"]),
                dense_params={
                    str(k): tuple(int(x) for x in v) for k, v in doc["dense_params"].items()
                },
            )
            return Manifest(
                step=int(doc["step"]),
                generation=int(doc["generation"]),
                gang_size=int(doc["gang_size"]),
                num_gangs=int(doc["num_gangs"]),
                sharding_type=str(doc["sharding_type"]),
                signature=signature,
                files={str(k): int(v) for k, v in doc["files"].items()},
                extra=dict(doc["extra"]),
                created_unix=float(doc["created_unix"]),
                format_version=int(version),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CheckpointError(
                f"checkpoint {where} is corrupt: its manifest lacks or mistypes a field "
                f"({type(e).__name__}: {e})"
            ) from None
