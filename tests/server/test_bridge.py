"""The bridge prototype against a real Mooncake (master + HTTP metadata server on localhost, TCP)
and SpecForge 0.2.0's own producer adapter and feature store.

No SGLang server: the dumps come from the project's own DumpWriter on CPU (as test_writer.py),
written for the rids the bridge sends, chunked; SpecForge's ``produce_refs`` reaches the bridge
through its own ``post_fn`` seam, and every ref is read back with SpecForge's
``MooncakeFeatureStore.get``. Mooncake is ``mooncake-transfer-engine-non-cuda``
(requirements-test.txt; its libraries need libibverbs1 and libnuma1, scripts/prereqs.txt).
"""

from __future__ import annotations

import contextlib
import importlib.util
import ipaddress
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch

from hsdump_patch import protocol
from hsdump_patch.capture.writer import DumpWriter
from hsdump_patch.client.bridge import (
    Bridge,
    CaptureFailed,
    MooncakeSink,
    SGLangEngine,
    TaskCapture,
    make_server,
    server_layers_for,
    spans,
)
from tests.harness.needs import require, specforge_on_path
from tests.harness.online import image_with_rdma_libs, local_mooncake, sf_adapter, sf_capture

HIDDEN = 16
SPECFORGE_LAYERS = (1, 3, 5)  # SpecForge's aux_hidden_state_layer_ids
CHUNK = 7  # prefill chunk of the stand-in engine: every prompt below spans several


@pytest.fixture(scope="module")
def mooncake(tmp_path_factory) -> Iterator[dict[str, str]]:
    """A Mooncake master and HTTP metadata server on localhost; their endpoints."""
    specforge_on_path()
    require(importlib.util.find_spec("mooncake") is not None,
            "mooncake-transfer-engine-non-cuda importable (requirements-test.txt)")
    with local_mooncake(tmp_path_factory.mktemp("mooncake")) as endpoints:
        yield endpoints


@pytest.fixture(scope="module")
def sink(mooncake) -> Iterator[MooncakeSink]:
    """The bridge's Mooncake client: its 64 MiB segment holds what it publishes."""
    s = MooncakeSink.connect(master=mooncake["master"], metadata=mooncake["metadata"],
                             local_hostname="127.0.0.1", global_segment_size=64 << 20,
                             local_buffer_size=16 << 20)
    yield s
    s.store.close()


@pytest.fixture(scope="module")
def store(mooncake, sink):
    """SpecForge's own store, a client without a segment (as its online launcher sets it)."""
    from specforge.runtime.data_plane.mooncake_store import MooncakeFeatureStore

    return MooncakeFeatureStore(store_id=f"t{uuid.uuid4().hex[:6]}", setup_kwargs={
        "local_hostname": "127.0.0.1", "metadata_server": mooncake["metadata"],
        "master_server_addr": mooncake["master"], "global_segment_size": 0,
        "local_buffer_size": 16 << 20})


class DumpEngine:
    """Writes each prompt's dump with the project's DumpWriter, in chunks of ``CHUNK`` tokens:
    hidden states drawn from ``seed`` and the token ids (what the capture would write)."""

    def __init__(self, dump_dir: Path, info: protocol.ServerInfo) -> None:
        self.dump_dir, self.info, self.seed = dump_dir, info, 0
        self.fail: set[int] = set()  # prompt indexes whose dump fails
        self.cached = 0  # the cached_tokens the rows report
        self.partial = False  # write each prompt's first chunk only: prefills under way
        self.written: dict[tuple[int, ...], torch.Tensor] = {}  # prompt -> [L, S, H]
        self.writer = DumpWriter(dump_dir, max_inflight_bytes=1 << 20, min_free_bytes=0,
                                 threads=2, device=torch.device("cpu"))

    def __call__(self, input_ids: list[list[int]], rids: list[str],
                 extra_key: list[str] | None) -> list[dict[str, Any]]:
        assert extra_key is not None and len(extra_key) == len(rids)
        slots = len(self.info.layers) + 1
        for i, (ids, rid) in enumerate(zip(input_ids, rids, strict=True)):
            g = torch.Generator().manual_seed(self.seed * 1000 + i)
            hs = torch.randn(len(ids), slots, HIDDEN, generator=g).to(torch.bfloat16)
            self.written[tuple(ids)] = hs
            if i in self.fail:
                self.writer.fail_request(rid, "stand-in failure", len(ids))
                continue
            for a in range(0, CHUNK if self.partial else len(ids), CHUNK):
                b = min(a + CHUNK, len(ids))
                meta = protocol.ChunkMeta(rid=rid, prefix_len=a, layers=self.info.layers,
                                          has_final=True, model="tiny", tp_size=1,
                                          sglang_version="0.5.23", hsdump_version="test")
                self.writer.submit(meta, [(protocol.HIDDEN_KEY, hs[a:b]),
                                          (protocol.INPUT_IDS_KEY, torch.tensor(ids[a:b])),
                                          (protocol.POSITIONS_KEY, torch.arange(a, b))],
                                   prompt_len=len(ids) if b == len(ids) and not self.partial
                                   else None)
        assert self.writer.flush(timeout=30)
        return [{"text": "", "meta_info": {"id": rid, "prompt_tokens": len(ids),
                                           "cached_tokens": self.cached}}
                for ids, rid in zip(input_ids, rids, strict=True)]


@pytest.fixture
def dump_dir(tmp_path: Path) -> Path:
    d = tmp_path / "dump"
    protocol.make_private_dir(d)
    # Layers listed unsorted: the bridge concatenates them in ascending order, as SGLang does.
    layers = tuple(server_layers_for(SPECFORGE_LAYERS))[::-1]
    info = protocol.ServerInfo(model="tiny", architecture="LlamaForCausalLM", layers=layers,
                               layers_source="test", has_final=True, hidden_size=HIDDEN,
                               num_hidden_layers=8, dtype="bfloat16", tp_size=1,
                               rid_prefix="hsdump-", sglang_version="0.5.23",
                               hsdump_version="test", pid=os.getpid())
    protocol.write_json_atomic(d / protocol.SERVER_INFO, info.to_json())
    return d


