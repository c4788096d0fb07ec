"""Test-only: dataset rows in both chat shapes, their template-independent reference
tokens, and a JSONL writer (the tiny tokenizer's template of tests/harness/make_models.py)."""

from __future__ import annotations

import json
from pathlib import Path

CONV = [
    ("system", "You are terse."),
    ("user", "What is the capital of France?"),
    ("assistant", "Paris is the capital of France."),
    ("user", "And the quick brown fox?"),
    ("assistant", "It jumps over the lazy dog."),
]


SHAREGPT_NAMES = {"system": "system", "user": "human", "assistant": "gpt"}


def openai_row(conv, **extra):
    return {"messages": [{"role": r, "content": c} for r, c in conv], **extra}


def sharegpt_row(conv, **extra):
    return {"conversations": [{"from": SHAREGPT_NAMES[r], "value": c} for r, c in conv], **extra}


def reference(tokenizer, conv):
    """Independent of the chat template: the tiny template is <|role|>content</s> per turn, and
    the assistant tokens are its content and the closing </s>."""
    ids, mask = [], []
    for role, content in conv:
        body = tokenizer.encode(content, add_special_tokens=False)
        body.append(tokenizer.convert_tokens_to_ids("</s>"))
        ids += [tokenizer.convert_tokens_to_ids(f"<|{role}|>"), *body]
        mask += [0] + [int(role == "assistant")] * len(body)
    return ids, mask


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path
