"""The suite's layout (docs/testing.md): every test file in one lane directory, each lane a
registered marker and a make target, no test importing another test file or a conftest, and
the check counter (scripts/count_asserts.py) counting what it says."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LANES = ("unit", "server", "image", "ansible")


def imports_of_tests(root: Path) -> list[str]:
    """Imports, anywhere under ``root``/tests, of a test module or a conftest."""
    found = []
    for path in sorted((root / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.relative_to(root)} imports {n}" for n in names
                      if n.split(".")[0] == "tests"
                      and re.search(r"\.(test_\w+|conftest)$", n)]
    return found


def test_every_test_file_is_in_a_lane_and_imports_no_other():
    stray = [p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").rglob("test_*.py")
             if p.parent.parent != ROOT / "tests" or p.parent.name not in LANES]
    assert stray == []
    assert imports_of_tests(ROOT) == []


def test_a_test_importing_another_is_found(tmp_path):
    (tmp_path / "tests" / "server").mkdir(parents=True)
    (tmp_path / "tests" / "server" / "test_a.py").write_text(
        "from tests.unit.test_b import helper\nimport tests.conftest\n"
        "from tests.harness.rows import CONV\nimport tests.harness.needs\n")
    assert imports_of_tests(tmp_path) == [
        "tests/server/test_a.py imports tests.unit.test_b",
        "tests/server/test_a.py imports tests.conftest"]


def test_each_lane_is_a_marker_and_a_make_target():
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert sorted(m.split(":")[0] for m in conf["markers"]) == sorted(LANES)
    help_text = subprocess.run(["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True,
                               check=True).stdout
    targets = {line.split()[0] for line in help_text.splitlines()}
    assert {f"test-{lane}" for lane in LANES} <= targets
    # make test runs every lane: each lane directory is named in its recipe.
    dry = subprocess.run(["make", "-n", "-o", ".venv/.hsdump-installed", "test"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60).stdout
    assert all(f"tests/{lane}" in dry for lane in LANES), dry
    # ... and each test file in exactly one of its pytest processes.
    runs = [line.split(" -m pytest ", 1)[1].split() for line in dry.splitlines()
            if " -m pytest " in line]
    assert len(runs) == 2, dry
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        rel = path.relative_to(ROOT).as_posix()
        in_runs = [run for run in runs
                   if any(rel == a or rel.startswith(f"{a}/") for a in run if a.startswith("tests"))
                   and f"--ignore={rel}" not in run]
        assert len(in_runs) == 1, (rel, runs)


def test_the_check_counter_counts_asserts_and_raises():
    spec = importlib.util.spec_from_file_location("count_asserts",
                                                  ROOT / "scripts" / "count_asserts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    source = ("import pytest\ndef test_x():\n    assert 1\n    with pytest.raises(ValueError):\n"
              "        int('x')\n    assert_helper()\n    raises(ValueError)\n")
    assert module.count(source) == 2
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "count_asserts.py")], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert int(out.split()[0]) >= 1100  # the count at ddc386e, before the lanes


def test_every_script_imports(monkeypatch):
    """The scripts import what they use from where it now lives (a bench that imports a moved
    test helper fails here, not on the next person who runs it). Imported as they run: with
    scripts/ first on the path."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    failed = {}
    for path in sorted((ROOT / "scripts").glob("*.py")):
        try:
            importlib.import_module(path.stem)
        except Exception as e:
            failed[path.name] = f"{type(e).__name__}: {e}"
    assert failed == {}


def bare_word_checks(root: Path) -> list[str]:
    """``"hsdump" in`` / ``not in`` tests in the test sources (tests/**/*.py): a server log holds
    the bare word in any path of a checkout named hsdump, so such a check of a log fails (or
    passes vacuously) in that checkout; check for what the plugin itself logs instead
    (tests/harness/dump_server.py: ``plugin_log_lines``)."""
    found = []
    for path in sorted((root / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant)
                    and node.left.value == "hsdump"
                    and any(isinstance(op, ast.In | ast.NotIn) for op in node.ops)):
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_no_test_looks_for_the_bare_word_hsdump():
    assert bare_word_checks(ROOT) == []


def test_a_bare_word_check_is_found(tmp_path):
    (tmp_path / "tests" / "server").mkdir(parents=True)
    (tmp_path / "tests" / "server" / "test_a.py").write_text(
        'def test_x(s):\n    assert "hsdump" not in s.log().replace("hsdump-x", "")\n'
        "    assert 'hsdump' in s.log()\n    assert \"hsdump: \" not in s.log()\n")
    assert bare_word_checks(tmp_path) == ["tests/server/test_a.py:2", "tests/server/test_a.py:3"]


def plugin_log_messages(root: Path) -> list[str]:
    """The leading literal text of every logging call in the capture package (the plugin)."""
    levels = {"debug", "info", "warning", "error", "exception", "critical"}
    found = []
    for path in sorted((root / "hsdump_patch" / "capture").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            if (isinstance(f, ast.Attribute) and f.attr in levels and isinstance(f.value, ast.Name)
                    and f.value.id == "logger") or (isinstance(f, ast.Name) and f.id == "log"):
                first = node.args[0]
                if isinstance(first, ast.JoinedStr):
                    first = first.values[0]
                found.append(first.value if isinstance(first, ast.Constant) else
                             f"{path.name}:{node.lineno}: not a literal")
    return found


def test_the_plugin_log_pattern_matches_every_message_of_the_plugin():
    """What the server lane looks for in a log (``PLUGIN_LOG``) is each message the capture
    logs, and not a checkout's path nor a dump-like rid."""
    from tests.harness.dump_server import PLUGIN_LOG, plugin_log_lines

    messages = plugin_log_messages(ROOT)
    assert len(messages) >= 20
    assert [m for m in messages if not PLUGIN_LOG.match(m)] == []
    log = ("/src/hsdump/.venv/lib/python3.11/site-packages/sglang/launch_server.py:71: "
           "UserWarning: x\n[2026-01-01 00:00:00] rid=hsdump-x /tmp/hsdump: done\n"
           "[2026-01-01 00:00:00 TP0] hsdump: capturing the residual stream\n")
    assert plugin_log_lines(log) == ["[2026-01-01 00:00:00 TP0] hsdump: capturing the residual "
                                     "stream"]


def test_each_lane_target_sets_up_what_its_tests_use():
    """A lane run alone on a fresh clone has what its tests need: the system packages
    (``prereqs``: Docker for the server lane's bridge tests, the image and Ansible lanes) and
    SpecForge's code (the server lane's trainer tests, the Ansible lane's online test)."""
    rules = dict(line.split(":", 1) for line in (ROOT / "Makefile").read_text().splitlines()
                 if re.match(r"test-\w+:", line))
    needs = {"unit": set(), "server": {"prereqs", "$(SPECFORGE_DIR)"}, "image": {"prereqs"},
             "ansible": {"prereqs", "$(SPECFORGE_DIR)"}}
    for lane, want in needs.items():
        prerequisites = set(rules[f"test-{lane}"].split("##")[0].split())
        assert want | {"$(STAMP)"} <= prerequisites, lane
