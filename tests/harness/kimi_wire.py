"""Test-only: Kimi-K2.5's wire format spelled out segment by segment (independent of the chat
template and of the renderer), and the (ids, loss mask) a list of segments tokenizes to."""

from __future__ import annotations

SYSTEM = "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"  # noqa: E501


GEN = "<|im_assistant|>assistant<|im_middle|><think>"


def user(text: str) -> str:
    return f"<|im_user|>user<|im_middle|>{text}<|im_end|>"


def past(content: str, section: str = "", reasoning: str = "") -> str:
    """An earlier assistant turn as the template renders it in a later prompt."""
    return f"<|im_assistant|>assistant<|im_middle|><think>{reasoning}</think>{content}{section}<|im_end|>"  # noqa: E501


def emitted(reasoning: str, content: str, section: str = "") -> str:
    """An assistant turn as the model generates it after GEN."""
    return f"{reasoning}</think>{content}{section}<|im_end|>"


def expected(tok, segments) -> tuple[list[int], list[int]]:
    ids, mask = [], []
    for text, trained in segments:
        seg = tok.encode(text, add_special_tokens=False)
        ids += seg
        mask += [trained] * len(seg)
    return ids, mask
