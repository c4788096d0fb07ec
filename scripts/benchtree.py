"""``--tree PATH`` for the benchmarks: import ``hsdump_patch`` from another checkout.

A benchmark script calls :func:`select` before it imports ``hsdump_patch``; with ``--tree PATH``
in its arguments (e.g. a ``git worktree`` of an older commit) the same workload then runs
against that tree's code, which is how ``scripts/bench_ab.py`` compares two commits in one
session. Without it the script's own checkout is used.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_selected: Path | None = None


def select(argv: list[str] | None = None) -> Path:
    """Put the tree of ``--tree PATH`` in ``argv`` (default ``sys.argv``; without it this
    checkout) first on ``sys.path``; return it. Idempotent."""
    global _selected
    if _selected is not None:
        return _selected
    args = sys.argv[1:] if argv is None else argv
    tree = ROOT
    for i, arg in enumerate(args):
        if arg == "--tree" and i + 1 < len(args):
            tree = Path(args[i + 1])
        elif arg.startswith("--tree="):
            tree = Path(arg.split("=", 1)[1])
    tree = tree.resolve()
    if not (tree / "hsdump_patch" / "__init__.py").is_file():
        raise SystemExit(f"--tree {tree}: no hsdump_patch package there")
    sys.path.insert(0, str(tree))
    _selected = tree
    return tree


def add_argument(parser: argparse.ArgumentParser) -> None:
    """The ``--tree`` flag (read by :func:`select` before argument parsing)."""
    parser.add_argument("--tree", type=Path, default=ROOT,
                        help="import hsdump_patch from this checkout, e.g. a git worktree of "
                             "an older commit (default: the script's own checkout)")


def imported_from() -> str:
    """The directory ``hsdump_patch`` was imported from (to check a run used its tree)."""
    import hsdump_patch

    return str(Path(hsdump_patch.__file__).resolve().parents[1])
