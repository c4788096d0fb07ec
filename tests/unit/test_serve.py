"""``hsdump serve``, the image's entrypoint, and its Blackwell profile, without an engine: the
profile chosen by compute capability, the command it builds, the arguments it refuses
(tests/image/test_image.py runs the image itself)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from hsdump_patch import cli
from hsdump_patch.ops import blackwell, serve

DEEPSEEK_FP8 = {"architectures": ["DeepseekV3ForCausalLM"], "kv_lora_rank": 512,
                "quantization_config": {"quant_method": "fp8"}}


def _serve_args(argv: list[str]):
    return cli.build_parser().parse_args(["serve", *argv])


def _model_dir(tmp_path: Path, config: dict) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


# ------------------------------------------------------------------ serve and profile, no engine


def test_profile_is_chosen_by_compute_capability():
    assert blackwell.profile_for((12, 0)) == "sm120"
    assert blackwell.profile_for((12, 1)) == "sm120"
    assert blackwell.profile_for((10, 0)) == "sm100"
    assert blackwell.profile_for((9, 0)) == "none"
    assert blackwell.profile_for(None) == "none"


def test_sm120_profile_for_deepseek_fp8_mla():
    got = {s.dest: s.args for s in blackwell.profile_settings("sm120", DEEPSEEK_FP8, tp=8)}
    assert got == {
        "attention_backend": ("--attention-backend", "triton"),
        "fp8_gemm_runner_backend": ("--fp8-gemm-backend", "triton"),
        "moe_runner_backend": ("--moe-runner-backend", "triton"),
        "disable_custom_all_reduce": ("--disable-custom-all-reduce",),
    }
    # One GPU, an unquantised MHA model: nothing to change.
    assert blackwell.profile_settings("sm120", {"architectures": ["LlamaForCausalLM"]}, 1) == []
    # DSA models (DeepSeek-V3.2) need SGLang's own dsa backend: no MLA override.
    dsa = {**DEEPSEEK_FP8, "index_topk": 2048}
    assert "attention_backend" not in {s.dest for s in blackwell.profile_settings("sm120", dsa, 1)}
    assert blackwell.profile_settings("sm100", DEEPSEEK_FP8, tp=8) == []
    with pytest.raises(ValueError, match="unknown profile"):
        blackwell.profile_settings("sm90", DEEPSEEK_FP8, 1)


def test_profile_flags_are_valid_sglang_flags():
    """Every flag the profile adds parses with SGLang 0.5.23's own parser, into its dest."""
    for s in blackwell.profile_settings("sm120", DEEPSEEK_FP8, tp=8):
        assert s.dest in serve.explicit_options(list(s.args)), s


def test_serve_command_carries_extraction_flags_and_profile(tmp_path):
    model = _model_dir(tmp_path, DEEPSEEK_FP8)
    launch = serve.plan(_serve_args(["--model", str(model), "--tp", "8", "--port", "31000",
                                     "--profile", "sm120", "--", "--mem-fraction-static",
                                     "0.8", "--attention-backend", "flashinfer"]), None)
    argv = launch.argv
    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert serve.REQUIRED_ARGS == ("--cuda-graph-backend-prefill", "disabled",
                                   "--cuda-graph-backend-decode", "disabled",
                                   "--disable-radix-cache")
    assert " ".join(serve.REQUIRED_ARGS) in " ".join(argv)
    assert argv[argv.index("--tp-size") + 1] == "8"
    assert argv[argv.index("--port") + 1] == "31000"
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[-4:] == ["--mem-fraction-static", "0.8", "--attention-backend", "flashinfer"]
    # The user's --attention-backend wins: the profile's triton is not added.
    assert argv.count("--attention-backend") == 1
    assert [s.dest for s in launch.overridden] == ["attention_backend"]
    assert {s.dest for s in launch.applied} == {"fp8_gemm_runner_backend", "moe_runner_backend",
                                                "disable_custom_all_reduce"}
    assert launch.env["SGLANG_HS_DUMP_DIR"] == serve.DEFAULT_DUMP_DIR


def test_serve_auto_profile_follows_detected_capability(tmp_path):
    args = _serve_args(["--model", str(_model_dir(tmp_path, DEEPSEEK_FP8)), "--tp", "2"])
    assert serve.plan(args, (12, 0)).profile == "sm120"
    assert "--fp8-gemm-backend" in serve.plan(args, (12, 0)).argv
    assert serve.plan(args, (9, 0)).profile == "none"
    none = _serve_args(["--model", str(tmp_path), "--profile", "none"])
    assert "--fp8-gemm-backend" not in serve.plan(none, (12, 0)).argv


@pytest.mark.parametrize(("extra", "message"), [
    (["--tp-size", "2"], "--tp is an option of hsdump serve"),
    (["--model-path", "/m"], "--model is an option of hsdump serve"),
    (["--port", "1"], "--port is an option of hsdump serve"),
    (["--cuda-graph-backend-prefill", "full"], "--cuda-graph-backend-prefill full turns CUDA"),
    (["--cuda-graph-backend-decode", "breakable"], "--cuda-graph-backend-decode breakable"),
    (["--enable-two-batch-overlap"], "Remove --enable-two-batch-overlap"),
    (["--pipeline-parallel-size", "2"], "pipeline parallel size is 2"),
    (["--enable-dp-attention"], "DP attention is on"),
    (["--enable-prefill-cp"], "prefill context parallel"),
    (["--pp", "2"], "ambiguous option: --pp could match"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_serve_refuses_contradictory_arguments(tmp_path, extra, message):
    with pytest.raises(serve.ServeError) as e:
        serve.plan(_serve_args(["--model", str(tmp_path), "--", *extra]), None)
    assert message in str(e.value)


def test_serve_rejects_relative_dump_dir_and_reports_on_the_cli(tmp_path, capsys):
    assert cli.main(["serve", "--model", str(tmp_path), "--dump-dir", "rel/dir",
                     "--profile", "none"]) == 2
    assert "--dump-dir must be an absolute path" in capsys.readouterr().err
    assert cli.main(["serve", "--model", str(tmp_path), "--profile", "none", "--dry-run",
                     "--", "--enable-two-batch-overlap"]) == 2
    assert "cannot be used for extraction" in capsys.readouterr().err


def test_serve_dry_run_prints_the_command(tmp_path, capsys):
    assert cli.main(["serve", "--model", str(tmp_path), "--profile", "none", "--dry-run",
                     "--dump-dir", "/dev/shm/x", "--", "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert "profile                        none" in err
    assert ("--cuda-graph-backend-prefill disabled --cuda-graph-backend-decode disabled "
            "--disable-radix-cache --device cpu") in err
    assert "/dev/shm/x" in err


def test_compute_capability_from_nvidia_smi(tmp_path, monkeypatch):
    """The nvidia-smi query and its parsing (a script answering like 8 RTX PRO 6000 and one
    older GPU): the lowest capability decides."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\n[ \"$1\" = --query-gpu=compute_cap ] || exit 9\n"
                   "printf '12.0\\n%.0s' 1 2 3 4 5 6 7 8\necho 9.0\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert blackwell.detect_compute_capability() == (9, 0)
