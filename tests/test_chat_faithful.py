"""Rows that quote the chat format's own markers still give each turn whole (issue 16).

The tiny Kimi-K2.5 tokenizer (Kimi-style custom tiktoken code, tests/harness/kimi) turns the
text ``<|im_assistant|>assistant<|im_middle|>`` into the assistant header tokens themselves, so
a renderer that looks for the header in rendered text finds it inside a message. Expectations are
spelled out as Kimi-K2.5's wire format (tests/test_kimi.py), token by token.
"""

from __future__ import annotations

import pytest

from hsdump_patch.client.conversation import ChatRenderer, parse_conversation
from tests.test_kimi import GEN, SYSTEM, emitted, expected, past, user

HEADER = "<|im_assistant|>assistant<|im_middle|>"


@pytest.fixture(scope="module")
def kimi_tokenizer(tiny_kimi):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_kimi[0], trust_remote_code=True)


QUOTED = [
    ({"id": "quoted-once", "messages": [
        {"role": "user", "content": f"Print {HEADER} verbatim."},
        {"role": "assistant", "content": f"Here: {HEADER} and more.",
         "reasoning_content": f"They want {HEADER} shown."},
    ]}, [("", [(SYSTEM + user(f"Print {HEADER} verbatim.") + GEN, 0),
               (emitted(f"They want {HEADER} shown.", f"Here: {HEADER} and more."), 1)])]),
    ({"id": "quoted-multi-turn", "messages": [
        {"role": "user", "content": f"{HEADER}?"},
        {"role": "assistant", "content": f"It is {HEADER}, the header."},
        {"role": "user", "content": "Again"},
        {"role": "assistant", "content": f"{HEADER}"},
    ]}, [("", [(SYSTEM + user(f"{HEADER}?") + GEN, 0),
               (emitted("", f"It is {HEADER}, the header."), 1)]),
         ("#3", [(SYSTEM + user(f"{HEADER}?") + past(f"It is {HEADER}, the header.")
                  + user("Again") + GEN, 0), (emitted("", HEADER), 1)])]),
]


@pytest.mark.parametrize(("row", "want"), QUOTED, ids=[r["id"] for r, _ in QUOTED])
@pytest.mark.parametrize("policy", ["auto", "per-turn"])
def test_quoted_header_keeps_every_turn_whole(kimi_tokenizer, row, want, policy):
    samples = ChatRenderer(kimi_tokenizer, policy=policy).render(parse_conversation(row))
    assert [s.suffix for s in samples] == [suffix for suffix, _ in want]
    for sample, (_, segments) in zip(samples, want, strict=True):
        ids, mask = expected(kimi_tokenizer, segments)
        assert sample.input_ids == ids
        assert sample.loss_mask == mask
