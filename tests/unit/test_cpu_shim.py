"""The CPU stand-ins every CPU test server runs with (tests/harness/cpu_shim): what they change in
a fresh process started with ``cpu_env``, as the servers are."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.harness import server as srv

PROBE = """
import torch
try:
    import flashinfer
except ModuleNotFoundError:
    flashinfer = None
print(torch.get_num_threads(), flashinfer is not None)
"""


@pytest.mark.parametrize(("given", "threads"), [(None, 1), ("2", 2)])
def test_a_cpu_server_process_runs_one_openmp_thread_unless_told(given, threads):
    """One OpenMP thread unless ``OMP_NUM_THREADS`` says otherwise (a 2-thread pool spins at each
    barrier for its preempted thread on the busy 2-core machine); FlashInfer is left out."""
    env = srv.cpu_env()
    env.pop("OMP_NUM_THREADS", None)  # make test's lanes set it for themselves
    if given:
        env["OMP_NUM_THREADS"] = given
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out == [str(threads), "False"]