@pytest.fixture
def engine(dump_dir: Path) -> Iterator[DumpEngine]:
    e = DumpEngine(dump_dir, protocol.read_server_info(dump_dir))
    yield e
    e.writer.close()


def _capture(layers: tuple[int, ...] = SPECFORGE_LAYERS):
    return sf_capture(layers, HIDDEN)


def sf_tasks(lengths: list[int], attempt: int = 0, first: int = 0):
    from specforge.runtime.contracts import PromptTask

    tasks = []
    for n, length in enumerate(lengths, start=first):
        ids = [(n * 131 + 7 * j) % 1000 for j in range(length)]
        mask = [int(j >= length // 3) for j in range(length)]
        tasks.append(PromptTask(task_id=f"task{n}", run_id="run", source_id=f"s{n}",
                                payload={"input_ids": ids, "loss_mask": mask},
                                max_length=4096, attempt=attempt))
    return tasks


def _expected(engine: DumpEngine, task) -> dict[str, torch.Tensor]:
    ids = task.payload["input_ids"]
    hs = engine.written[tuple(ids)]
    order = sorted(range(len(SPECFORGE_LAYERS)), key=lambda s: engine.info.layers[s])
    return {"hidden_state": hs[:, order].reshape(1, len(ids), -1),
            "target": hs[:, -1].unsqueeze(0),
            "input_ids": torch.tensor([ids]),
            "loss_mask": torch.tensor([task.payload["loss_mask"]]),
            "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}


def _assert_readable(store, engine: DumpEngine, task, ref) -> None:
    got, handle = store.get(ref)
    want = _expected(engine, task)
    assert set(got) == set(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), (task.task_id, name)
    store.release(handle)


def _bridge_dirs(dump_dir: Path) -> list[str]:
    """The bridge's request directories left in a dump dir (other clients' are not)."""
    return [p.name for p in dump_dir.iterdir() if p.is_dir() and "bridge-" in p.name]


def assert_removed(bridge: Bridge) -> None:
    """None of the bridge's dump directories is left once its pending removals are done (they
    run behind the answers; a bounded wait)."""
    assert bridge.remover.wait_idle(60), f"{bridge.remover.pending} removals pending after 60 s"
    assert _bridge_dirs(bridge.dump_dir) == []


def _listening(port: int) -> set[str]:
    """The addresses this host's TCP ``port`` listens on (/proc/net/tcp and tcp6)."""
    found = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/net/{table}") as f:
            for line in list(f)[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, at = local.split(":")
                if state == "0A" and int(at, 16) == port:  # 0A: LISTEN
                    raw = b"".join(bytes.fromhex(addr[i:i + 8])[::-1]
                                   for i in range(0, len(addr), 8))
                    found.add(str(ipaddress.ip_address(raw)))
    return found


def test_the_suites_mooncake_listens_on_this_host_only(mooncake) -> None:
    """The local Mooncake (mooncake_commands, the commands ``hsdump bridge`` prints) binds its
    master's RPC port and its metadata server to 127.0.0.1, not to every address."""
    master = int(mooncake["master"].rsplit(":", 1)[1])
    metadata = urllib.parse.urlsplit(mooncake["metadata"]).port
    assert metadata is not None
    assert (_listening(master), _listening(metadata)) == ({"127.0.0.1"}, {"127.0.0.1"})


def test_a_batch_of_chunked_prompts_reads_back_through_specforges_store(
        store, sink, dump_dir: Path, engine: DumpEngine) -> None:
    """Several tasks in one request, each dump in several chunks: every ref SpecForge builds
    reads back, with its own get, exactly what was dumped (aux layers in ascending order,
    the final state, the passthroughs); the dump dir is empty afterwards."""
    bridge = Bridge(dump_dir, sink, engine)
    tasks = sf_tasks([5, 23, 40])
    refs = sf_adapter(store, bridge).produce_refs(tasks, capture=_capture())
    for task, ref in zip(tasks, refs, strict=True):
        assert ref.metadata["generation"] == 1, ref
        assert ref.feature_specs["hidden_state"].shape == (1, len(task.payload["input_ids"]),
                                                           3 * HIDDEN)
        _assert_readable(store, engine, task, ref)
    assert_removed(bridge)


def test_a_retry_after_a_lost_response_leaves_only_the_retrys_values(
        store, sink, dump_dir: Path, engine: DumpEngine) -> None:
    """The first attempt writes its keys but its response is lost; the retry (SpecForge's
    ``replace``) supersedes them: the one readable generation holds the retry's values.
    (Mooncake's put_from keeps an existing key's old bytes; without the upsert this fails.)"""
    bridge = Bridge(dump_dir, sink, engine)
    with pytest.raises(ConnectionError):
        sf_adapter(store, bridge, lose_response=True).produce_refs(sf_tasks([30], first=10),
                                                                 capture=_capture())
    first = engine.written.copy()
    engine.seed = 1  # the retry's prefill gives other values: which attempt is read shows
    tasks = sf_tasks([30], attempt=1, first=10)
    (ref,) = sf_adapter(store, bridge).produce_refs(tasks, capture=_capture())
    assert not torch.equal(first[tuple(tasks[0].payload["input_ids"])],
                           engine.written[tuple(tasks[0].payload["input_ids"])])
    _assert_readable(store, engine, tasks[0], ref)
    assert_removed(bridge)


def test_a_failed_dump_answers_specforges_failure_and_its_neighbours_succeed(
        store, sink, dump_dir: Path, engine: DumpEngine) -> None:
    """A dump that fails gives that task SpecForge's retryable per-task failure naming the
    reason, with no key written; the other tasks of the request are readable."""
    from specforge.inference.adapters.server_capture import ServerCaptureFailure

    bridge = Bridge(dump_dir, sink, engine)
    engine.fail = {1}
    tasks = sf_tasks([12, 12, 12], first=20)
    refs = sf_adapter(store, bridge).produce_refs(tasks, capture=_capture())
    assert isinstance(refs[1], ServerCaptureFailure) and refs[1].retryable
    assert "stand-in failure" in refs[1].reason
    assert sink.store.is_exist(f"{store.store_id}/run:task21/g1/target") == 0
    for i in (0, 2):
        _assert_readable(store, engine, tasks[i], refs[i])
    assert_removed(bridge)


def test_layers_other_than_the_trainers_are_refused_naming_both(
        store, sink, dump_dir: Path, engine: DumpEngine) -> None:
    """A trainer asking for other aux layers gets a non-retryable failure naming both lists
    (SpecForge's verify_capture_specs on the ids the bridge reports), and nothing stays."""
    from specforge.inference.adapters.server_capture import ServerCaptureFailure

    bridge = Bridge(dump_dir, sink, engine)
    (fail,) = sf_adapter(store, bridge).produce_refs(sf_tasks([9], first=30),
                                                   capture=_capture((2, 3, 5)))
    assert isinstance(fail, ServerCaptureFailure) and not fail.retryable
    assert "(1, 3, 5) != requested (2, 3, 5)" in fail.reason, fail.reason
    assert_removed(bridge)


def test_concurrent_requests_each_read_back_their_own_features(
        store, sink, dump_dir: Path, engine: DumpEngine) -> None:
    """Four producer threads posting at once through one bridge (one Mooncake client): every
    ref reads back its own prompt's features."""
    bridge = Bridge(dump_dir, sink, engine)
    batches = [sf_tasks([11 + 3 * b, 20, 33 - b], first=100 + 10 * b) for b in range(4)]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(
            lambda tasks: sf_adapter(store, bridge).produce_refs(tasks, capture=_capture()),
            batches))
    for tasks, refs in zip(batches, results, strict=True):
        for task, ref in zip(tasks, refs, strict=True):
            _assert_readable(store, engine, task, ref)
    assert_removed(bridge)


def test_a_first_attempt_never_overwrites_existing_keys(
        store, sink, dump_dir: Path, engine: DumpEngine) -> None:
    """A request that does not replace, for a sample whose keys exist (a second writer), fails
    that task naming the keys and leaves the existing values readable."""
    from specforge.inference.adapters.server_capture import ServerCaptureFailure

    bridge = Bridge(dump_dir, sink, engine)
    tasks = sf_tasks([14], first=40)
    (ref,) = sf_adapter(store, bridge).produce_refs(tasks, capture=_capture())
    kept = engine.written.copy()
    engine.seed = 2
    (fail,) = sf_adapter(store, bridge).produce_refs(tasks, capture=_capture())
    assert isinstance(fail, ServerCaptureFailure) and "exist" in fail.reason, fail
    engine.written = kept
    _assert_readable(store, engine, tasks[0], ref)
    assert_removed(bridge)


def test_over_http_with_specforges_own_client(store, sink, dump_dir: Path,
                                              engine: DumpEngine) -> None:
    """The bridge's HTTP server and SpecForge's own HTTP post: the JSON on the wire builds the
    same readable refs; a bad spec_capture body is refused naming why; any other request goes
    to the SGLang server, and a server that does not answer is a 502 naming it."""
    import requests

    from hsdump_patch.ops.launch import free_port

    upstream = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    bridge = Bridge(dump_dir, sink, engine)
    server = make_server(bridge, "127.0.0.1", 0, upstream)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        tasks = sf_tasks([8, 27], first=50)
        refs = sf_adapter(store, None, url=url).produce_refs(tasks, capture=_capture())
        for task, ref in zip(tasks, refs, strict=True):
            _assert_readable(store, engine, task, ref)
        r = requests.post(f"{url}/generate", json={"input_ids": [1, 2]}, timeout=30)
        assert r.status_code == 502 and upstream in r.json()["error"], r.text
        r = requests.get(f"{url}/health", timeout=30)
        assert r.status_code == 502 and "GET /health: " in r.json()["error"], r.text
        r = requests.post(f"{url}/generate", json={"input_ids": [[1, 2]], "spec_capture": [
            {"store_id": "s", "sample_id": "x", "gen": 1, "features": {"logits": "t"}}]},
            timeout=30)
        assert r.status_code == 400 and "['logits']" in r.json()["error"], r.text
    finally:
        server.shutdown()
        thread.join()
    assert_removed(bridge)


def _stalling_server(engine: DumpEngine, posted: queue.Queue, release: threading.Event
                     ) -> ThreadingHTTPServer:
    """A stand-in SGLang server whose prefills never end: ``/health`` answers; a ``/generate``
    writes each prompt's first chunk (``engine.partial``), puts its rids on ``posted`` and
    holds the connection, unanswered, until ``release``."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            engine(body["input_ids"], body["rid"], body.get("extra_key"))
            posted.put(body["rid"])
            release.wait(120)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    engine.partial = True
    return ThreadingHTTPServer(("127.0.0.1", 0), Handler)


def _spec_body(lengths: list[int], first: int) -> dict[str, Any]:
    """A SpecForge producer's ``spec_capture`` /generate body for prompts of ``lengths``."""
    return {"input_ids": [[(7 * j + n) % 1000 for j in range(length)] for n, length in
                          enumerate(lengths, start=first)],
            "extra_key": [uuid.uuid4().hex for _ in lengths],
            "sampling_params": {"max_new_tokens": 0},
            "spec_capture": [{"store_id": "s", "sample_id": f"run:task{n}", "gen": 1,
                              "features": {"aux": "hidden_state", "last_hidden": "target"}}
                             for n in range(first, first + len(lengths))]}


def _unanswered(call: Callable[[], Any]) -> threading.Thread:
    """Run ``call`` on a thread of its own, ended by the connection error of a bridge or
    server that dies or never answers."""
    import requests

    def run() -> None:
        with contextlib.suppress(requests.ConnectionError):
            call()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _start_bridge(server: str, dump_dir: Path, mooncake: dict[str, str],
                  err: Path) -> tuple[subprocess.Popen, str]:
    """``hsdump bridge`` as a subprocess (stderr to ``err``); it and its URL, once it serves."""
    repo = Path(__file__).resolve().parents[2]
    with open(err, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hsdump_patch.cli", "bridge", "--server", server,
             "--dump-dir", str(dump_dir), "--port", "0", "--mooncake-master",
             mooncake["master"], "--mooncake-metadata", mooncake["metadata"],
             "--segment-size", "32MiB", "--local-buffer-size", "8MiB",
             "--progress-interval", "0"],
            cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)}, stdout=subprocess.PIPE,
            stderr=f, text=True)
    first = proc.stdout.readline()
    assert "serving on http://127.0.0.1:" in first, (first, err.read_text()[-2000:])
    return proc, first.split("serving on ")[1].split()[0]


