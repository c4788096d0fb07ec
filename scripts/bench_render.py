"""Benchmark: rendering + masking cost of a long agent conversation vs one render+encode.

``python scripts/bench_render.py [--turns 64] [--tokens 27000] [--repeats 5]`` builds the tiny
Kimi-K2.5 tokenizer (Kimi-style tiktoken custom code + K2.5-style template, tests/harness),
makes a thinking agent trace of ``--turns`` messages (one user query, then assistant turns with
reasoning and a tool call, each answered by a tool message, and a final answer) padded to about
``--tokens`` tokens, and times, in the same run:

* the baseline: one render + encode of the conversation: ``prompt_ids`` of the last turn
  (``apply_chat_template`` of every message before it with the generation prompt, encoded);
* ``ChatRenderer.render`` under each multi-turn policy (the extraction path);
* the quadratic reference: render + encode of every assistant turn's whole prompt.

It prints a table of best-of-N times and their ratio to the baseline.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hsdump_patch.client.conversation import (
    ChatRenderer,
    Conversation,
    parse_conversation,
    prompt_ids,
)

WORDS = [
    "the", "tool", "returned", "a", "long", "answer", "about", "the", "weather", "in", "Paris",
    "and", "the", "user", "wants", "a", "short", "summary", "so", "I", "will", "think", "about",
    "it", "step", "by", "step",
]


def conversation(turns: int, tokens: int, tok) -> Conversation:
    """An agent trace of ``turns`` messages with about ``tokens`` tokens."""
    tools = [{"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}}}}]

    def build(words_per_msg: int) -> dict:
        text = " ".join(WORDS[i % len(WORDS)] for i in range(words_per_msg))
        msgs = [{"role": "user", "content": "Find out. " + text}]
        while len(msgs) < turns - 1:
            k = len(msgs)
            call = {"id": f"functions.search:{k}", "type": "function",
                    "function": {"name": "search", "arguments": f'{{"q": "step {k}"}}'}}
            msgs.append({"role": "assistant", "content": "", "reasoning_content": text,
                         "tool_calls": [call]})
            msgs.append({"role": "tool", "tool_call_id": call["id"], "content": text})
        msgs.append({"role": "assistant", "content": text, "reasoning_content": text})
        return {"messages": msgs, "tools": tools}

    words = 10
    for _ in range(3):  # the per-message overhead is fixed: converge on the token count
        conv = parse_conversation(build(words))
        n = len(prompt_ids(tok, conv.messages[:-1], conv.tools))
        words = max(1, round(words * tokens / n))
    return parse_conversation(build(words))


def best(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=64, help="messages (default 64)")
    parser.add_argument("--tokens", type=int, default=27000,
                        help="approximate tokens of the conversation (default 27000)")
    parser.add_argument("--repeats", type=int, default=5, help="best of N (default 5)")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from tests.harness.make_models import make_kimi_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        make_kimi_tokenizer(Path(tmp))
        tok = AutoTokenizer.from_pretrained(tmp, trust_remote_code=True)
    conv = conversation(args.turns, args.tokens, tok)
    msgs, tools = conv.messages, conv.tools

    def baseline() -> list[int]:  # the last turn's serving prompt: the longest render
        return prompt_ids(tok, msgs[:-1], tools)

    def quadratic() -> None:
        for k, m in enumerate(msgs):
            if m["role"] == "assistant":
                prompt_ids(tok, msgs[:k], tools)

    n_tokens = len(baseline())
    rows = [("one render + encode (baseline)", best(baseline, args.repeats))]
    for policy in ("auto", "per-turn", "last"):
        renderer = ChatRenderer(tok, policy=policy)
        samples = renderer.render(conv)
        rows.append((f"render, --multi-turn {policy} ({len(samples)} sample(s))",
                     best(lambda r=renderer: r.render(conv), args.repeats)))
    rows.append(("every turn's prompt rendered + encoded", best(quadratic, args.repeats)))
    base = rows[0][1]
    print(f"{len(msgs)} messages, {n_tokens} prompt tokens, best of {args.repeats}")
    print(f"{'what':<48} {'seconds':>9} {'x baseline':>11}")
    for name, secs in rows:
        print(f"{name:<48} {secs:>9.4f} {secs / base:>11.2f}")


if __name__ == "__main__":
    main()
