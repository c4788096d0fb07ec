"""Asynchronous, bounded writer of chunk files (runs on the writer rank only).

The forward thread calls :meth:`DumpWriter.submit_forward` once per dumped forward (or
:meth:`DumpWriter.submit` per chunk); it only copies the chunks into staging pages (on CUDA:
enqueues device-to-host copies into pinned pages on a side stream, after one stream wait, with
one event per chunk) and returns: its host time is on the forward's critical path. A
pool of threads waits for each copy, writes the chunk's pages into its temp file with
``pwrite`` and renames the file into place. Each file is written by one thread: tmpfs
bandwidth scales with threads writing different files, while writes to one file are serialized
by the kernel, so several chunks (requests) are written at once instead.

Memory is bounded by the in-flight cap: staging memory is a pool of fixed-size pages that never
grows past ``max_inflight_bytes`` (a chunk larger than the cap goes through alone, and its extra
pages are dropped after it). On CUDA the pool is pinned up to the cap by a background thread
at start; after that no page is allocated. When the cap is reached the forward thread waits
rather than memory growing. A free-space guard refuses a chunk that would
push the dump dir below its reserve and turns the request into an error marker instead. Nothing
here raises into the forward: errors are counted, logged and reported in the error marker.

On CUDA every thread of the writer binds to the writer's device before its first CUDA call
(a bare call would create a context on GPU 0), and waits for a copy on a blocking event: a
default ``torch.cuda.Event`` spins a core in ``synchronize()`` for as long as the forward runs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from hsdump_patch import protocol

logger = logging.getLogger("hsdump")

PAGE_BYTES = 8 << 20  # staging page; 8 MiB keeps per-call overhead < 1%
# Pages per pwritev (up to 1 GiB, within IOV_MAX): a file in one call. Each system call of a
# writer thread is a GIL hand-over that can delay the forward thread by the thread's Python
# work, and the forward's first layers are host-bound (issue 17); pages go back per call.
_PAGES_PER_WRITE = 128
_MIN_PAGE_BYTES = 4 << 10
_MIN_PAGES_PER_CAP = 16  # a small cap gets smaller pages, so several chunks still overlap
_MAX_TRACKED_RIDS = 100_000


@dataclass
class _RidState:
    """One attempt of a request; a new attempt of the rid (see ``begin_request``) replaces it."""

    outstanding: int = 0
    chunks: list[int] = field(default_factory=list)
    tokens: int = 0
    prompt_len: int | None = None  # set when the last chunk has been submitted
    error: str | None = None
    marker_written: bool = False  # done, or the first error (a later error changes nothing)
    superseded: bool = False  # a newer attempt of the rid began: this one writes no marker
    dir_made: bool = False  # its directory exists (made by a writer thread for this attempt)


@dataclass(frozen=True)
class Chunk:
    """One request's chunk in :meth:`DumpWriter.submit_forward`: rows ``[start, end)`` of
    every tensor (``end`` None: to the end). ``prompt_len`` is set when it ends the prompt."""

    meta: protocol.ChunkMeta
    start: int
    end: int | None
    prompt_len: int | None


@dataclass
class _Staged:
    chunk: Chunk
    state: _RidState
    header: bytes
    nbytes: int
    pages: list[_Page]


@dataclass
class _Page:
    tensor: torch.Tensor  # uint8 [page_bytes], pinned on CUDA
    array: np.ndarray  # the same bytes, for host-side copies and pwrite


@dataclass
class _FileJob:
    rid: str
    state: _RidState  # the attempt the chunk belongs to
    prefix_len: int
    final: Path
    tmp: Path
    pages: list[_Page]  # page i holds bytes [i * page_bytes, (i + 1) * page_bytes) of the file
    nbytes: int
    ready: torch.cuda.Event | None  # D2H completion (CUDA only)
    released: int = 0  # pages[:released] are written and back in the pool


@dataclass
class WriterStats:
    chunks_written: int = 0
    chunks_failed: int = 0
    bytes_written: int = 0
    requests_done: int = 0
    requests_failed: int = 0
    internal_errors: int = 0
    forward_wait_s: float = 0.0  # time the forward thread waited for in-flight budget
    peak_inflight_bytes: int = 0  # most staging bytes held by chunks at once
    staging_bytes: int = 0  # staging memory allocated now (pool of pages)

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


class DumpWriter:
    """Writes chunk files and markers for requests; see the module docstring."""

    def __init__(
        self,
        dump_dir: Path,
        *,
        max_inflight_bytes: int,
        min_free_bytes: int,
        threads: int,
        device: torch.device,
        blocking_events: bool = True,
    ) -> None:
        """``blocking_events=False`` makes the copy waits spin (only to measure what that
        costs, in scripts/bench_writer.py)."""
        self.dump_dir = Path(dump_dir)
        self.max_inflight_bytes = max_inflight_bytes
        self.min_free_bytes = min_free_bytes
        self.stats = WriterStats()
        self._cuda = device.type == "cuda"
        self._blocking_events = blocking_events
        self._umask_owner_ok = _umask_keeps_owner_bits()
        # Resolved here, in the forward's thread: in another thread a bare "cuda" means GPU 0.
        self.device_index = bound_device_index(device, torch.cuda.current_device)
        self._side_stream = torch.cuda.Stream(device=device) if self._cuda else None
        self.page_bytes = _page_bytes_for(max_inflight_bytes)
        self._cap_pages = max(1, max_inflight_bytes // self.page_bytes)
        self._used_pages = 0
        self._pool_pages = 0
        self._free: list[_Page] = []
        self._closed = False
        self._cond = threading.Condition()
        self._rids: OrderedDict[str, _RidState] = OrderedDict()
        self._tasks: queue.SimpleQueue[_FileJob | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._worker, name=f"hsdump-writer-{i}", daemon=True)
            for i in range(max(1, threads))
        ]
        for t in self._threads:
            t.start()
        self._filler: threading.Thread | None = None
        if self._cuda:
            self._filler = threading.Thread(target=self._fill_pool, name="hsdump-pinned-pool",
                                            daemon=True)
            self._filler.start()

    # ---------------------------------------------------------------- forward thread side

    def submit(
        self,
        meta: protocol.ChunkMeta,
        tensors: list[tuple[str, torch.Tensor]],
        prompt_len: int | None,
    ) -> None:
        """Queue one chunk of one request: all of ``tensors``. ``prompt_len`` is set when this
        chunk ends the prompt. See :meth:`submit_forward`."""
        self.submit_forward(tensors, [Chunk(meta, 0, None, prompt_len)])

    def submit_forward(self, tensors: list[tuple[str, torch.Tensor]], chunks: list[Chunk]
                       ) -> None:
        """Queue one chunk file per entry of ``chunks`` (one forward's hand-off): each holds
        its rows of every one of ``tensors``, named as given, back to back.

        The data is taken as it is in stream order at the call (on CUDA the copies are
        enqueued on a side stream that waits once for the current stream); the caller may
        drop or reuse the tensors right after, and nothing keeps them beyond the copies.
        Per-chunk work is kept small: each tensor is flattened once, the free space is read
        once, and the side stream waits for the current stream once.
        """
        with self._cond:
            closed = self._closed
        fs_free = self._fs_free()
        staged: list[_Staged] = []
        for chunk in chunks:
            rid, prompt_len = chunk.meta.rid, chunk.prompt_len
            state = self._rid_state(rid)
            with self._cond:
                failed = state.error is not None
            if closed:
                self._fail(rid, state, "the dump writer is shut down", prompt_len)
                continue
            if failed:
                self._fail(rid, state, None, prompt_len)
                continue
            try:
                specs = [protocol.TensorSpec(n, _st_dtype(t), _rows_shape(t, chunk))
                         for n, t in tensors]
                header = protocol.safetensors_header(specs, chunk.meta.to_strings())
            except Exception as e:
                self._internal_error(rid, state, prompt_len, f"cannot describe the chunk: {e!r}")
                continue
            nbytes = len(header) + sum(spec.nbytes for spec in specs)
            reason = self._check_free_space(nbytes, fs_free)
            if reason is not None:
                self._fail(rid, state, reason, prompt_len)
                continue
            try:
                pages = self._acquire(-(-nbytes // self.page_bytes))
            except Exception as e:
                self._internal_error(rid, state, prompt_len, f"cannot allocate staging: {e!r}")
                continue
            staged.append(_Staged(chunk, state, header, nbytes, pages))
        if not staged:
            return
        try:
            ready = self._stage([t for _, t in tensors], staged)
        except Exception as e:  # _stage waited for any copy it had started
            for st in staged:
                self._release(st.pages)
                self._internal_error(st.chunk.meta.rid, st.state, st.chunk.prompt_len,
                                     f"cannot copy the chunk: {e!r}")
            return
        for st, done in zip(staged, ready, strict=True):
            meta = st.chunk.meta
            final = protocol.rid_dir(self.dump_dir, meta.rid) / protocol.chunk_filename(
                meta.prefix_len)
            job = _FileJob(meta.rid, st.state, meta.prefix_len, final, protocol.temp_path(final),
                           st.pages, st.nbytes, done)
            with self._cond:
                st.state.outstanding += 1
                st.state.chunks.append(meta.prefix_len)
                st.state.tokens += _rows_shape(tensors[0][1], st.chunk)[0]
                if st.chunk.prompt_len is not None:
                    st.state.prompt_len = st.chunk.prompt_len
            self._tasks.put(job)

    def begin_request(self, rid: str) -> None:
        """Start a new attempt of ``rid`` (its first chunk): forget an earlier attempt.

        A failed attempt keeps its state, so that its late chunks are dropped; an aborted one
        leaves chunk counts. A client that re-sends the rid after removing the old directory
        must get a fresh marker, not the old failure (nor nothing at all).
        """
        with self._cond:
            old = self._rids.pop(rid, None)
            if old is not None:
                old.superseded = True  # its chunks still in flight finish without a marker

    def fail_request(self, rid: str, reason: str, prompt_len: int | None = None) -> None:
        """Mark a request as failed: an error marker replaces its done marker."""
        self._fail(rid, self._rid_state(rid), reason, prompt_len)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until nothing is in flight; return False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._used_pages:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def wait_for_copies(self) -> None:
        """Make the current stream wait for every copy enqueued so far (no host wait), so
        the caller may overwrite the tensors it submitted; a no-op off CUDA."""
        if self._side_stream is not None:
            torch.cuda.current_stream().wait_stream(self._side_stream)

    def copies_event(self) -> torch.cuda.Event | None:
        """An event recorded after every copy enqueued so far (None off CUDA): a stream that
        waits on it may overwrite the tensors submitted before this call."""
        if self._side_stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self._side_stream)
        return event

    @property
    def thread_ids(self) -> list[int]:
        """Kernel thread ids of the writer threads (for CPU accounting)."""
        return [t.native_id for t in self._threads if t.native_id is not None]

    def close(self) -> None:
        """Flush, stop the threads and free the staging pages (later submits fail the request)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
        self.flush()
        for _ in self._threads:
            self._tasks.put(None)
        for t in self._threads:
            t.join()
        if self._filler is not None:
            self._filler.join()
        with self._cond:
            self._pool_pages -= len(self._free)
            self._free.clear()
            self.stats.staging_bytes = self._pool_pages * self.page_bytes

    @property
    def tracked_requests(self) -> int:
        """Requests the writer keeps state for: in flight, and failed ones (LRU-bounded)."""
        with self._cond:
            return len(self._rids)

    @property
    def inflight_bytes(self) -> int:
        """Staging bytes held by chunks not yet written (never above the cap but for one
        chunk larger than the cap, which goes through alone)."""
        with self._cond:
            return self._used_pages * self.page_bytes

    # ---------------------------------------------------------------- internals

    def _rid_state(self, rid: str) -> _RidState:
        with self._cond:
            state = self._rids.get(rid)
            if state is None:
                state = self._rids[rid] = _RidState()
                while len(self._rids) > _MAX_TRACKED_RIDS:  # aborted requests never finish
                    self._rids.popitem(last=False)
            return state

    def _fs_free(self) -> int | str:
        """Free bytes of the dump dir's filesystem, or why they cannot be read."""
        try:
            st = os.statvfs(self.dump_dir)
        except OSError as e:
            return f"cannot stat the dump dir {self.dump_dir}: {e}"
        return st.f_bavail * st.f_frsize

    def _check_free_space(self, nbytes: int, fs_free: int | str) -> str | None:
        """Why a chunk of ``nbytes`` may not be staged (None: it may), given ``_fs_free()``
        read before any chunk of this call was staged (their pages count as in flight)."""
        if isinstance(fs_free, str):
            return fs_free
        pending = self.inflight_bytes
        free = fs_free - pending
        if free - nbytes < self.min_free_bytes:
            return (
                f"not enough free space in {self.dump_dir}: {free} bytes free (after "
                f"{pending} in flight), this chunk needs {nbytes} and the reserve is "
                f"{self.min_free_bytes} (SGLANG_HS_DUMP_MIN_FREE_BYTES); consume or delete "
                "finished dumps, or enlarge the filesystem"
            )
        return None

    def _acquire(self, npages: int) -> list[_Page]:
        with self._cond:
            if self._used_pages and self._used_pages + npages > self._cap_pages:
                t0 = time.perf_counter()
                # A chunk larger than the cap still goes through, alone.
                while self._used_pages and self._used_pages + npages > self._cap_pages:
                    self._cond.wait()
                self.stats.forward_wait_s += time.perf_counter() - t0
            self._used_pages += npages
            self.stats.peak_inflight_bytes = max(
                self.stats.peak_inflight_bytes, self._used_pages * self.page_bytes)
            pages = [self._free.pop() for _ in range(min(npages, len(self._free)))]
            missing = npages - len(pages)
            self._pool_pages += missing
            self.stats.staging_bytes = self._pool_pages * self.page_bytes
        try:
            # Only while the pool grows (warm-up, or a chunk larger than the cap).
            pages += [self._new_page() for _ in range(missing)]
        except BaseException:
            with self._cond:
                self._pool_pages -= missing
                self._used_pages -= missing
            self._release(pages)
            raise
        return pages

    def _fill_pool(self) -> None:
        """Pin the pool up to the cap in the background: pinning is slow (cudaHostAlloc), and
        the forward thread would otherwise pay for it whenever the pool grows."""
        try:
            self._bind_thread()
            while True:
                with self._cond:
                    if self._closed or self._pool_pages >= self._cap_pages:
                        return
                    self._pool_pages += 1
                try:
                    page = self._new_page()
                except BaseException:
                    with self._cond:
                        self._pool_pages -= 1
                    raise
                with self._cond:
                    self._free.append(page)
                    self.stats.staging_bytes = self._pool_pages * self.page_bytes
                    self._cond.notify_all()
        except Exception:
            logger.exception("hsdump: could not pin the staging pool ahead; pinning on demand")

    def _bind_thread(self) -> None:
        """Bind the calling writer thread to the writer's device, before any CUDA call."""
        if self.device_index is not None:
            torch.cuda.set_device(self.device_index)

    def _new_page(self) -> _Page:
        t = torch.empty(self.page_bytes, dtype=torch.uint8, pin_memory=self._cuda)
        return _Page(t, t.numpy())

    def _release(self, pages: list[_Page]) -> None:
        with self._cond:
            self._used_pages -= len(pages)
            for page in pages:
                if self._pool_pages > self._cap_pages:  # pages of an oversize chunk
                    self._pool_pages -= 1
                else:
                    self._free.append(page)
            self.stats.staging_bytes = self._pool_pages * self.page_bytes
            self._cond.notify_all()

    def _stage(self, tensors: list[torch.Tensor], staged: list[_Staged]
               ) -> list[torch.cuda.Event | None]:
        """Copy each staged chunk's header + its rows' raw bytes back to back into its pages;
        return each chunk's copy-done event (None off CUDA)."""
        flats = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
        row_bytes = [f.numel() // t.shape[0] if t.dim() and t.shape[0] else 0
                     for t, f in zip(tensors, flats, strict=True)]
        for st in staged:
            self._copy_host(st.pages, np.frombuffer(st.header, dtype=np.uint8), 0)
        if not self._cuda:
            # numpy, not torch: a plain memcpy, without the intra-op thread pool's latency.
            arrays = [f.numpy() for f in flats]
            for st in staged:
                pos = len(st.header)
                for arr, rb in zip(arrays, row_bytes, strict=True):
                    lo, hi = _byte_range(st.chunk, rb, len(arr))
                    pos = self._copy_host(st.pages, arr[lo:hi], pos)
            return [None] * len(staged)
        assert self._side_stream is not None
        self._side_stream.wait_stream(torch.cuda.current_stream())
        events: list[torch.cuda.Event | None] = []
        with torch.cuda.stream(self._side_stream):
            try:
                for st in staged:
                    pos = len(st.header)
                    for flat, rb in zip(flats, row_bytes, strict=True):
                        lo, hi = _byte_range(st.chunk, rb, flat.numel())
                        for i, off, src, n in _spans(pos, hi - lo, self.page_bytes):
                            st.pages[i].tensor[off : off + n].copy_(
                                flat[lo + src : lo + src + n], non_blocking=True)
                        pos += hi - lo
                    events.append(copy_done_event(self._blocking_events))
                    events[-1].record(self._side_stream)
            except BaseException:
                # The caller puts the pages back in the pool: no copy may still land there.
                self._side_stream.synchronize()
                raise
        for f in flats:  # the caller may free them now: their memory waits for the copies
            if f.is_cuda:
                f.record_stream(self._side_stream)
        return events

    def _copy_host(self, pages: list[_Page], src: np.ndarray, start: int) -> int:
        """Copy host bytes ``src`` to stream offset ``start``; return the offset after them."""
        for i, off, lo, n in _spans(start, len(src), self.page_bytes):
            pages[i].array[off : off + n] = src[lo : lo + n]
        return start + len(src)

    def _worker(self) -> None:
        try:
            self._bind_thread()
        except Exception:  # its jobs then fail, with the CUDA error in their markers
            logger.exception("hsdump: writer thread could not bind to cuda:%s", self.device_index)
        while True:
            job = self._tasks.get()
            if job is None:
                return
            try:
                failure = self._write_file(job)
                self._finish_request(job, failure)
            except Exception:  # a bug here must not stop the thread or leak the pages
                with self._cond:
                    self.stats.internal_errors += 1
                logger.exception("hsdump: internal error after writing %s", job.final)
            finally:
                # Last, so that flush() returning means the markers are written too.
                self._release(job.pages[job.released :])

    def _write_file(self, job: _FileJob) -> str | None:
        """Write one file, whole, from this thread; return None, or why it failed.

        Writes to one file are serialized by the kernel (inode lock), so threads work on
        different files rather than on parts of one. Written pages go back to the pool at once.
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
                    _pwrite_all(fd, [memoryview(p.array) for p in group], start, n)
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

    def _finish_request(self, job: _FileJob, failure: str | None) -> None:
        ok = failure is None
        state = job.state
        with self._cond:
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

    def _internal_error(
        self, rid: str, state: _RidState, prompt_len: int | None, reason: str
    ) -> None:
        with self._cond:
            self.stats.internal_errors += 1
        logger.exception("hsdump: internal error on a chunk of %s", rid)
        self._fail(rid, state, f"internal error: {reason}", prompt_len)

    def _fail(
        self, rid: str, state: _RidState, reason: str | None, prompt_len: int | None
    ) -> None:
        """Record ``reason`` (None: keep the earlier one) and the prompt length, then finish."""
        with self._cond:
            first = state.error is None and reason is not None
            state.error = state.error or reason
            if prompt_len is not None:
                state.prompt_len = prompt_len
        if first:
            logger.error("hsdump: request %s cannot be dumped: %s", rid, reason)
        self._maybe_finish(rid, state)

    def _maybe_finish(self, rid: str, state: _RidState, rid_dir: Path | None = None) -> None:
        """Write the done or error marker once nothing of the request is outstanding
        (``rid_dir``: the request's directory, when the caller knows it)."""
        with self._cond:
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
            with self._cond:
                self.stats.internal_errors += 1
            logger.exception("hsdump: could not write %s for %s", marker, rid)


def copy_done_event(blocking: bool = True) -> torch.cuda.Event:
    """The event a writer thread waits on for a chunk's device-to-host copy.

    ``blocking=True`` (cudaEventBlockingSync): the waiting thread sleeps. A default event
    spins: on an H200 a waiting thread burnt one core for the whole wait.
    """
    return torch.cuda.Event(blocking=blocking)


def bound_device_index(device: torch.device, current: Callable[[], int]) -> int | None:
    """The CUDA device index the writer's threads bind to: ``device``'s index, else the
    calling thread's ``current()`` device; None off CUDA (no binding)."""
    if device.type != "cuda":
        return None
    return current() if device.index is None else device.index


def _umask_keeps_owner_bits() -> bool:
    """Whether the process umask (read without changing it) leaves a new 0700 directory 0700."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8) & 0o700 == 0
    except (OSError, ValueError, IndexError):
        pass
    return False


def _page_bytes_for(max_inflight_bytes: int) -> int:
    """Page size: PAGE_BYTES, smaller for a small cap (a power of two, at least 4 KiB)."""
    target = max(_MIN_PAGE_BYTES, max_inflight_bytes // _MIN_PAGES_PER_CAP)
    return min(PAGE_BYTES, 1 << (target.bit_length() - 1))


def _spans(start: int, n: int, page_bytes: int) -> Iterator[tuple[int, int, int, int]]:
    """Split stream bytes [start, start + n) at page boundaries.

    Yields ``(page index, offset in page, offset in the source, length)``.
    """
    pos, end = start, start + n
    while pos < end:
        i, off = divmod(pos, page_bytes)
        k = min(page_bytes - off, end - pos)
        yield i, off, pos - start, k
        pos += k


def _rows_shape(t: torch.Tensor, chunk: Chunk) -> tuple[int, ...]:
    """The shape of ``chunk``'s rows of ``t``."""
    if chunk.start == 0 and chunk.end is None:
        return tuple(t.shape)
    end = t.shape[0] if chunk.end is None else chunk.end
    if not 0 <= chunk.start <= end <= t.shape[0]:
        raise ValueError(f"rows [{chunk.start}, {end}) are outside a tensor of {t.shape[0]}")
    return (end - chunk.start, *t.shape[1:])


def _byte_range(chunk: Chunk, row_bytes: int, total: int) -> tuple[int, int]:
    """``chunk``'s rows as a byte range of a flattened tensor of ``total`` bytes."""
    if chunk.start == 0 and chunk.end is None:
        return 0, total
    end = total if chunk.end is None else chunk.end * row_bytes
    return chunk.start * row_bytes, end


def _st_dtype(t: torch.Tensor) -> str:
    name = str(t.dtype).removeprefix("torch.")
    try:
        return protocol.SAFETENSORS_DTYPES[name]
    except KeyError:
        raise TypeError(f"dtype {t.dtype} is not supported in dump files") from None


def _pwrite_all(fd: int, buffers: list[memoryview], offset: int, n: int) -> None:
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