def test_a_bridge_restarted_after_a_sigkill_mid_batch_removes_what_it_left(
        sink, dump_dir: Path, engine: DumpEngine, tmp_path: Path) -> None:
    """``hsdump bridge`` killed (SIGKILL) with a batch of three tasks in flight leaves their
    partial dump directories; the restarted bridge removes them before it serves. A live
    bridge's in-flight directory (another process's, on the same dump dir) and another
    client's stay. The killed bridge's Mooncake segment stays registered with its master
    until the master drops it, and puts placed there then fail: this test's bridges use a
    Mooncake of their own, not the module's."""
    import requests

    from hsdump_patch.client.extract import request_id

    posted: queue.Queue = queue.Queue()
    release = threading.Event()
    standin = _stalling_server(engine, posted, release)
    threading.Thread(target=standin.serve_forever, daemon=True).start()
    server = f"http://127.0.0.1:{standin.server_address[1]}"
    other = Bridge(dump_dir, sink, SGLangEngine(server))
    threads = [_unanswered(lambda: other.generate(_spec_body([20], 0)))]
    live = posted.get(timeout=60)
    engine([[1] * 20], [request_id("hsdump-", "run1", "x")], [""])  # an extractor's
    kept = {p.name for p in dump_dir.iterdir() if p.is_dir()}
    own = contextlib.ExitStack()
    mooncake = own.enter_context(local_mooncake(tmp_path))
    killed, url = _start_bridge(server, dump_dir, mooncake, tmp_path / "killed.err")
    restarted = None
    try:
        threads.append(_unanswered(lambda: requests.post(
            f"{url}/generate", json=_spec_body([20, 30, 40], 1), timeout=120)))
        stale = [protocol.rid_dirname(rid) for rid in posted.get(timeout=60)]
        killed.send_signal(signal.SIGKILL)
        killed.wait(30)
        assert len(stale) == 3 and all((dump_dir / n / protocol.chunk_filename(0)).exists()
                                       and not (dump_dir / n / protocol.DONE_MARKER).exists()
                                       for n in stale)
        restarted, _ = _start_bridge(server, dump_dir, mooncake, tmp_path / "restarted.err")
        assert {p.name for p in dump_dir.iterdir() if p.is_dir()} == kept
        assert len(live) == 1 and protocol.rid_dirname(live[0]) in kept
    finally:
        for proc in (killed, restarted):
            if proc is not None:
                proc.kill()
                proc.wait(30)
                proc.stdout.close()
        release.set()
        for t in threads:
            t.join(60)
        standin.shutdown()
        standin.server_close()
        other.close()
        own.close()


