"""The comparisons ``hsdump verify`` rests on fail on wrong data (no server; the CPU variant
itself runs in tests/server/test_verify.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch

from hsdump_patch import protocol
from hsdump_patch.ops import verify, verify_checks, verify_cost, verify_server


def test_bitwise_comparison_catches_one_ulp_and_shifted_rows():
    ref = torch.randn(40, 3 * 64).to(torch.bfloat16)
    assert verify_checks.bitwise_mismatch(ref.clone(), ref.float()) is None
    one_ulp = ref.clone()
    one_ulp.view(torch.int16)[17, 5] += 1  # the next bf16 value
    assert "1 of 7680 values differ (first at row 17" in verify_checks.bitwise_mismatch(
        one_ulp, ref)
    assert verify_checks.bitwise_mismatch(ref[1:], ref[:-1]) is not None
    assert "shape" in verify_checks.bitwise_mismatch(ref[1:], ref)


def test_reference_bound_rejects_a_wrong_layer_and_accepts_bf16_rounding():
    torch.manual_seed(0)
    ref = torch.randn(50, 64) * 3
    assert verify_checks.closeness(ref.bfloat16(), ref).within()
    assert not verify_checks.closeness(torch.randn(50, 64) * 3, ref).within()
    assert not verify_checks.closeness(ref.roll(1, dims=0), ref).within()


def test_outputs_check_needs_a_repeating_server_then_equal_outputs():
    gen = {"p": {"output_ids": [1, 2], "output_token_logprobs": [[-0.5, 1], [-0.25, 2]]}}
    other = {"p": {"output_ids": [1, 2], "output_token_logprobs": [[-0.5, 1], [-0.2500001, 2]]}}

    def verdict(on, off):
        return verify.check_outputs(verify.TpRun(1, gen={"on": on, "off": off})).verdict

    assert verdict([gen, gen], [gen, gen]) == verify.PASS
    assert verdict([other, other], [gen, gen]) == verify.FAIL
    assert verdict([gen, gen], [gen, other]) == verify.FAIL


def test_staging_check_fails_on_pages_a_failed_cuda_host_register_left_pageable(tmp_path):
    writer = {"mode": "process", "staging_bytes": 4 << 30, "pin_failed_pages": 0}
    (tmp_path / "status.json").write_text(json.dumps({"writer": writer}))
    ok = verify.check_staging(verify.writer_status(tmp_path), 8)
    assert (ok.check, ok.scope, ok.verdict) == ("f", "tp 8 staging", verify.PASS)
    bad = verify.check_staging({"writer": {**writer, "pin_failed_pages": 512}}, 8)
    assert bad.verdict == verify.FAIL
    assert bad.detail.startswith("writer.pin_failed_pages is 512 in status.json: "
                                 "cudaHostRegister failed, 512 staging pages are pageable")
    assert verify.writer_status(tmp_path / "none") is None
    assert verify.check_staging(None, 8).verdict == verify.FAIL  # no status.json


def test_cost_t_interval_matches_the_t_table():
    assert verify_cost.t975(1) == 12.706 and verify_cost.t975(9) == 2.262
    assert abs(verify_cost.t975(60) - 2.000) < 0.002 and abs(verify_cost.t975(120) - 1.980) < 0.002
    s = verify_cost.abba_stats([2.2, 2.0, 2.4], [2.0, 2.0, 2.0])
    assert s.n == 3 and s.ratios == [1.1, 1.0, 1.2] and abs(s.mean - 1.1) < 1e-12
    half = 4.303 * 0.1 / 3 ** 0.5  # t(2) x sd / sqrt(n)
    assert abs(s.low - (1.1 - half)) < 1e-9 and abs(s.high - (1.1 + half)) < 1e-9
    with pytest.raises(ValueError):
        verify_cost.abba_stats([1.0], [1.0])  # one block has no spread


def test_cost_fails_only_when_the_lower_bound_is_above_the_floor():
    off = [1.0] * 8
    surely_slower = verify_cost.abba_stats([1.10, 1.11, 1.09, 1.10, 1.12, 1.08, 1.10, 1.10], off)
    passed, detail = verify_cost.cost_verdict(surely_slower, 1.05)
    assert not passed and surely_slower.low > 1.05
    assert detail.startswith("prefill dumped / undumped 1.100 (95% CI 1.0")
    assert "n 8 ABBA blocks" in detail and "the lower bound is above the floor 1.05" in detail
    # mean above the floor, interval straddling it: a noisy host, not a failure
    noisy = verify_cost.abba_stats([1.00, 1.14, 0.97, 1.12, 1.03, 1.18, 0.99, 1.09], off)
    assert noisy.mean > 1.05 > noisy.low
    assert verify_cost.cost_verdict(noisy, 1.05)[0]
    assert verify_cost.cost_verdict(verify_cost.abba_stats([1.0, 1.01], [1.0, 1.0]), 1.05)[0]


def test_cost_sends_the_same_prompts_with_and_without_the_prefix_in_abba(tmp_path, monkeypatch):
    sent: list[str] = []

    class FakeServer:
        dump_dir = tmp_path

        def post(self, path, body, timeout=600):
            rid = body["rid"]
            sent.append(rid)
            assert body["sampling_params"]["max_new_tokens"] == 1
            if rid.startswith("hsdump-"):
                protocol.rid_dir(tmp_path, rid).mkdir(parents=True)
            return {"meta_info": {"e2e_latency": 1.2 if rid.startswith("hsdump-") else 1.0}}

    monkeypatch.setattr(verify_cost, "wait_for_marker",
                        lambda d, rid, timeout: SimpleNamespace(error=None))
    m = verify_cost.measure(FakeServer(), [[1, 2, 3], [1, 4, 5]], "hsdump-", "cost")
    assert m["problems"] == [] and len(sent) == 2 + 2 * 4
    assert [r.startswith("hsdump-") for r in sent[2:6]] == [True, False, False, True]
    assert m["on_s"] == [2.4, 2.4] and m["off_s"] == [2.0, 2.0]
    assert not any(tmp_path.iterdir())  # each dumped request's files removed
    assert abs(verify_cost.abba_stats(m["on_s"], m["off_s"]).mean - 1.2) < 1e-12


def test_fused_allreduce_is_not_applicable_where_sglang_never_enables_it():
    sm120 = verify.fused_allreduce("", "cuda", 8, (12, 0))
    assert sm120 == {"ran": None, "why": "not applicable: SGLang enables it only on sm90 / "
                                         "sm100, this GPU is sm120"}
    assert verify.fused_allreduce("", "cuda", 8, (9, 0))["ran"] is False  # no log line: off
    assert verify.fused_allreduce("", "cuda", 1, (12, 0))["why"].endswith("no all-reduce")


def test_writer_memory_is_taken_from_the_writer_gpu_by_device_id():
    log = ("hsdump: capture buffer of 4096 tokens x 4 states x 2048 (64 MiB) on cuda:3, 2 used "
           "in turn: 128 MiB of device memory in all")
    buf = verify.capture_buffer(log)
    assert buf == {"tokens": 4096, "states": 4, "hidden": 2048, "mib": 64, "count": 2,
                   "total_mib": 128, "device": "cuda:3"}
    tput = {"prefill_tokens_per_s": 1.0, "tokens": 10, "undumped_requests": [],
            "rank_cpu_s": {0: 1.0}}
    res = verify.TpRun(2, tput={"on": tput, "off": tput}, devices=[2, 3], capture_buffer=buf,
                       memory={"on": {0: 9000, 2: 1000, 3: 1300}, "off": {2: 1000, 3: 1000}})
    settings = verify.Settings("cuda", [2], Path("."), Path("."), 2048, 0.9, 1024, 900)
    v = verify.check_overhead(res, settings)
    assert v.data["writer_device"] == 3 and v.data["writer_extra_mib"] == 300, v.data
    assert "writer GPU (cuda:3) peak 1300 MiB vs 1000 MiB on the other ranks" in v.detail
    sampler = verify_server.GpuMemorySampler(peaks_mib={"GPU-a": 5, "GPU-b": 7},
                                             indexes={"GPU-a": 0, "GPU-b": 1})
    assert sampler.peaks_by_device({0: "GPU-b", 1: "GPU-a"}) == {0: 7, 1: 5}
    assert sampler.peaks_by_device({}) == {0: 5, 1: 7}  # by nvidia-smi index


def test_rank_cpu_seconds_count_the_writer_child_process(tmp_path):
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass\n" \
           "time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", burn])
    try:
        (tmp_path / "status.json").write_text(json.dumps({"writer": {"writer_pid": child.pid}}))
        server = SimpleNamespace(dump_dir=tmp_path, rank_pids=lambda: {0: os.getpid()})
        server.writer_pid = lambda: verify_server.VerifyServer.writer_pid(server)
        assert server.writer_pid() == child.pid
        deadline = time.monotonic() + 30
        while psutil.Process(child.pid).cpu_times().user < 0.4 and time.monotonic() < deadline:
            time.sleep(0.05)
        own = sum(psutil.Process().cpu_times()[:2])
        total = verify_server.VerifyServer.rank_cpu_seconds(server)[0]
        assert total >= own + 0.4, (total, own)
        assert verify_server.VerifyServer.writer_pid(SimpleNamespace(dump_dir=None)) is None
    finally:
        child.kill()
        child.wait()
