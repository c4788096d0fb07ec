"""scripts/bench_prompt_check.py on tiny input against the Kimi-K2.5 server: both settings
run, the check confirms every trained turn when on and none when off, the table is printed.

Not a timed test: it checks that everything was measured, not how fast.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.server
def test_bench_prompt_check_measures_both_settings(tmp_path: Path, kimi_server) -> None:
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_prompt_check.py"), "--server",
         kimi_server.url, "--dump-dir", str(kimi_server.dump_dir), "--rows", "2", "--turns", "4",
         "--tokens", "120", "--rounds", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    (off,), (on,) = result["runs"]["off"], result["runs"]["server"]
    assert off["checked"] == 0 and on["checked"] >= 2 and on["tokens"] == off["tokens"]
    assert result["ratio_samples_per_s"] > 0 and result["added_ms_per_checked_turn"] is not None
    assert "| server / off |" in proc.stdout