def test_a_put_mooncake_refuses_leaves_none_of_the_tasks_keys(sink) -> None:
    """One batched put, one key refused (larger than every segment): the keys it did write are
    removed, the task fails naming the refused key; a replace (upsert) fails the same way.
    Each distinct memory range is registered once (the passthroughs share one block)."""
    task = TaskCapture("full", "x", 1, False, {}, ())
    small = torch.arange(1024, dtype=torch.int64)
    big = torch.zeros(80 << 20, dtype=torch.uint8)  # the segments hold 64 MiB
    for t in (task, TaskCapture("full", "x", 1, True, {}, ())):
        with pytest.raises(CaptureFailed, match="full/x/g1/big"):
            sink.publish(t, {"small": small, "big": big})
        assert sink.store.batch_is_exist(["full/x/g1/small", "full/x/g1/big"]) == [0, 0]
    block, other = torch.arange(16), torch.arange(8)
    assert spans([block[8:], other, block[:8], block[2:4]]) == sorted(
        [(block.data_ptr(), 128), (other.data_ptr(), 64)])


class CountingStore:
    """A Mooncake store counting buffer registrations (everything else goes to the real one)."""

    def __init__(self, store) -> None:
        self.store, self.registered, self.unregistered = store, 0, 0

    def register_buffer(self, ptr: int, nbytes: int) -> int:
        self.registered += 1
        return self.store.register_buffer(ptr, nbytes)

    def unregister_buffer(self, ptr: int) -> int:
        self.unregistered += 1
        return self.store.unregister_buffer(ptr)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


