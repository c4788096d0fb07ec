"""The run report: counts, throughput, and every failed or skipped sample with its reason."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

EXIT_OK = 0
EXIT_STOPPED = 1
EXIT_WITH_ISSUES = 3


@dataclass(frozen=True)
class SampleIssue:
    """A sample that was skipped (bad input) or failed (extraction)."""

    kind: str  # "skipped" | "failed"
    id: str | None
    where: str | None
    reason: str


@dataclass(kw_only=True)
class RunReport:
    """What every run's report holds: token and time counts, the stop reason and the issues."""

    already_done: int = 0
    tokens: int = 0
    wall_s: float = 0.0
    stopped: str | None = None
    issues: list[SampleIssue] = field(default_factory=list)

    def add_issue(self, issue: SampleIssue) -> None:
        self.issues.append(issue)

    def stop(self, reason: str) -> None:
        """Stop the run (the first reason is kept)."""
        self.stopped = self.stopped or reason

    def count(self, kind: str) -> int:
        return sum(i.kind == kind for i in self.issues)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    def exit_code(self) -> int:
        if self.stopped:
            return EXIT_STOPPED
        return EXIT_WITH_ISSUES if self.issues else EXIT_OK

    def by_reason(self, kind: str) -> dict[str, int]:
        """How many issues of ``kind`` per reason (numbers and quoted names blanked out)."""
        return dict(Counter(_REASON_DETAILS.sub("…", i.reason) for i in self.issues
                            if i.kind == kind).most_common())

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(failed=self.count("failed"), skipped=self.count("skipped"),
                   skipped_by_reason=self.by_reason("skipped"),
                   failed_by_reason=self.by_reason("failed"),
                   tokens_per_s=round(self.tokens_per_s, 1), wall_s=round(self.wall_s, 3))
        return out


_REASON_DETAILS = re.compile(r"'[^']*'|\"[^\"]*\"|\d+")


class ErrorPolicy:
    """``--on-error`` and ``--max-consecutive-errors``: list each issue, stop when told to."""

    def __init__(self, report: RunReport, on_error: str, max_consecutive: int, noun: str,
                 progress: Any) -> None:
        self.report = report
        self.on_error = on_error
        self.max_consecutive = max_consecutive
        self.noun = noun  # "samples" / "rows", for the stop message
        self.progress = progress  # a tqdm bar: every issue counts as a processed item
        self.consecutive = 0

    def issue(self, kind: str, item_id: str | None, where: str | None, reason: str) -> None:
        """Record a skipped (bad input) or failed item."""
        self.report.add_issue(SampleIssue(kind, item_id, where, reason))
        self.progress.update(1)
        if self.on_error == "fail":
            self.report.stop(f"{where or item_id}: {reason} (--on-error fail)")
        self.consecutive += kind == "failed"
        if self.consecutive >= self.max_consecutive:
            self.report.stop(f"{self.consecutive} {self.noun} in a row failed "
                             f"(--max-consecutive-errors); last: {reason}")

    def ok(self) -> None:
        """An item succeeded: the consecutive-failure count starts again."""
        self.consecutive = 0


@dataclass
class ExtractReport(RunReport):
    """What one extraction did; ``to_json`` is what is written next to the records."""

    shard: str
    fmt: str
    out: str
    dataset: str
    server: str
    ok: int = 0
    bytes: int = 0
    max_chunks: int = 0
    leftover_dump_dirs: int = 0
    trained_tokens: int = 0  # loss-mask 1 tokens of the records as written (--loss-mask)
    longest: dict[str, Any] | None = None  # the longest written sample: id, tokens
    per_turn_fallbacks: int = 0  # chat rows ``auto`` split into per-turn samples
    fallback_reasons: dict[str, int] = field(default_factory=dict)
    fallback_rows: list[str] = field(default_factory=list)  # their ids (the first 100)
    # trained turns whose prompt ids the server's own rendering confirmed (None: not checked)
    prompts_checked_by_server: int | None = None

    def add_ok(self, tokens: int, size: int, chunks: int, trained: int = 0,
               sample_id: str | None = None) -> None:
        self.ok += 1
        self.tokens += tokens
        self.trained_tokens += trained
        self.bytes += size
        self.max_chunks = max(self.max_chunks, chunks)
        if self.longest is None or tokens > self.longest["tokens"]:
            self.longest = {"id": sample_id, "tokens": tokens}

    def watch(self, items: Iterable[Any]) -> Iterator[Any]:
        """Pass ``items`` (samples, errors) through, counting the rows ``auto`` split into
        per-turn samples (``Sample.fallback``) by reason."""
        for item in items:
            reason = getattr(item, "fallback", None)
            if reason:
                self.per_turn_fallbacks += 1
                self.fallback_reasons[reason] = self.fallback_reasons.get(reason, 0) + 1
                if len(self.fallback_rows) < 100:
                    self.fallback_rows.append(item.id)
            yield item


def print_issues(report: RunReport, shown: int = 20) -> None:
    """Print the first ``shown`` issues, one line each, and how many more the report holds."""
    for issue in report.issues[:shown]:
        print(f"  {issue.kind}: {issue.where or issue.id}: {issue.reason}")
    if len(report.issues) > shown:
        print(f"  ... {len(report.issues) - shown} more in the report")


def format_table(rows: list[tuple[str, str]]) -> str:
    """Two aligned columns."""
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def print_summary(report: ExtractReport, report_path: Path) -> None:
    """Print the end-of-run table, the issues (at most 20) and where the report is."""
    rows = [
        ("samples written", f"{report.ok:,}"),
        ("already done", f"{report.already_done:,}"),
        ("failed", f"{report.count('failed'):,}"),
        ("skipped", f"{report.count('skipped'):,}"),
        ("tokens stored", f"{report.tokens:,}"),
        ("tokens trained", f"{report.trained_tokens:,} ("
                           f"{report.trained_tokens / max(report.tokens, 1):.1%} of stored)"),
        ("longest record", f"{report.longest['tokens']:,} tokens ({report.longest['id']})"
                           if report.longest else "-"),
        ("per-turn fallbacks", f"{report.per_turn_fallbacks:,} rows"),
        ("written", f"{report.bytes / 1e9:.3f} GB"),
        ("wall time", f"{report.wall_s:.1f} s"),
        ("throughput", f"{report.tokens_per_s:,.0f} tokens/s"),
    ]
    print(f"hsdump extract: shard {report.shard}, format {report.fmt} -> {report.out}")
    print(format_table(rows))
    for reason, n in report.fallback_reasons.items():
        print(f"  per-turn fallback ({n:,} rows): {reason}")
    for kind in ("skipped", "failed"):
        for reason, n in report.by_reason(kind).items():
            print(f"  {kind} ({n:,}): {reason}")
    print_issues(report)
    if report.leftover_dump_dirs:
        print(f"  warning: {report.leftover_dump_dirs} unfinished request dir(s) of this dataset "
              "remain in the dump dir (requests still running on the server?)")
    if report.stopped:
        print(f"STOPPED: {report.stopped}")
    print(f"report: {report_path}")
