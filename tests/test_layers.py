"""The import contract (`make lint`, import-linter): capture and client side by side over the
protocol, ops above them, nothing importing the tests. Checked on this tree, and shown to fail
on a copy where a client module imports the capture or the package imports a test helper."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).parent / "lint-imports"


def _lint(tree: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT), "--config", str(tree / "pyproject.toml"), "--no-cache"],
                          capture_output=True, text=True, cwd=tree, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tree)})


def _copy(tmp_path: Path) -> Path:
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "hsdump_patch", tree / "hsdump_patch",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")
    (tree / "tests").mkdir()
    (tree / "tests" / "__init__.py").write_text("")
    (tree / "tests" / "harness.py").write_text("")
    return tree


def test_the_tree_keeps_the_contracts():
    proc = _lint(ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 kept, 0 broken" in proc.stdout


@pytest.mark.parametrize(("line", "broken"), [
    ("from hsdump_patch.capture import config", "capture | client over the protocol"),
    ("from hsdump_patch.client import extract", "capture | client over the protocol"),
    ("import tests.harness", "the package never imports the test suite"),
], ids=["client-imports-capture", "protocol-imports-client", "package-imports-tests"])
def test_a_wrong_arrow_breaks_the_lint(tmp_path, line, broken):
    tree = _copy(tmp_path)
    target = "protocol.py" if "client import" in line else "client/mask.py"
    path = tree / "hsdump_patch" / target
    path.write_text(path.read_text() + f"\n{line}  # noqa\n")
    proc = _lint(tree)
    assert proc.returncode != 0, proc.stdout
    verdicts = [x.rstrip() for x in proc.stdout.splitlines() if x.endswith(("KEPT", "BROKEN"))]
    assert [v for v in verdicts if v.endswith("BROKEN")] == [
        next(v for v in verdicts if v.startswith(broken))], proc.stdout
