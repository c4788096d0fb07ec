"""The ``hsdump regenerate`` sub-command: the target model writes the answers of a chat dataset.

Each chat row's assistant turns are generated anew by the server (see ``regen_plan`` for the
multi-turn and agent-trace policy). A turn's prompt is rendered exactly as ``hsdump extract``
renders it and sent as ``input_ids`` to ``/generate``; the answer keeps the generated token
ids (``token_ids``) beside its text, split into ``reasoning_content`` / ``content`` /
``tool_calls``: the reasoning on the model's think markers (with the think start the prompt
opened, so the split is the model's own), through SGLang's parsers when the server runs with
``--reasoning-parser`` / ``--tool-call-parser``. A row stops at its first turn cut at
``--max-new-tokens``. ``hsdump extract`` reads the output as is and uses those token ids
verbatim. Requests carry rids without the dump prefix, so a dump-enabled server dumps nothing.
Output rows are written exactly once (``rowlog``), in dataset order at the end of each run.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hsdump_patch import protocol
from hsdump_patch.client import options, runner
from hsdump_patch.client.options import RunSettings
from hsdump_patch.client.output.report import (
    EXIT_STOPPED,
    RunReport,
    format_table,
    print_issues,
)
from hsdump_patch.client.output.rowlog import RowLog
from hsdump_patch.client.rows import schema as rows
from hsdump_patch.client.rows.conversation import ConversationError, ThinkMarkers, decode
from hsdump_patch.client.rows.dataset import SampleError, Shard, index_shard, read_row
from hsdump_patch.client.rows.regen_plan import AGENT_POLICIES, DEFAULT_AGENT_POLICY, Plan, plan_row
from hsdump_patch.client.server.api import ServerClient, ServerDown
from hsdump_patch.client.server.served import request_messages
from hsdump_patch.client.server.tokenizer import follow_chat_template, load_tokenizer

DEFAULT_MAX_NEW_TOKENS = 4096
DEFAULT_CONCURRENCY = 32
RID_PREFIX = "regen-"  # never the dump prefix: regeneration requests dump nothing
ROW_FIELD = rows.REGENERATED  # the per-row record of what was done (rows.Regenerated)
# The keys SGLang itself takes from generation_config.json under --sampling-defaults model
# (sglang 0.5.23 srt/configs/model_config.py, ModelConfig.get_default_sampling_params).
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# What SGLang's chat API uses for a key that neither the request nor the model's generation
# config sets (sglang 0.5.23 srt/entrypoints/openai/protocol.py,
# ChatCompletionRequest._DEFAULT_SAMPLING_PARAMS): sampling at temperature 1, never greedy.
SERVER_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                   "repetition_penalty": 1.0}


class RowFailed(RuntimeError):
    """One row could not be regenerated; the message says why."""


# ------------------------------------------------------------------------------ sampling


def model_sampling(model: str, trust_remote_code: bool) -> dict[str, Any]:
    """The sampling keys the model's ``generation_config.json`` sets, read as SGLang reads them
    (``ModelConfig.get_default_sampling_params``: every key that is not None); {} without one."""
    from transformers import GenerationConfig

    try:
        config = GenerationConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    except OSError:
        return {}
    values = config.to_dict()
    return {k: values[k] for k in SAMPLING_KEYS if values.get(k) is not None}


def resolve_sampling(args: argparse.Namespace, model: str, trust: bool,
                     server_args: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The sampling of every request and where each key comes from.

    As the served chat API resolves a request that sets nothing: per key, the flag, else the
    model's ``generation_config.json`` (when the server's ``--sampling-defaults`` is ``model``,
    SGLang's default), else SGLang's own chat default (:data:`SERVER_DEFAULTS`).
    """
    sampling, source = dict(SERVER_DEFAULTS), dict.fromkeys(SERVER_DEFAULTS, "sglang default")
    if server_args.get("sampling_defaults", "model") == "model":
        model_values = model_sampling(model, trust)
        sampling.update(model_values)
        source.update(dict.fromkeys(model_values, "generation_config.json"))
    for key in (*SAMPLING_KEYS, "sampling_seed"):
        value = getattr(args, key)
        if value is not None:
            sampling[key], source[key] = value, "flag"
    return sampling, source


