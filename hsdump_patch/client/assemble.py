"""Reading one request's dump (client side of the file protocol) into a record builder.

Everything the server wrote is cross-checked against what the client sent: the rid, the
layers, the shapes and dtype, contiguous coverage of ``[0, L)`` and the token ids of every
chunk. A mismatch raises :class:`~hsdump_patch.protocol.ProtocolError`; it never yields a
silently wrong record.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from safetensors import safe_open

from hsdump_patch import protocol
from hsdump_patch.client.records import RecordBuilder, torch_dtype


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


def read_request(dump_dir: Path, rid: str, input_ids: list[int], info: protocol.ServerInfo,
                 builder: RecordBuilder) -> int:
    """Copy a finished request's chunks into ``builder``; return the number of chunks."""
    chunks = protocol.list_chunks(dump_dir, rid)
    if not chunks:
        raise protocol.ProtocolError(f"request {rid} is marked done but has no chunk files")
    slots = len(info.layers) + int(info.has_final)
    dtype = torch_dtype(info.dtype)
    sizes = []
    for prefix_len, path in chunks:
        with safe_open(path, framework="pt") as f:
            meta = protocol.ChunkMeta.from_strings(f.metadata() or {})
            hidden = f.get_tensor(protocol.HIDDEN_KEY)
            ids = f.get_tensor(protocol.INPUT_IDS_KEY)
        if meta.rid != rid or meta.prefix_len != prefix_len:
            raise protocol.ProtocolError(
                f"{path} belongs to rid {meta.rid!r} at {meta.prefix_len}, expected {rid!r} at "
                f"{prefix_len}")
        if meta.layers != info.layers or meta.has_final != info.has_final:
            raise protocol.ProtocolError(
                f"{path} has layers {list(meta.layers)} (final: {meta.has_final}) but server.json "
                f"announces {list(info.layers)} (final: {info.has_final}): the server was "
                "restarted with another configuration during the run")
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
    protocol.check_coverage(sizes, len(input_ids))
    return len(chunks)


def remove_request(dump_dir: Path, rid: str) -> None:
    """Delete a request's directory from the dump dir (it is consumed or stale)."""
    shutil.rmtree(protocol.rid_dir(dump_dir, rid), ignore_errors=True)


def dump_free_bytes(dump_dir: Path) -> int:
    """Free bytes (for unprivileged writers) on the dump dir's filesystem."""
    st = os.statvfs(dump_dir)
    return st.f_bavail * st.f_frsize

