"""Reading one request's dump (client side of the file protocol) into a sink of chunks.

Everything the server wrote is cross-checked against what the client sent: the rid, the
layers, the shapes and dtype, contiguous coverage of ``[0, L)`` and the token ids of every
chunk. A mismatch raises :class:`~hsdump_patch.protocol.ProtocolError`; it never yields a
silently wrong record.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Protocol

import torch

from hsdump_patch import protocol
from hsdump_patch.client.buffers import BufferPool, tensor_at, torch_dtype


class ChunkSink(Protocol):
    """Where a request's chunks go (an output format's record builder)."""

    def put(self, start: int, hidden: torch.Tensor) -> None:
        """Take one chunk's ``hidden_states`` [n, S, H] for positions ``start .. start+n``."""


def wait_for_marker(dump_dir: Path, rid: str, timeout: float) -> protocol.RequestStatus | None:
    """Poll until the request has a done or error marker; None after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    delay = 0.002
    while True:
        status = protocol.request_status(dump_dir, rid)
        if status.finished:
            return status
        if time.monotonic() >= deadline:
            return None
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def wait_until_settled(dump_dir: Path, rid: str, quiet: float, timeout: float) -> None:
    """Wait until a request's directory is final: it has a marker, is gone, or nothing in it
    changed for ``quiet`` seconds (an aborted request never gets a marker); at most ``timeout``.
    """
    d = protocol.rid_dir(dump_dir, rid)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if protocol.request_status(dump_dir, rid).finished:
            return
        try:
            age = time.time() - d.stat().st_mtime
        except FileNotFoundError:
            return
        if age >= quiet:
            return
        time.sleep(min(0.2, quiet - age))


_TORCH_DTYPES = {st: name for name, st in protocol.SAFETENSORS_DTYPES.items()}


def _tensor(buf: memoryview | bytearray, size: int, base: int, header: dict[str, Any], key: str,
            path: Path) -> torch.Tensor:
    """Tensor ``key`` of a safetensors file read into ``buf[:size]`` (a view, no copy)."""
    try:
        entry = header[key]
        dtype = getattr(torch, _TORCH_DTYPES[entry["dtype"]])
        shape = tuple(int(d) for d in entry["shape"])
        begin, end = (base + int(o) for o in entry["data_offsets"])
    except (KeyError, TypeError, ValueError):
        raise protocol.ProtocolError(f"{path}: no valid tensor {key!r} in its header") from None
    if not base <= begin <= end <= size or end - begin != math.prod(shape) * dtype.itemsize:
        raise protocol.ProtocolError(f"{path}: tensor {key!r} lies outside the file "
                                     "(a truncated or corrupt chunk)")
    return tensor_at(buf, begin, dtype, shape)


def _read_chunk(path: Path, buf: memoryview | bytearray,
                size: int) -> tuple[dict[str, str], torch.Tensor, torch.Tensor]:
    """Read a chunk file (``size`` bytes) into ``buf``; return its metadata and views of its
    hidden states and token ids. The safetensors layout: 8-byte header length, JSON header,
    data."""
    with open(path, "rb", buffering=0) as f:
        got = f.readinto(memoryview(buf)[:size])
    try:
        if got != size or size < 8:
            raise ValueError("short read")
        (n,) = struct.unpack_from("<Q", buf)
        header = json.loads(bytes(memoryview(buf)[8 : 8 + n]))
        meta = header.get("__metadata__") or {}
    except (ValueError, AttributeError, struct.error):
        raise protocol.ProtocolError(f"{path}: not a complete safetensors file") from None
    return (meta, _tensor(buf, size, 8 + n, header, protocol.HIDDEN_KEY, path),
            _tensor(buf, size, 8 + n, header, protocol.INPUT_IDS_KEY, path))


def read_request(dump_dir: Path, rid: str, input_ids: list[int], info: protocol.ServerInfo,
                 builder: ChunkSink, pool: BufferPool | None = None) -> int:
    """Copy a finished request's chunks into ``builder``; return the number of chunks.

    Each chunk file is read into a buffer of ``pool`` (or a fresh one) and copied from there.
    """
    chunks = protocol.list_chunks(dump_dir, rid)
    if not chunks:
        raise protocol.ProtocolError(f"request {rid} is marked done but has no chunk files")
    slots = len(info.layers) + int(info.has_final)
    dtype = torch_dtype(info.dtype)
    sizes = []
    for prefix_len, path in chunks:
        size = path.stat().st_size
        with pool.lend(size) if pool else nullcontext(bytearray(size)) as buf:
            raw_meta, hidden, ids = _read_chunk(path, buf, size)
            meta = protocol.ChunkMeta.from_strings(raw_meta)
            if meta.rid != rid or meta.prefix_len != prefix_len:
                raise protocol.ProtocolError(
                    f"{path} belongs to rid {meta.rid!r} at {meta.prefix_len}, expected {rid!r} "
                    f"at {prefix_len}")
            if meta.layers != info.layers or meta.has_final != info.has_final:
                raise protocol.ProtocolError(
                    f"{path} has layers {list(meta.layers)} (final: {meta.has_final}) but "
                    f"server.json announces {list(info.layers)} (final: {info.has_final}): the "
                    "server was restarted with another configuration during the run")
            n = ids.shape[0]
            if hidden.shape != (n, slots, info.hidden_size) or hidden.dtype != dtype:
                raise protocol.ProtocolError(
                    f"{path}: hidden_states is {tuple(hidden.shape)} {hidden.dtype}, expected "
                    f"({n}, {slots}, {info.hidden_size}) {dtype}")
            sent = input_ids[prefix_len : prefix_len + n]
            if ids.tolist() != sent:
                raise protocol.ProtocolError(
                    f"{path}: its token ids differ from the ids sent for positions "
                    f"{prefix_len}..{prefix_len + n} (a mixed-up or stale dump)")
            sizes.append((prefix_len, n))
            builder.put(prefix_len, hidden)
            del hidden, ids
    protocol.check_coverage(sizes, len(input_ids))
    return len(chunks)


def remove_request(dump_dir: Path, rid: str) -> None:
    """Delete a request's directory from the dump dir (it is consumed or stale)."""
    shutil.rmtree(protocol.rid_dir(dump_dir, rid), ignore_errors=True)