def test_a_staging_buffer_is_registered_once_for_all_its_puts(sink) -> None:
    """Three tasks built in the same staging buffer: one registration, none per put, and each
    task's bytes read back; the buffer is unregistered when the sink lets go of it (a larger
    one replaces it)."""
    counting = CountingStore(sink.store)
    staged = MooncakeSink(counting, sink.config, staging_bytes=64 << 20)
    for i in range(3):
        with staged.staging(1 << 20) as buf:
            t = torch.frombuffer(buf, dtype=torch.int64, count=1 << 17)
            t.fill_(i)
            staged.publish(TaskCapture("stage", f"x{i}", 1, False, {}, ()), {"t": t})
        assert (counting.registered, counting.unregistered) == (1, 0)
        got = torch.frombuffer(bytearray(sink.store.get(f"stage/x{i}/g1/t")), dtype=torch.int64)
        assert torch.equal(got, torch.full((1 << 17,), i)), i
    with staged.staging(32 << 20):
        assert (counting.registered, counting.unregistered) == (2, 1)
    assert sink.remove([f"stage/x{i}/g1/t" for i in range(3)]) == []


def test_a_prompt_served_from_cache_fails_naming_the_radix_cache(
        store, sink, dump_dir: Path, engine: DumpEngine) -> None:
    """A row whose prompt tokens came from the radix cache (no hidden states for them) is
    refused before any key is written."""
    from specforge.inference.adapters.server_capture import ServerCaptureFailure

    engine.cached = 4
    bridge = Bridge(dump_dir, sink, engine)
    (fail,) = sf_adapter(store, bridge).produce_refs(
        sf_tasks([10], first=60), capture=_capture())
    assert isinstance(fail, ServerCaptureFailure) and "radix" in fail.reason, fail
    assert sink.store.is_exist(f"{store.store_id}/run:task60/g1/target") == 0
    assert_removed(bridge)


class CountingSink:
    """The real sink, counting how many tasks publish at once (each publish takes >= 50 ms)."""

    def __init__(self, sink: MooncakeSink) -> None:
        self.sink, self.active, self.peak = sink, 0, 0
        self.staging = sink.staging
        self.lock = threading.Lock()

    def publish(self, task, tensors) -> None:
        with self.lock:
            self.active += 1
            self.peak = max(self.peak, self.active)
        try:
            time.sleep(0.05)
            self.sink.publish(task, tensors)
        finally:
            with self.lock:
                self.active -= 1


def test_features_in_flight_are_capped_by_workers_whatever_the_requests(
        store, sink, dump_dir: Path, engine: DumpEngine) -> None:
    """Four concurrent requests against a bridge of two workers: never more than two tasks'
    features are held and published at once, and every ref still reads back."""
    counting = CountingSink(sink)
    bridge = Bridge(dump_dir, counting, engine, workers=2)
    batches = [sf_tasks([9, 17, 25], first=200 + 10 * b) for b in range(4)]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(
            lambda tasks: sf_adapter(store, bridge).produce_refs(tasks, capture=_capture()),
            batches))
    assert counting.peak == 2, counting.peak
    for tasks, refs in zip(batches, results, strict=True):
        for task, ref in zip(tasks, refs, strict=True):
            _assert_readable(store, engine, task, ref)
    assert_removed(bridge)


# --- Against a real CPU SGLang 0.5.23 server with the plugin (the suite's shared Llama server:
# bf16, auto layers + the final state, chunked prefill of conftest.CHUNK tokens, radix cache off).

# ||Mooncake value - HF fp32|| / ||HF fp32|| per layer: the server computes in bf16 (the
# tolerance test_client_extract.py uses for its bf16 records).
REL_TOL = 2e-2


@pytest.fixture(scope="module")
def live(llama_server, sink) -> Iterator[tuple[str, Bridge]]:
    """The bridge's HTTP service in front of the shared Llama server; its URL and bridge."""
    bridge = Bridge(llama_server.dump_dir, sink, SGLangEngine(llama_server.url))
    server = make_server(bridge, "127.0.0.1", 0, llama_server.url)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", bridge
    server.shutdown()
    thread.join()
    bridge.close()


def assert_equals_hf_fp32(store, model: Path, info: protocol.ServerInfo, tasks, refs) -> float:
    """Every ref's features, read with SpecForge's own get, equal an HF float32 forward of its
    tokens (aux: the layers in ascending order; target: the post-norm state); the worst error."""
    from tests.harness.reference import hf_hidden_states

    worst = 0.0
    for task, ref in zip(tasks, refs, strict=True):
        ids = task.payload["input_ids"]
        got, handle = store.get(ref)
        hf = hf_hidden_states(model, ids, torch.float32)
        aux = got["hidden_state"]
        assert aux.dtype == torch.bfloat16, aux.dtype
        assert aux.shape == (1, len(ids), len(info.layers) * info.hidden_size)
        pairs = [*zip(aux[0].split(info.hidden_size, dim=-1), sorted(info.layers),
                      strict=True), (got["target"][0], len(hf) - 1)]
        for value, slot in pairs:
            want = hf[slot].float()
            worst = max(worst, ((value.float() - want).norm() / want.norm()).item())
        assert got["input_ids"].tolist() == [ids]
        assert got["loss_mask"].tolist() == [task.payload["loss_mask"]]
        assert got["attention_mask"].tolist() == [[1] * len(ids)]
        store.release(handle)
    assert worst < REL_TOL, worst
    return worst


@pytest.mark.server
def test_real_server_two_producers_batches_and_chunked_prefill_equal_hf_fp32(
        store, live, llama_server) -> None:
    """Two producers at once, each SpecForge's own produce_refs over HTTP with a batch of
    three tasks, one longer than three prefill chunks: every ref SpecForge builds reads back,
    with its own get, what an HF float32 forward gives; the layer ids SpecForge checks are the
    server's; the bridge's dump directories are gone."""
    from tests.harness.dump_server import CHUNK

    url, bridge = live
    info = bridge.info
    layers = tuple(sorted(info.layers))
    capture = sf_capture(layers=tuple(lay - 1 for lay in layers), hidden=info.hidden_size)
    batches = [sf_tasks([9, 3 * CHUNK + 5, 40], first=300),
               sf_tasks([17, 2 * CHUNK + 1, 5], first=310)]
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(
            lambda tasks: sf_adapter(store, None, url=url).produce_refs(tasks, capture=capture),
            batches))
    worst = 0.0
    for tasks, refs in zip(batches, results, strict=True):
        assert all(r.metadata["generation"] == 1 for r in refs), refs
        worst = max(worst, assert_equals_hf_fp32(store, llama_server.model, info, tasks, refs))
    print(f"worst relative error vs HF fp32: {worst:.2e}")
    assert_removed(bridge)