def split_reasoning(text: str, think: ThinkMarkers | None, opened: bool
                    ) -> tuple[str | None, str]:
    """``(reasoning, content)`` of generated ``text`` on the model's think markers, verbatim.

    ``opened``: the prompt ended with the think start, so the model began inside the block.
    Reasoning that never closes (a turn cut at the limit) is all reasoning; text that opens no
    block is all content (reasoning None).
    """
    if think is None:
        return None, text
    if opened:
        text = think.start + text
    if not text.lstrip().startswith(think.start):
        return None, text
    inner = text.lstrip()[len(think.start):]
    end = inner.find(think.end)
    if end < 0:
        return inner, ""
    return inner[:end], inner[end + len(think.end):]


# ------------------------------------------------------------------------------ HTTP


class RegenClient(ServerClient):
    """``/generate`` with sampling, and SGLang's reasoning / tool-call parser endpoints."""

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST JSON; raise RowFailed on an error answer (with the context overflow named)."""
        return self.post_json(path, body, RowFailed, lambda r: (
            f"context overflow: {r.text[:500]}" if "context length" in r.text[:500] else None))


# ------------------------------------------------------------------------------ one row


@dataclass(kw_only=True)
class RegenSettings(RunSettings):
    """Everything a regeneration run needs besides the rows."""

    sampling: dict[str, Any]
    sampling_source: dict[str, str] = field(default_factory=dict)
    chat_template_kwargs: dict[str, Any] | None = None
    train_only_regenerated: bool = False
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    concurrency: int = DEFAULT_CONCURRENCY
    agent_policy: str = DEFAULT_AGENT_POLICY


@dataclass
class RowResult:
    row: dict[str, Any]
    prompt_tokens: int
    tokens: int
    finish: list[str]
    not_generated: int = 0  # planned turns after a cut turn


def _tool_call_id(parser: str | None, row_id: str, turn: int, call: dict[str, Any],
                  history: int) -> str:
    """The id SGLang's chat API would give this call (Kimi-K2's ``functions.NAME:IDX``
    scheme where it matters), made reproducible in place of a random uuid.

    Adapted from sglang 0.5.23 srt/entrypoints/openai/serving_chat.py
    (OpenAIServingChat._process_tool_call_id).
    """
    index = history + call.get("tool_index", 0)
    if parser == "kimi_k3":
        return f"{call['name']}:{index}"
    if parser == "kimi_k2":
        return f"functions.{call['name']}:{index}"
    digest = hashlib.blake2b(f"{row_id}\0{turn}\0{index}".encode(), digest_size=12).hexdigest()
    return f"call_{digest}"


class Regenerator:
    """Generates the planned turns of one row after another."""

    def __init__(self, s: RegenSettings, client: RegenClient, tokenizer: Any,
                 parsers: dict[str, str | None], max_tokens: int | None) -> None:
        self.s = s
        self.client = client
        self.tokenizer = tokenizer
        self.reasoning_parser = parsers.get("reasoning_parser")
        self.tool_call_parser = parsers.get("tool_call_parser")
        self.think = (ThinkMarkers.from_reasoning_parser(self.reasoning_parser)
                      if self.reasoning_parser else ThinkMarkers.from_vocab(tokenizer))
        self.max_tokens = max_tokens

    def prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
               ) -> tuple[list[int], bool]:
        """A turn's prompt ids as the server serves them (its own chat rendering of the
        messages so far, ``/v1/tokenize``), and whether the prompt opened the think block."""
        kwargs = (self.s.chat_template_kwargs if self.s is not None else None)
        ids = self.client.tokenize_chat(request_messages(messages), tools, kwargs)
        opened = bool(self.think and decode(self.tokenizer, ids).endswith(self.think.start))
        return ids, opened

    def _generate(self, ids: list[int]) -> dict[str, Any]:
        max_new = self.s.max_new_tokens
        if self.max_tokens is not None:  # prompt + answer must fit the context
            if len(ids) >= self.max_tokens:
                raise RowFailed(f"context overflow: the prompt has {len(ids)} tokens, the "
                                f"server takes at most {self.max_tokens} per request (its "
                                "context length less a reserve)")
            max_new = min(max_new, self.max_tokens - len(ids))
        body = {"rid": RID_PREFIX + uuid.uuid4().hex, "input_ids": ids,
                # special tokens stay in the text: the parsers look for them
                "sampling_params": {**self.s.sampling, "max_new_tokens": max_new,
                                    "skip_special_tokens": False}}
        out = self.client.post("/generate", body)
        finish = out["meta_info"].get("finish_reason") or {}
        if finish.get("type") == "abort":
            raise RowFailed(f"the server aborted the request: {finish.get('message')}")
        return out

    def _message(self, out: dict[str, Any], plan: Plan, row_id: str, turn: int,
                 history_calls: int, opened: bool = False) -> dict[str, Any]:
        """The assistant message of one answer: reasoning split on the think markers (by the
        server's parser when it has one), with the think start the prompt ``opened`` put back
        in front, as SGLang's chat API does with ``force_reasoning``; then the tool calls."""
        text = out["text"]
        msg: dict[str, Any] = {"role": "assistant", "content": text}
        if self.reasoning_parser:
            if opened and self.think:
                text = self.think.start + text
            sep = self.client.post("/separate_reasoning", {
                "text": text, "reasoning_parser": self.reasoning_parser})
            msg["content"] = sep["text"]
            if sep.get("reasoning_text"):
                msg["reasoning_content"] = sep["reasoning_text"]
        else:
            reasoning, msg["content"] = split_reasoning(text, self.think, opened)
            if reasoning is not None:
                msg["reasoning_content"] = reasoning
        cut = (out.get("meta_info", {}).get("finish_reason") or {}).get("type") == "length"
        if self.tool_call_parser and plan.tools and not cut:
            parsed = self.client.post("/parse_function_call", {
                "text": msg["content"], "tool_call_parser": self.tool_call_parser,
                "tools": plan.tools})
            if parsed["calls"]:
                msg["content"] = parsed["normal_text"]
                msg["tool_calls"] = [
                    {"id": _tool_call_id(self.tool_call_parser, row_id, turn, c, history_calls),
                     "type": "function",
                     "function": {"name": c["name"], "arguments": c["parameters"]}}
                    for c in parsed["calls"]]
        msg[rows.TOKEN_IDS] = out["output_ids"]
        return msg

    def process(self, row_id: str, obj: dict[str, Any], plan: Plan) -> RowResult:
        """Regenerate the planned turns of one row; raise RowFailed (or ServerDown).

        The row stops at its first turn cut at the limit (finish ``length``): that turn ends
        the row (later messages are dropped, so it is never the history of a later turn) and
        keeps its generated ids, which extraction uses verbatim (a cut prefix, no end of turn).
        """
        messages = [dict(m) for m in plan.messages]
        prompt_tokens = tokens = 0
        finish: list[str] = []
        done: list[int] = []
        for turn in plan.turns:
            try:
                ids, opened = self.prompt(messages[:turn], plan.tools)
            except ConversationError as e:  # the server could not render the request
                raise RowFailed(f"message {turn}: {e}") from None
            try:
                out = self._generate(ids)
                history = sum(len(m.get("tool_calls") or ()) for m in messages[:turn])
                msg = self._message(out, plan, row_id, turn, history, opened)
            except RowFailed as e:
                raise RowFailed(f"message {turn}: {e}") from None
            messages[turn:turn + 1] = [msg]
            prompt_tokens += len(ids)
            tokens += len(msg[rows.TOKEN_IDS])
            done.append(turn)
            finish.append((out["meta_info"].get("finish_reason") or {}).get("type", "unknown"))
            if finish[-1] == "length":
                del messages[turn + 1:]
                break
        cut_at = done[-1] if finish and finish[-1] == "length" else None
        if self.s.train_only_regenerated:  # the kept original turns become prompt only
            for k, m in enumerate(messages):
                if m["role"] == "assistant" and k not in done:
                    m[rows.TRAIN] = False
        record = rows.Regenerated(
            policy=plan.mode, agent_trace=plan.agent, turns=done, finish_reasons=finish,
            cut=cut_at is not None, cut_at=cut_at,
            turns_not_generated=len(plan.turns) - len(done),
            train_only_regenerated=self.s.train_only_regenerated, sampling=self.s.sampling,
            sampling_source=self.s.sampling_source,
            chat_template_kwargs=self.s.chat_template_kwargs,
            max_new_tokens=self.s.max_new_tokens)
        # the normalized conversation replaces the row's own (a top-level system prompt is in it)
        row = {k: v for k, v in obj.items() if k not in ("messages", "conversations", "system")}
        row.update(id=obj.get("id", row_id), messages=messages)
        if plan.tools is not None:
            row["tools"] = plan.tools
        row[ROW_FIELD] = record.to_json()
        return RowResult(row, prompt_tokens, tokens, finish, len(plan.turns) - len(done))


# ------------------------------------------------------------------------------ report


@dataclass
class RegenReport(RunReport):
    """What one run did; ``to_json`` is the JSON report."""

    shard: str
    out: str
    dataset: str
    server: str
    sampling: dict[str, Any]
    max_new_tokens: int
    agent_policy: str
    sampling_source: dict[str, str] = field(default_factory=dict)
    chat_template_kwargs: dict[str, Any] | None = None
    train_only_regenerated: bool = False
    rows: int = 0
    turns: int = 0
    prompt_tokens: int = 0
    finish_reasons: dict[str, int] = field(default_factory=dict)
    cut_rows: list[str] = field(default_factory=list)
    turns_not_generated: int = 0  # planned turns after a cut turn
    agent_rows_last_turn: int = 0
    rows_in_output: int = 0

    def add_ok(self, row_id: str, res: RowResult) -> None:
        self.rows += 1
        self.turns += len(res.finish)
        self.prompt_tokens += res.prompt_tokens
        self.tokens += res.tokens
        for reason in res.finish:
            self.finish_reasons[reason] = self.finish_reasons.get(reason, 0) + 1
        if "length" in res.finish:
            self.cut_rows.append(row_id)
        self.turns_not_generated += res.not_generated
        self.agent_rows_last_turn += res.row[ROW_FIELD]["policy"] == "last-turn"


def sampling_line(sampling: dict[str, Any], source: dict[str, str]) -> str:
    """``sampling temperature=1.0 (flag), ...``: each key with where it comes from."""
    return "sampling " + ", ".join(
        f"{k}={v} ({source.get(k, '?')})" for k, v in sampling.items())


def print_summary(report: RegenReport, report_path: Path) -> None:
    """The end-of-run table, the issues (at most 20), the cut rows and the report's path."""
    finish = ", ".join(f"{k} {v:,}" for k, v in sorted(report.finish_reasons.items()))
    table = [
        ("rows regenerated", f"{report.rows:,}"),
        ("already done", f"{report.already_done:,}"),
        ("failed", f"{report.count('failed'):,}"),
        ("skipped", f"{report.count('skipped'):,}"),
        ("turns generated", f"{report.turns:,}"),
        ("tokens generated", f"{report.tokens:,}"),
        ("prompt tokens", f"{report.prompt_tokens:,}"),
        ("finish reasons", finish or "-"),
        ("cut at the limit", f"{len(report.cut_rows):,} rows stop at their cut turn (finish "
                             f"length, --max-new-tokens {report.max_new_tokens}); "
                             f"{report.turns_not_generated:,} later turns not generated"),
        ("agent rows", f"{report.agent_rows_last_turn:,} with only the last turn regenerated"),
        ("wall time", f"{report.wall_s:.1f} s"),
        ("throughput", f"{report.tokens_per_s:,.0f} generated tokens/s"),
        ("output", f"{report.rows_in_output:,} rows in {report.out}"),
    ]
    sampling = sampling_line(report.sampling, report.sampling_source)
    print(f"hsdump regenerate: shard {report.shard}, {sampling}")
    print(format_table(table))
    print_issues(report)
    if report.cut_rows:
        shown = ", ".join(report.cut_rows[:10])
        print(f"  cut at --max-new-tokens: {shown}{' ...' if len(report.cut_rows) > 10 else ''}")
    if report.stopped:
        print(f"STOPPED: {report.stopped}")
    print(f"report: {report_path}")


# ------------------------------------------------------------------------------ the run


Item = tuple[str, str, dict[str, Any], Plan]  # (id, file:line, row, plan)


def _planned(dataset: Path, refs: list[Any], policy: str) -> Iterator[Item | SampleError]:
    """Each row as ``(id, file:line, object, plan)``, or the SampleError saying why it is
    unfit."""
    with open(dataset, "rb") as f:
        for ref in refs:
            where = f"{dataset}:{ref.line}"
            try:
                obj = read_row(f, ref, where)
                yield ref.id, where, obj, plan_row(obj, where, policy)
            except SampleError as e:
                e.sample_id = ref.id
                yield e


class _RegenJob(runner.Job[Item, RowResult]):
    """A regeneration's hooks in the bounded runner: each finished row goes to the row log."""

    unit = "row"
    thread_prefix = "hsdump-regen"

    def __init__(self, regen: Regenerator, log: RowLog, report: RegenReport) -> None:
        self.regen, self.log, self.report = regen, log, report

    def key(self, item: Item) -> tuple[str | None, str | None]:
        return item[0], item[1]

    def process(self, item: Item) -> RowResult:
        row_id, _, obj, plan = item
        return self.regen.process(row_id, obj, plan)

    def failure(self, item: Item, error: Exception, report: RunReport) -> str:
        if not isinstance(error, RowFailed):  # server down, local fault: stop, do not spin
            where = item[1]
            report.stop(f"{where}: {error}" if isinstance(error, ServerDown)
                        else f"{where}: {type(error).__name__}: {error}")
            return f"{type(error).__name__}: {error}"
        return str(error)

    def finished(self, item: Item, result: RowResult) -> None:
        self.log.append(result.row)
        self.report.add_ok(item[0], result)


def run(s: RegenSettings, regen: Regenerator, items: Iterator[Item | SampleError], total: int,
        log: RowLog, report: RegenReport) -> None:
    """Regenerate ``items`` with bounded concurrency, appending finished rows to ``log``."""
    runner.run(items, total, _RegenJob(regen, log, report), report, s)


def regenerate(args: argparse.Namespace) -> RegenReport:
    """Run one regeneration from parsed flags; return its report."""
    client = RegenClient(args.server, request_timeout=args.request_timeout,
                         retries=args.retries, retry_wait=args.retry_wait)
    model_info = client.model_info()
    model = args.model or model_info.get("tokenizer_path") or model_info.get("model_path")
    server_args = client.server_args()
    trust = args.trust_remote_code or bool(server_args.get("trust_remote_code"))
    sampling, source = resolve_sampling(args, model, trust, server_args)
    s = settings_from_args(args, sampling)
    s.sampling_source = source
    print(f"hsdump regenerate: {sampling_line(sampling, source)}", file=sys.stderr)
    if "sampling_seed" in sampling and not server_args.get("enable_deterministic_inference"):
        print("hsdump regenerate: warning: --seed has no effect on this server: SGLang 0.5.23 "
              "uses sampling_seed only under --enable-deterministic-inference", file=sys.stderr)
    dataset: Path = args.dataset
    tokenizer = load_tokenizer(model, trust)
    follow_chat_template(tokenizer, server_args)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the tokenizer of {model} has no chat template: chat rows cannot be "
                         "rendered")
    parsers = {"reasoning_parser": args.reasoning_parser or model_info.get("reasoning_parser"),
               "tool_call_parser": args.tool_call_parser or model_info.get("tool_call_parser")}
    # max_req_input_len: the context length less a small reserve (sglang 0.5.23 /server_info)
    regen = Regenerator(s, client, tokenizer, parsers, server_args.get("max_req_input_len"))

    shard: Shard = args.shard
    refs, bad = index_shard(dataset, shard)
    report = RegenReport(shard=str(shard), out=str(s.out), dataset=str(dataset),
                         server=s.server, sampling=s.sampling,
                         max_new_tokens=s.max_new_tokens, agent_policy=s.agent_policy,
                         sampling_source=s.sampling_source,
                         chat_template_kwargs=s.chat_template_kwargs,
                         train_only_regenerated=s.train_only_regenerated)
    with RowLog(s.out) as log:
        todo = [r for r in refs if r.id not in log.done]
        report.already_done = len(refs) - len(todo)

        def items() -> Iterator[Any]:
            yield from bad
            yield from _planned(dataset, todo, s.agent_policy)

        try:
            run(s, regen, items(), len(bad) + len(todo), log, report)
        finally:
            report.rows_in_output = log.assemble(r.id for r in refs)
    return report


