"""scripts/bench_writer.py runs on CPU with small shapes; what it reports is consistent.

Not a timed test: it checks that every measurement ran, that each ratio is computed against the
baseline measured in the same run (recomputed here from the raw numbers it reports), that each
verdict is the goal comparison it states, and that the printed table and verdicts are the JSON's
numbers, not how fast anything is.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HIDDEN, SLOTS, IDS_BYTES = 256, 4, 16  # --hidden, the default --slots, input_ids + positions
CAP = 1 << 20  # --cap 1MiB
SHIPPED = "writer cap 1MiB blocking"  # the default cap with the writer's own (blocking) events
# Printed table columns compared with the JSON: (heading, Row field, format).
PRINTED = [("GB/s", "gbps", "{:.2f}"), ("vs limit", "vs_limit", "{:.2f}"),
           ("stall ms/chunk", "stall_mean_ms", "{:.2f}"), ("stall vs sync", "vs_sync", "{:.4f}"),
           ("peak in-flight MB", "peak_inflight_mb", "{:.0f}"),
           ("writer CPU s/GB", "writer_cpu_s_per_gb", "{:.3f}"),
           ("fwd CPU ms/chunk", "fwd_cpu_ms", "{:.2f}")]


def test_bench_writer_cpu_reports_ratios_and_verdicts_of_its_own_numbers(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_writer.py"), "--device", "cpu",
         "--hidden", str(HIDDEN), "--chunks", "64,256", "--threads", "2", "--cap", "1MiB",
         "--volume", "2MiB", "--raw-volume", "1MiB", "--paced-forwards", "2",
         "--sync-forwards", "1", "--min-free", "0", "--dump-dir", str(tmp_path),
         "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["errors"] == [] and result["verified_files"] >= 12
    rows = result["rows"]
    paths = {"host copy (cpu)", "dump-dir write, 1 thread", "dump-dir write, 2 threads",
             "sync .cpu()+torch.save", "writer cap 1MiB spin, saturated",
             "writer cap 1MiB spin, paced 50%", "writer cap 1MiB blocking, saturated",
             "writer cap 1MiB blocking, paced 50%", "writer cap 0.0625MiB blocking, saturated",
             "writer cap 0.0625MiB blocking, paced 50%"}
    assert sorted((r["tokens"], r["path"]) for r in rows) == sorted(
        (t, p) for t in (64, 256) for p in paths)
    verdicts = {v["goal"]: v for v in result["verdicts"]}
    assert len(verdicts) == len(result["verdicts"]) == 2 * (6 + 4)  # memory 6, others 4

    for tokens in (64, 256):
        by = {r["path"]: r for r in rows if r["tokens"] == tokens}
        assert all(r["chunk_mb"] == tokens * (SLOTS * HIDDEN * 2 + IDS_BYTES) / 1e6
                   for r in by.values())
        # The limit is the lower of this run's copy and N-thread write; every ratio is to it.
        limit = min(by["host copy (cpu)"]["gbps"], by["dump-dir write, 2 threads"]["gbps"])
        for r in by.values():
            assert r["gbps"] > 0 and r["vs_limit"] == pytest.approx(r["gbps"] / limit,
                                                                    rel=1e-9), r
        # The synchronous baseline: one chunk's bytes per stall; its stall is the unit of vs_sync.
        sync = by["sync .cpu()+torch.save"]
        assert sync["gbps"] == pytest.approx(
            sync["chunk_mb"] * 1e6 / (sync["stall_mean_ms"] / 1e3) / 1e9, rel=1e-9)
        for path, r in by.items():
            if path.startswith(("writer", "sync")):
                assert 0 < r["stall_mean_ms"] <= r["stall_max_ms"], r
                assert r["vs_sync"] == pytest.approx(r["stall_mean_ms"] / sync["stall_mean_ms"],
                                                     rel=1e-9), r
            if path.startswith("writer"):
                assert 0 < r["peak_inflight_mb"] <= r["staging_mb"], r
                # The writer threads did the writing: they used CPU, the forward thread too.
                assert r["writer_cpu_s_per_gb"] > 0 and r["fwd_cpu_ms"] > 0, r
            if path.startswith("writer cap 1MiB"):  # every request fits the cap: it holds
                assert r["staging_mb"] * 1e6 <= CAP, r

        # Each verdict is the comparison it states, on the numbers of the table.
        sat, paced = by[f"{SHIPPED}, saturated"], by[f"{SHIPPED}, paced 50%"]
        v = verdicts[f"throughput {tokens} tok"]
        assert v["ok"] == (sat["gbps"] >= 0.9 * limit), v
        assert v["detail"] == (f"{sat['gbps']:.2f} GB/s = {sat['vs_limit']:.0%} of "
                               f"{limit:.2f} GB/s (goal >= 90%)")
        for name, r in (("saturated", sat), ("paced 50%", paced)):
            v = verdicts[f"stall {tokens} tok {name}"]
            assert v["ok"] == (r["vs_sync"] <= 0.05), v
            assert v["detail"] == (f"{r['stall_mean_ms']:.2f} ms = {r['vs_sync']:.2%} of "
                                   f"{sync['stall_mean_ms']:.0f} ms (goal <= 5%)")
        spin = by["writer cap 1MiB spin, paced 50%"]["writer_cpu_s_per_gb"]
        blocking = paced["writer_cpu_s_per_gb"]
        v = verdicts[f"writer CPU {tokens} tok paced"]
        assert v["ok"] == (blocking <= spin), v
        assert v["detail"] == (f"blocking {blocking:.3f} s/GB vs spin {spin:.3f} s/GB "
                               f"({blocking / spin:.0%})")
        for path, r in by.items():
            if path.startswith("writer"):
                cap_kind, name = path.removeprefix("writer ").split(", ")
                v = verdicts[f"memory {tokens} tok {cap_kind} {name}"]
                assert v["ok"], v  # the in-flight cap held
                assert v["detail"].startswith(f"peak in-flight {r['peak_inflight_mb']:.0f} MB, "
                                              f"staging {r['staging_mb']:.0f} MB <= "), v

    # What it prints is the JSON's numbers: the table's cells, one verdict line per verdict.
    lines = proc.stdout.splitlines()
    header = [c.strip() for c in next(x for x in lines if x.startswith("| tokens")).split("|")]
    printed = {(int(c[1]), c[3]): c for x in lines if re.match(r"\| \d", x)
               for c in [[s.strip() for s in x.split("|")]]}
    assert set(printed) == {(r["tokens"], r["path"]) for r in rows}
    for r in rows:
        cells = printed[r["tokens"], r["path"]]
        for heading, key, fmt in PRINTED:
            want = "" if r[key] is None else fmt.format(r[key])
            assert cells[header.index(heading)] == want, (r["path"], heading)
    assert [x for x in lines if x.startswith(("PASS ", "MISS "))] == [
        f"{'PASS' if v['ok'] else 'MISS'}  {v['goal']}: {v['detail']}"
        for v in result["verdicts"]]
