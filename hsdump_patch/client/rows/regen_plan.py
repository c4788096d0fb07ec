"""Which assistant turns of a chat row ``hsdump regenerate`` writes anew, and why a row is unfit.

Policy (``--agent-policy``):

* A plain conversation: every assistant turn is regenerated in order, each prompt holding the
  turns regenerated before it; user, system and tool messages stay as given. A row ending in
  a user or tool message gets one new assistant turn appended.
* An agent trace (a ``tool`` message after an assistant message with ``tool_calls``): the tool
  results answer the original calls, so by default (``last``) the original assistant turns are
  kept and only the last one is regenerated (or a new one appended after a final tool
  result). ``all`` regenerates every assistant turn anyway (later tool results may then not
  match the calls).

Assistant messages before the first user turn (a canned greeting) are kept as given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hsdump_patch.client.rows.conversation import ConversationError, parse_conversation
from hsdump_patch.client.rows.dataset import SampleError

AGENT_POLICIES = ("last", "all")
DEFAULT_AGENT_POLICY = "last"


@dataclass(frozen=True)
class Plan:
    """A row's messages and the indices of the assistant turns to (re)generate, in order.

    ``turns`` may include ``len(messages)``: a new assistant turn appended at the end.
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    turns: list[int]
    agent: bool
    mode: str  # "all-turns" | "last-turn"


def is_agent_trace(messages: list[dict[str, Any]]) -> bool:
    """True when a tool message follows an assistant message that made tool calls."""
    called = False
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            called = True
        elif m["role"] == "tool" and called:
            return True
    return False


def plan_row(obj: dict[str, Any], where: str, agent_policy: str = DEFAULT_AGENT_POLICY) -> Plan:
    """Check a chat row and decide its turns; raise :class:`SampleError` if it is unfit."""
    if "messages" not in obj and "conversations" not in obj:
        what = "a pre-tokenized row" if "input_ids" in obj else "this row"
        raise SampleError(where, f'{what} cannot be regenerated: it needs "messages" (OpenAI '
                          'style) or "conversations" (ShareGPT style)')
    try:
        conv = parse_conversation(obj)
    except ConversationError as e:
        raise SampleError(where, str(e)) from None
    messages, tools = conv.messages, conv.tools
    for k, m in enumerate(messages):
        if m["role"] != "assistant" and not m["content"].strip():
            raise SampleError(where, f"message {k} ({m['role']}) has empty content: fix or drop "
                              "the row")
    first_user = next((k for k, m in enumerate(messages) if m["role"] == "user"), None)
    if first_user is None:
        raise SampleError(where, "the row has no user turn: there is nothing to answer")
    assistant = [k for k, m in enumerate(messages) if m["role"] == "assistant" and k > first_user]
    end = [len(messages)] if messages[-1]["role"] != "assistant" else []
    agent = is_agent_trace(messages)
    if agent and agent_policy == "last":
        return Plan(messages, tools, (assistant + end)[-1:], True, "last-turn")
    return Plan(messages, tools, assistant + end, agent, "all-turns")
