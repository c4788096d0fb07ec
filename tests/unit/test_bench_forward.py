"""scripts/bench_forward.py runs on CPU with tiny shapes: every condition is measured in ABBA
blocks, every dumped value is read back and checked, and the table has every point; "on" is
the process writer that ships, beside the thread writer.

Not a timed test: CPU timings say nothing about the GPU ordering (issue 17).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_forward_cpu_checks_every_dumped_value(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_forward.py"), "--device", "cpu",
         "--hidden", "32", "--layers", "4", "--aux-layers", "1,2", "--chunks", "16,40",
         "--us-per-token", "50", "--requests", "3", "--forwards", "3", "--threads", "2",
         "--cap", str(1 << 20), "--dump-dir", str(tmp_path / "dump"), "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    header = next(line for line in proc.stdout.splitlines() if line.startswith("| tokens"))
    for col in ("on/off", "thread/off", "old/off", "paired on/thread", "max host wait"):
        assert col in header
    result = json.loads(out.read_text())
    assert result["errors"] == []
    rows = result["rows"]
    assert [r["tokens"] for r in rows] == [16, 40]
    for r in rows:
        assert r["samples"] == {"off": 6, "on": 6, "thread": 6, "old": 6}, r
        assert r["off_ms"] > 0 and r["on_ms"] > 0 and r["old_ms"] > 0, r
    # Three dumped conditions (on: the process writer that ships; thread; old) x 2 blocks x
    # (3 + 1 warm-up) forwards x 3 requests, per point; each file holds its rows x 3 states x
    # 32 values, plus ids and positions.
    assert all(r["on_mode"] == "process" for r in rows)
    assert result["verified_files"] == 3 * 2 * 4 * 3 * 2
    assert result["verified_values"] == 3 * 2 * 4 * (16 + 40) * (3 * 32 + 2)
    writers = result["writers"]
    assert writers["process"]["chunks_written"] == 2 * 4 * 3 * 2  # "on" only
    assert writers["process"]["mode"] == "process" and writers["process"]["internal_errors"] == 0
    assert sum(w["chunks_written"] for w in writers.values()) == result["verified_files"]
    assert not any((tmp_path / "dump").iterdir())  # checked files are removed


def test_bench_forward_host_bound_forward_is_a_grid_dimension_and_costs_host_time(
        tmp_path: Path) -> None:
    """``--host-us-per-layer``: each load is a point of its own (every value still checked),
    and the host work really lengthens the forward: per layer, off's time grows by about the
    host microseconds asked for."""
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_forward.py"), "--device", "cpu",
         "--hidden", "32", "--layers", "4", "--aux-layers", "1,2", "--chunks", "16",
         "--us-per-token", "50", "--requests", "2", "--forwards", "3", "--threads", "2",
         "--host-us-per-layer", "0,2000", "--cap", str(1 << 20), "--dump-dir",
         str(tmp_path / "dump"), "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| tokens | host us/layer |" in proc.stdout
    result = json.loads(out.read_text())
    assert result["errors"] == []
    rows = result["rows"]
    assert [(r["tokens"], r["host_us_per_layer"]) for r in rows] == [(16, 0.0), (16, 2000.0)]
    assert all(r["samples"] == {"off": 6, "on": 6, "thread": 6, "old": 6} for r in rows)
    added = rows[1]["off_ms"] - rows[0]["off_ms"]  # 4 layers x 2 ms of host work
    assert 7.0 <= added <= 12.0, rows
    assert result["verified_files"] == 2 * (3 * 2 * 4 * 2)


def test_bench_forward_overlap_order_runs_on_cpu_and_needs_one_timed_forward(
        tmp_path: Path) -> None:
    """``--order overlap`` (the timed forward enqueued while the one before runs) needs one
    timed forward per block; on CPU, where nothing is asynchronous, it runs as ``sync``."""
    base = [sys.executable, str(ROOT / "scripts" / "bench_forward.py"), "--device", "cpu",
            "--hidden", "32", "--layers", "4", "--aux-layers", "1,2", "--chunks", "16",
            "--us-per-token", "50", "--requests", "2", "--rounds", "3", "--threads", "2",
            "--cap", str(1 << 20), "--dump-dir", str(tmp_path / "dump"), "--order", "overlap"]
    bad = subprocess.run([*base, "--forwards", "2"], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert bad.returncode == 2 and "--order overlap needs --forwards 1" in bad.stderr
    out = tmp_path / "bench.json"
    proc = subprocess.run([*base, "--forwards", "1", "--json", str(out)], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["order"] == "overlap" and result["errors"] == []
    assert result["rows"][0]["samples"] == {"off": 6, "on": 6, "thread": 6, "old": 6}
