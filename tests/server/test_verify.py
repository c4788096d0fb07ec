"""``hsdump verify``, CPU variant: four real servers (TP 1 and 2, dump on and off, one at a
time) and a refused launch; the report shows every check, each passing. The comparisons it
rests on are checked to fail on wrong data without a server in tests/unit/test_verify_checks.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hsdump_patch.ops import verify, verify_checks, verify_cost
from tests.harness import server as srv

EXPECTED = {("a", "tp 1"), ("a", "tp 2"), ("b", "all"), ("c", "tp 1"), ("c", "tp 2"),
            ("d", "tp 1"), ("d", "tp 2"), ("e", "resolved config"),
            ("e", "launch: radix cache on"), ("f", "tp 1"), ("f", "tp 2"),
            ("f", "tp 1 staging"), ("f", "tp 2 staging"), ("f", "tp 1 cost (ABBA)"),
            ("f", "tp 2 cost (ABBA)")}


@pytest.fixture(scope="module")
def verify_run(tmp_path_factory, sglang_available):
    work = tmp_path_factory.mktemp("verify")
    # The test-only CPU stand-ins reach verify's servers through its environment.
    env = srv.cpu_env(tp=2)
    r = subprocess.run([sys.executable, "-m", "hsdump_patch.cli", "verify", "--work", str(work),
                        "--no-progress"], env=env, capture_output=True, text=True,
                       timeout=1800, check=False)
    return r, json.loads((work / "report.json").read_text()), work


@pytest.mark.server
def test_cpu_variant_passes_every_check(verify_run):
    r, report, _ = verify_run
    checks = {(c["check"], c["scope"]): c for c in report["checks"]}
    failed = {k: c["detail"] for k, c in checks.items() if c["verdict"] != "PASS"}
    assert not failed, f"{failed}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert set(checks) == EXPECTED
    assert r.returncode == 0 and report["passed"] and report["tp"] == [1, 2]
    model = report["model"]  # Kimi-K2.5's layout, attention and routing
    assert model["architecture"] == "KimiK25ForConditionalGeneration"
    assert (model["hidden_size"], model["num_attention_heads"], model["q_lora_rank"]) == (
        2048, 64, 1536)
    assert (model["n_group"], model["num_experts_per_tok"]) == (1, 8)
    assert "hsdump verify: PASS" in r.stdout
    for check, scope in EXPECTED:  # the verdict table shows every row
        assert f"{check}. {verify.CHECKS[check]} [{scope}]" in r.stdout


@pytest.mark.server
def test_report_shows_what_each_check_covered(verify_run):
    _, report, work = verify_run
    checks = {(c["check"], c["scope"]): c for c in report["checks"]}
    for tp in (1, 2):
        cases = checks["a", f"tp {tp}"]["data"]["cases"]
        assert [c["ok"] for c in cases] == [True] * 5
        assert max(c["chunks"] for c in cases) >= 3  # the multi-chunk prompt
        # every chunk is compared, the multi-chunk prompt's earlier ones too
        assert all(c["chunks_compared"] >= c["chunks"] for c in cases), cases
        fused = checks["a", f"tp {tp}"]["data"]["fused_allreduce_rmsnorm"]
        assert fused == {"ran": None, "why": "not applicable: no GPU"}
        assert max(c["max_requests_per_forward"] for c in cases) >= 2
        # Dump on vs off (check c): token ids and every logprob, compared exactly (before the
        # lanes, tests/server/test_capture_numerics.py started its own dump-off servers for it).
        outputs = checks["c", f"tp {tp}"]["detail"]
        assert outputs.startswith("each server repeats itself;"), outputs
        assert "every input/output/top-5 logprob identical with the dump on and off" in outputs
        ranks = checks["d", f"tp {tp}"]["data"]
        assert ranks["writer_lines"] == 1 and ranks["non_writer_lines"] == tp - 1
        assert ranks["server_json_pid"] == ranks["rank_pids"]["0"]
        markers = ranks["install_markers"]
        assert sorted(markers) == [str(r) for r in range(tp)]
        assert [markers[str(r)]["writer"] for r in range(tp)] == [True] + [False] * (tp - 1)
        overhead = checks["f", f"tp {tp}"]["data"]
        assert overhead["on"]["prefill_tokens_per_s"] > 0 and overhead["dumped_gb"] > 0
        assert overhead["on"]["undumped_requests"] == []
        assert overhead["capture_buffer"]["hidden"] == 2048  # the Kimi-K2.5-shaped model
        buf = overhead["capture_buffer"]  # both buffers used in turn are counted
        assert buf["count"] == 2 and abs(buf["total_mib"] - 2 * buf["mib"]) <= 1, buf
    worst = checks["b", "all"]["data"]["worst"]
    assert worst["max_rel"] <= verify_checks.BF16_MAX_REL
    for tp in (1, 2):  # the dump's cost on the server: plumbing on CPU, its numbers printed
        cost = checks["f", f"tp {tp} cost (ABBA)"]
        data = cost["data"]
        print(f"tp {tp} cost: {cost['detail']}")
        assert data["n"] == verify_cost.CPU_BLOCKS == len(data["ratios"]) == len(data["blocks"])
        assert data["floor"] == verify_cost.CPU_MAX_RATIO and data["problems"] == []
        assert data["low"] <= data["mean"] <= data["high"] and all(r > 0 for r in data["ratios"])
        assert all(b["tokens"] == 2 * data["chunk"] for b in data["blocks"])
        assert "CPU: plumbing" in cost["detail"]
        # the writer rank's CPU includes its writer child (process mode: status.json's pid)
        assert checks["f", f"tp {tp}"]["data"]["on"]["rank_cpu_s"]["0"] > 0
    refusals = checks["e", "resolved config"]["data"]["cases"]
    assert len(refusals) == len(verify.REFUSED) + 1 and all(c["ok"] for c in refusals)
    # The real launch with the radix cache on (the suite's one launch refused by the guards on
    # SGLang's resolved server args): refused before serving, naming the fix.
    refused = (work / "refused-radix.log").read_text()
    assert checks["e", "launch: radix cache on"]["data"]["exit_code"] not in (0, None)
    assert "Pass --disable-radix-cache" in refused, refused[-3000:]
    assert "Uvicorn running" not in refused
