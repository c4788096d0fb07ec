"""``make judge``'s tiny version: the whole loop (SmolLM2 from its PyPI wheel, a CPU SGLang
server with the plugin, ``hsdump regenerate`` / ``extract`` / ``specforge``, SpecForge 0.2.0's
own trainer and evaluator) runs end to end, and the drafter it trains beats the untrained one on
the held-out records. The verdict numbers of the full run live in docs/PERFORMANCE.md, not here.
Uses no session server, so it runs after they have stopped (tests/server/conftest.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.harness.needs import specforge_on_path
from tests.harness.server import REPO

pytestmark = pytest.mark.server


def test_judge_tiny_trains_a_drafter_that_beats_an_untrained_one(tmp_path):
    specforge_on_path()
    work = tmp_path / "run"
    r = subprocess.run(
        [sys.executable, "-m", "judge", "--work", str(work), "--cache",
         str(REPO / ".cache" / "judge"), "--train-rows", "16", "--eval-rows", "4",
         "--max-new-tokens", "48", "--steps", "60", "--seeds", "1", "--conditions", "--quiet"],
        cwd=REPO, capture_output=True, text=True, env=dict(os.environ), timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((work / "judge.json").read_text())
    runs = {(x["condition"], x["seed"]) for x in report["runs"]}
    assert runs == {("hsdump", 0), ("untrained", 0)}
    trained, untrained = (report["summary"][c]["mean"] for c in ("hsdump", "untrained"))
    assert trained > untrained, (trained, untrained)
    assert report["verdicts"]["untrained"].startswith("PASS")
    # Every held-out position SpecForge evaluated, per TTT step, for both drafters.
    assert all(len(x["per_position_acc"]) == 7 for x in report["runs"])
    # The records SpecForge trained on are hsdump's, read through its own listing.
    meta = json.loads((work / "records" / "hsdump" / "hsdump-meta.json").read_text())
    assert meta["format"] == "specforge" and meta["layers"] == [2, 15, 27]
    assert (work / "judge.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "simulated acc len" in r.stdout and "untrained" in r.stdout
