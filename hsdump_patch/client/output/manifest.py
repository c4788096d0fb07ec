"""Resume state of an output directory: the manifest of finished samples, the shard lock and
the clean-up of temp files left by a killed run.

A record is written (temp + rename) before its manifest line is appended, so after a crash a
sample is either listed with its record present, or redone (its record, if any, is replaced
atomically): every sample ends up written exactly once, and no partial file survives.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from hsdump_patch.client.output.jsonl import exclusive_lock, truncate_torn_line
from hsdump_patch.client.rows.dataset import RowRef, Sample, Shard
from hsdump_patch.reader import manifest_entries


def manifest_path(out_dir: Path, shard: Shard) -> Path:
    return out_dir / f"manifest.{shard.tag}.jsonl"


def load_done(out_dir: Path) -> dict[str, dict[str, Any]]:
    """Return ``id -> entry`` for every finished sample whose record exists (all shards)."""
    return {e["id"]: e for e in manifest_entries(out_dir) if (out_dir / e["file"]).is_file()}


CHANGED = ("changed since its record was written (its bytes, or what renders it: tokenizer, chat "
           "template, --chat-template-kwargs, --multi-turn, --reasoning-parser, --max-len); use a "
           "new --out directory, or delete its record and rerun")


def entry(sample: Sample, render_key: str, **fields: Any) -> dict[str, Any]:
    """A manifest line for a finished sample: ``fields`` and the keys a resumed run checks."""
    row = sample.row
    return {**fields, "id": sample.id, "digest": sample.digest,
            "row": row.id if row else sample.id, "row_key": row.key(render_key) if row else None,
            "row_samples": sample.row_samples}


def plan_resume(dataset: Path, rows: list[RowRef], done: dict[str, dict[str, Any]],
                render_key: str) -> tuple[list[RowRef], int]:
    """The rows that still have a sample to extract, and how many samples are done.

    A row is finished when the manifest holds all its samples under its current key (a digest
    of its bytes and the render settings): nothing is read or rendered again. A row whose key
    differs raises ValueError. Rows with some samples done are returned, as are rows of a
    manifest written before row keys existed; their done samples are checked and skipped as
    they are rendered (:func:`skip_done`).
    """
    by_row: dict[str, list[dict[str, Any]]] = {}
    for e in done.values():
        if e.get("row_key"):
            by_row.setdefault(e["row"], []).append(e)
    todo, finished = [], 0
    for r in rows:
        entries = by_row.get(r.id, [])
        if any(e["row_key"] != r.key(render_key) for e in entries):
            raise ValueError(f"{dataset}:{r.line}: row {r.id!r} {CHANGED}")
        if entries and len(entries) >= entries[0]["row_samples"]:
            finished += len(entries)
        else:
            todo.append(r)
    return todo, finished


def skip_done(items: Iterable[Any], done: dict[str, dict[str, Any]],
              skipped: Callable[[], None]) -> Iterator[Any]:
    """Pass ``items`` (samples, errors) on, leaving out the samples already done (calling
    ``skipped`` for each); a done sample whose tokens or mask differ raises ValueError."""
    for item in items:
        if isinstance(item, Sample) and item.id in done:
            if item.digest != done[item.id].get("digest"):
                raise ValueError(f"{item.where}: sample {item.id!r} {CHANGED}")
            skipped()
            continue
        yield item


class Manifest:
    """Append-only list of this shard's finished samples; holds the shard's lock while open."""

    def __init__(self, out_dir: Path, shard: Shard) -> None:
        self.path = manifest_path(out_dir, shard)
        self._lock = exclusive_lock(
            out_dir / f".lock.{shard.tag}",
            f"another hsdump process is already extracting shard {shard} into {out_dir}")
        truncate_torn_line(self.path)
        self._f = open(self.path, "a")  # noqa: SIM115 - closed in close()

    def append(self, entry: dict[str, Any]) -> None:
        """Record one finished sample (flushed to the OS at once, so kill -9 keeps it)."""
        self._f.write(json.dumps(entry, sort_keys=True) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()
        self._lock.close()

    def __enter__(self) -> Manifest:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def remove_stale_temps(out_dir: Path, record_names: set[str]) -> int:
    """Delete temp files a killed run left for these records (paths relative to ``out_dir``,
    as :func:`~hsdump_patch.client.records.record_name` gives them); return how many."""
    by_dir: dict[Path, set[str]] = {}
    for rel in record_names:
        by_dir.setdefault(out_dir / Path(rel).parent, set()).add(Path(rel).name)
    removed = 0
    for directory, names in by_dir.items():
        try:
            entries = os.listdir(directory)
        except FileNotFoundError:
            continue
        for name in entries:
            if name.startswith(".") and ".tmp-" in name and \
                    name[1 : name.rindex(".tmp-")] in names:
                (directory / name).unlink(missing_ok=True)
                removed += 1
    return removed
