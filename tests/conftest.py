"""The suite's lanes and the fixtures every lane may use.

Each test file lives in one lane directory and gets that lane's marker (registered in
pyproject.toml): ``unit`` (no server, no container), ``server`` (real CPU SGLang servers),
``image`` (the Docker image) and ``ansible`` (real Ansible against containers). Shared helpers
live in tests/harness; fixtures of one lane in that lane's conftest.py.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from tests.harness import server as srv
from tests.harness.needs import require

# Fixtures of the image and Ansible lanes (the Ansible tests use the image lane's engine too).
pytest_plugins = ["tests.harness.image", "tests.harness.ansible"]

LANES = ("unit", "server", "image", "ansible")
TESTS = Path(__file__).resolve().parent

# The suite runs SGLang on CPU: in-process imports of SGLang's model code need the test-only
# stand-in for the CUDA-only sgl_kernel too (servers get it through their environment).
os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
sys.path.insert(0, str(srv.CPU_SHIM))


def lane_of(path: Path) -> str | None:
    """The lane of a test file: the directory under tests/ it lives in."""
    parts = Path(path).resolve().relative_to(TESTS).parts
    return parts[0] if len(parts) > 1 and parts[0] in LANES else None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test with its lane; a test file outside the lanes is an error."""
    for item in items:
        lane = lane_of(item.path)
        if lane is None:
            raise pytest.UsageError(f"{item.path}: a test file must live in tests/<lane>/, "
                                    f"one of {', '.join(LANES)}")
        item.add_marker(lane)


@pytest.fixture(scope="session")
def sglang_available() -> None:
    require(importlib.util.find_spec("sglang") is not None, "sglang==0.5.23 importable")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, sglang_available) -> Path:
    """Directory with ``tiny-llama`` and ``tiny-deepseek-v3`` random-weight checkpoints."""
    from tests.harness import make_models

    out = tmp_path_factory.mktemp("models")
    make_models.make_llama(out / "tiny-llama")
    make_models.make_deepseek_v3(out / "tiny-deepseek-v3")
    return out


@pytest.fixture(scope="session")
def tiny_kimi(tmp_path_factory, sglang_available) -> tuple[Path, Path]:
    """A tiny Kimi-K2.5 checkpoint (float32) and its language model as plain DeepSeek-V3."""
    from tests.harness import make_models

    out = tmp_path_factory.mktemp("kimi-models")
    return (make_models.make_kimi_k25(out / "tiny-kimi-k25", out / "tiny-kimi-k25-text"),
            out / "tiny-kimi-k25-text")


@pytest.fixture(scope="module")
def kimi_tokenizer(tiny_kimi):
    """The tiny Kimi-K2.5's tokenizer (Kimi's custom tiktoken code), loaded once per module."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_kimi[0], trust_remote_code=True)
