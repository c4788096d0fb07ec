"""The ``hsdump extract`` sub-command: one training record per dataset sample.

The dataset goes through a dump-enabled SGLang server. Per sample: a ``/generate`` request
with the token ids, ``max_new_tokens`` 0 and the rid of ``request_id``; a check of ``meta_info``
(no cached tokens, the whole prompt counted); a wait for the done/error marker; the chunks
read, cross-checked and assembled; the record written atomically to ``--out``; the request's
files deleted from the dump dir. Requests run with bounded concurrency and bounded
hidden-state bytes in the dump dir.
"""

from __future__ import annotations

import argparse
import errno
import itertools
import os
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

from hsdump_patch import protocol
from hsdump_patch.client import buffers, options, runner
from hsdump_patch.client.dumps import dumpdir
from hsdump_patch.client.options import RunSettings
from hsdump_patch.client.output import records
from hsdump_patch.client.output.manifest import (
    Manifest,
    entry,
    load_done,
    plan_resume,
    remove_stale_temps,
    skip_done,
)
from hsdump_patch.client.output.report import ExtractReport, RunReport, print_summary
from hsdump_patch.client.rows.conversation import (
    POLICIES,
    ChatRenderer,
    chat_renderer,
)
from hsdump_patch.client.rows.dataset import (
    Sample,
    SampleError,
    Shard,
    index_shard,
    iter_samples,
    render_key,
)
from hsdump_patch.client.rows.mask import LOSS_MASKS, apply_convention
from hsdump_patch.client.server.api import (
    DuplicateRid,
    Refused,
    ServerClient,
    ServerDown,
    check_meta,
)
from hsdump_patch.client.server.served import ServedPrompts
from hsdump_patch.client.server.tokenizer import follow_chat_template, load_tokenizer
from hsdump_patch.protocol import (
    DEFAULT_DUMP_DIR,
    DEFAULT_RID_PREFIX,
    ENV_DIR,
    ConfigError,
    parse_size,
)

DEFAULT_CONCURRENCY = 16
DEFAULT_DUMP_TIMEOUT = 300.0
DEFAULT_MAX_INFLIGHT = "8GiB"
DEFAULT_MIN_FREE = "2GiB"
PROMPT_CHECKS = ("server", "off")
STALE_QUIET_S = 5.0


class SampleFailed(RuntimeError):
    """One sample could not be extracted; the message says why."""


@dataclass(kw_only=True)
class ExtractSettings(RunSettings):
    """Everything an extraction run needs besides the samples."""

    dump_dir: Path
    fmt: str = "eagle3"
    concurrency: int = DEFAULT_CONCURRENCY
    dump_timeout: float = DEFAULT_DUMP_TIMEOUT
    max_inflight_bytes: int = parse_size(DEFAULT_MAX_INFLIGHT, "")
    min_free_bytes: int = parse_size(DEFAULT_MIN_FREE, "")
    compress: bool = False
    allow_no_final: bool = False
    loss_mask: str = "completion"  # a convention of hsdump_patch.client.rows.mask


# ------------------------------------------------------------------------------ one sample


def request_id(prefix: str, run_id: str, sample_id: str) -> str:
    """``<prefix><run id>-<len(id)>-<id>`` (docs/protocol.md): the run id keeps other
    extractions' rids apart, the length makes sure no rid is the start of another (SGLang's
    ``/abort_request`` aborts every request whose rid starts with the one given)."""
    return f"{prefix}{run_id}-{len(sample_id)}-{sample_id}"


@dataclass
class Done:
    sample: Sample
    file: str
    size: int
    chunks: int
    trained: int  # loss-mask 1 tokens of the record as written (its --loss-mask convention)


def _wait_quiet(path: Path, quiet: float, timeout: float) -> None:
    """Wait until ``path`` has not changed (appeared, gone, or new mtime) for ``quiet``
    seconds; at most ``timeout``."""
    t0 = since = time.monotonic()
    last: int | None = None
    while True:
        try:
            state: int | None = path.stat().st_mtime_ns
        except FileNotFoundError:
            state = None
        now = time.monotonic()
        if state != last:
            last, since = state, now
        elif now - since >= quiet or now - t0 >= timeout:
            return
        time.sleep(0.1)


