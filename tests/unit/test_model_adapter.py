"""The capture points the patch relies on exist in the installed SGLang (and drift is named)."""

from __future__ import annotations

import pytest

from hsdump_patch.capture import model_adapter


@pytest.fixture(scope="module")
def sglang_version(sglang_available) -> str:
    import sglang

    return sglang.__version__


def test_installed_sglang_is_supported_and_has_every_capture_point(sglang_version):
    assert sglang_version in model_adapter.SUPPORTED_SGLANG_VERSIONS
    assert model_adapter.check_capture_points() == []


def test_a_missing_capture_point_is_named(sglang_version, monkeypatch):
    from sglang.srt.layers.layer_boundary.stage import StageBoundary
    from sglang.srt.models.llama import LlamaDecoderLayer

    def prepare_without_capture(self, hidden_states, stream, forward_batch):
        raise AssertionError("never called")

    def forward_without_boundary(self, positions, hidden_states, forward_batch):
        raise AssertionError("never called")

    monkeypatch.setattr(StageBoundary, "_prepare_attention", prepare_without_capture)
    monkeypatch.setattr(LlamaDecoderLayer, "forward", forward_without_boundary)
    problems = model_adapter.check_capture_points()
    assert any("no longer accepts capture_gathered" in p for p in problems), problems
    assert any("LlamaDecoderLayer.forward no longer calls attn_boundary.prepare" in p
               for p in problems), problems
