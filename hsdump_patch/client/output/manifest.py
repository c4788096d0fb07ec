"""Resume state of an output directory: the manifest of finished samples, the shard lock and
the clean-up of temp files left by a killed run.

A record is written (temp + rename) before its manifest line is appended, so after a crash a
sample is either listed with its record present, or redone (its record, if any, is replaced
atomically): every sample ends up written exactly once, and no partial file survives.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from hsdump_patch.client.output.jsonl import exclusive_lock, truncate_torn_line
from hsdump_patch.client.rows.dataset import Shard
from hsdump_patch.reader import manifest_entries


def manifest_path(out_dir: Path, shard: Shard) -> Path:
    return out_dir / f"manifest.{shard.tag}.jsonl"


def load_done(out_dir: Path) -> dict[str, dict[str, Any]]:
    """Return ``id -> entry`` for every finished sample whose record exists (all shards)."""
    return {e["id"]: e for e in manifest_entries(out_dir) if (out_dir / e["file"]).is_file()}


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
