"""What data a run read, cheaply: recorded in every checkpoint, compared when a job resumes.

A resume continues the saved job's data position (which batch of which file each stream reads
next), which means something only on the same data. :func:`data_fingerprint` describes the data
of a source without reading it: for Parquet, each input file's path, size and modification time
(one listing, no file contents); for the synthetic source, its generator's settings. The
checkpoint's manifest keeps it (``extra["data"]``), and :func:`data_changes` names every file
added, removed or changed since, so a resume onto other data is refused before any rank starts
(:func:`raytrec.preflight.check_same_data`).

A source of the caller's own (``fit(source=...)`` of another type) has no fingerprint, and a
checkpoint saved without one (an older raytrec) is not checked.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from raytrec.data.source import BatchSource

__all__ = ["changes_line", "data_changes", "data_fingerprint"]

#: Changes named in full in a refusal; more are counted.
_SHOWN = 5


def data_fingerprint(source: BatchSource) -> dict[str, Any] | None:
    """The JSON fingerprint of ``source``'s data (module doc), or None for a source of another
    type than :class:`~raytrec.data.parquet.ParquetSource` and
    :class:`~raytrec.data.synthetic.SyntheticCriteo`."""
    from raytrec.data.parquet import ParquetSource
    from raytrec.data.synthetic import SyntheticCriteo

    if isinstance(source, SyntheticCriteo):
        settings = dataclasses.asdict(source)
        return {"kind": "synthetic", "settings": _json(settings)}
    if isinstance(source, ParquetSource):
        fs, files = source.list_files()
        infos = fs.get_file_info(files)
        return {
            "kind": "parquet",
            "files": [
                {"path": i.path, "size": i.size, "mtime_ns": i.mtime_ns}
                for i in sorted(infos, key=lambda i: i.path)
            ],
        }
    return None


def data_changes(
    saved: Mapping[str, Any], current: Mapping[str, Any] | None, *, growing: bool = False
) -> list[str]:
    """What differs between the ``saved`` fingerprint and the ``current`` one, one phrase each
    (empty: the same data). ``growing``: files may have been added (``data.growing``)."""
    if current is None:
        return [f"the checkpoint's job read {saved.get('kind')} data; this job's source has none"]
    if saved.get("kind") != current.get("kind"):
        return [f"data source: saved {saved.get('kind')!r}, now {current.get('kind')!r}"]
    if saved["kind"] == "synthetic":
        a, b = saved["settings"], current["settings"]
        return [
            f"synthetic data setting {k}: saved {a.get(k)!r}, now {b.get(k)!r}"
            for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k)
        ]
    before = {f["path"]: f for f in saved["files"]}
    after = {f["path"]: f for f in current["files"]}
    out = [f"file removed: {p}" for p in before if p not in after]
    out += [f"file added: {p}" for p in after if p not in before and not growing]
    for path in before.keys() & after.keys():
        a, b = before[path], after[path]
        if a["size"] != b["size"]:
            out.append(f"file changed: {path} (size {a['size']} bytes, now {b['size']})")
        elif a["mtime_ns"] != b["mtime_ns"]:
            out.append(f"file changed: {path} (modified since the checkpoint's job read it)")
    return sorted(out, key=lambda line: line.split(": ", 1)[1])


def changes_line(changes: list[str]) -> str:
    """``changes`` as one line: the first few, and how many more."""
    shown = "; ".join(changes[:_SHOWN])
    more = len(changes) - _SHOWN
    return shown + (f"; and {more} more" if more > 0 else "")


def _json(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_json(v) for v in value]
    if isinstance(value, dict):
        return {k: _json(v) for k, v in value.items()}
    return value
