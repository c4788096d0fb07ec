"""scripts/bench_writer.py runs on CPU with small shapes and prints a sane table.

Not a timed test: it checks that every measurement ran and that the numbers are plausible,
not how fast anything is.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_writer_cpu_prints_table_and_verdicts(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_writer.py"), "--device", "cpu",
         "--hidden", "256", "--chunks", "64,256", "--threads", "2", "--cap", "1MiB",
         "--volume", "2MiB", "--raw-volume", "1MiB", "--paced-forwards", "2",
         "--sync-forwards", "1", "--min-free", "0", "--dump-dir", str(tmp_path),
         "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    header = next(line for line in lines if line.startswith("| tokens"))
    for col in ("GB/s", "vs limit", "stall ms/chunk", "stall vs sync", "peak in-flight MB",
                "writer CPU s/GB", "fwd CPU ms/chunk"):
        assert col in header
    paths = {"host copy (cpu)", "dump-dir write, 1 thread", "dump-dir write, 2 threads",
             "sync .cpu()+torch.save", "writer cap 1MiB spin, saturated",
             "writer cap 1MiB spin, paced 50%", "writer cap 1MiB blocking, saturated",
             "writer cap 1MiB blocking, paced 50%", "writer cap 0.0625MiB blocking, saturated",
             "writer cap 0.0625MiB blocking, paced 50%"}
    table_paths = [row.split("|")[3].strip() for row in lines if row.startswith("| 64 ")]
    assert set(table_paths) == paths

    result = json.loads(out.read_text())
    assert result["errors"] == [] and result["verified_files"] >= 12
    rows = result["rows"]
    assert {r["tokens"] for r in rows} == {64, 256}
    for r in rows:
        assert r["gbps"] > 0 and r["vs_limit"] > 0, r
        if r["path"].startswith(("writer", "sync")):
            assert r["stall_mean_ms"] > 0 and r["stall_max_ms"] >= r["stall_mean_ms"], r
            assert r["vs_sync"] > 0, r
        if r["path"].startswith("writer"):
            assert 0 < r["peak_inflight_mb"] <= r["staging_mb"], r
            # The writer threads did the writing: they used CPU, the forward thread too.
            assert r["writer_cpu_s_per_gb"] > 0 and r["fwd_cpu_ms"] > 0, r
    for tokens in (64, 256):  # the limit is the lower of the copy and the N-thread write
        raw = [r["vs_limit"] for r in rows if r["tokens"] == tokens
               and r["path"] in ("host copy (cpu)", "dump-dir write, 2 threads")]
        assert min(raw) == 1.0 and max(raw) >= 1.0
    verdicts = {v["goal"]: v for v in result["verdicts"]}
    for tokens in (64, 256):
        assert f"throughput {tokens} tok" in verdicts
        assert f"stall {tokens} tok saturated" in verdicts
        assert f"writer CPU {tokens} tok paced" in verdicts
    memory = [v for v in result["verdicts"] if v["goal"].startswith("memory")]
    assert len(memory) == 12 and all(v["ok"] for v in memory), memory
    assert "MISS" in proc.stdout or "PASS" in proc.stdout