@pytest.mark.server
def test_real_server_refusing_the_batch_fails_it_whole_and_leaves_nothing(
        store, live, llama_server) -> None:
    """A batch the server refuses (a prompt beyond the model's context) is a transport-level
    error for SpecForge (it fails the lease batch, retryable) naming the server's reason; no
    key of the batch is readable and no dump directory stays. The same bridge then serves."""
    import requests

    url, bridge = live
    info = bridge.info
    capture = sf_capture(layers=tuple(lay - 1 for lay in sorted(info.layers)),
                       hidden=info.hidden_size)
    tasks = sf_tasks([12, 4100], first=320)  # the tiny Llama's context: 4096
    answers = []

    def post(url: str, json_body: dict[str, Any], timeout: float) -> Any:
        answers.append(requests.post(url, json=json_body, timeout=timeout))
        answers[-1].raise_for_status()

    adapter = sf_adapter(store, None, url=url)
    adapter.post_fn = post
    with pytest.raises(requests.HTTPError, match="502"):
        adapter.produce_refs(tasks, capture=capture)
    assert "context length" in answers[0].json()["error"], answers[0].text
    for task in tasks:
        assert sink_has(bridge, store, task) is False
    assert_removed(bridge)
    ok = sf_tasks([12], first=330)
    refs = sf_adapter(store, None, url=url).produce_refs(ok, capture=capture)
    assert_equals_hf_fp32(store, llama_server.model, info, ok, refs)


def sink_has(bridge: Bridge, store, task) -> bool:
    """Whether the bridge's store holds the task's target key."""
    return bridge.sink.store.is_exist(f"{store.store_id}/run:{task.task_id}/g1/target") == 1


# Values that differ between two calls of the same request (clocks, request ids, live load).
VOLATILE = {"created", "id", "e2e_latency", "internal_states", "response_sent_to_client_ts",
            "queue_time", "prefill_launch_delay", "prefill_launch_latency", "inference_time",
            "prefill_finished_ts", "decode_throughput", "request_received_ts",
            "forward_entry_time", "tokenizer_entry_time"}


def _stable(value: Any) -> Any:
    """``value`` without the VOLATILE keys, at any depth."""
    if isinstance(value, dict):
        return {k: _stable(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [_stable(v) for v in value]
    return value


@pytest.mark.server
def test_real_server_everything_else_passes_through_unchanged(live, llama_server) -> None:
    """What a producer or an operator calls besides a spec_capture /generate reaches the
    server unchanged: the same status and body as calling the server directly (minus clocks
    and request ids), for GETs, POSTs, a plain and a streamed /generate, a 404 and a 400;
    nothing is dumped for them."""
    import requests

    url, _ = live
    before = sorted(p.name for p in llama_server.dump_dir.iterdir())
    gen = {"input_ids": [3, 17, 29, 41, 5], "sampling_params": {"temperature": 0,
                                                                  "max_new_tokens": 6}}
    calls = [("GET", "/health", None), ("GET", "/health_generate", None),
             ("GET", "/get_model_info", None), ("GET", "/model_info", None),
             ("GET", "/server_info", None), ("GET", "/get_server_info", None),
             ("GET", "/v1/models", None), ("POST", "/flush_cache", None),
             ("POST", "/generate", gen), ("POST", "/generate", {**gen, "input_ids": [gen[
                 "input_ids"], [7, 8, 9]]}),
             ("GET", "/no_such_path", None), ("POST", "/generate", {"sampling_params": {}})]
    for method, path, body in calls:
        via = requests.request(method, url + path, json=body, timeout=120)
        direct = requests.request(method, llama_server.url + path, json=body, timeout=120)
        assert via.status_code == direct.status_code, (path, via.status_code, via.text[:300])
        assert via.headers.get("content-type") == direct.headers.get("content-type"), path
        try:
            got, want = via.json(), direct.json()
        except ValueError:
            assert via.content == direct.content, path
            continue
        assert _stable(got) == _stable(want), (path, got, want)
    assert requests.get(url + "/generate", timeout=30).status_code == 405  # the server's
    # A streamed /generate: server-sent events, forwarded as they come; the same text.
    lines = []
    with requests.post(url + "/generate", json={**gen, "stream": True}, stream=True,
                       timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith(
            "text/event-stream"), r.headers
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == b"data: [DONE]" and len(lines) > 2, lines
    streamed = json.loads(lines[-2].removeprefix(b"data: "))
    direct = requests.post(llama_server.url + "/generate", json=gen, timeout=120).json()
    assert streamed["output_ids"] == direct["output_ids"], (streamed, direct)
    assert sorted(p.name for p in llama_server.dump_dir.iterdir()) == before


@pytest.mark.server
def test_hsdump_bridge_command_serves_specforge_and_stops_with_a_summary(
        store, mooncake, llama_server, tmp_path) -> None:
    """``hsdump bridge`` as a subprocess in front of the real server: SpecForge's own
    produce_refs over HTTP gets refs that read back as HF float32 gives; SIGTERM stops it with
    exit 0 and a summary counting what it published."""
    info = protocol.read_server_info(llama_server.dump_dir)
    repo = Path(__file__).resolve().parents[2]
    with open(tmp_path / "bridge.err", "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hsdump_patch.cli", "bridge", "--server", llama_server.url,
             "--dump-dir", str(llama_server.dump_dir), "--port", "0",
             "--mooncake-master", mooncake["master"], "--mooncake-metadata",
             mooncake["metadata"], "--segment-size", "32MiB", "--local-buffer-size", "8MiB",
             "--progress-interval", "0"],
            cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)}, stdout=subprocess.PIPE,
            stderr=err, text=True)
    try:
        first = proc.stdout.readline()
        assert "serving on http://127.0.0.1:" in first, (first, (tmp_path / "bridge.err")
                                                          .read_text()[-2000:])
        url = first.split("serving on ")[1].split()[0]
        capture = sf_capture(layers=tuple(lay - 1 for lay in sorted(info.layers)),
                           hidden=info.hidden_size)
        tasks = sf_tasks([21, 50], first=400)
        refs = sf_adapter(store, None, url=url).produce_refs(tasks, capture=capture)
        assert_equals_hf_fp32(store, llama_server.model, info, tasks, refs)
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, (tmp_path / "bridge.err").read_text()[-2000:]
    assert "stopped: 1 requests, 2 samples published, 0 failed" in out, out
    assert _bridge_dirs(llama_server.dump_dir) == []


