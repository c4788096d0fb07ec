"""The writer process (``SGLANG_HS_DUMP_WRITER=process``): the file side off the forward's GIL.

Issue 17: the first layers of a prefill forward are host-bound, and exactly then the previous
forward's copies end and wake writer threads whose ~11 system calls per file each hand the GIL
to and from the forward's thread. Here the forward's process only stages: its staging pages lie
in one shared-memory region (a memfd, pinned with ``cudaHostRegister`` on CUDA), into which the
device-to-host copies go. One waiter thread waits for each forward's copies (one blocking event,
GIL released) and sends the forward's chunk descriptions as one pickled frame over a pipe: two
GIL hand-overs per forward instead of ~90. A child Python process (this module's ``main``, no
torch, no CUDA context) runs :class:`~hsdump_patch.capture.files.FileWriter` on views of the
same pages: every file system call, marker and bookkeeping step happens there.

Shared state, beside the pages (written by one side each, read by the other):

* one byte per page: 0 the forward's process owns it, 1 staged (a copy may still be landing),
  3 sent to the child, 2 written and released by the child (the forward's process takes it
  back to 0 when it needs pages);
* the child's counters (:data:`COUNTERS`), published after every message it has fully handled;
* a ring of the child's marker reports: each request attempt handed to the child has a ticket
  (in its messages); once the child has written an attempt's marker it reports the ticket
  (negated for an error marker). The forward's process reads them when it next asks
  :meth:`ProcessFiles.failed` (and when the child dies): a done attempt is forgotten, a failed
  one's later chunks are not staged.

The child ignores SIGINT, SIGTERM and SIGHUP (it shares the server's process group, which a
Ctrl-C or a launcher signals): it leaves on its pipe's EOF (the parent closed it or died), once
it has written every file and marker of what it was sent.

A dead child (killed, crashed) is seen by a monitor thread (``waitpid``) and by a failed pipe
write: from then on every chunk fails its request with a clear error marker written by the
forward's process, the pages the child held are taken back, every request attempt handed to
the child that it has not reported marked gets an error marker, and ``status.json`` reports
it. Serving continues.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import mmap
import os
import pickle
import queue
import signal
import struct
import subprocess
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hsdump_patch import protocol
from hsdump_patch.capture.files import FileStats, FileWriter, Page, Ready

logger = logging.getLogger("hsdump")

COUNTERS = ("settled", "tracked_requests", *FileStats.__dataclass_fields__)
CTRL_BYTES = 1 << 20  # counters, reports + one state byte per page (the data starts after)
_REPORTED_AT = 2048  # int64: how many marker reports the child has published
_REPORTS_AT = 4096  # int64 ring: report i at i % _REPORTS, +ticket (done) or -ticket (error)
_REPORTS = 8192
_STATE_AT = _REPORTS_AT + 8 * _REPORTS
FREE, STAGED, RELEASED, SENT = 0, 1, 2, 3
_FRAME = struct.Struct("<Q")
_SENT_RIDS = 4096  # request attempts remembered (an error marker if the child dies first)


@dataclass
class ShmPage:
    index: int
    array: np.ndarray  # uint8 [page_bytes] view of the shared region


class SharedRegion:
    """The memfd: counters, page states and ``pages`` pages of ``page_bytes``."""

    def __init__(self, fd: int, pages: int, page_bytes: int) -> None:
        if _STATE_AT + pages > CTRL_BYTES:
            raise ValueError(f"{pages} staging pages do not fit the control block")
        self.fd, self.pages, self.page_bytes = fd, pages, page_bytes
        self.size = CTRL_BYTES + pages * page_bytes
        self.mm = mmap.mmap(fd, self.size)
        self.counters = np.frombuffer(self.mm, np.int64, len(COUNTERS), 0)
        self.reported = np.frombuffer(self.mm, np.int64, 1, _REPORTED_AT)
        self.reports = np.frombuffer(self.mm, np.int64, _REPORTS, _REPORTS_AT)
        self.state = np.frombuffer(self.mm, np.uint8, pages, _STATE_AT)
        self.data = np.frombuffer(self.mm, np.uint8, pages * page_bytes, CTRL_BYTES)

    @classmethod
    def create(cls, pages: int, page_bytes: int) -> SharedRegion:
        fd = os.memfd_create("hsdump-staging", os.MFD_CLOEXEC)
        os.ftruncate(fd, CTRL_BYTES + pages * page_bytes)
        return cls(fd, pages, page_bytes)

    def page(self, i: int) -> np.ndarray:
        return self.data[i * self.page_bytes : (i + 1) * self.page_bytes]

    def counter(self, name: str) -> int:
        return int(self.counters[COUNTERS.index(name)])


# ------------------------------------------------------------------ the forward's process


@dataclass
class _Attempt:
    """A request attempt handed to the child, until the child reports its done marker."""

    ticket: int
    failed: bool = False  # failed here, or the child wrote its error marker
    marked: bool = False  # the child wrote its error marker


class ProcessFiles:
    """The forward's side of the writer process: the file side's interface, as messages.

    ``add``/``begin_request``/``fail`` queue messages; ``commit(ready)`` hands them to the
    waiter thread, which sends them once ``ready`` (the forward's last copy event) is done."""

    def __init__(self, dump_dir: Path, region: SharedRegion, threads: int,
                 bind: Callable[[], None] | None = None) -> None:
        self.dump_dir, self.region, self._bind = Path(dump_dir), region, bind
        self.dead: str | None = None  # why the child is gone (set once)
        self.deaths = 0
        self.local = FileStats()  # markers written here after the child died
        self.sent = 0  # messages handed to the waiter
        self._handled = 0  # of them, sent to the child or settled here by the waiter
        self._pending: list[tuple] = []
        self._out: queue.SimpleQueue[tuple[Ready | None, list[tuple]] | None] = (
            queue.SimpleQueue())
        self._lock = threading.Lock()  # the attempts (the forward's thread and the waiter)
        self._attempts: OrderedDict[str, _Attempt] = OrderedDict()
        self._by_ticket: dict[int, str] = {}
        self._tickets = 0
        self._reports_read = 0
        self._closing = False
        self._stopped = False  # closed: what comes later is settled here
        r, w = os.pipe()
        # This very package: its root goes first on the child's path only when it is not there
        # already (a source tree; an installed package's site-packages keeps its place).
        root = str(Path(__file__).resolve().parents[2])
        boot = (f"import sys; r = {root!r}; r in sys.path or sys.path.insert(0, r); "
                "from hsdump_patch.capture.writer_proc import main; sys.exit(main())")
        self.proc = subprocess.Popen(
            [sys.executable, "-P", "-c", boot, "--memfd",  # -P: not the server's cwd first
             str(region.fd), "--pipe", str(r), "--dump-dir", str(self.dump_dir), "--threads",
             str(threads), "--pages", str(region.pages), "--page-bytes", str(region.page_bytes),
             "--parent", str(os.getpid())],
            pass_fds=(region.fd, r), stdin=subprocess.DEVNULL)
        os.close(r)
        self._pipe = w
        self._waiter = threading.Thread(target=self._wait_and_send, name="hsdump-writer-send",
                                        daemon=True)
        self._waiter.start()
        self._monitor = threading.Thread(target=self._watch, name="hsdump-writer-watch",
                                         daemon=True)
        self._monitor.start()
        logger.info("hsdump: writer process pid %d (%d threads), staging %d pages of %d KiB in "
                    "shared memory (%.0f MiB)", self.proc.pid, threads, region.pages,
                    region.page_bytes >> 10, region.size / (1 << 20))

    # ---------------------------------------------------------------- the file side's API

    def begin_request(self, rid: str) -> None:
        with self._lock:
            self._forget(rid)
        self._pending.append(("begin", rid))

    def failed(self, rid: str) -> bool:
        """Whether the current attempt of ``rid`` has failed: here, or as the child reported
        (its later chunks are then not staged)."""
        with self._lock:
            self._read_reports()
            attempt = self._attempts.get(rid)
            return attempt is not None and attempt.failed

    def fail(self, rid: str, reason: str | None, prompt_len: int | None,
             internal: bool = False) -> None:
        ticket = self._ticket(rid, failed=reason is not None)
        self._pending.append(("fail", rid, reason, prompt_len, internal, ticket, False))

    def fail_here(self, rid: str, reason: str, prompt_len: int | None) -> None:
        """Fail ``rid`` with its error marker written here, now (the child is stalled); the
        child is told, so that it drops the attempt's later chunks and writes no marker."""
        ticket = self._ticket(rid, failed=True)
        with self._lock:
            attempt = self._attempts.get(rid)
            if attempt is not None:
                attempt.marked = True
        self._local_marker(rid, reason)
        self._pending.append(("fail", rid, reason, prompt_len, False, ticket, True))

    def add(self, rid: str, prefix_len: int, tokens: int, prompt_len: int | None,
            pages: Sequence[Page], nbytes: int, ready: Ready | None) -> None:
        self.region.state[[p.index for p in pages]] = STAGED
        self._pending.append(("file", rid, prefix_len, tokens, prompt_len,
                              [p.index for p in pages], nbytes, self._ticket(rid)))

    def commit(self, ready: Ready | None) -> None:
        """Hand the queued messages to the waiter: sent once ``ready`` is synchronized."""
        if self._pending:
            msgs, self._pending = self._pending, []
            if self._stopped:  # after close: only failures come (nothing is staged)
                self._settle_locally(msgs)
                return
            self.sent += len(msgs)
            self._out.put((ready, msgs))

    @property
    def tracked_requests(self) -> int:
        return self.region.counter("tracked_requests")

    @property
    def thread_ids(self) -> list[int]:
        return [t.native_id for t in (self._waiter, self._monitor) if t.native_id is not None]

    @property
    def stats(self) -> FileStats:
        """The child's counters (as last published) plus what this process wrote itself."""
        return FileStats(**{k: self.region.counter(k) + getattr(self.local, k)
                            for k in FileStats.__dataclass_fields__})

    def idle(self) -> bool:
        """Every message committed has had its full effect (after the child died: has been
        handled here)."""
        if self.dead is not None:
            return self._handled >= self.sent
        return self.region.counter("settled") >= self.sent

    def close(self, timeout: float = 60.0) -> None:
        """Stop the child once it has written everything (killed after ``timeout``)."""
        self._closing = True
        self._out.put(None)
        self._waiter.join()
        self._stopped = True
        with contextlib.suppress(OSError):
            os.close(self._pipe)  # EOF: the child drains its queue and exits
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            logger.error("hsdump: the writer process did not exit in %.0f s; killing it",
                         timeout)
            self.proc.kill()
            self.proc.wait()
        self._monitor.join()

    # ---------------------------------------------------------------- threads

    def _wait_and_send(self) -> None:
        if self._bind is not None:
            try:
                self._bind()  # before its first CUDA call (a bare one would use GPU 0)
            except Exception:
                logger.exception("hsdump: the writer's waiter thread could not bind")
        while True:
            item = self._out.get()
            if item is None:
                return
            ready, msgs = item
            if ready is not None:
                try:
                    ready.synchronize()
                except Exception as e:  # a CUDA error: the copies never landed
                    logger.exception("hsdump: waiting for a forward's copies failed")
                    msgs = [_as_failure(m, f"the copy to host failed: {e!r}") for m in msgs]
            if self.dead is None and msgs[0][0] != "dead":
                pages = [i for m in msgs for i in _pages_of(m)]
                self.region.state[pages] = SENT
                try:
                    data = pickle.dumps(msgs, protocol=pickle.HIGHEST_PROTOCOL)
                    _write_all(self._pipe, _FRAME.pack(len(data)) + data)
                    self._handled += len(msgs)
                    continue
                except OSError as e:
                    self.region.state[pages] = STAGED
                    self._died(f"stopped reading its pipe ({e})")
            self._settle_locally(msgs)
            self._handled += sum(m[0] != "dead" for m in msgs)

    def _watch(self) -> None:
        code = self.proc.wait()
        if not self._closing:
            how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
            self._out.put((None, [("dead", how)]))

    def _died(self, how: str) -> None:
        """Take back what the child held and fail what it had not finished (waiter thread)."""
        if self.dead is not None:
            return
        self.dead = (f"the hsdump writer process (pid {self.proc.pid}) {how}; dumping is "
                     "stopped on this server (it keeps serving); see its log, then restart "
                     "the server to dump again")
        self.deaths += 1
        logger.error("hsdump: %s", self.dead)
        state = self.region.state
        state[state == SENT] = RELEASED
        with self._lock:  # the markers are written after: the forward's thread never waits
            self._read_reports()
            unmarked = [rid for rid, a in self._attempts.items() if not a.marked]
        for rid in unmarked:
            self._local_marker(rid, self.dead)

    def _settle_locally(self, msgs: list[tuple]) -> None:
        """After the child died: release the pages of ``msgs``, fail their requests."""
        for m in msgs:
            if m[0] == "dead":
                self._died(m[1])
            elif m[0] in ("file", "drop"):
                self.region.state[_pages_of(m)] = RELEASED
                self._local_marker(m[1], self.dead or "")
            elif m[0] == "fail":
                self._local_marker(m[1], self.dead or str(m[2]))

    def _local_marker(self, rid: str, reason: str) -> None:
        d = protocol.rid_dir(self.dump_dir, rid)
        if (d / protocol.DONE_MARKER).exists() or (d / protocol.ERROR_MARKER).exists():
            return
        written = [p for p, _ in protocol.list_chunks(self.dump_dir, rid)]
        try:
            protocol.make_private_dir(d)
            protocol.write_json_atomic(d / protocol.ERROR_MARKER, protocol.ErrorMarker(
                rid, reason, written).to_json(), fsync=False)
            self.local.requests_failed += 1
        except Exception:
            self.local.internal_errors += 1
            logger.exception("hsdump: could not write the error marker of %s", rid)

    def _ticket(self, rid: str, failed: bool = False) -> int:
        """The ticket of ``rid``'s current attempt (a new one when there is none)."""
        with self._lock:
            attempt = self._attempts.get(rid)
            if attempt is None:
                self._tickets += 1
                attempt = self._attempts[rid] = _Attempt(self._tickets)
                self._by_ticket[attempt.ticket] = rid
                while len(self._attempts) > _SENT_RIDS:
                    self._forget(next(iter(self._attempts)))
            else:
                self._attempts.move_to_end(rid)
            attempt.failed = attempt.failed or failed
            return attempt.ticket

    def _forget(self, rid: str) -> None:
        """Drop ``rid``'s current attempt (lock held)."""
        attempt = self._attempts.pop(rid, None)
        if attempt is not None:
            del self._by_ticket[attempt.ticket]

    def _read_reports(self) -> None:
        """Apply the child's marker reports published since the last call (lock held): a done
        attempt is forgotten, a failed one noted. Reports the ring no longer holds are lost:
        those attempts stay remembered."""
        n = int(self.region.reported[0])
        for i in range(max(self._reports_read, n - _REPORTS), n):
            ticket = int(self.region.reports[i % _REPORTS])
            rid = self._by_ticket.get(abs(ticket))
            if rid is None:  # a new attempt began, or the attempt was forgotten
                continue
            if ticket > 0:
                self._forget(rid)
            else:
                self._attempts[rid].failed = self._attempts[rid].marked = True
        self._reports_read = n


def _pages_of(msg: tuple) -> list[int]:
    """The staging pages a message holds."""
    return msg[5] if msg[0] == "file" else msg[3] if msg[0] == "drop" else []


def _as_failure(msg: tuple, reason: str) -> tuple:
    """A file message whose copy failed becomes: release its pages, fail its request."""
    if msg[0] != "file":
        return msg
    return ("drop", msg[1], msg[4], msg[5], reason, msg[7])


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


# ------------------------------------------------------------------ the writer process


class _Child:
    def __init__(self, region: SharedRegion, dump_dir: Path, threads: int) -> None:
        self.region = region
        self._lock = threading.Lock()
        self._settled = 0
        self.files = FileWriter(dump_dir, threads=threads, page_bytes=region.page_bytes,
                                release=self._release, settled=self._on_settled,
                                marked=self._report)
        self.pages = [ShmPage(i, region.page(i)) for i in range(region.pages)]

    def _release(self, pages: Sequence[Page]) -> None:
        if pages:
            self.region.state[[p.index for p in pages]] = RELEASED  # type: ignore[attr-defined]

    def _on_settled(self) -> None:
        with self._lock:
            self._settled += 1
            values = {"settled": self._settled, "tracked_requests": self.files.tracked_requests,
                      **self.files.stats.__dict__}
            # The counters first, "settled" last: a reader that sees it sees them too.
            for name in COUNTERS[1:]:
                self.region.counters[COUNTERS.index(name)] = values[name]
            self.region.counters[0] = values["settled"]

    def _report(self, ticket: int, done: bool) -> None:
        """Publish that the marker of attempt ``ticket`` is written (the entry, then the count)."""
        with self._lock:
            n = int(self.region.reported[0])
            self.region.reports[n % _REPORTS] = ticket if done else -ticket
            self.region.reported[0] = n + 1

    def handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "begin":
            self.files.begin_request(msg[1])
        elif kind == "fail":
            _, rid, reason, prompt_len, internal, ticket, marked = msg
            self.files.fail(rid, reason, prompt_len, internal=internal, tag=ticket,
                            marked=marked)
        elif kind == "file":
            _, rid, prefix_len, tokens, prompt_len, pages, nbytes, ticket = msg
            self.files.add(rid, prefix_len, tokens, prompt_len, [self.pages[i] for i in pages],
                           nbytes, None, tag=ticket)
        elif kind == "drop":
            _, rid, prompt_len, pages, reason, ticket = msg
            self._release([self.pages[i] for i in pages])
            self.files.fail(rid, reason, prompt_len, internal=True, tag=ticket)
        else:
            raise ValueError(f"unknown message {kind!r}")


def _read_exactly(fd: int, n: int) -> bytes | None:
    parts, left = [], n
    while left:
        b = os.read(fd, left)
        if not b:
            return None
        parts.append(b)
        left -= len(b)
    return b"".join(parts)


def main(argv: list[str] | None = None) -> int:
    # A Ctrl-C or a launcher's signal to the server's process group must not cut the files
    # short: this process leaves on its pipe's EOF, once it has written what it was sent.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    ap = argparse.ArgumentParser(description="hsdump's writer process (started by the capture "
                                 "patch; not for use by hand)")
    for name in ("memfd", "pipe", "threads", "pages", "page-bytes", "parent"):
        ap.add_argument(f"--{name}", type=int, required=True, help="set by the parent (no "
                        "default)")
    ap.add_argument("--dump-dir", type=Path, required=True, help="set by the parent (no "
                    "default)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s hsdump writer process {os.getpid()} (of "
                               f"{args.parent}): %(levelname)s %(message)s")
    child = _Child(SharedRegion(args.memfd, args.pages, args.page_bytes), args.dump_dir,
                   args.threads)
    while True:
        head = _read_exactly(args.pipe, _FRAME.size)
        if head is None:  # the parent closed the pipe (or died): finish and leave
            break
        data = _read_exactly(args.pipe, _FRAME.unpack(head)[0])
        if data is None:
            break
        for msg in pickle.loads(data):
            try:
                child.handle(msg)
            except Exception:
                logger.exception("hsdump: internal error on message %r", msg[:2])
                with child.files._lock:
                    child.files.stats.internal_errors += 1
                child._on_settled()
    child.files.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