# Errors of the output disk that every following sample would hit too: stop the run.
_FATAL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS}


class Extraction:
    """One run: samples in, records out (see the module docstring)."""

    def __init__(self, settings: ExtractSettings, info: protocol.ServerInfo, client: ServerClient,
                 run_id: str, render_key: str) -> None:
        self.s = settings
        self.render_key = render_key
        self.info = info
        self.client = client
        self.run_id = run_id
        # Reused read and assembly buffers (fresh ones page-fault on first touch), bounded by
        # the in-flight budget.
        self._chunk_bufs = buffers.BufferPool(settings.max_inflight_bytes)
        self._record_bufs = buffers.BufferPool(settings.max_inflight_bytes)

    def rid(self, sample_id: str) -> str:
        return request_id(self.info.rid_prefix, self.run_id, sample_id)

    def _clear_stale(self, rid: str) -> None:
        """Remove what an earlier attempt or (killed) run left for this rid, once it is final.

        SGLang aborts the requests of a client that disconnects (kill -9), and an aborted
        request never gets a marker: a directory quiet for STALE_QUIET_S seconds is final too.
        A request that is really still running is refused as a duplicate rid by the server,
        and ``_send`` comes back here after a pause.
        """
        if protocol.rid_dir(self.s.dump_dir, rid).exists():
            dumpdir.wait_until_settled(self.s.dump_dir, rid, STALE_QUIET_S, self.s.dump_timeout)
            dumpdir.remove_request(self.s.dump_dir, rid)

    def _abort(self, rid: str) -> None:
        """Abort a request the client gave up on; remove its directory once the server has
        stopped writing to it (an aborted request gets no marker: it stays quiet)."""
        self.client.abort(rid)
        _wait_quiet(protocol.rid_dir(self.s.dump_dir, rid), STALE_QUIET_S, self.s.dump_timeout)
        dumpdir.remove_request(self.s.dump_dir, rid)

    def _send(self, rid: str, input_ids: list[int]) -> dict[str, Any]:
        """Send the request. Every attempt starts from an empty directory: an attempt cut short
        (a restarted server, a dropped connection) leaves chunks whose boundaries differ from
        the next attempt's."""
        deadline = time.monotonic() + self.s.dump_timeout
        delay = 0.1
        while True:
            try:
                return self.client.generate(rid, input_ids,
                                            before_attempt=lambda: self._clear_stale(rid))
            except Refused as e:
                raise SampleFailed(str(e)) from None
            except DuplicateRid:
                if time.monotonic() > deadline:
                    raise SampleFailed(
                        f"the server kept running an older request with rid {rid} for "
                        f"{self.s.dump_timeout:.0f}s (--dump-timeout)") from None
                time.sleep(delay)
                delay = min(delay * 2, 5.0)

    def process(self, sample: Sample) -> Done:
        """Extract one sample; raise SampleFailed (or ServerDown) on failure. Whatever happens,
        the request's files leave the dump dir."""
        try:
            return self._process(sample)
        except BaseException:
            dumpdir.remove_request(self.s.dump_dir, self.rid(sample.id))
            raise

    def _process(self, sample: Sample) -> Done:
        rid, dump = self.rid(sample.id), self.s.dump_dir
        try:
            meta = self._send(rid, sample.input_ids)
        except requests.Timeout:
            self._abort(rid)
            raise SampleFailed(f"no answer within --request-timeout {self.s.request_timeout:g}s "
                               "(aborted on the server)") from None
        problem = check_meta(meta, len(sample.input_ids))
        if problem is None:
            status = dumpdir.wait_for_marker(dump, rid, self.s.dump_timeout)
            if status is None:
                problem = (
                    f"no done/error marker in {protocol.rid_dir(dump, rid)} within "
                    f"{self.s.dump_timeout:.0f}s (--dump-timeout): is the capture patch of the "
                    f"server at {self.client.url} writing to --dump-dir {dump}?")
            elif status.error is not None:
                problem = f"the server could not dump it: {status.error.reason}"
            elif status.done.prompt_len != len(sample.input_ids):
                problem = (f"done.json says prompt_len={status.done.prompt_len}, "
                           f"{len(sample.input_ids)} tokens were sent")
        else:
            self._clear_stale(rid)
        if problem is not None:
            dumpdir.remove_request(dump, rid)
            raise SampleFailed(problem)
        return self.write_record(sample)

    def write_record(self, sample: Sample) -> Done:
        """Assemble a finished request's chunks into its record, write it, free the dump."""
        rid, dump = self.rid(sample.id), self.s.dump_dir
        length = len(sample.input_ids)
        with self._record_bufs.lend(records.RecordBuilder.nbytes(length, self.info)) as buf:
            try:
                builder = records.RecordBuilder(self.s.fmt, length, self.info, buf)
                chunks = dumpdir.read_request(dump, rid, sample.input_ids, self.info, builder,
                                               self._chunk_bufs)
            except protocol.ProtocolError as e:
                raise SampleFailed(f"invalid dump: {e}") from None
            dumpdir.remove_request(dump, rid)
            name = records.record_name(sample.id, self.s.fmt, self.s.compress)
            mask = apply_convention(sample.loss_mask, self.s.loss_mask)
            try:
                size = records.save_atomic(builder.record(sample.input_ids, mask),
                                           self.s.out / name, self.s.compress)
            except OSError as e:
                if e.errno in _FATAL_ERRNOS:
                    raise
                raise SampleFailed(f"could not write its record {self.s.out / name}: {e}") from None
            del builder
        return Done(sample, name, size, chunks, sum(mask))

    # -------------------------------------------------------------------------- the run

    def run(self, items: Iterable[Sample | SampleError], total: int, manifest: Manifest,
            report: ExtractReport) -> ExtractReport:
        """Process ``items`` (samples or the errors of bad rows); fill and return ``report``."""
        runner.run(items, total, _ExtractJob(self, manifest, report), report, self.s)
        return report

    def _wait_for_space(self, need: int, report: ExtractReport) -> None:
        """With nothing in flight, wait (up to --dump-timeout) for room in the dump dir."""
        deadline = time.monotonic() + self.s.dump_timeout
        while True:
            free = dumpdir.dump_free_bytes(self.s.dump_dir)
            if free - need >= self.s.min_free_bytes:
                return
            if time.monotonic() > deadline:
                gib = 2**30
                report.stop(
                    f"the dump dir {self.s.dump_dir} has {free / gib:.2f} GiB free; the next "
                    f"sample needs {need / gib:.2f} GiB plus the {self.s.min_free_bytes / gib:.2f}"
                    " GiB reserve (--min-free-bytes): free space in it or enlarge it")
                return
            time.sleep(1.0)

    def sweep_dump_dir(self, sample_ids: Iterable[str]) -> int:
        """Delete this run's final dump directories of these samples (finished, or quiet for
        STALE_QUIET_S: what a killed run left); return how many unfinished remain. For
        before and after the run, when none of its requests is in flight."""
        names = {protocol.rid_dirname(self.rid(i)) for i in sample_ids}
        return dumpdir.sweep(self.s.dump_dir, names.__contains__, STALE_QUIET_S)


