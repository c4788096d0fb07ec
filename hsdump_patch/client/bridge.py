"""``hsdump bridge``: hsdump captures published into Mooncake for SpecForge's online
(disaggregated) training, under SpecForge's own key layout (design: docs/online.md).

SpecForge 0.2.0's producer (``specforge/inference/adapters/server_capture.py``,
``SGLangServerCaptureAdapter.produce_refs``) posts one ``/generate`` per batch of prompt tasks
with a ``spec_capture`` entry per task; it expects, per task, ``meta_info["spec_capture"]`` naming
the sample id, generation, store id, aux layer ids and each feature's shape and dtype, once every
tensor is readable at ``{store_id}/{sample_id}/g{gen}/{name}`` (``specforge/runtime/data_plane/
mooncake_store.py``, ``MooncakeFeatureStore._tkey``), or ``{"error": reason}``.

:class:`Bridge` does that with an hsdump-enabled server: one prefill-only ``/generate`` under
dump rids, the chunks read back through the file protocol (every check of
:func:`~hsdump_patch.client.dumps.dumpdir.read_request`), the aux layers concatenated in ascending
order, the tensors put into Mooncake, the answer sent while the dump directories are removed behind
it. Client side: it depends on the file protocol only, never on SGLang.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import math
import os
import signal
import sys
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import IO, Any

import requests
import torch

from hsdump_patch import protocol
from hsdump_patch.client.buffers import BufferPool, tensor_at, torch_dtype
from hsdump_patch.client.dumps.dumpdir import (
    Remover,
    read_request,
    sweep,
    wait_for_marker,
    wait_until_settled,
)
from hsdump_patch.client.extract import DEFAULT_DUMP_TIMEOUT
from hsdump_patch.client.options import DEFAULT_SERVER
from hsdump_patch.client.output.records import RecordBuilder
from hsdump_patch.client.server.api import check_meta

# The server's generic artifacts (SpecForge's ServerCaptureSchema aux / last_hidden_feature).
ARTIFACTS = ("aux", "last_hidden")
PASSTHROUGH_DTYPES = {"int64": torch.int64, "int32": torch.int32}
SETTLE_QUIET_S = 1.0  # a failed row's dump directory is final after this long unchanged
PENDING_REMOVALS = 16  # request directories left to remove before an answer waits for them
MOONCAKE_NOT_FOUND = -704  # Mooncake's OBJECT_NOT_FOUND, what remove() of an absent key returns
# A bridge's lock file in the dump dir, ``.hsdump-bridge-<owner>.lock``, locked while it runs.
LOCK_PREFIX, LOCK_SUFFIX = ".hsdump-bridge-", ".lock"
# How long a starting bridge waits for a dead bridge's request directories to settle (SGLang
# aborts a gone client's requests within seconds: it checks for a disconnect every 4 s).
SWEEP_WAIT_S = 10.0

# ``engine(input_ids, rids, extra_key) -> rows``: runs the prefills, one /generate row per prompt.
Engine = Callable[[list[list[int]], list[str], "list[str] | None"], list[dict[str, Any]]]


class BridgeRequestError(ValueError):
    """A ``/generate`` body this bridge cannot serve (answered HTTP 400, never retried)."""


class CaptureFailed(RuntimeError):
    """One task's capture failed; its reason goes back as SpecForge's per-task failure."""


def feature_key(store_id: str, sample_id: str, gen: int, name: str) -> str:
    """Mooncake key of one feature tensor (SpecForge 0.2.0 ``MooncakeFeatureStore._tkey``)."""
    return f"{store_id}/{sample_id}/g{gen}/{name}"


def aux_layer_ids(info: protocol.ServerInfo) -> tuple[int, ...]:
    """SpecForge's ids of the server's capture layers, ascending (the concatenation order).

    hsdump's layer ``l`` is HF ``output_hidden_states[l]``, the input of decoder layer ``l``;
    SpecForge (like SGLang's ``set_eagle3_layers_to_capture``, which captures at ``id + 1``)
    names it ``l - 1``, the output of layer ``l - 1``. Layer 0 (the embeddings) has no id.
    """
    if 0 in info.layers:
        raise BridgeRequestError("the server captures layer 0 (the embeddings), which has no "
                                 "SpecForge aux layer id; start it with layers >= 1")
    return tuple(sorted(layer - 1 for layer in info.layers))


def server_layers_for(specforge_ids: Sequence[int]) -> list[int]:
    """The hsdump ``--layers`` that give SpecForge's ``aux_hidden_state_layer_ids``."""
    return [i + 1 for i in specforge_ids]


@dataclass(frozen=True)
class Passthrough:
    """A client tensor stored verbatim (``input_ids``, ``loss_mask``, ``attention_mask``)."""

    name: str
    data: list[int]
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class TaskCapture:
    """One task's ``spec_capture`` entry of the request."""

    store_id: str
    sample_id: str
    gen: int
    replace: bool
    features: dict[str, str]  # artifact ("aux" / "last_hidden") -> SpecForge feature name
    passthrough: tuple[Passthrough, ...]

    @classmethod
    def from_json(cls, payload: Any, prompt_len: int) -> TaskCapture:
        """Validate one ``spec_capture`` entry for a prompt of ``prompt_len`` tokens."""
        if not isinstance(payload, Mapping):
            raise BridgeRequestError(f"spec_capture entry is {type(payload).__name__}, "
                                     "expected an object")
        try:
            store_id, sample_id = str(payload["store_id"]), str(payload["sample_id"])
            gen, replace = int(payload["gen"]), bool(payload.get("replace", False))
            features = dict(payload.get("features") or {})
            raw_pass = list(payload.get("passthrough") or [])
        except (KeyError, TypeError, ValueError) as e:
            raise BridgeRequestError(f"spec_capture entry lacks or mangles {e}") from None
        if not store_id or not sample_id or gen < 1:
            raise BridgeRequestError(f"spec_capture entry needs a store_id, a sample_id and a "
                                     f"generation >= 1 (got {store_id!r}, {sample_id!r}, {gen})")
        unknown = sorted(set(features) - set(ARTIFACTS))
        if unknown:
            raise BridgeRequestError(f"spec_capture asks for artifacts {unknown}; this bridge "
                                     f"captures {list(ARTIFACTS)}")
        passthrough = []
        for item in raw_pass:
            try:
                p = Passthrough(str(item["name"]), [int(v) for v in item["data"]],
                                tuple(int(d) for d in item["shape"]), str(item["dtype"]))
            except (KeyError, TypeError, ValueError) as e:
                raise BridgeRequestError(f"passthrough entry lacks or mangles {e}") from None
            if p.dtype not in PASSTHROUGH_DTYPES:
                raise BridgeRequestError(f"passthrough {p.name!r} has dtype {p.dtype!r}; "
                                         f"expected one of {sorted(PASSTHROUGH_DTYPES)}")
            if math.prod(p.shape) != len(p.data) or p.shape[:2] != (1, prompt_len):
                raise BridgeRequestError(
                    f"passthrough {p.name!r}: shape {list(p.shape)} does not hold its "
                    f"{len(p.data)} values as [1, {prompt_len}, ...] for this prompt")
            passthrough.append(p)
        names = [*features.values(), *(p.name for p in passthrough)]
        if not names or len(set(names)) != len(names):
            raise BridgeRequestError(f"spec_capture feature names must be unique and non-empty, "
                                     f"got {names}")
        return cls(store_id, sample_id, gen, replace, features, tuple(passthrough))

    def key(self, name: str) -> str:
        return feature_key(self.store_id, self.sample_id, self.gen, name)


def _passthrough_at(length: int, info: protocol.ServerInfo) -> int:
    """Where a task's passthroughs start in its buffer: after its hidden states, 8-aligned."""
    return -(-RecordBuilder.nbytes(length, info) // 8) * 8


def task_nbytes(length: int, info: protocol.ServerInfo, task: TaskCapture) -> int:
    """The buffer :func:`task_tensors` needs for a prompt of ``length`` tokens."""
    return _passthrough_at(length, info) + sum(
        len(p.data) * PASSTHROUGH_DTYPES[p.dtype].itemsize for p in task.passthrough)


def task_tensors(dump_dir: Path, rid: str, input_ids: list[int], info: protocol.ServerInfo,
                 task: TaskCapture, buf: memoryview,
                 chunk_pool: BufferPool | None = None) -> dict[str, torch.Tensor]:
    """The tensors of one finished dump, named as the task asks: ``aux`` [1, L, K*H] (the
    layers in ascending order), ``last_hidden`` [1, L, H] in the model dtype, passthroughs;
    all of them in ``buf`` (:func:`task_nbytes` long), so that the sink registers it once."""
    length = len(input_ids)
    builder = RecordBuilder("specforge", length, info, buf=buf)
    read_request(dump_dir, rid, input_ids, info, builder, chunk_pool)
    out: dict[str, torch.Tensor] = {}
    if "aux" in task.features:
        out[task.features["aux"]] = builder.aux.view(1, length, -1)
    if "last_hidden" in task.features:
        if builder.final is None:
            raise CaptureFailed("last_hidden wanted but the server does not capture the "
                                "post-final-norm state (start it with the final state on)")
        out[task.features["last_hidden"]] = builder.final.view(1, length, -1)
    at = _passthrough_at(length, info)
    for p in task.passthrough:
        dtype = PASSTHROUGH_DTYPES[p.dtype]
        t = tensor_at(buf, at, dtype, (len(p.data),))
        t.copy_(torch.tensor(p.data, dtype=dtype))
        out[p.name] = t.view(p.shape)
        at += t.nbytes
    return out


def _address(buf: memoryview) -> int:
    return tensor_at(buf, 0, torch.uint8, (1,)).data_ptr()


def spans(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    """The address ranges ``(ptr, nbytes)`` that cover ``tensors`` (contiguous ones), adjacent
    or overlapping ranges merged: what to register with Mooncake, once each."""
    out: list[list[int]] = []
    for ptr, end in sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in tensors if t.nbytes):
        if out and ptr <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([ptr, end])
    return [(ptr, end - ptr) for ptr, end in out]


class MooncakeSink:
    """Writes tensors into Mooncake as raw buffers, hard-pinned (SpecForge frees them).

    ``store`` is a set-up ``mooncake.store.MooncakeDistributedStore`` whose global segment holds
    the published features until the trainer removes them: size it (docs/online.md). Tasks
    build their tensors in :meth:`staging` buffers, kept for reuse up to ``staging_bytes``.
    """

    def __init__(self, store: Any, replicate_config: Any, staging_bytes: int = 4 << 30) -> None:
        self.store = store
        self.config = replicate_config
        if hasattr(self.config, "with_hard_pin"):
            self.config.with_hard_pin = True
        self._lock = threading.Lock()
        self._registered: dict[int, int] = {}  # staging buffers: address -> bytes
        self._staging = BufferPool(staging_bytes, on_drop=self._unregister)

    @contextlib.contextmanager
    def staging(self, nbytes: int) -> Iterator[memoryview]:
        """A buffer of at least ``nbytes`` for one task's tensors, registered with Mooncake once
        for all its uses (a registration is a round trip to the metadata server; over RDMA it
        pins the pages): :meth:`publish` registers nothing for tensors inside it."""
        with self._staging.lend(nbytes) as buf:
            ptr = _address(buf)
            with self._lock:
                if ptr not in self._registered:
                    if self.store.register_buffer(ptr, len(buf)) != 0:
                        raise CaptureFailed(f"Mooncake could not register a {len(buf)}-byte "
                                            "staging buffer for the put")
                    self._registered[ptr] = len(buf)
            yield buf

    def _unregister(self, buf: memoryview) -> None:
        ptr = _address(buf)
        with self._lock:
            if self._registered.pop(ptr, None) is not None:
                self.store.unregister_buffer(ptr)

    def _staged(self, ptr: int, nbytes: int) -> bool:
        with self._lock:
            return any(b <= ptr and ptr + nbytes <= b + n for b, n in self._registered.items())

    @classmethod
    def connect(cls, *, master: str, metadata: str, local_hostname: str,
                global_segment_size: int, local_buffer_size: int = 64 << 20,
                protocol_name: str = "tcp", rdma_devices: str = "",
                staging_bytes: int = 4 << 30) -> MooncakeSink:
        """Connect to a Mooncake master (``host:port``) and metadata server (URL)."""
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        store = MooncakeDistributedStore()
        rc = store.setup(local_hostname, metadata, global_segment_size, local_buffer_size,
                         protocol_name, rdma_devices, master)
        if rc != 0:
            raise RuntimeError(f"Mooncake setup failed (status {rc}) for master {master}, "
                               f"metadata {metadata}, protocol {protocol_name}")
        return cls(store, ReplicateConfig(), staging_bytes)

    def remove(self, keys: list[str]) -> list[str]:
        """Force-remove ``keys``; return the ones that could not be removed."""
        return [k for k in keys if self.store.remove(k, force=True) not in (0, MOONCAKE_NOT_FOUND)]

    def publish(self, task: TaskCapture, tensors: dict[str, torch.Tensor]) -> None:
        """Make every tensor readable under the task's keys, or none of them: one existence
        check, one batched put, each distinct memory range outside the staging buffers
        registered for it.

        Mooncake's ``put_from`` keeps an existing object's old bytes (and answers 0), so a
        ``replace`` (a retry) upserts; without it an existing key is refused.
        """
        keys = [task.key(name) for name in tensors]
        if not task.replace:
            present = [k for k, e in zip(keys, self.store.batch_is_exist(keys), strict=True)
                       if e == 1]
            if present:
                raise CaptureFailed(f"keys {present} exist and the request does not replace "
                                    "them (a second writer of this sample?)")
        flat = [t.contiguous() for t in tensors.values()]
        ranges = [r for r in spans(flat) if not self._staged(*r)]
        registered = []
        try:
            for ptr, nbytes in ranges:
                if self.store.register_buffer(ptr, nbytes) != 0:
                    raise CaptureFailed(f"Mooncake could not register {nbytes} bytes of this "
                                        "sample's features for the put")
                registered.append(ptr)
            put = self.store.batch_upsert_from if task.replace else self.store.batch_put_from
            try:
                rcs = put(keys, [t.data_ptr() for t in flat], [t.nbytes for t in flat],
                          self.config)
            except BaseException:
                self.remove(keys)
                raise
        finally:
            for ptr in registered:
                self.store.unregister_buffer(ptr)
        refused = {k: rc for k, rc in zip(keys, rcs, strict=True) if rc != 0}
        if refused:
            self.remove([k for k in keys if k not in refused])
            raise CaptureFailed(f"Mooncake refused {refused} (key: status) of {len(keys)} "
                                f"tensors, {sum(t.nbytes for t in flat)} bytes: is the bridge's "
                                "segment full (the trainer lagging)?")


def capture_result(task: TaskCapture, tensors: dict[str, torch.Tensor],
                   layer_ids: tuple[int, ...]) -> dict[str, Any]:
    """``meta_info["spec_capture"]`` of a published task (what SpecForge builds its ref from)."""
    return {
        "sample_id": task.sample_id,
        "store_id": task.store_id,
        "gen": task.gen,
        "aux_layer_ids": list(layer_ids),
        "features": {name: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
                     for name, t in tensors.items()},
    }


def capture_failure(task: TaskCapture, reason: str) -> dict[str, Any]:
    """SpecForge's per-task failure shape (a retryable ``ServerCaptureFailure`` on its side)."""
    return {"sample_id": task.sample_id, "store_id": task.store_id, "gen": task.gen,
            "error": reason}


@dataclass
class BridgeStats:
    """What a bridge has served so far (thread-safe counters)."""

    requests: int = 0
    ok: int = 0
    failed: int = 0
    bytes: int = 0
    started: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, requests: int = 0, ok: int = 0, failed: int = 0, nbytes: int = 0) -> None:
        with self.lock:
            self.requests += requests
            self.ok += ok
            self.failed += failed
            self.bytes += nbytes

    def line(self) -> str:
        """One progress / summary line."""
        with self.lock:
            wall = max(time.monotonic() - self.started, 1e-9)
            return (f"{self.requests} requests, {self.ok} samples published, {self.failed} "
                    f"failed, {self.bytes / 2**20:.1f} MiB ({self.ok / wall:.2f} samples/s, "
                    f"{self.bytes / 2**20 / wall:.2f} MiB/s over {wall:.0f} s)")


def hold_lock(path: Path) -> IO[bytes]:
    """Create ``path`` flock-ed until the returned file is closed (or its process dies). It
    gets its name only once locked: a lock file found unlocked belongs to a dead process."""
    tmp = protocol.temp_path(path)
    f = open(tmp, "wb")  # noqa: SIM115 - the caller holds it until its close()
    fcntl.flock(f, fcntl.LOCK_EX)
    os.replace(tmp, path)
    return f


class Bridge:
    """Serves SpecForge's ``spec_capture`` ``/generate`` with an hsdump-enabled server."""

    def __init__(self, dump_dir: Path, sink: MooncakeSink, engine: Engine, *,
                 marker_timeout: float = 300.0, workers: int = 4,
                 max_inflight_bytes: int = 4 << 30) -> None:
        """At most ``workers`` tasks are read and published at once, whatever the number of
        requests: host memory for features in flight is ``workers`` x (largest sample + one
        chunk), chunk buffers reused up to ``max_inflight_bytes`` (the samples' are the sink's
        :meth:`~MooncakeSink.staging` buffers); further requests wait (their
        HTTP answer too: the producer slows down). The request's dump directories are removed
        after its answer, on a thread of their own (at most ``PENDING_REMOVALS`` waiting, or the
        answers wait too); :meth:`close` removes what is left. Its rids carry its ``owner``, whose
        lock file it holds; it starts by removing what dead bridges left (:meth:`sweep_dead`)."""
        self.dump_dir = Path(dump_dir)
        self.info = protocol.read_server_info(self.dump_dir)
        torch_dtype(self.info.dtype)  # a dtype the client cannot read fails here, not per task
        self.layer_ids = aux_layer_ids(self.info)
        self.sink = sink
        self.engine = engine
        self.marker_timeout = marker_timeout
        self._slots = threading.BoundedSemaphore(workers)
        self._chunk_bufs = BufferPool(max_inflight_bytes)
        self.remover = Remover(self.dump_dir, PENDING_REMOVALS)
        self.stats = BridgeStats()
        self.owner = uuid.uuid4().hex[:12]
        self._lock = hold_lock(self._lock_path(self.owner))
        self.left_by_dead = self.sweep_dead()

    def close(self) -> None:
        """Remove the dump directories still waiting, then this bridge's lock file; requests
        answered later remove their own before answering."""
        self.remover.close()
        self._lock_path(self.owner).unlink(missing_ok=True)
        self._lock.close()

    def _lock_path(self, owner: str) -> Path:
        return self.dump_dir / f"{LOCK_PREFIX}{owner}{LOCK_SUFFIX}"

    def _rid_prefix(self, owner: str) -> str:
        return f"{self.info.rid_prefix}bridge-{owner}-"

    def _rid(self) -> str:
        return f"{self._rid_prefix(self.owner)}{uuid.uuid4().hex}"

    def sweep_dead(self) -> int:
        """Remove what bridges that died (SIGKILL, a crash) left in the dump dir: the request
        directories of every owner whose lock file nobody holds, once each is final (up to
        ``SWEEP_WAIT_S``), then its lock file. A live bridge's (its lock held), this one's and
        other clients' directories stay. Return how many are left (kept with their lock file,
        for the next start)."""
        left = 0
        for lock in self.dump_dir.glob(f"{LOCK_PREFIX}*{LOCK_SUFFIX}"):
            try:
                f = open(lock, "rb")  # noqa: SIM115 - closed below, releasing the lock
            except FileNotFoundError:
                continue  # another starting bridge swept it
            with f:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # its bridge runs
                owner = lock.name[len(LOCK_PREFIX):-len(LOCK_SUFFIX)]
                start = protocol.rid_dirname(self._rid_prefix(owner))
                n = sweep(self.dump_dir, lambda name, start=start: name.startswith(start),
                          SETTLE_QUIET_S, SWEEP_WAIT_S)
                if n == 0:
                    lock.unlink(missing_ok=True)
                left += n
        return left

    def generate(self, body: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Answer one ``spec_capture`` ``/generate`` body: the server's rows, each with its
        task's ``meta_info["spec_capture"]``."""
        ids = body.get("input_ids")
        entries = body.get("spec_capture")
        if isinstance(ids, list) and ids and isinstance(ids[0], int):
            ids, entries = [ids], [entries] if isinstance(entries, Mapping) else entries
        if not isinstance(ids, list) or not isinstance(entries, list) or len(ids) != len(entries):
            raise BridgeRequestError("a spec_capture /generate needs input_ids (a list of token "
                                     "id lists) and one spec_capture entry per prompt")
        tasks = [TaskCapture.from_json(e, len(p)) for e, p in zip(entries, ids, strict=True)]
        rids = [self._rid() for _ in tasks]
        self.stats.add(requests=1)
        try:
            rows = self.engine(ids, rids, body.get("extra_key"))
            if len(rows) != len(tasks):
                raise RuntimeError(f"the server answered {len(rows)} rows for {len(tasks)} "
                                   "prompts")
            for task, rid, prompt, row in zip(tasks, rids, ids, rows, strict=True):
                meta = row.setdefault("meta_info", {})
                meta["spec_capture"] = self._capture_one(task, rid, prompt, meta)
            return rows
        finally:
            for rid in rids:
                self.remover.put(rid)

    def _capture_one(self, task: TaskCapture, rid: str, prompt: list[int],
                     meta: dict[str, Any]) -> dict[str, Any]:
        problem = check_meta(meta, len(prompt))
        if problem is not None:
            # The writer may still be writing this rid's files (an aborted one gets no
            # marker): let its directory settle before it is removed.
            wait_until_settled(self.dump_dir, rid, SETTLE_QUIET_S, self.marker_timeout)
            return self._failure(task, problem)
        status = wait_for_marker(self.dump_dir, rid, self.marker_timeout)
        if status is None:
            return self._failure(task, f"no done marker for dump rid {rid} within "
                                         f"{self.marker_timeout:g}s")
        if status.error is not None:
            return self._failure(task, f"the server could not dump rid {rid}: "
                                         f"{status.error.reason}")
        nbytes = task_nbytes(len(prompt), self.info, task)
        try:
            with self._slots, self.sink.staging(nbytes) as buf:
                tensors = task_tensors(self.dump_dir, rid, prompt, self.info, task, buf,
                                       self._chunk_bufs)
                self.sink.publish(task, tensors)
                self.stats.add(ok=1, nbytes=sum(t.numel() * t.element_size()
                                                for t in tensors.values()))
                return capture_result(task, tensors, self.layer_ids)
        except (CaptureFailed, protocol.ProtocolError) as e:
            return self._failure(task, str(e))

    def _failure(self, task: TaskCapture, reason: str) -> dict[str, Any]:
        self.stats.add(failed=1)
        return capture_failure(task, reason)


class SGLangEngine:
    """The prefills on an hsdump-enabled SGLang server: one batched prefill-only ``/generate``."""

    def __init__(self, url: str, timeout: float = 300.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self._local = threading.local()

    def __call__(self, input_ids: list[list[int]], rids: list[str],
                 extra_key: list[str] | None) -> list[dict[str, Any]]:
        body: dict[str, Any] = {"input_ids": input_ids, "rid": rids,
                                "sampling_params": {"max_new_tokens": 0, "temperature": 0}}
        if extra_key is not None:
            body["extra_key"] = extra_key
        if not hasattr(self._local, "session"):
            self._local.session = requests.Session()
        r = self._local.session.post(f"{self.url}/generate", json=body, timeout=self.timeout)
        if r.status_code != 200:
            raise RuntimeError(f"the server {self.url} answered HTTP {r.status_code}: "
                               f"{r.text[:500]}")
        rows = r.json()
        return rows if isinstance(rows, list) else [rows]


# Headers of one hop (RFC 9110 7.6.1) and the ones the HTTP clients set themselves: not
# forwarded either way.
HOP_HEADERS = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                         "te", "trailer", "transfer-encoding", "upgrade", "host",
                         "content-length"})
FORWARD_CHUNK = 64 << 10


def make_server(bridge: Bridge, host: str, port: int, upstream: str,
                timeout: float = 300.0) -> ThreadingHTTPServer:
    """An HTTP server answering SpecForge's ``spec_capture`` ``/generate`` with ``bridge`` (one
    thread per request); every other request (any path, a plain ``/generate``, streamed or
    not) is forwarded to the SGLang server at ``upstream`` unchanged, and its answer (status,
    headers, body bytes, as they arrive) goes back unchanged."""
    upstream = upstream.rstrip("/")
    sessions = threading.local()

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, code: int, payload: Any) -> None:
            raw = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def _body(self) -> bytes | None:
            length = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(length) if length else None

        def _forward(self, body: bytes | None = None) -> None:
            if not hasattr(sessions, "session"):
                sessions.session = requests.Session()
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS}
            try:
                r = sessions.session.request(self.command, upstream + self.path, data=body,
                                             headers=headers, stream=True, timeout=timeout,
                                             allow_redirects=False)
            except requests.RequestException as e:
                return self._answer(502, {"error": f"the SGLang server {upstream} did not "
                                                   f"answer {self.command} {self.path}: {e}"})
            with r:
                self.send_response_only(r.status_code, r.reason)
                for k, v in r.raw.headers.items():
                    if k.lower() not in HOP_HEADERS - {"content-length"}:
                        self.send_header(k, v)
                self.end_headers()
                if self.command == "HEAD":
                    return None
                # HTTP/1.0: the body ends with the connection when it has no Content-Length
                # (a streamed /generate); bytes go on as they arrive, still encoded.
                for chunk in r.raw.stream(FORWARD_CHUNK, decode_content=False):
                    self.wfile.write(chunk)
                    self.wfile.flush()
            return None

        def do_POST(self) -> None:
            raw = self._body()
            body = None
            if self.path == "/generate" and raw:
                with contextlib.suppress(ValueError):
                    body = json.loads(raw)
            if not isinstance(body, dict) or "spec_capture" not in body:
                return self._forward(raw)
            try:
                return self._answer(200, bridge.generate(body))
            except BridgeRequestError as e:
                return self._answer(400, {"error": str(e)})
            except Exception as e:  # the whole batch fails; SpecForge retries its lease
                return self._answer(502, {"error": f"{type(e).__name__}: {e}"})

        def do_GET(self) -> None:
            self._forward()

        def do_HEAD(self) -> None:
            self._forward()

        def do_PUT(self) -> None:
            self._forward(self._body())

        def do_DELETE(self) -> None:
            self._forward(self._body())

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return ThreadingHTTPServer((host, port), Handler)


DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 30100
MOONCAKE_MASTER_PORT, MOONCAKE_METRICS_PORT, MOONCAKE_METADATA_PORT = 50051, 9003, 8080
DEFAULT_SEGMENT = "32GiB"  # SpecForge's managed Mooncake default (MOONCAKE_GLOBAL_SEGMENT_SIZE)
DEFAULT_LOCAL_BUFFER = "64MiB"
DEFAULT_WORKERS = 4
DEFAULT_MAX_INFLIGHT = "4GiB"
DEFAULT_REQUEST_TIMEOUT = 300.0  # SpecForge's producer waits as long (timeout_s)
DEFAULT_PROGRESS_INTERVAL = 60.0


def mooncake_commands(master_port: int = MOONCAKE_MASTER_PORT,
                      metadata_port: int = MOONCAKE_METADATA_PORT, *,
                      metrics_port: int = MOONCAKE_METRICS_PORT, host: str = DEFAULT_HOST,
                      master: str = "mooncake_master",
                      python: str = "python") -> tuple[list[str], list[str]]:
    """The commands of a Mooncake master and HTTP metadata server (mooncake-transfer-engine's
    own programs) listening on ``host`` only: this host by default (both bind 0.0.0.0, every
    address, unless told); this host's address or 0.0.0.0 opens them to other hosts."""
    return ([master, f"-rpc_address={host}", f"-rpc_port={master_port}",
             f"-metrics_host={host}", f"-metrics_port={metrics_port}"],
            [python, "-m", "mooncake.http_metadata_server", "--host", host, "--port",
             str(metadata_port)])


