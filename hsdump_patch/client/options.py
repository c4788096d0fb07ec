"""The flags and settings the client's commands share, declared once.

``hsdump extract``, ``regenerate`` and ``smoke`` reach one SGLang server with the same timeouts
and retries and load the same tokenizer; ``extract`` and ``regenerate`` also run their rows
through the bounded runner (``runner.py``) under the same error policy. Every flag's --help
states its default.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hsdump_patch.client.rows.dataset import Shard
from hsdump_patch.client.server.api import MAX_BACKOFF

DEFAULT_SERVER = "http://127.0.0.1:30000"
DEFAULT_REQUEST_TIMEOUT = 3600.0
DEFAULT_RETRIES = 6
DEFAULT_RETRY_WAIT = 1.0
DEFAULT_MAX_CONSECUTIVE_ERRORS = 20


@dataclass(kw_only=True)
class RunSettings:
    """What every run needs: the server and how to reach it, the output, the runner's bounds."""

    server: str
    out: Path
    concurrency: int = 1
    on_error: str = "fail"
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT
    retries: int = DEFAULT_RETRIES
    retry_wait: float = DEFAULT_RETRY_WAIT
    max_consecutive_errors: int = DEFAULT_MAX_CONSECUTIVE_ERRORS
    progress: bool = True


def add_io_flags(p: argparse.ArgumentParser, *, dataset: str, out: str) -> None:
    """The required ``--dataset`` (a JSONL of ``dataset``) and ``--out`` (``out``)."""
    p.add_argument("--dataset", type=Path, required=True, help=f"JSONL: {dataset} (required)")
    p.add_argument("--out", type=Path, required=True, help=f"{out} (required)")


def add_server_flags(p: argparse.ArgumentParser, *, model_for: str) -> None:
    """``--server``, ``--model`` (the tokenizer's source, read for ``model_for``), timeouts and
    retries, ``--trust-remote-code``, ``--no-progress``."""
    p.add_argument("--server", default=DEFAULT_SERVER,
                   help=f"SGLang server URL (default {DEFAULT_SERVER})")
    p.add_argument("--model", default=None,
                   help=f"model dir or hub id for {model_for} (default: the server's tokenizer "
                        "path from /model_info)")
    p.add_argument("--request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT,
                   help="seconds to wait for one answer of the server (default "
                        f"{DEFAULT_REQUEST_TIMEOUT:g})")
    p.add_argument("--retries", type=int, default=DEFAULT_RETRIES,
                   help=f"retries on connection errors, with exponential backoff (default "
                        f"{DEFAULT_RETRIES})")
    p.add_argument("--retry-wait", type=float, default=DEFAULT_RETRY_WAIT,
                   help=f"first backoff in seconds, doubled per retry up to {MAX_BACKOFF:g} "
                        f"(default {DEFAULT_RETRY_WAIT:g})")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow the tokenizer's custom code, as Kimi-K2/K2.5's needs (default: "
                        "off, unless the server itself runs with --trust-remote-code)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (default: shown)")


def add_run_flags(p: argparse.ArgumentParser, *, noun: str, concurrency: int,
                  report: str) -> None:
    """The runner's flags (``noun``: what one item is; ``report``: the report's default
    path, in words): ``--on-error``, ``--shard``, ``--concurrency``,
    ``--max-consecutive-errors``, ``--report``."""
    p.add_argument("--on-error", choices=("skip", "fail"), default="fail",
                   help=f"on a bad row or failed {noun}: list it and go on (skip) or stop the "
                        "run (fail) (default fail)")
    p.add_argument("--shard", type=Shard.parse, default=Shard(),
                   help="i/N: process only shard i of N (hash of the row id, the same in every "
                        "hsdump command; default 0/1)")
    p.add_argument("--concurrency", type=int, default=concurrency,
                   help=f"{noun}s in flight (default {concurrency})")
    p.add_argument("--max-consecutive-errors", type=int, default=DEFAULT_MAX_CONSECUTIVE_ERRORS,
                   help=f"stop after this many failed {noun}s in a row, even with --on-error "
                        f"skip (default {DEFAULT_MAX_CONSECUTIVE_ERRORS})")
    p.add_argument("--report", type=Path, default=None,
                   help=f"JSON report path (default {report})")


def add_template_kwargs_flag(p: argparse.ArgumentParser, *, recorded_in: str) -> None:
    """``--chat-template-kwargs`` (recorded in ``recorded_in``)."""
    p.add_argument("--chat-template-kwargs", type=template_kwargs, default=None,
                   help='JSON object passed to every chat-template rendering, as a request\'s '
                        'chat_template_kwargs (e.g. \'{"thinking": false}\' for Kimi-K2.5 '
                        f"instant mode); recorded in {recorded_in} (default: none)")


def template_kwargs(text: str) -> dict[str, Any]:
    """``--chat-template-kwargs``: a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError('must be a JSON object, e.g. \'{"thinking": false}\'')
    return value


def server_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`RunSettings` fields of :func:`add_server_flags`."""
    return {"server": args.server, "request_timeout": args.request_timeout,
            "retries": args.retries, "retry_wait": args.retry_wait,
            "progress": not args.no_progress}


def run_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`RunSettings` fields of :func:`add_run_flags`."""
    return {"on_error": args.on_error, "concurrency": args.concurrency,
            "max_consecutive_errors": args.max_consecutive_errors}