# ------------------------------------------------------------------------------ CLI


def add_parser(subparsers: Any) -> None:
    """Register ``hsdump regenerate``."""
    p = subparsers.add_parser(
        "regenerate", help="let the served model write the answers of a chat dataset",
        description=__doc__.splitlines()[0])
    options.add_io_flags(p, dataset="messages / conversations rows",
                         out="output JSONL, one per shard: messages rows with token_ids on "
                             "every regenerated assistant turn")
    options.add_server_flags(p, model_for="the tokenizer, chat template and generation_config")
    options.add_run_flags(p, noun="row", concurrency=DEFAULT_CONCURRENCY,
                          report="OUT with the suffix .report.json")
    g = p.add_argument_group(
        "sampling (default: what the served chat API uses: the model's generation_config.json "
        "under the server's --sampling-defaults model, else SGLang's defaults; printed and "
        "recorded in the output)")
    g.add_argument("--temperature", type=float, default=None,
                   help="default: generation_config, else 1.0 (0 is greedy)")
    g.add_argument("--top-p", type=float, default=None,
                   help="default: generation_config, else 1.0")
    g.add_argument("--top-k", type=int, default=None,
                   help="default: generation_config, else -1 (all)")
    g.add_argument("--min-p", type=float, default=None, help="default: generation_config, else 0")
    g.add_argument("--repetition-penalty", type=float, default=None,
                   help="default: generation_config, else 1")
    g.add_argument("--seed", dest="sampling_seed", type=int, default=None,
                   help="sampling seed sent with each request; SGLang uses it only when the "
                        "server runs with --enable-deterministic-inference (default: none)")
    options.add_template_kwargs_flag(p, recorded_in="the output")
    p.add_argument("--train-only-regenerated", action="store_true",
                   help="mark the original assistant turns a row keeps (agent traces under "
                        '--agent-policy last) "train": false, so hsdump extract masks them out '
                        "and trains only the regenerated turns (default off: kept turns train)")
    p.add_argument("--reasoning-parser", default=None,
                   help="SGLang reasoning parser that splits reasoning_content off each answer, "
                        "e.g. kimi_k2 (default: the server's --reasoning-parser; none: kept whole)")
    p.add_argument("--tool-call-parser", default=None,
                   help="SGLang tool-call parser that turns calls into tool_calls, for rows with "
                        "tools, e.g. kimi_k2 (default: the server's --tool-call-parser)")
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS,
                   help="generated tokens per assistant turn, capped by the server's context "
                        f"length; rows that hit it are flagged (default {DEFAULT_MAX_NEW_TOKENS})")
    p.add_argument("--agent-policy", choices=AGENT_POLICIES, default=DEFAULT_AGENT_POLICY,
                   help="rows whose tool results answer earlier tool calls: regenerate only the "
                        "last assistant turn (last) or every turn (all) (default "
                        f"{DEFAULT_AGENT_POLICY})")
    p.set_defaults(func=main)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse ``hsdump regenerate`` flags, for callers that run it in-process."""
    parser = argparse.ArgumentParser(prog="hsdump")
    add_parser(parser.add_subparsers())
    return parser.parse_args(["regenerate", *argv])


def settings_from_args(args: argparse.Namespace, sampling: dict[str, Any]) -> RegenSettings:
    """RegenSettings from parsed flags and the resolved sampling."""
    return RegenSettings(
        **options.server_settings(args), **options.run_settings(args), out=args.out,
        sampling=sampling, chat_template_kwargs=args.chat_template_kwargs,
        train_only_regenerated=args.train_only_regenerated,
        max_new_tokens=args.max_new_tokens, agent_policy=args.agent_policy)


def report_path(args: argparse.Namespace) -> Path:
    return args.report or args.out.with_suffix(".report.json")


def main(args: argparse.Namespace) -> int:
    """Run ``hsdump regenerate``; exit 0 all rows done, 3 with skipped/failed rows, 1 stopped."""
    try:
        report = regenerate(args)
    except (ServerDown, ValueError, RuntimeError, OSError) as e:
        print(f"hsdump regenerate: error: {e}", file=sys.stderr)
        return EXIT_STOPPED
    path = report_path(args)
    protocol.write_json_atomic(path, report.to_json())
    print_summary(report, path)
    return report.exit_code()