@pytest.mark.server
def test_hsdump_bridge_refuses_a_dead_server_or_a_foreign_dump_dir(
        llama_server, tmp_path, capsys) -> None:
    """Before connecting to Mooncake: a server that does not answer, or a dump dir without the
    server's server.json, ends the command with exit 2 and a message naming the flag."""
    from hsdump_patch.cli import main as cli

    common = ["--mooncake-master", "127.0.0.1:1", "--mooncake-metadata", "http://127.0.0.1:1/m"]
    assert cli(["bridge", "--server", "http://127.0.0.1:1", *common]) == 2
    assert "does not answer /health" in capsys.readouterr().err
    assert cli(["bridge", "--server", llama_server.url, "--dump-dir", str(tmp_path),
                *common]) == 2
    err = capsys.readouterr().err
    assert "--dump-dir" in err and "server.json" in err, err
    assert cli(["bridge", "--segment-size", "lots", *common]) == 2
    assert "--segment-size='lots' is not a size" in capsys.readouterr().err


# --- ``hsdump serve --bridge``: the server, then the bridge beside it (a server of its own).


def _serve_with_bridge(tiny_models: Path, tmp_path: Path, mooncake: dict[str, str],
                       *bridge_args: str) -> tuple[subprocess.Popen, Path, int, int]:
    """Start ``hsdump serve --bridge`` for the tiny Llama on CPU (output in ``serve.log``);
    the process, its log, the server's and the bridge's ports."""
    from hsdump_patch.ops.launch import CPU_ARGS, free_port
    from tests.harness.server import cpu_env

    repo = Path(__file__).resolve().parents[2]
    port, bport = free_port(), free_port()
    env = cpu_env()
    env["PYTHONPATH"] = os.pathsep.join([str(repo), env["PYTHONPATH"]])
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hsdump_patch.cli", "serve", "--model",
             str(tiny_models / "tiny-llama"), "--port", str(port), "--dump-dir",
             str(tmp_path / "dump"), "--profile", "none", "--bridge", "--bridge-port",
             str(bport), "--mooncake-master", mooncake["master"], "--mooncake-metadata",
             mooncake["metadata"], "--bridge-arg=--segment-size=32MiB",
             "--bridge-arg=--local-buffer-size=8MiB", *bridge_args, "--", *CPU_ARGS],
            cwd=repo, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, log, port, bport


