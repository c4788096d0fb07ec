"""Test-only: prerequisites a test needs (skipped locally when missing, failed in CI), and
SpecForge's released code on ``sys.path``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require(condition: bool, what: str) -> None:
    """Skip when a prerequisite is missing locally; fail in CI, where nothing may be skipped."""
    if condition:
        return
    if IN_CI:
        pytest.fail(f"missing prerequisite in CI: {what}")
    pytest.skip(f"missing prerequisite: {what}")


def specforge_on_path() -> None:
    """Put SpecForge's released code (``make test`` installs it at $HSDUMP_SPECFORGE_PATH) on
    ``sys.path``, so tests import SpecForge's own modules."""
    path = os.environ.get("HSDUMP_SPECFORGE_PATH", "")
    require(bool(path) and Path(path, "specforge").is_dir(),
            "SpecForge's code at $HSDUMP_SPECFORGE_PATH (make test installs it)")
    if path not in sys.path:
        sys.path.insert(0, path)