class _ExtractJob(runner.Job[Sample, Done]):
    """An extraction's hooks in the bounded runner: hidden-state bytes in flight and free
    space in the dump dir bound it; each record goes to the manifest."""

    unit = "sample"

    def __init__(self, extraction: Extraction, manifest: Manifest, report: ExtractReport) -> None:
        self.extraction, self.manifest, self.report = extraction, manifest, report

    def process(self, item: Sample) -> Done:
        return self.extraction.process(item)

    def key(self, item: Sample) -> tuple[str | None, str | None]:
        return item.id, item.where

    def failure(self, item: Sample, error: Exception, report: RunReport) -> str:
        if isinstance(error, SampleFailed):
            return str(error)
        if isinstance(error, ServerDown):
            report.stop(str(error))
            return str(error)
        if isinstance(error, OSError) and error.errno in _FATAL_ERRNOS:
            report.stop(f"{item.where}: {error}")  # a full or read-only disk: stop
        return f"{type(error).__name__}: {error}"  # anything else is local to this sample

    def finished(self, item: Sample, result: Done) -> str:
        self.manifest.append(entry(item, self.extraction.render_key, file=result.file,
                                   tokens=len(item.input_ids), trained=result.trained,
                                   bytes=result.size))
        self.report.add_ok(len(item.input_ids), result.size, result.chunks, result.trained,
                           item.id)
        return f"{self.report.bytes / 1e9:.2f} GB"

    def cost(self, item: Sample) -> int:
        return len(item.input_ids) * self.extraction.info.bytes_per_token

    def has_room(self, need: int, inflight: int) -> bool:
        s = self.extraction.s
        if inflight + need > s.max_inflight_bytes:
            return False
        return dumpdir.dump_free_bytes(s.dump_dir) - need >= s.min_free_bytes

    def wait_for_room(self, need: int, report: RunReport) -> bool:
        self.extraction._wait_for_space(need, self.report)
        return not report.stopped


