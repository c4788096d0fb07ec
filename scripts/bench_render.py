"""Benchmark: rendering + masking cost of chat rows (``ChatRenderer.render``).

``python scripts/bench_render.py [--turns 64] [--tokens 27000] [--repeats 5]`` builds the tiny
Kimi-K2.5 tokenizer (Kimi-style tiktoken custom code + K2.5-style template, tests/harness),
makes a thinking agent trace of ``--turns`` messages (one user query, then assistant turns with
reasoning and a tool call, each answered by a tool message, and a final answer) padded to about
``--tokens`` tokens, and times, in the same run:

* the baseline: one render + encode of the conversation: ``prompt_ids`` of the last turn
  (``apply_chat_template`` of every message before it with the generation prompt, encoded);
* ``ChatRenderer.render`` under each multi-turn policy (the extraction path);
* the quadratic reference: render + encode of every assistant turn's whole prompt.

It prints a table of best-of-N times and their ratio to the baseline. Optionally also:

* ``--corpus N``: render a corpus of N rows (agent traces and plain thinking chats of 2-64
  messages) under each of ``--policies``: seconds, rows/s, tokens/s;
* ``--sweep 8,16,32,64,128``: conversations of that many messages (``--tokens-per-message``
  each), time per message under each policy and the one render + encode, and the ratio of the
  per-message time at the longest to the shortest (linear in turns: about 1);
* ``--tree PATH`` imports ``hsdump_patch`` from another checkout, ``--json`` writes the results
  (``scripts/bench_ab.py`` compares two commits with both).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import benchtree

benchtree.select()

from hsdump_patch.client.rows.conversation import (  # noqa: E402 - after choosing the tree
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


def chat_row(turns: int, tokens: int, tok: Any, kind: str = "agent") -> dict[str, Any]:
    """A row of ``turns`` messages with about ``tokens`` prompt tokens: an ``agent`` trace (a user
    query, assistant turns with reasoning and a tool call each answered by a tool message, a
    final answer) or a plain thinking ``chat`` (user and assistant with reasoning in turn)."""
    tools = [{"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}}}}]

    def build(words_per_msg: int) -> dict[str, Any]:
        text = " ".join(WORDS[i % len(WORDS)] for i in range(words_per_msg))
        msgs = [{"role": "user", "content": "Find out. " + text}]
        while len(msgs) < turns - 1:
            k = len(msgs)
            if kind == "chat":
                msgs.append({"role": "assistant", "content": text, "reasoning_content": text}
                            if k % 2 else {"role": "user", "content": f"{k}. {text}"})
                continue
            call = {"id": f"functions.search:{k}", "type": "function",
                    "function": {"name": "search", "arguments": f'{{"q": "step {k}"}}'}}
            msgs.append({"role": "assistant", "content": "", "reasoning_content": text,
                         "tool_calls": [call]})
            msgs.append({"role": "tool", "tool_call_id": call["id"], "content": text})
        if msgs[-1]["role"] == "assistant":
            msgs.append({"role": "user", "content": "And then? " + text})
        msgs.append({"role": "assistant", "content": text, "reasoning_content": text})
        return {"messages": msgs, "tools": tools} if kind == "agent" else {"messages": msgs}

    words = 10
    for _ in range(3):  # the per-message overhead is fixed: converge on the token count
        row = build(words)  # counted without hsdump_patch: the same rows from every --tree
        n = len(tok.encode(tok.apply_chat_template(row["messages"][:-1], tools=row.get("tools"),
                                                   tokenize=False, add_generation_prompt=True)))
        words = max(1, round(words * tokens / n))
    return build(words)


def conversation(turns: int, tokens: int, tok: Any, kind: str = "agent") -> Conversation:
    """:func:`chat_row` parsed."""
    return parse_conversation(chat_row(turns, tokens, tok, kind))


def tokenizer(path: Path | None) -> Any:
    """The tokenizer at ``path``, or the tiny Kimi-K2.5 one (tests/harness) built afresh."""
    from transformers import AutoTokenizer

    if path is not None:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=True)
    from tests.harness.make_models import make_kimi_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        make_kimi_tokenizer(Path(tmp))
        return AutoTokenizer.from_pretrained(tmp, trust_remote_code=True)


def best(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


POLICIES = ("auto", "per-turn", "last")
CORPUS_MESSAGES = (2, 4, 8, 16, 32, 64)


def corpus(rows: int, tokens_per_message: int, tok: Any) -> list[Conversation]:
    """``rows`` conversations: agent traces and plain thinking chats in turn, of 2-64 messages."""
    out = []
    for i in range(rows):
        n = CORPUS_MESSAGES[(i // 2) % len(CORPUS_MESSAGES)]
        out.append(conversation(n, n * tokens_per_message, tok, ("agent", "chat")[i % 2]))
    return out


def time_corpus(tok: Any, convs: list[Conversation], policies: list[str],
                repeats: int) -> dict[str, dict[str, float]]:
    """Best-of-``repeats`` time to render every conversation, per policy."""
    out = {}
    for policy in policies:
        renderer = ChatRenderer(tok, policy=policy)
        samples = [s for c in convs for s in renderer.render(c)]
        seconds = best(lambda r=renderer: [r.render(c) for c in convs], repeats)
        tokens = sum(len(s.input_ids) for s in samples)
        out[policy] = {"seconds": seconds, "rows_per_s": len(convs) / seconds,
                       "tokens_per_s": tokens / seconds, "samples": len(samples),
                       "tokens": tokens}
    return out


def sweep(tok: Any, lengths: list[int], tokens_per_message: int, policies: list[str],
          repeats: int) -> dict[str, Any]:
    """Milliseconds per message of one render + encode and of each policy's render, for
    agent traces of each length; the ratio of the longest's per-message time to the
    shortest's."""
    points = []
    for n in lengths:
        conv = conversation(n, n * tokens_per_message, tok)
        point: dict[str, Any] = {"messages": len(conv.messages)}
        one = best(lambda c=conv: prompt_ids(tok, c.messages[:-1], c.tools), repeats)
        point["one render + encode"] = one * 1e3 / len(conv.messages)
        for policy in policies:
            renderer = ChatRenderer(tok, policy=policy)
            renderer.render(conv)
            secs = best(lambda r=renderer, c=conv: r.render(c), repeats)
            point[policy] = secs * 1e3 / len(conv.messages)
        points.append(point)
    whats = ["one render + encode", *policies]
    return {"points": points, "ratio": {w: points[-1][w] / points[0][w] for w in whats}}


