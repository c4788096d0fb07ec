"""Count the checks of the test suite: ``assert`` statements and ``pytest.raises`` calls in every
Python file under tests/, per file and in all, in the work tree or at a git revision.

    python scripts/count_asserts.py [--rev REV] [--per-file]

A renovation of the suite compares the totals before and after (docs/testing.md).
"""

from __future__ import annotations

import argparse
import ast
import subprocess
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def is_check(node: ast.AST) -> bool:
    """An ``assert`` statement or a ``pytest.raises(...)`` call."""
    return isinstance(node, ast.Assert) or (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        and node.func.attr == "raises" and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "pytest")


def count(source: str) -> int:
    """The checks (``is_check``) in one Python source."""
    return sum(map(is_check, ast.walk(ast.parse(source))))


def sources(rev: str | None) -> Iterator[tuple[str, str]]:
    """(path, source) of every tests/**/*.py, in the work tree or at ``rev``."""
    if rev is None:
        for path in sorted((ROOT / "tests").rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), path.read_text()
        return
    names = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, "tests/"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    for name in sorted(n for n in names if n.endswith(".py")):
        yield name, subprocess.run(["git", "show", f"{rev}:{name}"], cwd=ROOT,
                                   capture_output=True, text=True, check=True).stdout


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", default=None,
                    help="git revision to count at (default: none, the work tree)")
    ap.add_argument("--per-file", action="store_true",
                    help="print each file's count too (default: off, the total only)")
    args = ap.parse_args(argv)
    total = 0
    for path, source in sources(args.rev):
        n = count(source)
        total += n
        if args.per_file and n:
            print(f"{n:5d}  {path}")
    print(f"{total:5d}  total ({args.rev or 'work tree'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