# ------------------------------------------------------------------------------ set-up


def connect(settings: ExtractSettings,
            rid_prefix: str | None) -> tuple[ServerClient, dict[str, Any], protocol.ServerInfo]:
    """Reach the server and read its ``server.json``; raise on any mismatch between them."""
    client = ServerClient(settings.server, request_timeout=settings.request_timeout,
                          retries=settings.retries, retry_wait=settings.retry_wait)
    model_info = client.model_info()
    info = protocol.read_server_info(settings.dump_dir)
    if info.format_version != protocol.FORMAT_VERSION:
        raise protocol.ProtocolError(
            f"{settings.dump_dir}/server.json uses protocol version {info.format_version}; this "
            f"client reads version {protocol.FORMAT_VERSION}: use matching hsdump versions")
    served = {model_info.get(k) for k in ("model_path", "served_model_name")} - {None}
    if served and info.model not in served:
        raise protocol.ProtocolError(
            f"{settings.dump_dir}/server.json was written by a server of {info.model}, but "
            f"{settings.server} serves {' / '.join(sorted(served))}: --dump-dir belongs to "
            "another server")
    if rid_prefix is not None and rid_prefix != info.rid_prefix:
        raise protocol.ProtocolError(
            f"--rid-prefix {rid_prefix!r} differs from the server's SGLANG_HS_DUMP_RID_PREFIX "
            f"{info.rid_prefix!r}: the server would not dump these requests")
    records.check_format(settings.fmt, info, settings.allow_no_final)
    return client, model_info, info


@dataclass
class Prepared:
    """A connected server and the rendering of its chat rows: what a run needs besides rows."""

    client: ServerClient
    info: protocol.ServerInfo
    tokenizer_path: str
    trust_remote_code: bool
    renderer: ChatRenderer | None
    served: ServedPrompts | None
    chat_template_kwargs: dict[str, Any] | None


def prepare(settings: ExtractSettings, *, model: str | None = None,
            rid_prefix: str | None = None, trust_remote_code: bool = False,
            multi_turn: str = "auto", reasoning_parser: str | None = None,
            chat_template_kwargs: dict[str, Any] | None = None,
            prompt_check: str = "server") -> Prepared:
    """Connect to the server and build the renderer its chat rows are rendered with."""
    client, model_info, info = connect(settings, rid_prefix)
    tokenizer_path = model or model_info.get("tokenizer_path") or info.model
    server_args = client.server_args()
    trust = trust_remote_code or bool(server_args.get("trust_remote_code"))
    tokenizer = load_tokenizer(tokenizer_path, trust)
    follow_chat_template(tokenizer, server_args)
    served = (ServedPrompts(client.tokenize_chat, chat_template_kwargs)
              if prompt_check == "server" else None)
    renderer = chat_renderer(tokenizer, multi_turn,
                             reasoning_parser or server_args.get("reasoning_parser"),
                             template_kwargs=chat_template_kwargs, check=served)
    return Prepared(client, info, tokenizer_path, trust, renderer, served, chat_template_kwargs)