def _port(address: str, default: int) -> int:
    """The port of ``host:port`` or of a URL; ``default`` where it names none."""
    try:
        port = urllib.parse.urlsplit(address if "//" in address else f"//{address}").port
    except ValueError:
        port = None
    return port or default


def mooncake_hint(master: str, metadata: str) -> str:
    """How to start the Mooncake that ``--mooncake-master`` / ``--mooncake-metadata`` name, on
    this host (its ports), and how to open it to other hosts."""
    cmds = mooncake_commands(_port(master, MOONCAKE_MASTER_PORT),
                             _port(metadata, MOONCAKE_METADATA_PORT))
    return (f"is Mooncake running? On this host: `{' '.join(cmds[0])}` and "
            f"`{' '.join(cmds[1])}`; they listen on {DEFAULT_HOST} only: for bridges or "
            "trainers on other hosts, give -rpc_address, -metrics_host and --host this host's "
            "address (or 0.0.0.0, every address)")


def add_parser(subparsers: Any) -> None:
    """Register ``hsdump bridge``."""
    p = subparsers.add_parser(
        "bridge", help="serve SpecForge's online capture (/generate with spec_capture) from an "
                       "hsdump server into Mooncake",
        description="Answer SpecForge's disaggregated producers (server_urls) in front of an "
                    "hsdump-enabled SGLang server: each task's prefill is captured, its "
                    "features put into Mooncake under SpecForge's keys (docs/online.md).")
    p.add_argument("--server", default=DEFAULT_SERVER,
                   help=f"the hsdump-enabled SGLang server's URL (default {DEFAULT_SERVER})")
    p.add_argument("--dump-dir", type=Path,
                   default=Path(os.environ.get(protocol.ENV_DIR)
                                or protocol.DEFAULT_DUMP_DIR),
                   help=f"the server's dump dir, visible on this machine (default "
                        f"${protocol.ENV_DIR} or {protocol.DEFAULT_DUMP_DIR})")
    p.add_argument("--host", default=DEFAULT_HOST,
                   help=f"address the bridge listens on (default {DEFAULT_HOST}; use 0.0.0.0 "
                        "for producers on other hosts)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help=f"port the bridge listens on, 0 for any free one (default {DEFAULT_PORT})")
    p.add_argument("--mooncake-master", required=True,
                   help="Mooncake master, host:port (required)")
    p.add_argument("--mooncake-metadata", required=True,
                   help="Mooncake metadata server URL, e.g. http://host:8080/metadata (required)")
    p.add_argument("--local-hostname", default=DEFAULT_HOST,
                   help="address the trainers reach this bridge's Mooncake segment at (default "
                        f"{DEFAULT_HOST}: trainers on this host only)")
    p.add_argument("--segment-size", default=DEFAULT_SEGMENT,
                   help="the bridge's Mooncake segment: holds every published sample until the "
                        f"trainer frees it (docs/online.md, sizing) (default {DEFAULT_SEGMENT})")
    p.add_argument("--local-buffer-size", default=DEFAULT_LOCAL_BUFFER,
                   help=f"Mooncake client transfer buffer (default {DEFAULT_LOCAL_BUFFER})")
    p.add_argument("--protocol", dest="mc_protocol", choices=("tcp", "rdma"), default="tcp",
                   help="Mooncake transport (default tcp)")
    p.add_argument("--rdma-devices", default="",
                   help="RDMA devices for --protocol rdma, comma-separated (default: none)")
    p.add_argument("--workers", type=int, default=DEFAULT_WORKERS,
                   help="samples read and published at once; caps host memory for features in "
                        f"flight at workers x (longest sample + one chunk) (default "
                        f"{DEFAULT_WORKERS})")
    p.add_argument("--max-inflight-bytes", default=DEFAULT_MAX_INFLIGHT,
                   help=f"buffers kept for reuse (default {DEFAULT_MAX_INFLIGHT})")
    p.add_argument("--request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT,
                   help="seconds to wait for the server's /generate answer (default "
                        f"{DEFAULT_REQUEST_TIMEOUT:g})")
    p.add_argument("--dump-timeout", type=float, default=DEFAULT_DUMP_TIMEOUT,
                   help="seconds to wait for a request's done/error marker (default "
                        f"{DEFAULT_DUMP_TIMEOUT:g})")
    p.add_argument("--progress-interval", type=float, default=DEFAULT_PROGRESS_INTERVAL,
                   help="seconds between progress lines on stderr, 0 for none (default "
                        f"{DEFAULT_PROGRESS_INTERVAL:g})")
    p.set_defaults(func=main)


def _fail(message: str) -> int:
    print(f"hsdump bridge: {message}", file=sys.stderr)
    return 2


def main(args: argparse.Namespace) -> int:
    """``hsdump bridge``: serve until SIGINT / SIGTERM, then print a summary."""
    try:
        segment = protocol.parse_size(str(args.segment_size), "--segment-size")
        local_buffer = protocol.parse_size(str(args.local_buffer_size), "--local-buffer-size")
        inflight = protocol.parse_size(str(args.max_inflight_bytes), "--max-inflight-bytes")
    except (ValueError, protocol.ProtocolError) as e:
        return _fail(str(e))
    if args.workers < 1:
        return _fail(f"--workers must be >= 1, got {args.workers}")
    # The bridge's tensor work is copies of one sample's chunks, run side by side by --workers
    # threads. Torch's intra-op pool would make each copy a parallel region whose helper
    # threads spin after it, taking cores from the server beside the bridge: 4x the bridge's
    # CPU per GB on a 2-core host (docs/PERFORMANCE.md, online).
    torch.set_num_threads(1)
    server_url = args.server.rstrip("/")
    try:
        requests.get(f"{server_url}/health", timeout=10).raise_for_status()
    except requests.RequestException as e:
        return _fail(f"the SGLang server at {server_url} does not answer /health ({e}); start "
                     "it (hsdump serve) or pass --server")
    try:
        info = protocol.read_server_info(args.dump_dir)
    except (OSError, ValueError, protocol.ProtocolError) as e:
        return _fail(f"no usable server.json in --dump-dir {args.dump_dir} ({e}); is it the "
                     "dump dir of the server at --server?")
    try:
        sink = MooncakeSink.connect(master=args.mooncake_master, metadata=args.mooncake_metadata,
                                    local_hostname=args.local_hostname,
                                    global_segment_size=segment, local_buffer_size=local_buffer,
                                    protocol_name=args.mc_protocol,
                                    rdma_devices=args.rdma_devices, staging_bytes=inflight)
    except ImportError as e:
        return _fail(f"cannot import Mooncake ({e}): install mooncake-transfer-engine (or its "
                     "non-CUDA build, mooncake-transfer-engine-non-cuda)")
    except RuntimeError as e:
        return _fail(f"{e}: {mooncake_hint(args.mooncake_master, args.mooncake_metadata)}")
    try:
        bridge = Bridge(args.dump_dir, sink, SGLangEngine(server_url, args.request_timeout),
                        marker_timeout=args.dump_timeout, workers=args.workers,
                        max_inflight_bytes=inflight)
        http = make_server(bridge, args.host, args.port, server_url,
                           args.request_timeout)
    except (BridgeRequestError, protocol.ProtocolError, OSError) as e:
        sink.store.close()
        return _fail(str(e))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    thread = threading.Thread(target=http.serve_forever, daemon=True)
    thread.start()
    if bridge.left_by_dead:
        print(f"hsdump bridge: {bridge.left_by_dead} request dir(s) of a dead bridge still "
              f"changed after {SWEEP_WAIT_S:g}s: left for the next start", file=sys.stderr)
    host, port = http.server_address[:2]
    print(f"hsdump bridge: serving on http://{host}:{port} for {server_url} ({info.model}, "
          f"aux_layer_ids {list(bridge.layer_ids)}, hidden {info.hidden_size}, {info.dtype}); "
          f"Mooncake {args.mooncake_master}, segment {segment / 2**30:.2f} GiB", flush=True)
    interval = args.progress_interval if args.progress_interval > 0 else None
    while not stop.wait(interval):
        print(f"hsdump bridge: {bridge.stats.line()}", file=sys.stderr, flush=True)
    http.shutdown()
    thread.join()
    http.server_close()
    bridge.close()
    sink.store.close()
    print(f"hsdump bridge: stopped: {bridge.stats.line()}", flush=True)
    return 0
