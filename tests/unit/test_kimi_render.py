"""The tiny Kimi-K2.5's tokenizer and ChatRenderer on real-shaped agent / thinking rows, token by
token (no server; tests/server/test_kimi.py extracts the same battery from the served model).

The expectations are written independently of the chat template and of the renderer
(tests/harness/kimi_wire.py): the prompt part as the template renders the conversation before a
turn with the generation prompt (which opens ``<think>``), the trained part as the model emits
the turn after it: reasoning, ``</think>``, content, tool-call section, ``<|im_end|>``.
"""

from __future__ import annotations

import pytest

from hsdump_patch.client.rows.conversation import ChatRenderer, parse_conversation
from tests.harness.kimi_wire import BATTERY, GEN, SYSTEM, emitted, expected, user


def test_kimi_tokenizer_is_kimis_custom_code_with_its_special_layout(kimi_tokenizer):
    tok = kimi_tokenizer
    assert type(tok).__name__ == "TikTokenTokenizer"
    base = len(tok.model._mergeable_ranks)
    for text, off in (("<|im_end|>", 2), ("<|im_assistant|>", 4), ("<|im_middle|>", 17),
                      ("<think>", 22), ("</think>", 23), ("<|tool_calls_section_begin|>", 11)):
        assert tok.encode(text, add_special_tokens=False) == [base + off]


@pytest.mark.parametrize(("row", "want"), BATTERY, ids=[r["id"] for r, _ in BATTERY])
def test_battery_of_real_shaped_rows_masks_token_by_token(kimi_tokenizer, row, want):
    samples = ChatRenderer(kimi_tokenizer).render(parse_conversation(row))
    assert [s.suffix for s in samples] == [suffix for suffix, _ in want]
    for sample, (_, segments) in zip(samples, want, strict=True):
        ids, mask = expected(kimi_tokenizer, segments)
        assert sample.input_ids == ids
        assert sample.loss_mask == mask


def test_multi_turn_policies(kimi_tokenizer):
    row = BATTERY[2][0]  # prefix-stable: auto gives one sample
    conv = parse_conversation(row)
    (auto,) = ChatRenderer(kimi_tokenizer, policy="auto").render(conv)
    first, second = ChatRenderer(kimi_tokenizer, policy="per-turn").render(conv)
    (last,) = ChatRenderer(kimi_tokenizer, policy="last").render(conv)
    assert (first.suffix, second.suffix) == ("", "#4")
    assert last.input_ids == second.input_ids == auto.input_ids
    assert last.loss_mask == second.loss_mask
    assert sum(auto.loss_mask) == sum(first.loss_mask) + sum(second.loss_mask)


def test_regenerated_token_ids_are_the_completion_verbatim(kimi_tokenizer):
    tok = kimi_tokenizer
    generated = tok.encode(emitted("Hm.", "Yes"), add_special_tokens=False)
    row = {"messages": [{"role": "user", "content": "Hello world"},
                        {"role": "assistant", "content": "ignored", "token_ids": generated}]}
    (sample,) = ChatRenderer(tok).render(parse_conversation(row))
    prompt = tok.encode(SYSTEM + user("Hello world") + GEN, add_special_tokens=False)
    assert sample.input_ids == prompt + generated
    assert sample.loss_mask == [0] * len(prompt) + [1] * len(generated)