def extract(settings: ExtractSettings, dataset: Path, *, shard: Shard | None = None,
            max_len: int | None = None, prepared: Prepared | None = None,
            **how: Any) -> ExtractReport:
    """Run one extraction (on ``prepared``, else on :func:`prepare` with ``how``); return its
    report."""
    shard = shard or Shard()
    p = prepared or prepare(settings, **how)
    rows, bad_rows = index_shard(dataset, shard)
    settings.out.mkdir(parents=True, exist_ok=True)
    run_id = records.ensure_sidecar(settings.out, records.sidecar(
        settings.fmt, p.info, tokenizer=p.tokenizer_path, max_len=max_len,
        compress=settings.compress, trust_remote_code=p.trust_remote_code,
        loss_mask=settings.loss_mask, chat_template_kwargs=p.chat_template_kwargs))

    report = ExtractReport(shard=str(shard), fmt=settings.fmt, out=str(settings.out),
                           dataset=str(dataset), server=settings.server)
    key = render_key(p.renderer, max_len)
    run = Extraction(settings, p.info, p.client, run_id, key)
    with Manifest(settings.out, shard) as manifest:
        done = load_done(settings.out)
        remove_stale_temps(settings.out, {records.record_name(r.id, settings.fmt,
                                                              settings.compress) for r in rows})
        run.sweep_dump_dir(r.id for r in rows)
        todo, report.already_done = plan_resume(dataset, rows, done, key)

        def count_done() -> None:
            report.already_done += 1

        samples = skip_done(iter_samples(dataset, todo, p.renderer, max_len), done, count_done)
        run.run(itertools.chain(bad_rows, report.watch(samples)), len(bad_rows) + len(todo),
                manifest, report)
        report.leftover_dump_dirs = run.sweep_dump_dir(r.id for r in rows)
    report.prompts_checked_by_server = p.served.checked if p.served is not None else None
    return report


# ------------------------------------------------------------------------------ CLI


def add_common_args(p: argparse.ArgumentParser) -> None:
    """The server, dump and record flags shared by ``extract`` and ``smoke``."""
    options.add_server_flags(p, model_for="the tokenizer and chat template")
    p.add_argument("--dump-dir", type=Path,
                   default=Path(os.environ.get(ENV_DIR) or DEFAULT_DUMP_DIR),
                   help=f"the server's dump dir, visible on this machine (default ${ENV_DIR} or "
                        f"{DEFAULT_DUMP_DIR})")
    p.add_argument("--format", dest="fmt", choices=records.FORMATS, default="eagle3",
                   help="record format: eagle3 (<id>.pt) or specforge (what SpecForge's offline "
                        "training reads: rows_*/<id>.ckpt) (default eagle3)")
    p.add_argument("--compress", action="store_true",
                   help="gzip each record (.pt.gz / .ckpt.gz, as SpecForge's --compress) "
                        "(default off)")
    p.add_argument("--allow-no-final", action="store_true",
                   help="let --format eagle3 run against a server that does not dump the "
                        "post-final-norm state (records without final_hidden_state) (default "
                        "off: refused)")
    p.add_argument("--max-len", type=int, default=None,
                   help="truncate samples to this many tokens (default: no limit)")
    p.add_argument("--rid-prefix", default=None,
                   help="expected rid prefix (default: the one in server.json, normally "
                        f"{DEFAULT_RID_PREFIX!r})")
    p.add_argument("--dump-timeout", type=float, default=DEFAULT_DUMP_TIMEOUT,
                   help="seconds to wait for a request's done/error marker after its answer "
                        f"(default {DEFAULT_DUMP_TIMEOUT:g})")
    p.add_argument("--multi-turn", choices=POLICIES, default="auto",
                   help="samples of a multi-turn chat row: auto (one sample with every "
                        "assistant turn trained when each turn's serving prompt extends the "
                        "previous one, else one per turn), per-turn, or last (docs/client.md) "
                        "(default auto)")
    p.add_argument("--reasoning-parser", default=None,
                   help="SGLang reasoning parser whose think markers wrap reasoning_content, "
                        "e.g. kimi_k2 (default: the server's --reasoning-parser, else <think> / "
                        "</think> when both are tokens)")


