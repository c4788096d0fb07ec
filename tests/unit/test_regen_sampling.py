"""``hsdump regenerate``'s fallback sampling is SGLang's own (no server)."""

from __future__ import annotations

from hsdump_patch.client.regenerate import SAMPLING_KEYS, SERVER_DEFAULTS
from tests.harness.sglang_defaults import sglang_chat_defaults


def test_server_defaults_are_sglangs_chat_defaults(sglang_available):
    """The defaults regenerate records as "sglang default" are what SGLang's chat API samples
    with when neither the request nor generation_config.json sets a key, for the same keys."""
    sglangs = sglang_chat_defaults()
    assert sglangs == SERVER_DEFAULTS
    assert sorted(SAMPLING_KEYS) == sorted(sglangs)
