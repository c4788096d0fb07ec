"""The unit lane: every test leaves the process environment as it found it.

SGLang's in-process resolution of server args (the guard tables) sets ``NCCL_*`` variables in
``os.environ`` (its MoE and parallel hooks), and ``make test`` runs this lane in the process of
the Ansible lane, whose NCCL-check stand-ins log the ``NCCL_*`` environment they are given.
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
