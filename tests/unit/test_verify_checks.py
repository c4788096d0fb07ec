"""The comparisons ``hsdump verify`` rests on fail on wrong data (no server; the CPU variant
itself runs in tests/server/test_verify.py)."""

from __future__ import annotations

import json

import torch

from hsdump_patch.ops import verify, verify_checks


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