def _listens(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.server
def test_hsdump_serve_bridge_starts_it_once_the_server_is_ready_and_stops_both(
        store, mooncake, tiny_models, tmp_path) -> None:
    """``hsdump serve --bridge``: the bridge starts only after the server answers /ready, serves
    SpecForge's produce_refs (refs equal HF float32) and passes the rest through; SIGTERM stops
    both (exit 0, neither port listens)."""
    import requests

    proc, log, port, bport = _serve_with_bridge(tiny_models, tmp_path, mooncake)
    try:
        deadline = time.monotonic() + 600
        while "hsdump bridge: serving on" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(1)
        text = log.read_text()
        assert text.index("the server is ready: starting the bridge") < text.index(
            "hsdump bridge: serving on"), text[-3000:]
        url = f"http://127.0.0.1:{bport}"
        assert requests.get(f"{url}/ready", timeout=30).status_code == 200
        info = protocol.read_server_info(tmp_path / "dump")
        capture = sf_capture(layers=tuple(lay - 1 for lay in sorted(info.layers)),
                             hidden=info.hidden_size)
        tasks = sf_tasks([19, 44], first=500)
        refs = sf_adapter(store, None, url=url).produce_refs(tasks, capture=capture)
        assert_equals_hf_fp32(store, tiny_models / "tiny-llama", info, tasks, refs)
    finally:
        proc.terminate()
        rc = proc.wait(timeout=120)
    assert rc == 0, log.read_text()[-3000:]
    assert "stopped: 1 requests, 2 samples published, 0 failed" in log.read_text()
    assert not _listens(port) and not _listens(bport)


@pytest.mark.server
def test_hsdump_serve_bridge_failure_restarts_the_bridge_and_keeps_the_server(
        mooncake, tiny_models, tmp_path) -> None:
    """A bridge that cannot start (here: a dump dir without the server's server.json) is logged
    with its exit status and its own message, and restarted alone: the server keeps serving;
    SIGTERM then stops both (exit 0)."""
    import requests

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    proc, log, port, bport = _serve_with_bridge(tiny_models, tmp_path, mooncake,
                                                f"--bridge-arg=--dump-dir={foreign}")
    try:
        deadline = time.monotonic() + 600
        while log.read_text().count("the bridge exited with 2 after") < 2:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(1)
        assert requests.get(f"http://127.0.0.1:{port}/health", timeout=30).status_code == 200
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert rc == 0, text[-3000:]
    assert "the server keeps serving" in text and "restarting the bridge (restart 1" in text
    tail = text.split("its last lines:")[1]
    assert "no usable server.json in --dump-dir" in tail, tail
    assert not _listens(port) and not _listens(bport)


def test_hsdump_serve_bridge_refuses_bad_bridge_arguments_before_starting(tmp_path,
                                                                         capsys) -> None:
    """``--bridge`` without the Mooncake endpoints, or with a --bridge-arg hsdump bridge does
    not take, is refused (exit 2, naming it) before any server starts; --dry-run prints both
    commands."""
    from hsdump_patch.cli import main as cli

    base = ["serve", "--model", str(tmp_path), "--profile", "none", "--dry-run", "--bridge"]
    endpoints = ["--mooncake-master", "h:1", "--mooncake-metadata", "http://h:2/metadata"]
    assert cli(base) == 2
    assert "--bridge needs --mooncake-master and --mooncake-metadata" in capsys.readouterr().err
    assert cli([*base, *endpoints, "--bridge-arg=--no-such"]) == 2
    err = capsys.readouterr().err
    assert "hsdump bridge rejects the --bridge-arg arguments" in err and "--no-such" in err, err
    assert cli([*base, *endpoints, "--host", "0.0.0.0", "--port", "31000"]) == 0
    err = capsys.readouterr().err
    assert ("once ready, beside it: " in err and "bridge --server http://127.0.0.1:31000 "
            "--dump-dir /dev/shm/sglang_hs --host 127.0.0.1 --port 30100" in err), err


# --- The image: the entry point takes --bridge from its environment; Mooncake's libraries.

PUT_GET = """
import pathlib, sys, tempfile, torch
sys.path.insert(0, "/src")
from tests.harness.online import local_mooncake
from hsdump_patch.client.bridge import MooncakeSink, TaskCapture
with local_mooncake(pathlib.Path(tempfile.mkdtemp())) as ep:
    sink = MooncakeSink.connect(master=ep["master"], metadata=ep["metadata"],
                                local_hostname="127.0.0.1", global_segment_size=16 << 20,
                                local_buffer_size=8 << 20)
    t = torch.arange(4096, dtype=torch.float32)
    sink.publish(TaskCapture("s", "x", 1, False, {}, ()), {"t": t})
    assert sink.store.get("s/x/g1/t") == t.numpy().tobytes()
    sink.store.close()
print("mooncake put/get ok")
"""


def test_the_image_runs_the_bridge_beside_the_server_with_debians_rdma_libraries(
        docker_engine, hsdump_image) -> None:
    """The image's entry point (hsdump serve) plans the bridge from its environment
    (HSDUMP_BRIDGE=1 and the Mooncake endpoints). Mooncake's wheel, which the official base
    image ships, links Debian's libibverbs1, librdmacm1 and libnuma1 (the official base has them,
    the CPU stand-in does not): with them added, its master, HTTP metadata server and the
    bridge's own put read back, inside the image, over TCP."""
    r = docker_engine.run(
        "run", "--rm", "--network", "none", "-e", "HSDUMP_BRIDGE=1", "-e",
        "HSDUMP_MOONCAKE_MASTER=mc:50051", "-e", "HSDUMP_MOONCAKE_METADATA=http://mc:8080/metadata",
        "-e", "HSDUMP_BRIDGE_ARGS=--segment-size 64GiB", hsdump_image, "--model", "/tmp",
        "--profile", "none", "--dry-run")
    assert ("once ready, beside it: python3 -m hsdump_patch.cli bridge --server "
            "http://127.0.0.1:30000 --dump-dir /dev/shm/sglang_hs --host 127.0.0.1 --port 30100 "
            "--mooncake-master mc:50051 --mooncake-metadata http://mc:8080/metadata "
            "--segment-size 64GiB") in r.stderr.replace("/usr/bin/python3", "python3"), r.stderr
    tag = image_with_rdma_libs(docker_engine, hsdump_image)
    try:
        repo = Path(__file__).resolve().parents[2]
        # Mooncake's transfer engine needs a LAN address besides loopback: the host's network.
        r = docker_engine.run("run", "--rm", "--network", "host", "-v",
                              f"{repo}/tests:/src/tests:ro", "--entrypoint", "python3", tag,
                              "-c", PUT_GET, check=False)
        assert r.returncode == 0 and "mooncake put/get ok" in r.stdout, r.stdout + r.stderr
    finally:
        docker_engine.run("rmi", tag, check=False)


def test_the_documented_kimi_config_loads_with_specforges_schema(tmp_path: Path) -> None:
    """docs/online.md's `specforge train` config for Kimi-K2.5 loads with SpecForge 0.2.0's own
    load_config: disaggregated over Mooncake, its producers at the bridges, the aux layer ids
    of the servers' dump layers (hsdump layer l = SpecForge id l - 1), bf16."""
    import yaml

    specforge_on_path()
    from specforge.config.schema import load_config

    doc = (Path(__file__).resolve().parents[2] / "docs" / "online.md").read_text()
    block = doc.split("<!-- kimi-online-config -->\n```yaml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "kimi.yaml").write_text(block)
    cfg = load_config(str(tmp_path / "kimi.yaml"), [])
    d = cfg.deployment.disaggregated
    assert cfg.deployment.mode == "disaggregated" and d.backend == "mooncake"
    assert all(u.endswith(":30100") for u in d.server_urls), d.server_urls  # the bridge's port
    ids = cfg.model.aux_hidden_state_layer_ids
    assert ids == [1, 29, 57] and server_layers_for(ids) == [2, 30, 58]
    assert "SGLANG_HS_DUMP_LAYERS 2,30,58" in block
    assert cfg.model.torch_dtype == "bfloat16" and cfg.model.vocab_mapping_path
    assert yaml.safe_load(block)["runtime"]["in_flight_high_watermark"] == 256

