"""The unit lane: every test leaves the process environment as it found it.

SGLang's in-process resolution of server args (the guard tables) sets ``NCCL_*`` variables in
``os.environ`` (its MoE and parallel hooks), and whatever later tests of the same pytest process
start inherits that environment: the server lane's servers (``cpu_env`` copies it) in
``make test``, and the Ansible lane's playbooks when one process runs both lanes (its NCCL-check
stand-ins log the ``NCCL_*`` environment they are given: two failures, 2026-12-03).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _environment_restored() -> Iterator[None]:
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
