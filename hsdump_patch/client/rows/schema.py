"""The chat row's hsdump fields: what ``hsdump regenerate`` writes and ``hsdump extract`` reads.

A chat row is OpenAI-style ``messages`` (or ShareGPT ``conversations``). hsdump adds, beside
the chat API's own fields (which requests carry; these never reach the server):

* on an assistant message, ``token_ids``: the ids the model generated for it; extract uses
  them verbatim as the turn's completion (a cut turn keeps its cut prefix, with no end of
  turn), never re-encoding the text;
* on an assistant message, ``train``: ``false`` keeps the turn as prompt only (loss mask 0),
  as ``regenerate --train-only-regenerated`` marks the original turns a row keeps;
* on the row, ``regenerated``: what regenerate did (:class:`Regenerated`), for people and
  reports; extract does not need it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

TOKEN_IDS = "token_ids"
TRAIN = "train"
REGENERATED = "regenerated"


class RowFieldError(ValueError):
    """An hsdump field of a row has the wrong shape."""


def token_ids(message: dict[str, Any], k: int) -> list[int] | None:
    """Message ``k``'s generated ``token_ids``, or None when it has none (then its text is
    encoded); a RowFieldError when they are not a non-empty list of integers."""
    ids = message.get(TOKEN_IDS)
    if ids is not None and (not isinstance(ids, list) or not ids or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids)):
        raise RowFieldError(f"messages[{k}].token_ids must be a non-empty list of integers")
    return ids


def trained(message: dict[str, Any]) -> bool:
    """Whether an assistant message is trained (not marked ``"train": false``)."""
    return message.get(TRAIN) is not False


@dataclass(frozen=True)
class Regenerated:
    """The row's ``regenerated`` field: the turns generated and how."""

    policy: str  # the regeneration plan's mode (regen_plan.Plan.mode)
    agent_trace: bool  # the row's tool results answer earlier tool calls
    turns: list[int]  # message indices generated, in order
    finish_reasons: list[str]  # one per generated turn (stop, length, ...)
    cut: bool  # the last generated turn hit --max-new-tokens: the row ends there
    cut_at: int | None
    turns_not_generated: int  # planned turns after a cut turn
    train_only_regenerated: bool  # the kept original assistant turns are marked train false
    sampling: dict[str, Any]
    sampling_source: dict[str, str]
    chat_template_kwargs: dict[str, Any] | None
    max_new_tokens: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)
