"""The server lane: real CPU SGLang servers. The main dump-enabled server of each model is
session-scoped and shared by every test module of the lane; specialised servers are started by
the module that needs them."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.harness.dump_server import (
    CHUNK,
    DEEPSEEK_DRAFT_IDS,
    DumpServer,
    eagle3_dump_server,
    start_dump_server,
)


@pytest.fixture(scope="session")
def llama_server(tmp_path_factory, tiny_models) -> Iterator[DumpServer]:
    """Tiny Llama, dump on (auto layers + final state), chunked prefill of CHUNK tokens with
    mixed chunks (``--enable-mixed-chunk``: a prefill beside running decodes is one MIXED
    forward), and SGLang's own aux capture on (``return_hidden_states`` returns the EAGLE-3
    layers)."""
    tmp = tmp_path_factory.mktemp("llama-server")
    yield from eagle3_dump_server(tmp, tiny_models / "tiny-llama", "tiny-llama",
                                  args=["--enable-mixed-chunk"])


@pytest.fixture(scope="session")
def deepseek_server(tmp_path_factory, tiny_models) -> Iterator[DumpServer]:
    """Tiny DeepSeek-V3 (MLA + MoE), configured like ``llama_server`` but with 'auto' layers
    taken from a drafter config (``DEEPSEEK_DRAFT_IDS``)."""
    tmp = tmp_path_factory.mktemp("deepseek-server")
    draft = tmp / "draft-config.json"
    draft.write_text(json.dumps({"eagle_config": {"eagle_aux_hidden_state_layer_ids":
                                                  DEEPSEEK_DRAFT_IDS}}))
    yield from eagle3_dump_server(
        tmp, tiny_models / "tiny-deepseek-v3", "tiny-deepseek-v3",
        args=["--return-aux-hidden-state-layer-ids", *map(str, DEEPSEEK_DRAFT_IDS)],
        env={"SGLANG_HS_DUMP_DRAFT_CONFIG": str(draft)},
    )


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
