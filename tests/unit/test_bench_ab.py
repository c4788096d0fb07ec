"""scripts/bench_ab.py on tiny input: both trees run every benchmark (each importing its own
``hsdump_patch``), and the table, the sweep and the verdicts are printed.

Not a timed test: it checks that everything was measured, not how fast.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_ab_compares_two_trees(tmp_path: Path) -> None:
    base = tmp_path / "base"  # another tree: a copy of the package alone
    shutil.copytree(ROOT / "hsdump_patch", base / "hsdump_patch",
                    ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "ab.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_ab.py"), "--baseline-tree", str(base),
         "--rounds", "1", "--corpus", "2", "--sweep", "4,8", "--tokens-per-message", "40",
         "--repeats", "1", "--chat", "4", "--client-gb", "0.0005", "--client-tokens",
         "64,128", "--concurrency", "2", "--dump-root", str(tmp_path), "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    result = json.loads(out.read_text())
    trees = {name: [r[k]["tree"] for r in runs for k in ("render", "client")]
             for name, runs in result["runs"].items()}
    assert trees == {"baseline": [str(base)] * 2, "current": [str(ROOT)] * 2}
    whats = [row["what"] for row in result["rows"]]
    assert whats == [f"render corpus, --multi-turn {p}: rows/s" for p in
                     ("auto", "per-turn", "last")] + [
        f"extraction, rendering included (auto, eagle3): {u}" for u in ("samples/s", "tokens/s")]
    for row in result["rows"]:
        assert len(row["baseline"]) == len(row["current"]) == 1 and row["ratio"] > 0, row
        assert any(line.startswith(f"| {row['what']} |") for line in lines), row
    for name in ("baseline", "current"):
        sweep = result["sweep"][name]
        assert [p["messages"] for p in sweep["points"]] == [4, 8]
        assert set(sweep["ratio"]) == {"one render + encode", "auto", "per-turn", "last"}
        client = result["runs"][name][0]["client"]
        assert client["chat"] == {"rows": client["samples"], "messages": 4,
                                  "multi_turn": "auto"}
    assert any(line.startswith("| longest / shortest |") for line in lines)
    assert any(line.startswith("within 10%") for line in lines)
    assert any(line.startswith("linear in turns") for line in lines)
    assert not list(tmp_path.glob("hsdump-ab-*"))  # dump dirs removed
