"""Start-up behaviour: bad configuration stops a real server at once with a clear message (one
launch per failure stage). With ``SGLANG_HS_DUMP_DIR`` unset the plugin installs nothing: asserted
on the lane's plain server (radix cache on; tests/server/conftest.py)."""

from __future__ import annotations

import pytest
import requests

from tests.harness import server as srv

# One real launch per failure stage (id, extra server args, extraction args, env, expected
# message fragment); every other refusal is decided in-process, in tables of
# tests/unit/test_capture_config.py (the environment, the guards on the resolved server args).
STARTUP_ERRORS = [
    # Once SGLang has resolved its server args (one hook reads the capture's environment, then
    # the guards): hsdump verify's CPU variant launches a server with the radix cache on, which
    # that hook stops (check (e), asserted in tests/server/test_verify.py); a bad environment
    # raises in the same hook before the guards (its messages: the unit table).
    # At install, in each scheduler, against the loaded model.
    ("layers-out-of-range", [], srv.EXTRACTION_ARGS, {"SGLANG_HS_DUMP_LAYERS": "2,99"},
     "capture indices [99] are out of range"),
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
def test_a_rank_without_the_capture_refuses_to_serve_dumps(tiny_models, tmp_path):
    """SGLang only logs a plugin that fails to load or apply in one scheduler, which would
    leave that rank silently without capture. Here TP rank 1 loads no plugin (the test-only
    fault injection in tests/harness/fault_shim): the first dumped request stops the server
    with a message naming the rank."""
    env = {"SGLANG_HS_DUMP_DIR": str(tmp_path / "dump"), "HSDUMP_TEST_NO_PLUGINS_ON_TP_RANK": "1"}
    s = srv.start(tiny_models / "tiny-llama", tmp_path / "server.log", env=env, tp=2)
    try:
        assert s.generate([1, 5, 6, 7], rid="not-dumped", max_new_tokens=2)["output_ids"]
        with pytest.raises(requests.RequestException):
            s.generate([1, 5, 6, 7], rid="hsdump-x")
        rc = s.proc.wait(120)
    finally:
        s.stop()
    log = s.log()
    assert rc != 0
    assert "Skipping plugin hsdump" in log
    assert "the capture is not installed on TP rank 1 of this server" in log
    assert "Refusing to serve dumps" in log
