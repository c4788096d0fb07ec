"""``make smoke`` with no server given: it starts a local dump-enabled server, runs the smoke
check against it and stops it. In a module of its own, which uses no session server, so it runs
after they have stopped (tests/server/conftest.py orders the lane's modules)."""

from __future__ import annotations

import json

import pytest

from tests.harness.extraction import make_smoke


@pytest.mark.server
def test_make_smoke_on_its_own_starts_and_stops_a_local_server(tmp_path):
    r = make_smoke(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "hsdump smoke: PASS" in r.stdout and "smoke: server stopped" in r.stdout
    assert json.loads((tmp_path / "report.json").read_text())["passed"]
    assert "hsdump: capturing the residual stream" in (tmp_path / "server.log").read_text()
