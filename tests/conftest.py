"""Shared fixtures: tiny models and real CPU SGLang servers, each kind started once.

Servers are expensive (20-40 s to start, several GB): the main dump-enabled server of each
model is session-scoped and shared by every test module; specialised servers are started by
the module that needs them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.harness import server as srv

pytest_plugins = ["tests.fixtures_image", "tests.fixtures_ansible"]

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

# The suite runs SGLang on CPU: in-process imports of SGLang's model code need the test-only
# stand-in for the CUDA-only sgl_kernel too (servers get it through their environment).
os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
sys.path.insert(0, str(srv.CPU_SHIM))
# Small chunks so ordinary test prompts are split across several prefill forwards.
CHUNK = 32


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


@dataclass
class DumpServer:
    """A running server with the capture patch active, and its dump directory."""

    server: srv.Server
    dump_dir: Path
    model: Path

    @property
    def url(self) -> str:
        return self.server.url


def start_dump_server(tmp: Path, model: Path, name: str, *, args: list[str] = (),
                      env: dict[str, str] | None = None, tp: int = 1,
                      dump: bool = True) -> DumpServer:
    """Start a server for ``model``; with ``dump`` the patch is on, writing under ``tmp``."""
    dump_dir = tmp / f"dump-{name}"
    # The final state is on by default; these servers add it only when asked (env).
    full_env = {"SGLANG_HS_DUMP_DIR": str(dump_dir), "SGLANG_HS_DUMP_FINAL": "0"} if dump else {}
    full_env.update(env or {})
    server = srv.start(model, tmp / f"server-{name}.log", args=list(args), env=full_env, tp=tp)
    return DumpServer(server, dump_dir, model)


# The drafter layer ids the DeepSeek server is configured with, through a drafter config for
# the patch and --return-aux-hidden-state-layer-ids for SGLang's own capture: both must resolve
# them with DeepSeek's convention (first id 1: every id + 1 -> capture before layers 2, 4, 6).
DEEPSEEK_DRAFT_IDS = [1, 3, 5]


def _dump_server(tmp: Path, model: Path, name: str, *, args: list[str] = (),
                 env: dict[str, str] | None = None) -> Iterator[DumpServer]:
    s = start_dump_server(
        tmp, model, name,
        args=["--chunked-prefill-size", str(CHUNK), "--enable-return-aux-hidden-states",
              "--speculative-algorithm", "EAGLE3", *args],
        env={"SGLANG_HS_DUMP_FINAL": "1", **(env or {})},
    )
    yield s
    s.server.stop()


@pytest.fixture(scope="session")
def llama_server(tmp_path_factory, tiny_models) -> Iterator[DumpServer]:
    """Tiny Llama, dump on (auto layers + final state), chunked prefill of CHUNK tokens with
    mixed chunks (``--enable-mixed-chunk``: a prefill beside running decodes is one MIXED
    forward), and SGLang's own aux capture on (``return_hidden_states`` returns the EAGLE-3
    layers)."""
    tmp = tmp_path_factory.mktemp("llama-server")
    yield from _dump_server(tmp, tiny_models / "tiny-llama", "tiny-llama",
                            args=["--enable-mixed-chunk"])


@pytest.fixture(scope="session")
def deepseek_server(tmp_path_factory, tiny_models) -> Iterator[DumpServer]:
    """Tiny DeepSeek-V3 (MLA + MoE), configured like ``llama_server`` but with 'auto' layers
    taken from a drafter config (``DEEPSEEK_DRAFT_IDS``)."""
    tmp = tmp_path_factory.mktemp("deepseek-server")
    draft = tmp / "draft-config.json"
    draft.write_text(json.dumps({"eagle_config": {"eagle_aux_hidden_state_layer_ids":
                                                  DEEPSEEK_DRAFT_IDS}}))
    yield from _dump_server(
        tmp, tiny_models / "tiny-deepseek-v3", "tiny-deepseek-v3",
        args=["--return-aux-hidden-state-layer-ids", *map(str, DEEPSEEK_DRAFT_IDS)],
        env={"SGLANG_HS_DUMP_DRAFT_CONFIG": str(draft)},
    )


@pytest.fixture(scope="session")
def tiny_kimi(tmp_path_factory, sglang_available) -> tuple[Path, Path]:
    """A tiny Kimi-K2.5 checkpoint (float32) and its language model as plain DeepSeek-V3."""
    from tests.harness import make_models

    out = tmp_path_factory.mktemp("kimi-models")
    return (make_models.make_kimi_k25(out / "tiny-kimi-k25", out / "tiny-kimi-k25-text"),
            out / "tiny-kimi-k25-text")


@pytest.fixture(scope="session")
def kimi_server(tmp_path_factory, tiny_kimi) -> Iterator[DumpServer]:
    """The tiny Kimi-K2.5 served text-only as SGLang serves it (``language_model_only``,
    Kimi's custom tokenizer code), float32, dump on with the final state, chunked prefill."""
    tmp = tmp_path_factory.mktemp("kimi-server")
    s = start_dump_server(
        tmp, tiny_kimi[0], "tiny-kimi-k25",
        args=["--chunked-prefill-size", str(CHUNK), "--dtype", "float32", "--trust-remote-code",
              "--json-model-override-args", json.dumps({"language_model_only": True})],
        env={"SGLANG_HS_DUMP_FINAL": "1"},
    )
    yield s
    s.server.stop()


@pytest.fixture(scope="session")
def qwen3_style_server(tmp_path_factory, sglang_available) -> Iterator[DumpServer]:
    """A tiny float32 Llama with ChatML / Qwen3 special tokens, served with the Qwen3-style
    template through ``--chat-template`` (its tokenizer's own template is another one), SGLang's
    qwen3 reasoning and qwen25 tool-call parsers, dump on with the final state."""
    from tests.harness import make_models

    tmp = tmp_path_factory.mktemp("qwen3-style-server")
    model = make_models.make_qwen3_style(tmp / "tiny-qwen3-style")
    s = start_dump_server(
        tmp, model, "tiny-qwen3-style",
        args=["--chunked-prefill-size", str(CHUNK), "--dtype", "float32",
              "--chat-template", str(make_models.QWEN3_STYLE_TEMPLATE),
              "--reasoning-parser", "qwen3", "--tool-call-parser", "qwen25"],
        env={"SGLANG_HS_DUMP_FINAL": "1"},
    )
    yield s
    s.server.stop()
