"""The file side of the dump writer: per-request bookkeeping, chunk files and markers.

Torch-free: it runs in the forward's process (threads, ``SGLANG_HS_DUMP_WRITER=thread``) or in
the writer process (``writer_proc.py``). Its caller has already put each chunk's bytes
(safetensors header + tensors) into staging pages; a pool of threads writes each chunk's pages
into its temp file with ``pwritev`` and renames the file into place, then writes the request's
done or error marker once nothing of it is outstanding. Each file is written by one thread:
tmpfs bandwidth scales with threads writing different files, while writes to one file are
serialized by the kernel. Nothing here raises into the caller: errors are counted, logged and
reported in the error marker.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from hsdump_patch import protocol

logger = logging.getLogger("hsdump")

# Pages per pwritev (up to 1 GiB, within IOV_MAX): a file in one call. Each system call of a
# writer thread is a GIL hand-over that can delay the forward thread by the thread's Python
# work, and the forward's first layers are host-bound (issue 17); pages go back per call.
_PAGES_PER_WRITE = 128
MAX_TRACKED_RIDS = 100_000


class Page(Protocol):
    """A staging page: ``array`` is its bytes (a numpy uint8 array)."""

    array: Any


class Ready(Protocol):
    """Completion of the copies into a job's pages (a CUDA event)."""

    def synchronize(self) -> None: ...


@dataclass
class RidState:
    """One attempt of a request; a new attempt of the rid (see ``begin_request``) replaces it."""

    outstanding: int = 0
    chunks: list[int] = field(default_factory=list)
    tokens: int = 0
    prompt_len: int | None = None  # set when the last chunk has been submitted
    error: str | None = None
    marker_written: bool = False  # done, or the first error (a later error changes nothing)
    superseded: bool = False  # a newer attempt of the rid began: this one writes no marker
    dir_made: bool = False  # its directory exists (made by a writer thread for this attempt)
    tag: int = 0  # the caller's name for this attempt (the writer process's), for ``marked``


@dataclass
class FileJob:
    rid: str
    state: RidState  # the attempt the chunk belongs to
    prefix_len: int
    final: Path
    tmp: Path
    pages: Sequence[Page]  # page i holds bytes [i * page_bytes, (i + 1) * page_bytes)
    nbytes: int
    ready: Ready | None  # the copies into the pages are done once this is synchronized
    released: int = 0  # pages[:released] are written and back with their owner


@dataclass
class FileStats:
    chunks_written: int = 0
    chunks_failed: int = 0
    bytes_written: int = 0
    requests_done: int = 0
    requests_failed: int = 0
    internal_errors: int = 0


