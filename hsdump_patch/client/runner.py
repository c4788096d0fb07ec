"""The bounded runner under ``hsdump extract`` and ``hsdump regenerate``.

Items (or the :class:`SampleError` of a bad row) go through a thread pool with at most
``concurrency`` in flight, and at most what the job's :meth:`Job.has_room` allows; finished
items are handed back in completion order. Bad rows are listed as skipped, failed items as
failed (``--on-error`` and ``--max-consecutive-errors`` decide when the run stops); a progress
bar counts both and shows the token rate.
"""

from __future__ import annotations

import concurrent.futures as cf
import sys
import time
from collections.abc import Iterable
from typing import Generic, Protocol, TypeVar

from tqdm import tqdm

from hsdump_patch.client.output.report import ErrorPolicy, RunReport
from hsdump_patch.client.rows.dataset import SampleError

T = TypeVar("T")
R = TypeVar("R")


class Limits(Protocol):
    """The flags that bound a run (both commands' Settings have them)."""

    concurrency: int
    on_error: str
    max_consecutive_errors: int
    progress: bool


class Job(Generic[T, R]):
    """What one command does with an item; the runner calls these hooks."""

    unit = "item"  # the progress bar's unit
    thread_prefix = "hsdump"

    def key(self, item: T) -> tuple[str | None, str | None]:
        """``(id, where)`` of an item, for the issues."""
        raise NotImplementedError

    def process(self, item: T) -> R:
        """Do the work of one item (in a pool thread)."""
        raise NotImplementedError

    def failure(self, item: T, error: Exception, report: RunReport) -> str:
        """The issue's reason for an item whose ``process`` raised; stop ``report`` here when
        the error ends the run."""
        raise NotImplementedError

    def finished(self, item: T, result: R) -> str | None:
        """Keep a finished item's result; return more progress text, or None."""
        raise NotImplementedError

    def cost(self, item: T) -> int:
        """What an item holds while in flight (bytes), checked by :meth:`has_room`."""
        return 0

    def has_room(self, need: int, inflight: int) -> bool:
        """Whether one more item of cost ``need`` fits beside ``inflight`` (with some in
        flight; the concurrency bound is the runner's)."""
        return True

    def wait_for_room(self, need: int, report: RunReport) -> bool:
        """With nothing in flight, wait until an item of cost ``need`` fits; False: stop."""
        return True


def run(items: Iterable[T | SampleError], total: int, job: Job[T, R], report: RunReport,
        limits: Limits) -> None:
    """Run ``job`` over ``items`` with bounded concurrency; fill ``report`` (issues, stop
    reason, ``wall_s``)."""
    t0 = time.monotonic()
    pending: dict[cf.Future[R], tuple[T, int]] = {}
    inflight = 0
    noun = job.unit + "s"
    bar = tqdm(total=total, unit=job.unit, disable=not limits.progress, dynamic_ncols=True,
               file=sys.stderr)
    policy = ErrorPolicy(report, limits.on_error, limits.max_consecutive_errors, noun, bar)

    def collect(block: bool) -> None:
        nonlocal inflight
        if not pending:
            return
        done, _ = cf.wait(pending, timeout=None if block else 0, return_when=cf.FIRST_COMPLETED)
        for fut in done:
            item, need = pending.pop(fut)
            inflight -= need
            try:
                res = fut.result()
            except Exception as e:
                item_id, where = job.key(item)
                policy.issue("failed", item_id, where, job.failure(item, e, report))
                continue
            policy.ok()
            note = job.finished(item, res)
            bar.update(1)
            rate = report.tokens / max(time.monotonic() - t0, 1e-9)
            bar.set_postfix_str(f"{rate:,.0f} tok/s" + (f", {note}" if note else ""),
                                refresh=False)

    with cf.ThreadPoolExecutor(limits.concurrency, thread_name_prefix=job.thread_prefix) as pool:
        try:
            for item in items:
                if report.stopped:
                    break
                if isinstance(item, SampleError):
                    policy.issue("skipped", item.sample_id, item.where, item.problem)
                    continue
                need = job.cost(item)
                while pending and (len(pending) >= limits.concurrency
                                   or not job.has_room(need, inflight)):
                    collect(block=True)
                if not pending and not job.wait_for_room(need, report):
                    break
                pending[pool.submit(job.process, item)] = (item, need)
                inflight += need
                collect(block=False)
            while pending:
                collect(block=True)
        finally:
            bar.close()
    report.wall_s = time.monotonic() - t0