def add_parser(subparsers: Any) -> None:
    """Register ``hsdump extract``."""
    p = subparsers.add_parser(
        "extract", help="extract hidden states for a JSONL dataset into training records",
        description=__doc__.splitlines()[0])
    options.add_io_flags(p, dataset="messages / conversations / input_ids+loss_mask rows",
                         out="output directory for records, manifest and report")
    add_common_args(p)
    options.add_run_flags(p, noun="sample", concurrency=DEFAULT_CONCURRENCY,
                          report="OUT/report.shard-I-of-N.json")
    p.add_argument("--max-inflight-bytes", default=DEFAULT_MAX_INFLIGHT,
                   help="cap on the estimated hidden-state bytes of requests in flight "
                        f"(default {DEFAULT_MAX_INFLIGHT})")
    p.add_argument("--min-free-bytes", default=DEFAULT_MIN_FREE,
                   help=f"free space kept in the dump dir (default {DEFAULT_MIN_FREE})")
    p.add_argument("--loss-mask", choices=LOSS_MASKS, default="completion",
                   help="completion: 1 on each turn's emitted tokens; drafted: 1 where, under "
                        "SpecForge's one-token shift, the drafter's input and target tokens "
                        "are both emitted in one turn, as it drafts them when served "
                        "(docs/client.md) (default completion)")
    p.add_argument("--prompt-check", choices=PROMPT_CHECKS, default="server",
                   help="server: every trained turn's prompt ids must equal what the server "
                        "serves for that turn's chat request (its /v1/tokenize), a row that "
                        "differs is skipped with the reason; off: trust local rendering "
                        "(default server)")
    options.add_template_kwargs_flag(p, recorded_in=records.META_FILE)
    p.set_defaults(func=main)


def settings_from_args(args: argparse.Namespace, out: Path, **overrides: Any) -> ExtractSettings:
    """Build ExtractSettings from parsed flags (``overrides`` win)."""
    values: dict[str, Any] = {
        **options.server_settings(args), "dump_dir": args.dump_dir, "out": out,
        "fmt": args.fmt, "dump_timeout": args.dump_timeout, "compress": args.compress,
        "allow_no_final": args.allow_no_final,
    }
    values.update(overrides)
    return ExtractSettings(**values)


def main(args: argparse.Namespace) -> int:
    """Run ``hsdump extract``; exit 0 all ok, 3 finished with skipped/failed samples, 1 stopped."""
    try:
        settings = settings_from_args(
            args, args.out, **options.run_settings(args),
            max_inflight_bytes=parse_size(args.max_inflight_bytes, "--max-inflight-bytes"),
            min_free_bytes=parse_size(args.min_free_bytes, "--min-free-bytes"),
            loss_mask=args.loss_mask)
        report = extract(settings, args.dataset, shard=args.shard, model=args.model,
                         max_len=args.max_len, rid_prefix=args.rid_prefix,
                         trust_remote_code=args.trust_remote_code, multi_turn=args.multi_turn,
                         reasoning_parser=args.reasoning_parser,
                         chat_template_kwargs=args.chat_template_kwargs,
                         prompt_check=args.prompt_check)
    except (ServerDown, protocol.ProtocolError, ConfigError, ValueError, RuntimeError,
            OSError) as e:
        print(f"hsdump extract: error: {e}", file=sys.stderr)
        return 1
    path = args.report or args.out / f"report.{args.shard.tag}.json"
    protocol.write_json_atomic(path, report.to_json())
    print_summary(report, path)
    return report.exit_code()

