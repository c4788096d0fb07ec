"""What every append-only JSONL output shares: one writer at a time, and no torn last line."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO


def exclusive_lock(path: Path, busy: str) -> IO[str]:
    """Hold an exclusive lock on ``path`` until the returned file is closed.

    ``busy`` says what the process already holding it is doing, for the error raised then.
    """
    f = open(path, "a")  # noqa: SIM115 - the caller holds it until its close()
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise RuntimeError(f"{busy} (it holds {path}); wait for it or stop it") from None
    return f


def truncate_torn_line(path: Path) -> None:
    """Cut off a last line that a crash left half-written (no newline), durably."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return
    if data and not data.endswith(b"\n"):
        with open(path, "r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)
            os.fsync(f.fileno())
