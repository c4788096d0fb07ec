"""Reading hsdump training records: needs only torch (no client extras, no server).

>>> from hsdump_patch.reader import iter_records, load_record
>>> rec = load_record("out/sample-1.pt")                 # one record
>>> for sample_id, rec in iter_records("out"): ...       # every finished record of a run

Records hold tensors only, so they load with ``torch.load(..., weights_only=True)`` (no pickled
code runs); ``.gz`` files (``--compress``) are gunzipped in memory first.
"""

from __future__ import annotations

import gzip
import io
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

MANIFEST_GLOB = "manifest.*.jsonl"


def load_record(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load one record (``.pt``, ``.ckpt`` or ``.ckpt.gz``) safely: ``weights_only=True``."""
    path = Path(path)
    if path.suffix == ".gz":
        with gzip.open(path, "rb") as f:
            return torch.load(io.BytesIO(f.read()), weights_only=True)
    return torch.load(path, weights_only=True, mmap=True)


def manifest_entries(out_dir: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Every complete manifest line of an output directory (all shards): id, file, tokens, ..."""
    for path in sorted(Path(out_dir).glob(MANIFEST_GLOB)):
        with open(path, "rb") as f:
            for raw in f:
                if not raw.endswith(b"\n"):  # a line cut by a crash: that sample was redone
                    break
                yield json.loads(raw)


def iter_records(out_dir: str | os.PathLike[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(sample id, record)`` for every finished sample of an output directory."""
    seen: set[str] = set()
    for entry in manifest_entries(out_dir):
        path = Path(out_dir) / entry["file"]
        if entry["id"] in seen or not path.is_file():
            continue
        seen.add(entry["id"])
        yield entry["id"], load_record(path)
