"""Start-up refusals decided in-process (no server): the capture's environment
(``DumpConfig.from_env``) and the guards on SGLang's resolved server args, the graph runner and
the CLI. tests/server/test_capture_startup.py launches one real server per failure stage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hsdump_patch.capture import guards
from hsdump_patch.capture.config import (
    ConfigError,
    DumpConfig,
    parse_layers,
    parse_size,
)
from hsdump_patch.capture.session import runner_device

# (id, environment beside SGLANG_HS_DUMP_DIR, expected message fragment): each refused by
# DumpConfig.from_env, which the plugin calls once SGLang has resolved the server args.
ENV_REFUSALS = [
    ("layers-not-ints", {"SGLANG_HS_DUMP_LAYERS": "3;x"},
     "SGLANG_HS_DUMP_LAYERS='3;x' is not a list of layer indices"),
    ("relative-dir", {"SGLANG_HS_DUMP_DIR": "relative/dir"},
     "SGLANG_HS_DUMP_DIR='relative/dir' must be an absolute path"),
    ("bad-size", {"SGLANG_HS_DUMP_MAX_INFLIGHT_BYTES": "lots"},
     "SGLANG_HS_DUMP_MAX_INFLIGHT_BYTES='lots' is not a size"),
    ("bad-min-free", {"SGLANG_HS_DUMP_MIN_FREE_BYTES": "-1"},
     "SGLANG_HS_DUMP_MIN_FREE_BYTES='-1' is not a size"),
    ("bad-final", {"SGLANG_HS_DUMP_FINAL": "maybe"},
     "SGLANG_HS_DUMP_FINAL='maybe' is not a boolean"),
    ("bad-prefix", {"SGLANG_HS_DUMP_RID_PREFIX": "a b"},
     "SGLANG_HS_DUMP_RID_PREFIX='a b' must be non-empty"),
    ("bad-threads", {"SGLANG_HS_DUMP_WRITER_THREADS": "0"},
     "SGLANG_HS_DUMP_WRITER_THREADS='0' must be an integer in 1..64"),
    ("missing-draft-config", {"SGLANG_HS_DUMP_DRAFT_CONFIG": "/nonexistent/config.json"},
     "SGLANG_HS_DUMP_DRAFT_CONFIG=/nonexistent/config.json: file not found"),
    ("layers-and-draft-config",
     {"SGLANG_HS_DUMP_LAYERS": "1,2", "SGLANG_HS_DUMP_DRAFT_CONFIG": "/x/config.json"},
     "are both set"),
]


@pytest.mark.parametrize(("env", "message"), [c[1:] for c in ENV_REFUSALS],
                         ids=[c[0] for c in ENV_REFUSALS])
def test_a_bad_environment_is_refused_naming_the_variable(env, message):
    with pytest.raises(ConfigError) as refused:
        DumpConfig.from_env({"SGLANG_HS_DUMP_DIR": "/dev/shm/hsdump", **env})
    assert message in str(refused.value)


def _resolved(model: Path, **kwargs) -> object:
    """A real ServerArgs, resolved by SGLang in this process (no server)."""
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path=str(model), device="cpu", **kwargs)
    args.resolve_once()
    return args


EXTRACTION = {"disable_radix_cache": True}


# (id, ServerArgs fields, expected message fragment): decided on the resolved state.
RESOLVED_REFUSALS = [
    ("backend-flag-beats-disable-cuda-graph",
     {"disable_cuda_graph": True, "cuda_graph_backend_prefill": "breakable"},
     "prefill CUDA graphs are on (--cuda-graph-backend-prefill breakable): graph replays never "
     "run the capture hooks, so dumps would be empty. Pass --cuda-graph-backend-prefill "
     "disabled. --disable-cuda-graph does not turn them off"),
    ("graph-config-beats-disable-cuda-graph",
     {"disable_cuda_graph": True, "cuda_graph_config": {"prefill": {"backend": "full"}}},
     "Remove the prefill backend from --cuda-graph-config"),
    ("dwdp-turns-on-attention-dp", {"tp_size": 2, "dwdp_size": 2},
     "DP attention is on (--dwdp-size 2 turns it on): each attention-DP group holds "
     "different requests and rows. Remove --dwdp-size"),
    ("pdmux", {"enable_pdmux": True}, "Remove --enable-pdmux"),
    # Without --disable-cuda-graph: the backend is named, and the fix says nothing of that flag.
    ("backend-flag-alone", {"cuda_graph_backend_prefill": "full"},
     "prefill CUDA graphs are on (--cuda-graph-backend-prefill full): graph replays never run "
     "the capture hooks, so dumps would be empty. Pass --cuda-graph-backend-prefill disabled. "
     "The extraction profile"),
    ("multi-node-dp", {"nnodes": 2, "dp_size": 2, "tp_size": 2}, "--dp-size 2 across --nnodes 2"),
    ("disaggregation-decode", {"disaggregation_mode": "decode"},
     "--disaggregation-mode decode: this server only decodes"),
    # What a server launched with these flags refused (before the lanes, one launch each).
    ("radix-cache-on", {"disable_radix_cache": False, "cuda_graph_backend_prefill": "disabled"},
     "Pass --disable-radix-cache"),
    ("two-batch-overlap", {"disable_cuda_graph": True, "enable_two_batch_overlap": True},
     "Remove --enable-two-batch-overlap"),
    ("pipeline-parallel", {"disable_cuda_graph": True, "pp_size": 2}, "Use --pp-size 1"),
    ("dp-attention", {"disable_cuda_graph": True, "attn_dp_size": 2, "tp_size": 2},
     "Remove --attn-dp-size"),
    ("prefill-cp", {"disable_cuda_graph": True, "enable_prefill_cp": True,
                    "cp_strategy": "zigzag"}, "Remove --enable-prefill-cp"),
]


@pytest.mark.parametrize(("fields", "message"), [c[1:] for c in RESOLVED_REFUSALS],
                         ids=[c[0] for c in RESOLVED_REFUSALS])
def test_guards_decide_on_the_resolved_server_args(tiny_models, fields, message):
    problems = guards.problems_for_server_args(
        _resolved(tiny_models / "tiny-llama", **{**EXTRACTION, **fields}))
    assert len(problems) == 1 and message in problems[0], problems


def test_both_graph_spellings_are_accepted_and_problems_are_reported_together(tiny_models):
    model = tiny_models / "tiny-llama"
    assert guards.problems_for_server_args(_resolved(model, disable_cuda_graph=True,
                                                     **EXTRACTION)) == []
    assert guards.problems_for_server_args(_resolved(
        model, cuda_graph_backend_prefill="disabled", cuda_graph_backend_decode="disabled",
        **EXTRACTION)) == []
    problems = guards.problems_for_server_args(_resolved(
        model, cuda_graph_backend_prefill="breakable", enable_pdmux=True))
    assert len(problems) == 3  # graphs, radix cache, pdmux
    with pytest.raises(guards.UnsupportedServerConfig, match="--disable-radix-cache"):
        guards.raise_if(problems)


def test_cli_check_applies_sglang_graph_precedence():
    """hsdump serve's early check: SGLang's own parser and graph-config precedence."""
    from hsdump_patch.ops import serve

    def problems(*flags: str) -> list[str]:
        return guards.problems_for_cli_args(serve.sglang_parser().parse_args(
            ["--model-path", "/m", "--disable-radix-cache", *flags]))

    assert problems("--disable-cuda-graph") == []
    assert problems(*serve.REQUIRED_ARGS) == []
    [graph] = problems("--disable-cuda-graph", "--cuda-graph-config",
                       '{"prefill": {"backend": "breakable"}}')
    assert "--cuda-graph-config sets the prefill backend 'breakable'" in graph


def test_scheduler_check_reads_the_runner_prefill_graph_runner(tiny_models):
    """The authoritative check at install time also looks at the graph runner the model
    runner built: anything but SGLang's EagerRunner replays prefill from graphs."""
    from types import SimpleNamespace

    from sglang.srt.model_executor.runner.eager_runner import EagerRunner

    args = _resolved(tiny_models / "tiny-llama", disable_cuda_graph=True, **EXTRACTION)
    replaying = SimpleNamespace(server_args=args, prefill_cuda_graph_runner=SimpleNamespace())
    [problem] = guards.problems_for_runner(replaying)
    assert "replays prefill from a SimpleNamespace" in problem
    assert "--cuda-graph-backend-prefill disabled" in problem
    eager = SimpleNamespace(server_args=args,
                            prefill_cuda_graph_runner=EagerRunner.__new__(EagerRunner))
    assert guards.problems_for_runner(eager) == []