class FileWriter:
    """Writes chunk files and markers for requests; see the module docstring.

    ``release(pages)`` gives written pages back to their owner; ``bind()`` runs first in each
    thread (the CUDA device binding); ``settled()`` runs after each call of :meth:`begin_request`,
    :meth:`fail` or :meth:`add` has had its full effect (a job: written, marker included);
    ``marked(tag, done)`` runs once an attempt's marker is written (before its ``settled()``),
    with the ``tag`` last given for the attempt to :meth:`add` or :meth:`fail`."""

    def __init__(self, dump_dir: Path, *, threads: int, page_bytes: int,
                 release: Callable[[Sequence[Page]], None],
                 bind: Callable[[], None] | None = None,
                 settled: Callable[[], None] | None = None,
                 marked: Callable[[int, bool], None] | None = None) -> None:
        self.dump_dir = Path(dump_dir)
        self.page_bytes = page_bytes
        self.stats = FileStats()
        self.dead: str | None = None  # (the writer process's interface: never, here)
        self.deaths = 0
        self._release = release
        self._bind = bind
        self._settled = settled or (lambda: None)
        self._marked = marked or (lambda tag, done: None)
        self._umask_owner_ok = umask_keeps_owner_bits()
        self._lock = threading.Lock()
        self._rids: OrderedDict[str, RidState] = OrderedDict()
        self._tasks: queue.SimpleQueue[FileJob | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._worker, name=f"hsdump-writer-{i}", daemon=True)
            for i in range(max(1, threads))
        ]
        for t in self._threads:
            t.start()

    # ---------------------------------------------------------------- caller side

    def begin_request(self, rid: str) -> None:
        """Start a new attempt of ``rid`` (its first chunk): forget an earlier attempt.

        A failed attempt keeps its state, so that its late chunks are dropped; an aborted one
        leaves chunk counts. A client that re-sends the rid after removing the old directory
        must get a fresh marker, not the old failure (nor nothing at all).
        """
        with self._lock:
            old = self._rids.pop(rid, None)
            if old is not None:
                old.superseded = True  # its chunks still in flight finish without a marker
        self._settled()

    def failed(self, rid: str) -> bool:
        """Whether the current attempt of ``rid`` has failed (its later chunks are dropped)."""
        with self._lock:
            state = self._rids.get(rid)
            return state is not None and state.error is not None

    def fail(self, rid: str, reason: str | None, prompt_len: int | None,
             internal: bool = False, tag: int = 0, marked: bool = False) -> None:
        """Record ``reason`` (None: keep the earlier one) and the prompt length, then finish
        (``internal``: also count an internal error; ``tag``: see the class; ``marked``: the
        error marker is written already, by the writer process's parent: write none)."""
        state = self._rid_state(rid, tag)
        with self._lock:
            if internal:
                self.stats.internal_errors += 1
            if marked:
                state.error = state.error or reason
                state.marker_written = True
        self._fail(rid, state, reason, prompt_len)
        self._settled()

    def add(self, rid: str, prefix_len: int, tokens: int, prompt_len: int | None,
            pages: Sequence[Page], nbytes: int, ready: Ready | None, tag: int = 0) -> None:
        """Queue one chunk file whose bytes are (or, once ``ready``, will be) in ``pages``.
        A chunk of a failed request is dropped (its pages go back once the copy is done)."""
        state = self._rid_state(rid, tag)
        with self._lock:
            failed = state.error is not None
            if not failed:
                state.outstanding += 1
                state.chunks.append(prefix_len)
                state.tokens += tokens
                if prompt_len is not None:
                    state.prompt_len = prompt_len
        if failed:
            if ready is not None:
                with contextlib.suppress(Exception):
                    ready.synchronize()
            self._release(pages)
            self._fail(rid, state, None, prompt_len)
            self._settled()
            return
        final = protocol.rid_dir(self.dump_dir, rid) / protocol.chunk_filename(prefix_len)
        self._tasks.put(FileJob(rid, state, prefix_len, final, protocol.temp_path(final),
                                pages, nbytes, ready))

    def commit(self, ready: Ready | None) -> None:
        """Nothing to do: :meth:`add` has queued each job (the writer process sends here)."""

    def idle(self) -> bool:
        """Always: the owner of the pages knows when every job is done (all are back)."""
        return True

    @property
    def tracked_requests(self) -> int:
        """Requests kept state for: in flight, and failed ones (LRU-bounded)."""
        with self._lock:
            return len(self._rids)

    @property
    def thread_ids(self) -> list[int]:
        """Kernel thread ids of the writer threads (for CPU accounting)."""
        return [t.native_id for t in self._threads if t.native_id is not None]

    def close(self) -> None:
        """Stop the threads once the queued jobs are written."""
        for _ in self._threads:
            self._tasks.put(None)
        for t in self._threads:
            t.join()

    # ---------------------------------------------------------------- internals

    def _rid_state(self, rid: str, tag: int = 0) -> RidState:
        with self._lock:
            state = self._rids.get(rid)
            if state is None:
                state = self._rids[rid] = RidState()
                while len(self._rids) > MAX_TRACKED_RIDS:  # aborted requests never finish
                    self._rids.popitem(last=False)
            if tag:
                state.tag = tag
            return state

    def _worker(self) -> None:
        if self._bind is not None:
            try:
                self._bind()
            except Exception:  # its jobs then fail, with the CUDA error in their markers
                logger.exception("hsdump: writer thread could not bind to its device")
        while True:
            job = self._tasks.get()
            if job is None:
                return
            try:
                failure = self._write_file(job)
                self._finish_request(job, failure)
            except Exception:  # a bug here must not stop the thread or leak the pages
                with self._lock:
                    self.stats.internal_errors += 1
                logger.exception("hsdump: internal error after writing %s", job.final)
            finally:
                # Last, so that a drained pool means the markers are written too.
                self._release(job.pages[job.released :])
                self._settled()

    def _write_file(self, job: FileJob) -> str | None:
        """Write one file, whole, from this thread; return None, or why it failed.

        Writes to one file are serialized by the kernel (inode lock), so threads work on
        different files rather than on parts of one. Written pages go back at once.
        """
        copied = False
        try:
            # Directory and file are made before the wait for the copy: a thread usually takes
            # its job during the forward's hand-off, when the forward thread is far ahead of
            # the device, while the copy ends early in the next forward, whose first layers are
            # host-bound (each system call here is a GIL hand-over that can delay them).
            if not job.state.dir_made:
                self._make_dir(job.final.parent)
                job.state.dir_made = True
            fd = os.open(job.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, protocol.FILE_MODE)
            try:
                if job.ready is not None:
                    job.ready.synchronize()
                copied = True
                for i in range(0, len(job.pages), _PAGES_PER_WRITE):
                    group = job.pages[i : i + _PAGES_PER_WRITE]
                    start = i * self.page_bytes
                    n = min(len(group) * self.page_bytes, job.nbytes - start)
                    pwrite_all(fd, [memoryview(p.array) for p in group], start, n)
                    done = min(i + len(group), len(job.pages) - 1)  # the last page is kept
                    self._release(job.pages[job.released : done])  # until the marker
                    job.released = done
            finally:
                os.close(fd)
            os.replace(job.tmp, job.final)
            return None
        except Exception as e:  # OSError, or a CUDA error from the copy
            if not copied and job.ready is not None:  # no copy may land in released pages
                with contextlib.suppress(Exception):
                    job.ready.synchronize()
            with contextlib.suppress(OSError):
                job.tmp.unlink(missing_ok=True)
            return f"{type(e).__name__}: {e}"

    def _make_dir(self, path: Path) -> None:
        """``protocol.make_private_dir`` in one system call for a new directory (its mode is
        then exact unless the umask takes owner bits, checked once at start)."""
        if self._umask_owner_ok:
            try:
                os.mkdir(path, protocol.DIR_MODE)
                return
            except OSError:  # it exists (tighten its mode) or a parent is missing
                pass
        protocol.make_private_dir(path)

    def _finish_request(self, job: FileJob, failure: str | None) -> None:
        ok = failure is None
        state = job.state
        with self._lock:
            if ok:
                self.stats.chunks_written += 1
                self.stats.bytes_written += job.nbytes
            else:
                self.stats.chunks_failed += 1
            state.outstanding -= 1
            if not ok:
                state.error = state.error or f"writing chunk {job.prefix_len} failed: {failure}"
        if not ok:
            logger.error("hsdump: writing %s failed: %s", job.final, failure)
        self._maybe_finish(job.rid, state, job.final.parent)

    def _fail(self, rid: str, state: RidState, reason: str | None,
              prompt_len: int | None) -> None:
        with self._lock:
            first = state.error is None and reason is not None
            state.error = state.error or reason
            if prompt_len is not None:
                state.prompt_len = prompt_len
        if first:
            logger.error("hsdump: request %s cannot be dumped: %s", rid, reason)
        self._maybe_finish(rid, state)

    def _maybe_finish(self, rid: str, state: RidState, rid_dir: Path | None = None) -> None:
        """Write the done or error marker once nothing of the request is outstanding
        (``rid_dir``: the request's directory, when the caller knows it)."""
        with self._lock:
            if state.outstanding or state.marker_written or state.superseded:
                return
            complete = state.prompt_len is not None
            if state.error is not None:
                # The state stays (LRU-bounded), so that a late chunk of the rid is dropped.
                state.marker_written = True
                payload = protocol.ErrorMarker(rid, state.error, sorted(state.chunks)).to_json()
                self.stats.requests_failed += 1
                marker = protocol.ERROR_MARKER
            elif complete:
                state.marker_written = True
                if self._rids.get(rid) is state:
                    del self._rids[rid]
                payload = protocol.DoneMarker(rid, state.prompt_len, state.tokens,
                                              sorted(state.chunks)).to_json()
                self.stats.requests_done += 1
                marker = protocol.DONE_MARKER
            else:
                return
        try:
            d = protocol.rid_dir(self.dump_dir, rid) if rid_dir is None else rid_dir
            if not state.dir_made:
                protocol.make_private_dir(d)
            protocol.write_json_atomic(d / marker, payload, fsync=False)  # a transient dir
        except Exception:
            with self._lock:
                self.stats.internal_errors += 1
            logger.exception("hsdump: could not write %s for %s", marker, rid)
            return
        self._marked(state.tag, marker == protocol.DONE_MARKER)


def umask_keeps_owner_bits() -> bool:
    """Whether the process umask (read without changing it) leaves a new 0700 directory 0700."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8) & 0o700 == 0
    except (OSError, ValueError, IndexError):
        pass
    return False


def pwrite_all(fd: int, buffers: list[memoryview], offset: int, n: int) -> None:
    """Write the first ``n`` bytes of ``buffers`` (back to back) at ``offset``."""
    views, left = [], n
    for b in buffers:
        if left <= 0:
            break
        views.append(b[:left])
        left -= len(views[-1])
    while views:
        written = os.pwritev(fd, views, offset)
        offset += written
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if views:
            views[0] = views[0][written:]