def _settled(d: Path, quiet: float) -> bool:
    """Whether a request directory is final: it has a done or error marker, or neither it nor
    a file in it changed for ``quiet`` seconds (False while it changes under the scan)."""
    try:
        names = os.listdir(d)
        if protocol.DONE_MARKER in names or protocol.ERROR_MARKER in names:
            return True
        changed = max([d.stat().st_mtime, *((d / n).stat().st_mtime for n in names)])
    except FileNotFoundError:
        return False
    return time.time() - changed >= quiet


def sweep(dump_dir: Path, owned: Callable[[str], bool], quiet: float,
          timeout: float = 0.0) -> int:
    """Remove the request directories whose names ``owned`` accepts, each once it is final
    (:func:`_settled`: an aborted request, e.g. one whose client was killed, never gets a
    marker and goes once quiet); wait up to ``timeout`` seconds for the others. Return how
    many are left. ``owned`` must accept only requests that no live client waits for: the
    caller's own, none in flight, or those of a client known dead."""
    deadline = time.monotonic() + timeout
    while True:
        left = 0
        for entry in os.scandir(dump_dir):
            if entry.is_dir(follow_symlinks=False) and owned(entry.name):
                if _settled(Path(entry.path), quiet):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    left += 1
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.2)


class Remover:
    """Removes requests' directories on a thread of its own, so that whoever consumed a request
    need not wait for it (:func:`remove_request`, one at a time, in order).

    At most ``limit`` directories wait: :meth:`put` blocks while that many do, so the dump dir
    is drained as fast as it fills. :meth:`close` removes what is left; a directory put after
    it is removed at once, by the caller.
    """

    def __init__(self, dump_dir: Path, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"a remover needs a limit >= 1, got {limit}")
        self.dump_dir = dump_dir
        self.limit = limit
        self._queue: deque[str] = deque()
        self._pending = 0  # queued or being removed
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="hsdump-remover", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        """Directories put and not yet removed."""
        with self._cond:
            return self._pending

    def put(self, rid: str) -> None:
        """Have request ``rid``'s directory removed; waits while ``limit`` others wait."""
        with self._cond:
            self._cond.wait_for(lambda: self._closed or self._pending < self.limit)
            if not self._closed:
                self._queue.append(rid)
                self._pending += 1
                self._cond.notify_all()
                return
        remove_request(self.dump_dir, rid)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until every directory put so far is removed; False after ``timeout`` seconds."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending == 0, timeout)

    def close(self) -> None:
        """Remove every directory put so far, then stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                rid = self._queue.popleft()
            try:
                remove_request(self.dump_dir, rid)
            finally:
                with self._cond:
                    self._pending -= 1
                    self._cond.notify_all()


def dump_free_bytes(dump_dir: Path) -> int:
    """Free bytes (for unprivileged writers) on the dump dir's filesystem."""
    st = os.statvfs(dump_dir)
    return st.f_bavail * st.f_frsize

