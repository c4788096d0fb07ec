"""Start-up behaviour: bad configuration stops a real server at once with a clear message;
with ``SGLANG_HS_DUMP_DIR`` unset the plugin installs nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hsdump_patch.capture import guards
from hsdump_patch.capture.config import (
    ConfigError,
    DumpConfig,
    parse_layers,
    parse_size,
)
from tests.harness import server as srv

NO_EXTRACTION_FLAGS: list[str] = []

# (id, extra server args, extraction args, env, expected message fragment)
STARTUP_ERRORS = [
    ("prefill-graphs-on", [], ["--disable-radix-cache"], {}, "Pass --disable-cuda-graph"),
    ("radix-cache-on", [], ["--disable-cuda-graph"], {}, "Pass --disable-radix-cache"),
    ("two-batch-overlap", ["--enable-two-batch-overlap"], srv.EXTRACTION_ARGS, {},
     "Remove --enable-two-batch-overlap"),
    ("pipeline-parallel", ["--pp-size", "2"], srv.EXTRACTION_ARGS, {}, "Use --pp-size 1"),
    ("dp-attention", ["--attn-dp-size", "2", "--tp-size", "2"], srv.EXTRACTION_ARGS, {},
     "Remove --attn-dp-size"),
    ("prefill-cp", ["--enable-prefill-cp", "--cp-strategy", "zigzag"], srv.EXTRACTION_ARGS, {},
     "Remove --enable-prefill-cp"),
    ("layers-not-ints", [], srv.EXTRACTION_ARGS, {"SGLANG_HS_DUMP_LAYERS": "3;x"},
     "SGLANG_HS_DUMP_LAYERS='3;x' is not a list of layer indices"),
    ("layers-out-of-range", [], srv.EXTRACTION_ARGS, {"SGLANG_HS_DUMP_LAYERS": "2,99"},
     "capture indices [99] are out of range"),
    ("relative-dir", [], srv.EXTRACTION_ARGS, {"SGLANG_HS_DUMP_DIR": "relative/dir"},
     "SGLANG_HS_DUMP_DIR='relative/dir' must be an absolute path"),
    ("bad-size", [], srv.EXTRACTION_ARGS, {"SGLANG_HS_DUMP_MAX_INFLIGHT_BYTES": "lots"},
     "SGLANG_HS_DUMP_MAX_INFLIGHT_BYTES='lots' is not a size"),
    ("bad-min-free", [], srv.EXTRACTION_ARGS, {"SGLANG_HS_DUMP_MIN_FREE_BYTES": "-1"},
     "SGLANG_HS_DUMP_MIN_FREE_BYTES='-1' is not a size"),
    ("bad-final", [], srv.EXTRACTION_ARGS, {"SGLANG_HS_DUMP_FINAL": "maybe"},
     "SGLANG_HS_DUMP_FINAL='maybe' is not a boolean"),
    ("bad-prefix", [], srv.EXTRACTION_ARGS, {"SGLANG_HS_DUMP_RID_PREFIX": "a b"},
     "SGLANG_HS_DUMP_RID_PREFIX='a b' must be non-empty"),
    ("bad-threads", [], srv.EXTRACTION_ARGS, {"SGLANG_HS_DUMP_WRITER_THREADS": "0"},
     "SGLANG_HS_DUMP_WRITER_THREADS='0' must be an integer in 1..64"),
    ("missing-draft-config", [], srv.EXTRACTION_ARGS,
     {"SGLANG_HS_DUMP_DRAFT_CONFIG": "/nonexistent/config.json"},
     "SGLANG_HS_DUMP_DRAFT_CONFIG=/nonexistent/config.json: file not found"),
    ("layers-and-draft-config", [], srv.EXTRACTION_ARGS,
     {"SGLANG_HS_DUMP_LAYERS": "1,2", "SGLANG_HS_DUMP_DRAFT_CONFIG": "/x/config.json"},
     "are both set"),
]


@pytest.mark.server
@pytest.mark.parametrize(("args", "extraction", "env", "message"),
                         [c[1:] for c in STARTUP_ERRORS], ids=[c[0] for c in STARTUP_ERRORS])
def test_bad_configuration_stops_the_server_with_a_clear_message(
        tiny_models, tmp_path, args, extraction, env, message):
    full_env = {"SGLANG_HS_DUMP_DIR": str(tmp_path / "dump"), **env}
    rc, log = srv.run_until_exit(tiny_models / "tiny-llama", tmp_path / "server.log", args=args,
                                 env=full_env, extraction_args=extraction, timeout=300)
    assert rc != 0
    assert message in log, log[-3000:]
    assert "Uvicorn running" not in log


@pytest.mark.server
def test_dump_off_installs_nothing(tiny_models, tmp_path):
    """Without SGLANG_HS_DUMP_DIR the plugin registers no hook, so even a configuration the
    patch would refuse serves normally."""
    s = srv.start(tiny_models / "tiny-llama", tmp_path / "server.log", extraction_args=[])
    try:
        assert s.generate([1, 5, 6, 7], rid="hsdump-x", max_new_tokens=2)["output_ids"]
        log = s.log()
    finally:
        s.stop()
    assert "hsdump" not in log.replace("hsdump-x", "")


def test_unsupported_flags_are_all_reported_together():
    class Args:
        disable_cuda_graph = False
        disable_radix_cache = False
        pp_size = 2

    problems = guards.find_problems(Args())
    assert len(problems) == 3
    with pytest.raises(guards.UnsupportedServerConfig, match="--pp-size 1"):
        guards.check(Args())


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
