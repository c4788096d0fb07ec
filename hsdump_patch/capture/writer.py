"""Asynchronous, bounded writer of chunk files (runs on the writer rank only).

The forward thread calls :meth:`DumpWriter.submit`; it only enqueues device-to-host copies
(pinned buffers, side stream, on CUDA) and returns. A pool of threads waits for each copy,
streams the bytes into a temp file with ``pwrite`` (a large chunk is split across threads,
since tmpfs write bandwidth scales with writers) and renames it into place. The bytes in
flight are bounded: when the cap is reached the forward thread waits rather than memory
growing. A free-space guard refuses a chunk that would push the dump dir below its reserve and
turns the request into an error marker instead. Nothing here raises into the forward: errors
are counted, logged and reported in the request's error marker.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hsdump_patch import protocol

logger = logging.getLogger("hsdump")

SEGMENT_BYTES = 32 << 20  # one pwrite task; large chunks are written by several threads
_MAX_TRACKED_RIDS = 100_000


@dataclass
class _RidState:
    outstanding: int = 0
    chunks: list[int] = field(default_factory=list)
    tokens: int = 0
    prompt_len: int | None = None  # set when the last chunk has been submitted
    error: str | None = None
    error_written: bool = False


@dataclass
class _FileJob:
    rid: str
    prefix_len: int
    final: Path
    tmp: Path
    header: bytes
    host: list[torch.Tensor]  # host tensors, raw bytes written back to back after the header
    nbytes: int
    ready: torch.cuda.Event | None  # D2H completion (CUDA only)
    keepalive: list[torch.Tensor]  # device sources, released once the copy is done
    fd: int = -1
    remaining: int = 0
    failed: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class WriterStats:
    chunks_written: int = 0
    bytes_written: int = 0
    requests_done: int = 0
    requests_failed: int = 0
    internal_errors: int = 0
    forward_wait_s: float = 0.0  # time the forward thread waited for in-flight budget

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
    ) -> None:
        self.dump_dir = dump_dir
        self.max_inflight_bytes = max_inflight_bytes
        self.min_free_bytes = min_free_bytes
        self.stats = WriterStats()
        self._cuda = device.type == "cuda"
        self._side_stream = torch.cuda.Stream(device=device) if self._cuda else None
        self._inflight = 0
        self._cond = threading.Condition()
        self._rids: OrderedDict[str, _RidState] = OrderedDict()
        self._tasks: queue.SimpleQueue[tuple[_FileJob, int, int] | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._worker, name=f"hsdump-writer-{i}", daemon=True)
            for i in range(threads)
        ]
        for t in self._threads:
            t.start()

    # ---------------------------------------------------------------- forward thread side

    def submit(
        self,
        meta: protocol.ChunkMeta,
        tensors: list[tuple[str, torch.Tensor]],
        prompt_len: int | None,
    ) -> None:
        """Queue one chunk of one request. ``prompt_len`` is set when this chunk ends the prompt.

        The tensors must stay unmodified until the D2H copy has been issued (this method
        issues it before returning) and are not retained beyond that on CPU.
        """
        rid = meta.rid
        state = self._rid_state(rid)
        if prompt_len is not None:
            state.prompt_len = prompt_len
        if state.error is not None:
            self._maybe_finish(rid, state)
            return
        specs = [protocol.TensorSpec(name, _st_dtype(t), tuple(t.shape)) for name, t in tensors]
        header = protocol.safetensors_header(specs, meta.to_strings())
        nbytes = len(header) + sum(s.nbytes for s in specs)

        reason = self._check_free_space(nbytes)
        if reason is not None:
            self._fail(rid, state, reason)
            return
        self._acquire(nbytes)
        try:
            host, ready, keepalive = self._start_copy([t for _, t in tensors])
            final = protocol.rid_dir(self.dump_dir, rid) / protocol.chunk_filename(meta.prefix_len)
            job = _FileJob(rid, meta.prefix_len, final, protocol.temp_path(final), header, host,
                           nbytes, ready, keepalive)
            with self._cond:
                state.outstanding += 1
                state.chunks.append(meta.prefix_len)
                state.tokens += int(tensors[0][1].shape[0])
            self._enqueue(job)
        except Exception as e:
            self._release(nbytes)
            self.stats.internal_errors += 1
            logger.exception("hsdump: could not queue chunk %s of %s", meta.prefix_len, rid)
            self._fail(rid, state, f"internal error while queueing the chunk: {e!r}")

    def fail_request(self, rid: str, reason: str, prompt_len: int | None = None) -> None:
        """Mark a request as failed: an error marker replaces its done marker."""
        state = self._rid_state(rid)
        if prompt_len is not None:
            state.prompt_len = prompt_len
        self._fail(rid, state, reason)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until nothing is in flight; return False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._inflight:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self) -> None:
        """Flush and stop the threads."""
        self.flush()
        for _ in self._threads:
            self._tasks.put(None)
        for t in self._threads:
            t.join()

    # ---------------------------------------------------------------- internals

    def _rid_state(self, rid: str) -> _RidState:
        with self._cond:
            state = self._rids.get(rid)
            if state is None:
                state = self._rids[rid] = _RidState()
                while len(self._rids) > _MAX_TRACKED_RIDS:  # aborted requests never finish
                    self._rids.popitem(last=False)
            return state

    def _check_free_space(self, nbytes: int) -> str | None:
        try:
            st = os.statvfs(self.dump_dir)
        except OSError as e:
            return f"cannot stat the dump dir {self.dump_dir}: {e}"
        with self._cond:
            pending = self._inflight
        free = st.f_bavail * st.f_frsize - pending
        if free - nbytes < self.min_free_bytes:
            return (
                f"not enough free space in {self.dump_dir}: {free} bytes free (after "
                f"{pending} in flight), this chunk needs {nbytes} and the reserve is "
                f"{self.min_free_bytes} (SGLANG_HS_DUMP_MIN_FREE_BYTES); consume or delete "
                "finished dumps, or enlarge the filesystem"
            )
        return None

    def _acquire(self, nbytes: int) -> None:
        with self._cond:
            if self._inflight and self._inflight + nbytes > self.max_inflight_bytes:
                t0 = time.perf_counter()
                # A chunk larger than the cap still goes through, alone.
                while self._inflight and self._inflight + nbytes > self.max_inflight_bytes:
                    self._cond.wait()
                self.stats.forward_wait_s += time.perf_counter() - t0
            self._inflight += nbytes

    def _release(self, nbytes: int) -> None:
        with self._cond:
            self._inflight -= nbytes
            self._cond.notify_all()

    @property
    def inflight_bytes(self) -> int:
        with self._cond:
            return self._inflight

    def _start_copy(
        self, tensors: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], torch.cuda.Event | None, list[torch.Tensor]]:
        if not self._cuda:
            # CPU: the sources are views into buffers owned by this chunk; keep them as they are.
            return [t.contiguous() for t in tensors], None, []
        assert self._side_stream is not None
        producer = torch.cuda.current_stream()
        host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        self._side_stream.wait_stream(producer)
        with torch.cuda.stream(self._side_stream):
            for h, t in zip(host, tensors, strict=True):
                h.copy_(t, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self._side_stream)
        for t in tensors:
            t.record_stream(self._side_stream)
        return host, ready, list(tensors)

    def _enqueue(self, job: _FileJob) -> None:
        job.remaining = max(1, -(-job.nbytes // SEGMENT_BYTES))
        for start in range(0, job.nbytes, SEGMENT_BYTES):
            self._tasks.put((job, start, min(job.nbytes, start + SEGMENT_BYTES)))

    def _worker(self) -> None:
        while True:
            task = self._tasks.get()
            if task is None:
                return
            job, start, end = task
            try:
                self._write_segment(job, start, end)
            except Exception as e:
                with job.lock:
                    job.failed = job.failed or f"{type(e).__name__}: {e}"
            with job.lock:
                job.remaining -= 1
                last = job.remaining == 0
            if last:
                self._finish_file(job)

    def _write_segment(self, job: _FileJob, start: int, end: int) -> None:
        with job.lock:
            if job.failed:
                return
            if job.fd < 0:
                if job.ready is not None:
                    job.ready.synchronize()
                protocol.make_private_dir(job.final.parent)
                job.fd = os.open(job.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, protocol.FILE_MODE)
                os.ftruncate(job.fd, job.nbytes)
            fd = job.fd
        # Walk the concatenation header + tensors and write the part in [start, end).
        pos = 0
        for part in [memoryview(job.header), *(_bytes_view(h) for h in job.host)]:
            lo, hi = max(start, pos), min(end, pos + len(part))
            if lo < hi:
                _pwrite_all(fd, part[lo - pos : hi - pos], lo)
            pos += len(part)

    def _finish_file(self, job: _FileJob) -> None:
        ok = False
        try:
            if job.fd >= 0:
                os.close(job.fd)
            if job.failed is None:
                os.replace(job.tmp, job.final)
                ok = True
        except OSError as e:
            job.failed = job.failed or f"{type(e).__name__}: {e}"
        finally:
            if not ok:
                job.tmp.unlink(missing_ok=True)
            job.host.clear()
            job.keepalive.clear()
            self._release(job.nbytes)
        with self._cond:
            state = self._rids.get(job.rid)
        if state is None:
            return
        if ok:
            self.stats.chunks_written += 1
            self.stats.bytes_written += job.nbytes
        else:
            logger.error("hsdump: writing %s failed: %s", job.final, job.failed)
            with self._cond:
                state.error = state.error or f"writing chunk {job.prefix_len} failed: {job.failed}"
        with self._cond:
            state.outstanding -= 1
        self._maybe_finish(job.rid, state)

    def _fail(self, rid: str, state: _RidState, reason: str) -> None:
        with self._cond:
            first = state.error is None
            state.error = state.error or reason
        if first:
            logger.error("hsdump: request %s cannot be dumped: %s", rid, reason)
        self._maybe_finish(rid, state)

    def _maybe_finish(self, rid: str, state: _RidState) -> None:
        with self._cond:
            if state.outstanding:
                return
            complete = state.prompt_len is not None
            if state.error is not None:
                write_error = not state.error_written
                state.error_written = True
                if complete:
                    self._rids.pop(rid, None)
                payload = {"rid": rid, "reason": state.error, "chunks": sorted(state.chunks)}
                if not write_error:
                    return
                self.stats.requests_failed += 1
                marker = protocol.ERROR_MARKER
            elif complete:
                self._rids.pop(rid, None)
                payload = {"rid": rid, "prompt_len": state.prompt_len, "tokens": state.tokens,
                           "chunks": sorted(state.chunks)}
                self.stats.requests_done += 1
                marker = protocol.DONE_MARKER
            else:
                return
        try:
            d = protocol.rid_dir(self.dump_dir, rid)
            protocol.make_private_dir(d)
            protocol.write_json_atomic(d / marker, payload)
        except Exception:
            self.stats.internal_errors += 1
            logger.exception("hsdump: could not write %s for %s", marker, rid)


def _st_dtype(t: torch.Tensor) -> str:
    name = str(t.dtype).removeprefix("torch.")
    try:
        return protocol.SAFETENSORS_DTYPES[name]
    except KeyError:
        raise TypeError(f"dtype {t.dtype} is not supported in dump files") from None


def _bytes_view(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data = data[n:]
        offset += n