def int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected integers like 8,16,32") from None
    if len(values) < 2 or min(values) < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: at least two lengths, each >= 2")
    return values


def policy_list(text: str) -> list[str]:
    values = text.split(",")
    bad = [v for v in values if v not in POLICIES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown policy {bad[0]!r}: choose from "
                                         f"{','.join(POLICIES)}")
    return values


def table(tok: Any, turns: int, tokens: int, repeats: int) -> None:
    """The one-conversation table (the module docstring's first list)."""
    conv = conversation(turns, tokens, tok)
    msgs, tools = conv.messages, conv.tools

    def baseline() -> list[int]:  # the last turn's serving prompt: the longest render
        return prompt_ids(tok, msgs[:-1], tools)

    def quadratic() -> None:
        for k, m in enumerate(msgs):
            if m["role"] == "assistant":
                prompt_ids(tok, msgs[:k], tools)

    n_tokens = len(baseline())
    rows = [("one render + encode (baseline)", best(baseline, repeats))]
    for policy in POLICIES:
        renderer = ChatRenderer(tok, policy=policy)
        samples = renderer.render(conv)
        rows.append((f"render, --multi-turn {policy} ({len(samples)} sample(s))",
                     best(lambda r=renderer: r.render(conv), repeats)))
    rows.append(("every turn's prompt rendered + encoded", best(quadratic, repeats)))
    base = rows[0][1]
    print(f"{len(msgs)} messages, {n_tokens} prompt tokens, best of {repeats}")
    print(f"{'what':<48} {'seconds':>9} {'x baseline':>11}")
    for name, secs in rows:
        print(f"{name:<48} {secs:>9.4f} {secs / base:>11.2f}")


def print_sweep(result: dict[str, Any], label: str = "") -> None:
    whats = list(result["ratio"])
    print(f"ms per message{label}: " + " | ".join(["messages", *whats]))
    for p in result["points"]:
        print(" | ".join([str(p["messages"]), *(f"{p[w]:.3f}" for w in whats)]))
    print("longest / shortest: " + ", ".join(f"{w} {r:.2f}" for w, r in result["ratio"].items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=64, help="messages (default 64)")
    parser.add_argument("--tokens", type=int, default=27000,
                        help="approximate tokens of the conversation (default 27000)")
    parser.add_argument("--repeats", type=int, default=5, help="best of N (default 5)")
    parser.add_argument("--table", action=argparse.BooleanOptionalAction, default=True,
                        help="the one-conversation table (default on)")
    parser.add_argument("--corpus", type=int, default=0,
                        help="also render a corpus of this many rows (default 0: not run)")
    parser.add_argument("--sweep", type=int_list, default=None,
                        help="also time conversations of these message counts, e.g. "
                             "8,16,32,64,128 (default: not run)")
    parser.add_argument("--tokens-per-message", type=int, default=420,
                        help="corpus and sweep rows' tokens per message (default 420, as the "
                             "table's 27000 / 64)")
    parser.add_argument("--policies", type=policy_list, default=list(POLICIES),
                        help=f"corpus and sweep policies (default {','.join(POLICIES)})")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="tokenizer directory (default: the tiny Kimi-K2.5 one, built)")
    parser.add_argument("--json", type=Path, default=None,
                        help="write the corpus and sweep results here (default: print only)")
    benchtree.add_argument(parser)
    args = parser.parse_args()

    tok = tokenizer(args.tokenizer)
    if args.table:
        table(tok, args.turns, args.tokens, args.repeats)
    result: dict[str, Any] = {"tree": benchtree.imported_from(), "repeats": args.repeats}
    if args.corpus:
        convs = corpus(args.corpus, args.tokens_per_message, tok)
        result["corpus"] = time_corpus(tok, convs, args.policies, args.repeats)
        print(f"corpus of {args.corpus} rows, best of {args.repeats}:")
        for policy, r in result["corpus"].items():
            print(f"  --multi-turn {policy}: {r['seconds']:.4f} s, {r['rows_per_s']:.1f} rows/s, "
                  f"{r['tokens_per_s']:,.0f} tokens/s ({r['samples']} samples)")
    if args.sweep:
        result["sweep"] = sweep(tok, args.sweep, args.tokens_per_message, args.policies,
                                args.repeats)
        print_sweep(result["sweep"])
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
