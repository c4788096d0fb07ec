"""What the server serves: its own prompt ids for a chat request.

SGLang 0.5.23 is the reference for prompts (its chat template is followed by
:func:`~hsdump_patch.client.server.tokenizer.follow_chat_template`). ``ServedPrompts`` asks
the server for the prompt ids it would serve a chat request (``/v1/tokenize`` with
``messages``: the same ``OpenAIServingChat._process_messages`` as ``/v1/chat/completions``, no
forward) and refuses a turn whose locally rendered prompt differs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from hsdump_patch.client.rows.conversation import MESSAGE_FIELDS, Conversation, ConversationError

# A server call: (messages, tools, chat_template_kwargs) -> the prompt ids it serves.
Tokenize = Callable[[list[dict[str, Any]], "list[dict[str, Any]] | None",
                     "dict[str, Any] | None"], list[int]]


def request_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as a chat request carries them: the chat API's fields, values untouched
    (hsdump's own keys such as ``token_ids`` and ``train`` left out)."""
    return [{f: m[f] for f in MESSAGE_FIELDS if f in m} for m in messages]


class ServedPrompts:
    """Checks each trained turn's prompt ids against the server's own rendering of the turn's
    request; counts the turns checked. The server's answers for the conversation last asked
    about are kept, so a turn checked twice (``auto``'s one stream, then its per-turn fallback)
    is asked and counted once."""

    def __init__(self, tokenize: Tokenize, template_kwargs: dict[str, Any] | None) -> None:
        self.tokenize = tokenize
        self.template_kwargs = dict(template_kwargs or {}) or None
        self.checked = 0
        self._conv: Conversation | None = None
        self._served: dict[int, list[int]] = {}

    def served(self, conv: Conversation, k: int) -> list[int]:
        """The prompt ids the server serves for the messages before ``k``."""
        if conv is not self._conv:
            self._conv, self._served = conv, {}
        if k not in self._served:
            self._served[k] = self.tokenize(request_messages((conv.request or conv.messages)[:k]),
                                            conv.tools, self.template_kwargs)
            self.checked += 1
        return self._served[k]

    def __call__(self, conv: Conversation, k: int, ids: list[int]) -> None:
        """Raise ConversationError when ``ids`` are not the server's prompt of turn ``k``."""
        served = self.served(conv, k)
        if served == ids:
            return
        at = next((i for i, (a, b) in enumerate(zip(ids, served, strict=False)) if a != b),
                  min(len(ids), len(served)))
        raise ConversationError(
            f"messages[{k}]: the prompt rendered here differs from the one the server serves for "
            f"this turn (its /v1/tokenize of the same messages) at token {at} (here "
            f"{ids[at:at + 4]} of {len(ids)}, server {served[at:at + 4]} of {len(served)}): "
            "the server renders with another template or treats these messages differently; "
            "check --chat-template-kwargs and the server's --chat-template")
