"""A JSONL output written exactly once per row id, surviving ``kill -9`` at any point.

Finished rows are appended to ``OUT.part`` (one ``write`` per line, flushed and fsynced). On
start the part file is truncated after its last complete line, and the ids in ``OUT`` and
``OUT.part`` are the rows already done. :meth:`RowLog.assemble` writes every done row once, in
dataset order, to a temp file, fsyncs it, renames it onto ``OUT`` and only then deletes the part
file; a crash between the two leaves rows in both, which the next start reads once (by id).
A lock file refuses a second process on the same ``OUT``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hsdump_patch import protocol
from hsdump_patch.client.output.jsonl import exclusive_lock, truncate_torn_line


def _scan(path: Path) -> list[tuple[str, int, int]]:
    """``(id, offset, length)`` of each complete line."""
    entries: list[tuple[str, int, int]] = []
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below
    except FileNotFoundError:
        return entries
    with f:
        offset = 0
        for raw in f:
            if not raw.endswith(b"\n"):
                break
            entries.append((str(json.loads(raw)["id"]), offset, len(raw)))
            offset += len(raw)
    return entries


class RowLog:
    """The done rows of one output file, and the append-only log of new ones."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.part = out.with_name(out.name + ".part")
        out.parent.mkdir(parents=True, exist_ok=True)
        self._lock = exclusive_lock(out.with_name(f".{out.name}.lock"),
                                    f"another hsdump process is writing {out}")
        for stale in out.parent.glob(f".{out.name}.tmp-*"):  # an assembly killed midway
            stale.unlink()
        # id -> (file, offset, length) of the line holding that row; OUT wins over OUT.part
        self.done: dict[str, tuple[Path, int, int]] = {}
        truncate_torn_line(self.part)  # a crash mid-append
        for path in (out, self.part):
            for row_id, offset, length in _scan(path):
                self.done.setdefault(row_id, (path, offset, length))
        self._f = open(self.part, "ab")  # noqa: SIM115 - closed in close()

    def append(self, row: dict[str, Any]) -> None:
        """Record one finished row durably (a single write, flushed and fsynced)."""
        raw = (json.dumps(row, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
        offset = self._f.tell()
        self._f.write(raw)
        self._f.flush()
        os.fsync(self._f.fileno())
        self.done.setdefault(str(row["id"]), (self.part, offset, len(raw)))

    def assemble(self, order: Iterable[str]) -> int:
        """Write every done row once to ``OUT``: ids of ``order`` first, in that order, then
        any others (rows of an earlier run no longer in the dataset); return the row count."""
        order = [i for i in dict.fromkeys(order) if i in self.done]
        listed = set(order)
        ids = order + [i for i in self.done if i not in listed]
        sources = {p: open(p, "rb") for p in {self.done[i][0] for i in ids}}  # noqa: SIM115
        new: dict[str, tuple[Path, int, int]] = {}
        try:
            with protocol.atomic_file(self.out, mode=protocol.PUBLIC_FILE_MODE,
                                      fsync_dir=True) as f:
                for i in ids:
                    path, offset, length = self.done[i]
                    src = sources[path]
                    src.seek(offset)
                    new[i] = (self.out, f.tell(), length)
                    f.write(src.read(length))
        finally:
            for src in sources.values():
                src.close()
        self._f.close()
        self.part.unlink(missing_ok=True)
        self._f = open(self.part, "ab")  # noqa: SIM115 - closed in close()
        self.done = new
        return len(ids)

    def close(self) -> None:
        self._f.close()
        if self.part.exists() and self.part.stat().st_size == 0:
            self.part.unlink()
        self._lock.close()

    def __enter__(self) -> RowLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
