"""The import contract (`make lint`, import-linter): capture and client side by side over the
protocol, ops above them, nothing importing the tests. Checked on this tree, and shown to fail
on a copy where a client module imports the capture or the package imports a test helper.
Likewise no make target but the test runners uses the test suite (its commands, dry-run)."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
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
    assert "3 kept, 0 broken" in proc.stdout


@pytest.mark.parametrize(("line", "broken"), [
    ("from hsdump_patch.capture import config", ["capture | client over the protocol"]),
    # The client's stages import the protocol: one importing a command breaks both contracts.
    ("from hsdump_patch.client import extract", ["capture | client over the protocol",
                                                 "the client by stage"]),
    ("import tests.harness", ["the package never imports the test suite"]),
    ("from hsdump_patch.client.output import records", ["the client by stage"]),
], ids=["client-imports-capture", "protocol-imports-client", "package-imports-tests",
        "rows-import-output"])
def test_a_wrong_arrow_breaks_the_lint(tmp_path, line, broken):
    tree = _copy(tmp_path)
    target = "protocol.py" if "client import" in line else "client/rows/mask.py"
    path = tree / "hsdump_patch" / target
    path.write_text(path.read_text() + f"\n{line}  # noqa\n")
    proc = _lint(tree)
    assert proc.returncode != 0, proc.stdout
    verdicts = [x.rstrip() for x in proc.stdout.splitlines() if x.endswith(("KEPT", "BROKEN"))]
    assert len(verdicts) == 3, proc.stdout
    assert [v for v in verdicts if v.endswith("BROKEN")] == [
        next(v for v in verdicts if v.startswith(b)) for b in broken], proc.stdout


# The targets whose job is the test suite (running or linting it).
TEST_TARGETS = {"test", "test-unit", "test-server", "test-image", "test-ansible", "lint"}


# The one exception: the test-only CPU stand-in for sgl_kernel (kept under tests/, never
# shipped), which a CPU variant (make smoke, make verify without a GPU) puts on its server's
# PYTHONPATH; on a GPU machine nothing from tests/ is used.
CPU_SHIM = "tests/harness/cpu_shim"


def _uses_of_tests(commands: str, root: Path) -> list[str]:
    """What in these make commands reaches into tests/: a path under it (but the CPU stand-in),
    or a Python script (run by path) that imports the ``tests`` package."""
    found = [f"command: {line.strip()}" for line in commands.splitlines()
             if re.search(r"(^|[\s=:/])tests/|-m\s+tests\.", line.replace(CPU_SHIM, ""))]
    for script in sorted(set(re.findall(r"(?:^|\s)(scripts/[\w./-]+\.py)", commands))):
        for node in ast.walk(ast.parse((root / script).read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{script} imports {n}" for n in names if n.split(".")[0] == "tests"]
    return found


def test_make_targets_do_not_use_the_tests():
    out = subprocess.run(["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    targets = [line.split()[0] for line in out.splitlines()]
    assert {"smoke", "verify", "image", "disk"} <= set(targets), out
    uses = {}
    for target in sorted(set(targets) - TEST_TARGETS):
        for variables in ([], ["VERIFY_GPU=1"]):  # verify: the CPU and the GPU branch
            dry = subprocess.run(["make", "-n", target, *variables], cwd=ROOT,
                                 capture_output=True, text=True, timeout=60)
            assert dry.returncode == 0, dry.stderr
            if found := _uses_of_tests(dry.stdout, ROOT):
                uses[" ".join([target, *variables])] = found
    assert not uses


def test_a_target_that_reaches_into_the_tests_is_found(tmp_path):
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "run.py").write_text("import os\nfrom tests.harness import x\n")
    (tmp_path / "scripts" / "fine.py").write_text("import testsuite, hsdump_patch.ops\n")
    commands = (".venv/bin/python scripts/run.py --work .cache/x\n"
                "PYTHONPATH=/repo/tests/harness/cpu_shim python -m hsdump_patch.cli verify\n"
                "PYTHONPATH=/repo/tests/harness python -m hsdump_patch.cli smoke\n"
                ".venv/bin/python scripts/fine.py --out tests.json\n"
                "python -m tests.harness.make_models out\n")
    assert _uses_of_tests(commands, tmp_path) == [
        "command: PYTHONPATH=/repo/tests/harness python -m hsdump_patch.cli smoke",
        "command: python -m tests.harness.make_models out",
        "scripts/run.py imports tests.harness"]