def test_writer_device_is_the_runner_gpu():
    """The capture binds the writer (and its threads) to the runner's GPU, not GPU 0."""
    assert runner_device("cuda", 3) == torch.device("cuda", 3)
    assert runner_device(torch.device("cuda", 1), 3) == torch.device("cuda", 1)
    assert runner_device("cpu", 0) == torch.device("cpu")


def test_parse_helpers():
    assert parse_size("4GiB", "X") == 4 << 30
    assert parse_size("512M", "X") == 512 * 10**6
    assert parse_size("1000", "X") == 1000
    assert parse_layers("auto") is None
    assert parse_layers("3, 31 59") == (3, 31, 59)
    with pytest.raises(ConfigError, match="unique"):
        parse_layers("3,3")


def test_config_defaults_and_draft_ids(tmp_path: Path):
    assert DumpConfig.from_env({}) is None
    draft = tmp_path / "config.json"
    draft.write_text(json.dumps({"eagle_aux_hidden_state_layer_ids": [1, 29, 57]}))
    cfg = DumpConfig.from_env({"SGLANG_HS_DUMP_DIR": "/dev/shm/x",
                               "SGLANG_HS_DUMP_DRAFT_CONFIG": str(draft)})
    assert cfg is not None
    assert cfg.layers is None and cfg.draft_layer_ids == (1, 29, 57)
    assert cfg.rid_prefix == "hsdump-" and cfg.dump_final  # the final state is on by default
    assert cfg.max_inflight_bytes == 4 << 30 and cfg.writer_threads == 8
    draft.write_text(json.dumps({"eagle_config": {}}))
    with pytest.raises(ConfigError, match="no eagle_aux_hidden_state_layer_ids"):
        DumpConfig.from_env({"SGLANG_HS_DUMP_DIR": "/x", "SGLANG_HS_DUMP_DRAFT_CONFIG": str(draft)})


def test_an_all_to_all_moe_backend_with_the_final_state_is_refused(tiny_models):
    """DeepEP (any --moe-a2a-backend) with the final state dumped: refused, naming both ways
    out; with layers only it runs."""
    args = _resolved(tiny_models / "tiny-deepseek-v3", **EXTRACTION, moe_a2a_backend="deepep")
    (problem,) = guards.problems_for_server_args(args, dump_final=True)
    assert problem.startswith("--moe-a2a-backend deepep with the final state dumped")
    assert "SGLANG_HS_DUMP_FINAL=0" in problem and "--moe-a2a-backend none" in problem
    assert guards.problems_for_server_args(args, dump_final=False) == []
