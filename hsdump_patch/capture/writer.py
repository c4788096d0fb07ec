"""Asynchronous, bounded writer of chunk files (runs on the writer rank only).

The forward thread calls :meth:`DumpWriter.submit_forward` once per dumped forward (or
:meth:`DumpWriter.submit` per chunk); it only copies the chunks into staging pages (on CUDA:
enqueues device-to-host copies into pinned pages on a side stream, after one stream wait) and
returns: its host time is on the forward's critical path. The file side
(:class:`~hsdump_patch.capture.files.FileWriter`: threads that write each chunk's pages into
its file with ``pwritev``, rename it into place and write the markers) runs either

* in this process (``mode="thread"``): a thread per file waits for its chunk's copy event; or
* in a writer process (``mode="process"``, :mod:`~hsdump_patch.capture.writer_proc`): the
  staging pages are shared memory, one waiter thread here waits for each forward's copies and
  sends one message per forward; every file system call happens in the other process, off
  this process's GIL (issue 17).

Memory is bounded by the in-flight cap: staging memory is a pool of fixed-size pages that never
grows past ``max_inflight_bytes`` (in thread mode a chunk larger than the cap goes through
alone, and its extra pages are dropped after it; in process mode the pool is one fixed shared
region and such a chunk fails its request with a message naming the cap). On CUDA the pool is
pinned up to the cap by a background thread at start; after that no page is allocated. When
the cap is reached the forward thread waits rather than memory growing, but never longer than
``stall_s`` (``SGLANG_HS_DUMP_STALL_S``) per forward: a writer that gives no page back in that
time (stopped, blocked in the kernel, starved of CPU) is marked stalled, the chunk's request
gets an error marker, and later chunks fail at once, without a wait, until the writer shows
progress again (pages given back; in process mode also its ``settled`` counter). A free-space
guard refuses a chunk that would push the dump dir below its reserve and turns the request into
an error marker instead. Nothing here raises into the forward: errors are counted, logged and
reported in the error marker.

On CUDA every thread of the writer binds to the writer's device before its first CUDA call
(a bare call would create a context on GPU 0), and waits for a copy on a blocking event: a
default ``torch.cuda.Event`` spins a core in ``synchronize()`` for as long as the forward runs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hsdump_patch import protocol
from hsdump_patch.capture.config import DEFAULT_STALL_S, ENV_STALL_S
from hsdump_patch.capture.files import FileStats, FileWriter
from hsdump_patch.capture.writer_proc import FREE, RELEASED, ProcessFiles, SharedRegion

logger = logging.getLogger("hsdump")

PAGE_BYTES = 8 << 20  # staging page; 8 MiB keeps per-call overhead < 1%
_MIN_PAGE_BYTES = 4 << 10
_MIN_PAGES_PER_CAP = 16  # a small cap gets smaller pages, so several chunks still overlap
MODES = ("thread", "process")
_POLL_S = 0.0005  # process mode: how often a waiting forward thread looks for released pages


@dataclass(frozen=True)
class Chunk:
    """One request's chunk in :meth:`DumpWriter.submit_forward`: rows ``[start, end)`` of
    every tensor (``end`` None: to the end). ``prompt_len`` is set when it ends the prompt."""

    meta: protocol.ChunkMeta
    start: int
    end: int | None
    prompt_len: int | None


@dataclass
class _Page:
    tensor: torch.Tensor  # uint8 [page_bytes], pinned (or registered) on CUDA
    array: np.ndarray  # the same bytes, for host-side copies and pwrite
    index: int = -1  # its place in the shared region (process mode)


@dataclass
class _Staged:
    chunk: Chunk
    header: bytes
    nbytes: int
    pages: list[_Page]


@dataclass
class WriterStats(FileStats):
    """The file side's counters and the forward side's."""

    forward_wait_s: float = 0.0  # time the forward thread waited for in-flight budget
    peak_inflight_bytes: int = 0  # most staging bytes held by chunks at once
    staging_bytes: int = 0  # staging memory allocated now (pool of pages)
    mode: str = "thread"  # where files are written: "thread" or "process"
    writer_pid: int = 0  # the process that writes the files
    writer_process_deaths: int = 0  # process mode: the writer process died (dumping stopped)
    writer_error: str | None = None  # why dumping stopped, when it did
    # process mode on CUDA: staging pages left pageable because cudaHostRegister failed (the
    # copies into them serialise with the host)
    pin_failed_pages: int = 0
    stalled: bool = False  # the writer gave no page back within the stall bound, and since
    stalls: int = 0  # stall episodes
    stalled_chunks: int = 0  # chunks whose request failed because the writer was stalled

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class ChunkTooLarge(ValueError):
    """Process mode: a chunk needs more staging than the whole (fixed) shared region."""


class WriterStalled(RuntimeError):
    """The writer gave no staging page back within the stall bound (or is still stalled)."""


class DumpWriter:
    """Stages chunks for the file side; see the module docstring."""

    def __init__(
        self,
        dump_dir: Path,
        *,
        max_inflight_bytes: int,
        min_free_bytes: int,
        threads: int,
        device: torch.device,
        blocking_events: bool = True,
        mode: str = "thread",
        stall_s: float = DEFAULT_STALL_S,
    ) -> None:
        """``blocking_events=False`` makes the copy waits spin (only to measure what that
        costs, in scripts/bench_writer.py). ``mode``: one of :data:`MODES`. ``stall_s``: the
        longest one :meth:`submit_forward` waits for staging pages."""
        if mode not in MODES:
            raise ValueError(f"writer mode must be one of {MODES}, not {mode!r}")
        self.dump_dir = Path(dump_dir)
        self.max_inflight_bytes = max_inflight_bytes
        self.min_free_bytes = min_free_bytes
        self.mode = mode
        self.stall_s = stall_s
        self._stats = WriterStats(mode=mode)
        self._cuda = device.type == "cuda"
        self._blocking_events = blocking_events
        # Resolved here, in the forward's thread: in another thread a bare "cuda" means GPU 0.
        self.device_index = bound_device_index(device, torch.cuda.current_device)
        self._side_stream = torch.cuda.Stream(device=device) if self._cuda else None
        self.page_bytes = _page_bytes_for(max_inflight_bytes)
        self._cap_pages = max(1, max_inflight_bytes // self.page_bytes)
        self._used_pages = 0
        self._pool_pages = 0
        self._free: list[_Page] = []
        self._closed = False
        self._progress = 0  # pages given back by the file side (thread) or reclaimed (process)
        self._stalled_at: float | None = None  # time.monotonic() the current stall began
        self._stall_mark = 0  # _writer_progress() when it began
        self._cond = threading.Condition()
        self._region: SharedRegion | None = None
        self._registered: list[int] = []  # process mode on CUDA: addresses to unregister
        self._files: FileWriter | ProcessFiles
        if mode == "process":
            self._region = SharedRegion.create(self._cap_pages, self.page_bytes)
            self._files = ProcessFiles(self.dump_dir, self._region, threads, self._bind_thread)
            if not self._cuda:  # nothing to pin: the whole region is the pool at once
                self._free = [self._shared_page(i) for i in range(self._cap_pages)][::-1]
                self._pool_pages = self._cap_pages
                self._stats.staging_bytes = self._pool_pages * self.page_bytes
        else:
            self._files = FileWriter(self.dump_dir, threads=threads, page_bytes=self.page_bytes,
                                     release=self._release, bind=self._bind_thread)
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
        stopped = "the dump writer is shut down" if closed else self._files.dead
        fs_free = self._fs_free()
        deadline = time.monotonic() + self.stall_s  # one bound for the whole forward
        staged: list[_Staged] = []
        for chunk in chunks:
            rid, prompt_len = chunk.meta.rid, chunk.prompt_len
            if stopped is not None:
                self._files.fail(rid, stopped, prompt_len)
                continue
            if self._files.failed(rid):
                self._files.fail(rid, None, prompt_len)
                continue
            try:
                specs = [protocol.TensorSpec(n, _st_dtype(t), _rows_shape(t, chunk))
                         for n, t in tensors]
                header = protocol.safetensors_header(specs, chunk.meta.to_strings())
            except Exception as e:
                self._internal_error(rid, prompt_len, f"cannot describe the chunk: {e!r}")
                continue
            nbytes = len(header) + sum(spec.nbytes for spec in specs)
            reason = self._check_free_space(nbytes, fs_free)
            if reason is not None:
                self._files.fail(rid, reason, prompt_len)
                continue
            try:
                pages = self._acquire(-(-nbytes // self.page_bytes), deadline)
            except ChunkTooLarge as e:
                self._files.fail(rid, str(e), prompt_len)
                continue
            except WriterStalled as e:
                self._fail_stalled(rid, str(e), prompt_len)
                continue
            except Exception as e:
                self._internal_error(rid, prompt_len, f"cannot allocate staging: {e!r}")
                continue
            staged.append(_Staged(chunk, header, nbytes, pages))
        ready: list[Any] = []
        if staged:
            try:
                ready = self._stage([t for _, t in tensors], staged)
            except Exception as e:  # _stage waited for any copy it had started
                for st in staged:
                    self._release(st.pages)
                    self._internal_error(st.chunk.meta.rid, st.chunk.prompt_len,
                                         f"cannot copy the chunk: {e!r}")
                staged, ready = [], []
        for st, done in zip(staged, ready, strict=True):
            meta = st.chunk.meta
            self._files.add(meta.rid, meta.prefix_len, _rows_shape(tensors[0][1], st.chunk)[0],
                            st.chunk.prompt_len, st.pages, st.nbytes, done)
        self._files.commit(ready[-1] if ready else None)

    def begin_request(self, rid: str) -> None:
        """Start a new attempt of ``rid`` (its first chunk): forget an earlier attempt (see
        :meth:`FileWriter.begin_request`)."""
        self._files.begin_request(rid)

    def fail_request(self, rid: str, reason: str, prompt_len: int | None = None) -> None:
        """Mark a request as failed: an error marker replaces its done marker."""
        self._files.fail(rid, reason, prompt_len)
        self._files.commit(None)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until nothing is in flight, markers included; return False on timeout."""
        self._files.commit(None)
        deadline = None if timeout is None else time.monotonic() + timeout
        poll = _POLL_S if self._region is not None else None
        with self._cond:
            while True:
                self._reclaim()
                if not self._used_pages and self._files.idle():
                    return True
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left if poll is None else min(poll, left or poll))

    def wait_for_copies(self) -> None:
        """Make the current stream wait for every copy enqueued so far (no host wait), so
        the caller may overwrite the tensors it submitted; a no-op off CUDA."""
        if self._side_stream is not None:
            torch.cuda.current_stream().wait_stream(self._side_stream)

    @contextlib.contextmanager
    def on_copy_stream(self, *tensors: torch.Tensor) -> Iterator[None]:
        """Run the enclosed device work on the copy stream, after the current stream's work
        so far and before the copies of the next submit; the memory of ``tensors`` (which it
        reads) is not reused before it ends. Off CUDA: in place."""
        if self._side_stream is None:
            yield
            return
        self._side_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._side_stream):
            yield
        for t in tensors:
            t.record_stream(self._side_stream)

    def copies_event(self) -> torch.cuda.Event | None:
        """An event recorded after every copy enqueued so far (None off CUDA): a stream that
        waits on it may overwrite the tensors submitted before this call."""
        if self._side_stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self._side_stream)
        return event

    @property
    def stats(self) -> WriterStats:
        """The counters: the file side's (in process mode as the writer process last
        published them) and this side's."""
        files = self._files.stats
        for name in FileStats.__dataclass_fields__:
            setattr(self._stats, name, getattr(files, name))
        self._stats.writer_pid = self.writer_pid
        self._stats.writer_process_deaths = self._files.deaths
        self._stats.writer_error = self._files.dead
        with self._cond:
            self._check_recovered()
        return self._stats

    @property
    def thread_ids(self) -> list[int]:
        """Kernel thread ids of this process's writer threads (for CPU accounting)."""
        return self._files.thread_ids

    @property
    def writer_pid(self) -> int:
        """The process that writes the files (this one in thread mode)."""
        return self._files.proc.pid if isinstance(self._files, ProcessFiles) else os.getpid()

    def close(self) -> None:
        """Flush, stop the file side and free the staging (later submits fail the request)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
        self.flush()
        self._files.close()
        if self._filler is not None:
            self._filler.join()
        with self._cond:
            self._reclaim()
            self._pool_pages -= len(self._free)
            self._free.clear()
            self._stats.staging_bytes = self._pool_pages * self.page_bytes
        if self._region is not None:
            for ptr in self._registered:
                torch.cuda.cudart().cudaHostUnregister(ptr)
            self._registered.clear()
            os.close(self._region.fd)  # the memory goes with the last mapping

    @property
    def tracked_requests(self) -> int:
        """Requests the writer keeps state for: in flight, and failed ones (LRU-bounded)."""
        return self._files.tracked_requests

    @property
    def inflight_bytes(self) -> int:
        """Staging bytes held by chunks not yet written (never above the cap but for one
        chunk larger than the cap, which goes through alone in thread mode)."""
        with self._cond:
            self._reclaim()
            return self._used_pages * self.page_bytes

    # ---------------------------------------------------------------- internals

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

    def _internal_error(self, rid: str, prompt_len: int | None, reason: str) -> None:
        logger.exception("hsdump: internal error on a chunk of %s", rid)
        self._files.fail(rid, f"internal error: {reason}", prompt_len, internal=True)

    def _acquire(self, npages: int, deadline: float) -> list[_Page]:
        """Take ``npages`` staging pages, waiting for the file side until ``deadline`` at most
        (:class:`WriterStalled` then, or at once while the writer is stalled)."""
        if self._region is not None:
            return self._acquire_shared(npages, deadline)
        with self._cond:
            # A chunk larger than the cap still goes through, alone.
            self._wait_for(lambda: not self._used_pages
                           or self._used_pages + npages <= self._cap_pages, deadline)
            pages = self._take(npages)
            missing = npages - len(pages)
            self._pool_pages += missing
            self._stats.staging_bytes = self._pool_pages * self.page_bytes
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

    def _acquire_shared(self, npages: int, deadline: float) -> list[_Page]:
        """Process mode: wait (polling, until ``deadline`` at most) until the writer process
        has given back enough pages of the fixed region (and, at start, until the filler has
        pinned them)."""
        if npages > self._cap_pages:
            raise ChunkTooLarge(
                f"a chunk of {npages * self.page_bytes} bytes needs more staging than the "
                f"in-flight cap of {self.max_inflight_bytes} bytes "
                f"({protocol.ENV_MAX_INFLIGHT}): raise it above the largest chunk (chunked "
                "prefill size x captured states x hidden size x dtype bytes)")
        def enough() -> bool:
            self._reclaim()
            return len(self._free) >= npages

        with self._cond:
            self._wait_for(enough, deadline)
            return self._take(npages)

    def _wait_for(self, ready: Callable[[], bool], deadline: float) -> None:
        """Wait (lock held) until ``ready()``; raise :class:`WriterStalled` at ``deadline``
        (the writer is then marked stalled), or at once while it is stalled and has not
        moved since."""
        if self._stalled_at is not None and not self._check_recovered():
            raise WriterStalled(self._stall_reason())
        if ready():
            return
        t0 = time.perf_counter()
        poll = _POLL_S if self._region is not None else None
        try:
            while not ready():
                left = deadline - time.monotonic()
                if left <= 0:
                    self._stalled_at = time.monotonic()
                    self._stall_mark = self._writer_progress()
                    self._stats.stalled = True
                    self._stats.stalls += 1
                    reason = self._stall_reason()
                    logger.error("hsdump: %s", reason)
                    raise WriterStalled(reason)
                self._cond.wait(left if poll is None else min(poll, left))
        finally:
            self._stats.forward_wait_s += time.perf_counter() - t0

    def _writer_progress(self) -> int:
        """A count that grows whenever the file side moves (lock held): pages given back, in
        process mode also the writer process's ``settled`` counter and the pages pinned."""
        if self._region is None:
            return self._progress
        self._reclaim()
        return self._progress + self._region.counter("settled") + self._pool_pages

    def _check_recovered(self) -> bool:
        """End a stall once the writer has moved (lock held); return whether it is not
        stalled (any more)."""
        if self._stalled_at is None:
            return True
        if self._writer_progress() == self._stall_mark:
            return False
        logger.warning("hsdump: the writer moves again after %.1f s stalled; dumping resumes "
                       "(%d chunks failed in %d stalls so far)",
                       time.monotonic() - self._stalled_at, self._stats.stalled_chunks,
                       self._stats.stalls)
        self._stalled_at = None
        self._stats.stalled = False
        return True

    def _stall_reason(self) -> str:
        who = (f"writer process (pid {self.writer_pid}) is" if self._region is not None
               else "writer threads are")
        return (f"the hsdump {who} stalled: no staging page came back within "
                f"{ENV_STALL_S}={self.stall_s:g} s (stopped, blocked in the kernel or starved "
                "of CPU), so this request is not dumped; the server keeps serving, and dumping "
                "resumes once the writer moves again")

    def _fail_stalled(self, rid: str, reason: str, prompt_len: int | None) -> None:
        """Fail ``rid`` for a stall: its error marker is written now, here (in process mode
        the stalled writer process could not write it)."""
        with self._cond:
            self._stats.stalled_chunks += 1
        if isinstance(self._files, ProcessFiles):
            self._files.fail_here(rid, reason, prompt_len)
        else:
            self._files.fail(rid, reason, prompt_len)

    def _take(self, npages: int) -> list[_Page]:
        """Count ``npages`` as used and take what the pool has of them (lock held)."""
        self._used_pages += npages
        self._stats.peak_inflight_bytes = max(
            self._stats.peak_inflight_bytes, self._used_pages * self.page_bytes)
        return [self._free.pop() for _ in range(min(npages, len(self._free)))]

    def _reclaim(self) -> None:
        """Process mode: take back the pages the writer process has released (lock held)."""
        if self._region is None:
            return
        state = self._region.state
        back = np.flatnonzero(state == RELEASED)
        if back.size:
            state[back] = FREE
            self._used_pages -= back.size
            self._progress += int(back.size)
            self._free.extend(self._shared_page(int(i)) for i in back)

    def _shared_page(self, i: int) -> _Page:
        assert self._region is not None
        array = self._region.page(i)
        return _Page(torch.from_numpy(array), array, i)

    def _fill_pool(self) -> None:
        """Pin the pool up to the cap in the background: pinning is slow (cudaHostAlloc,
        cudaHostRegister), and the forward thread would otherwise pay for it."""
        try:
            self._bind_thread()
            while True:
                with self._cond:
                    if self._closed or self._pool_pages >= self._cap_pages:
                        return
                    i = self._pool_pages
                    self._pool_pages += 1
                try:
                    page = self._new_page() if self._region is None else self._pin_shared(i)
                except BaseException:
                    with self._cond:
                        self._pool_pages -= 1
                    raise
                with self._cond:
                    self._free.append(page)
                    self._stats.staging_bytes = self._pool_pages * self.page_bytes
                    self._cond.notify_all()
        except Exception:
            if self._region is None:
                logger.exception("hsdump: could not pin the staging pool ahead; pinning on "
                                 "demand")
                return
            # Unregistered pages still work, but copies into pageable memory are synchronous.
            with self._cond:
                first, self._pool_pages = self._pool_pages, self._cap_pages
                self._free.extend(self._shared_page(i) for i in range(first, self._cap_pages))
                self._stats.staging_bytes = self._pool_pages * self.page_bytes
                self._stats.pin_failed_pages = self._cap_pages - first
                self._cond.notify_all()
            logger.exception(
                "hsdump: pinning the shared staging pages with cudaHostRegister failed at page "
                "%d: %d of %d pages (%d MiB) stay pageable memory, so the device-to-host "
                "copies into them will serialise with the host (the forward's thread waits "
                "for each one); counted in status.json as writer.pin_failed_pages (hsdump "
                "verify fails on it). Restart the server, or set SGLANG_HS_DUMP_WRITER=thread "
                "(pages pinned with cudaHostAlloc)",
                first, self._cap_pages - first, self._cap_pages,
                (self._cap_pages - first) * self.page_bytes >> 20)

    def _pin_shared(self, i: int) -> _Page:
        """Register shared page ``i`` with CUDA, so copies into it are asynchronous DMA."""
        page = self._shared_page(i)
        ptr = page.array.ctypes.data
        err = torch.cuda.cudart().cudaHostRegister(ptr, self.page_bytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of a shared staging page failed: {err}")
        self._registered.append(ptr)
        return page

    def _bind_thread(self) -> None:
        """Bind the calling writer thread to the writer's device, before any CUDA call."""
        if self.device_index is not None:
            torch.cuda.set_device(self.device_index)

    def _new_page(self) -> _Page:
        t = torch.empty(self.page_bytes, dtype=torch.uint8, pin_memory=self._cuda)
        return _Page(t, t.numpy())

    def _release(self, pages: Sequence[_Page]) -> None:
        if self._region is not None:  # process mode: staged here, never sent
            self._region.state[[p.index for p in pages]] = RELEASED
            return
        with self._cond:
            self._used_pages -= len(pages)
            self._progress += len(pages)
            for page in pages:
                if self._pool_pages > self._cap_pages:  # pages of an oversize chunk
                    self._pool_pages -= 1
                else:
                    self._free.append(page)
            self._stats.staging_bytes = self._pool_pages * self.page_bytes
            self._cond.notify_all()

    def _stage(self, tensors: list[torch.Tensor], staged: list[_Staged]
               ) -> list[torch.cuda.Event | None]:
        """Copy each staged chunk's header + its rows' raw bytes back to back into its pages;
        return each chunk's copy-done event (None off CUDA; in process mode one event, after
        the last chunk's copies, stands for all)."""
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
        one = self._region is not None
        with torch.cuda.stream(self._side_stream):
            try:
                for k, st in enumerate(staged):
                    pos = len(st.header)
                    for flat, rb in zip(flats, row_bytes, strict=True):
                        lo, hi = _byte_range(st.chunk, rb, flat.numel())
                        for i, off, src, n in _spans(pos, hi - lo, self.page_bytes):
                            st.pages[i].tensor[off : off + n].copy_(
                                flat[lo + src : lo + src + n], non_blocking=True)
                        pos += hi - lo
                    if not one or k == len(staged) - 1:
                        events.append(copy_done_event(self._blocking_events))
                        events[-1].record(self._side_stream)
            except BaseException:
                # The caller puts the pages back in the pool: no copy may still land there.
                self._side_stream.synchronize()
                raise
        if one:
            events = events * len(staged)
        for f in flats:  # the caller may free them now: their memory waits for the copies
            if f.is_cuda:
                f.record_stream(self._side_stream)
        return events

    def _copy_host(self, pages: list[_Page], src: np.ndarray, start: int) -> int:
        """Copy host bytes ``src`` to stream offset ``start``; return the offset after them."""
        for i, off, lo, n in _spans(start, len(src), self.page_bytes):
            pages[i].array[off : off + n] = src[lo : lo + n]
        return start + len(src)


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
