"""The capture writer on CPU: files, markers, modes, the in-flight cap and failures.

Real files in a temp dir, the real writer threads; no server. The tensors handed to
``submit`` are row slices of a packed ``[T, S, H]`` buffer, as the capture hook passes them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from hsdump_patch import protocol
from hsdump_patch.capture import writer as writer_module
from hsdump_patch.capture.session import CaptureBuffers, _ForwardState, copy_rows
from hsdump_patch.capture.writer import MODES, Chunk, DumpWriter

SLOTS, HIDDEN = 4, 64
CPU = torch.device("cpu")


def _meta(rid: str, prefix_len: int) -> protocol.ChunkMeta:
    return protocol.ChunkMeta(rid=rid, prefix_len=prefix_len, layers=(2, 30, 58), has_final=True,
                              model="tiny", tp_size=1, sglang_version="0.5.23",
                              hsdump_version="test")


def _batch(n: int, seed: int, hidden: int = HIDDEN) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(n, SLOTS, hidden, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, 32000, (n,), generator=g)
    return hs, ids, torch.arange(n)


def _tensors(batch: tuple[torch.Tensor, ...], a: int, b: int) -> list[tuple[str, torch.Tensor]]:
    hs, ids, pos = batch
    return [(protocol.HIDDEN_KEY, hs[a:b]), (protocol.INPUT_IDS_KEY, ids[a:b]),
            (protocol.POSITIONS_KEY, pos[a:b])]


@pytest.fixture
def dump_dir(tmp_path: Path) -> Path:
    d = tmp_path / "dump"
    protocol.make_private_dir(d)
    return d


def _writer(dump_dir: Path, cap: int = 1 << 20, threads: int = 4, min_free: int = 0,
            mode: str = "thread") -> DumpWriter:
    return DumpWriter(dump_dir, max_inflight_bytes=cap, min_free_bytes=min_free, threads=threads,
                      device=CPU, mode=mode)


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest) -> str:
    """Both writer modes: threads in this process, and the writer process (shared memory)."""
    return request.param


def _temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob(".*")]


def _error(dump_dir: Path, rid: str) -> protocol.ErrorMarker:
    status = protocol.request_status(dump_dir, rid)
    assert status.done is None and status.error is not None
    return status.error


def test_submit_forward_writes_each_requests_rows_and_fails_a_bad_range(dump_dir: Path,
                                                                         mode: str) -> None:
    """One forward's hand-off in one call (as the capture does): each chunk file holds exactly
    its rows of the whole-batch tensors; a range outside them fails only its own request."""
    batch = _batch(300, seed=3, hidden=256)
    whole = [(k, t) for k, t in zip((protocol.HIDDEN_KEY, protocol.INPUT_IDS_KEY,
                                     protocol.POSITIONS_KEY), batch, strict=True)]
    bounds = {"hsdump-f0": (0, 7), "hsdump-f1": (7, 250), "hsdump-f2": (250, 300)}
    expected = {rid: [(k, t[a:b].clone()) for k, t in whole] for rid, (a, b) in bounds.items()}
    w = _writer(dump_dir, mode=mode)
    chunks = [Chunk(_meta(rid, 0), a, b, b - a) for rid, (a, b) in bounds.items()]
    w.submit_forward(whole, [*chunks, Chunk(_meta("hsdump-bad", 0), 250, 301, 51)])
    batch[0].zero_()
    assert w.flush(timeout=30)
    for rid, ref in expected.items():
        loaded = load_file(protocol.list_chunks(dump_dir, rid)[0][1])
        for key, want in ref:
            assert torch.equal(loaded[key], want), (rid, key)
        assert protocol.request_status(dump_dir, rid).done.tokens == len(ref[1][1])
    assert "outside a tensor of 300" in _error(dump_dir, "hsdump-bad").reason
    w.close()


def test_copy_rows_packs_a_slot_exactly() -> None:
    """The capture's packing copy (moved as wide elements when the layout allows) equals a
    plain copy, for an aligned slot and for rows whose width does not allow a wide view."""
    for hidden in (64, 3):  # 3: 6-byte rows, no wide view
        src = torch.randn(33, hidden).to(torch.bfloat16)
        buf = torch.zeros(40, SLOTS, hidden, dtype=torch.bfloat16)
        copy_rows(buf[:33, 2], src)
        assert torch.equal(buf[:33, 2], src)
        assert not buf[:33, [0, 1, 3]].any() and not buf[33:].any()


def test_forward_state_stores_each_slot_exactly() -> None:
    """``_ForwardState.store`` (through the buffer's widened slot views, or ``copy_rows`` when
    the source does not fit them) packs exactly the batch's rows of every slot: padded,
    exact, offset (not 16-byte aligned) and float32 sources, a batch smaller than the buffer,
    and a buffer whose rows allow no wide view."""
    for hidden in (HIDDEN, 3):
        buffers = CaptureBuffers(None, SLOTS, hidden, torch.bfloat16, CPU)  # type: ignore[arg-type]
        buffers.reserve(40)
        for rows in (40, 33):
            g = torch.Generator().manual_seed(rows + hidden)
            srcs = [torch.randn(rows + 7, hidden, generator=g).to(torch.bfloat16),  # padded
                    torch.randn(rows, hidden, generator=g).to(torch.bfloat16),
                    torch.randn(rows, hidden + 1, generator=g).to(torch.bfloat16)[:, 1:],
                    torch.randn(rows, hidden, generator=g)]  # float32: converted
            state = _ForwardState(buffers, None, rows)
            assert state.buf is not None and state.error is None
            state.buf.zero_()
            for slot, src in enumerate(srcs):
                state.store(slot, src)
            assert state.error is None and state.captured == set(range(SLOTS))
            for slot, src in enumerate(srcs):
                assert torch.equal(state.buf[:rows, slot], src[:rows].to(torch.bfloat16))
            assert not state.buf[rows:].any()
            state.store(0, srcs[1][: rows - 1])  # too few rows: an error, never a raise
            assert state.error is not None and "rows" in state.error


class _Copies:
    """A stand-in for a writer's copy event: ``query()`` says whether the copies ended."""

    def __init__(self) -> None:
        self.ended = False
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.ended


def test_capture_buffers_take_a_buffer_without_a_cuda_call_once_its_copies_ended() -> None:
    """Buffers are used in turn; the hand-off forgets the next buffer's copy event once those
    copies have ended, so the pre-hook's acquire makes no CUDA call for it (on this CPU-only
    test a stream wait would fail)."""
    events: list[_Copies] = []

    class Writer:
        def copies_event(self) -> _Copies:
            events.append(_Copies())
            return events[-1]

    buffers = CaptureBuffers(Writer(), SLOTS, HIDDEN, torch.bfloat16, CPU)  # type: ignore[arg-type]
    buffers.reserve(8)
    first = buffers.acquire(8)
    buffers.handed_off()  # forward 0's copies (events[0]) still run
    second = buffers.acquire(5)
    assert second.data_ptr() != first.data_ptr() and second.shape == (8, SLOTS, HIDDEN)
    events[0].ended = True
    buffers.handed_off()  # looks at buffer 0's copies: ended, forgotten
    assert events[0].queries == 1
    assert buffers.acquire(8).data_ptr() == first.data_ptr()  # no query, no wait
    assert events[0].queries == 1
    buffers.handed_off()  # buffer 1's copies (events[1]) have not ended: kept
    assert events[1].queries == 1
    events[1].ended = True
    assert buffers.acquire(8).data_ptr() == second.data_ptr()  # asked again: ended, no wait
    assert events[1].queries == 2


def test_chunks_are_safetensors_with_exact_bytes_and_private_modes(dump_dir: Path,
                                                                   mode: str) -> None:
    batch = _batch(500, seed=0, hidden=256)
    # 3 chunks of one request; the middle one (~460 KB) spans several 64 KiB pages/threads.
    bounds = [(0, 40), (40, 340), (340, 347)]
    w = _writer(dump_dir, mode=mode)
    assert w.page_bytes == 64 << 10
    expected = {a: [(k, t.clone()) for k, t in _tensors(batch, a, b)] for a, b in bounds}
    for a, b in bounds:
        w.submit(_meta("hsdump-r1", a), _tensors(batch, a, b),
                 prompt_len=347 if b == 347 else None)
    batch[0].zero_()  # the caller reuses its buffer at once: the files keep the submitted data
    assert w.flush(timeout=30)

    d = protocol.rid_dir(dump_dir, "hsdump-r1")
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    chunks = protocol.list_chunks(dump_dir, "hsdump-r1")
    assert [p for p, _ in chunks] == [0, 40, 340]
    for prefix_len, path in chunks:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        loaded = load_file(path)
        assert set(loaded) == {k for k, _ in expected[prefix_len]}
        for key, ref in expected[prefix_len]:
            assert loaded[key].dtype == ref.dtype and torch.equal(loaded[key], ref), key
        with safe_open(path, "pt") as f:
            meta = protocol.ChunkMeta.from_strings(f.metadata())
        assert meta == _meta("hsdump-r1", prefix_len)
    done = protocol.request_status(dump_dir, "hsdump-r1").done
    assert done == protocol.DoneMarker("hsdump-r1", 347, 347, [0, 40, 340])
    assert stat.S_IMODE((d / protocol.DONE_MARKER).stat().st_mode) == 0o600
    protocol.check_coverage(((p, len(load_file(f)[protocol.INPUT_IDS_KEY])) for p, f in chunks),
                            done.prompt_len)
    assert _temp_files(dump_dir) == []
    w.close()
    assert w.stats.chunks_written == 3 and w.stats.requests_done == 1
    assert w.stats.internal_errors == 0 and w.stats.staging_bytes == 0


def test_done_marker_only_after_every_chunk(dump_dir: Path, mode: str) -> None:
    w = _writer(dump_dir, cap=4 << 20, threads=4, mode=mode)
    batch = _batch(64, seed=1)
    w.submit(_meta("hsdump-a", 0), _tensors(batch, 0, 30), prompt_len=None)
    w.submit(_meta("hsdump-a", 30), _tensors(batch, 30, 60), prompt_len=None)
    assert w.flush(timeout=30)
    assert len(protocol.list_chunks(dump_dir, "hsdump-a")) == 2
    assert not protocol.request_status(dump_dir, "hsdump-a").finished

    # Many requests of several chunks, big chunks first: a watcher checks that whenever a done
    # marker is visible, every chunk it lists is already complete on disk.
    seen_bad: list[str] = []
    stop = threading.Event()

    def watch() -> None:
        try:
            while not stop.is_set():
                for rid_dir in dump_dir.iterdir():
                    try:
                        done = json.loads((rid_dir / protocol.DONE_MARKER).read_text())
                    except (FileNotFoundError, NotADirectoryError):
                        continue
                    names = set(os.listdir(rid_dir))
                    missing = [c for c in done["chunks"]
                               if protocol.chunk_filename(c) not in names]
                    if missing:
                        seen_bad.append(f"{rid_dir.name}: {missing}")
                time.sleep(0.001)
        except Exception as e:  # a watcher that died would check nothing: fail the test
            seen_bad.append(f"the watcher stopped: {e!r}")

    watcher = threading.Thread(target=watch)
    watcher.start()
    big = _batch(3000, seed=2)
    for r in range(12):
        rid = f"hsdump-m{r}"
        w.submit(_meta(rid, 0), _tensors(big, 0, 2000), prompt_len=None)
        w.submit(_meta(rid, 2000), _tensors(big, 2000, 2990), prompt_len=None)
        w.submit(_meta(rid, 2990), _tensors(big, 2990, 3000), prompt_len=3000)
    w.submit(_meta("hsdump-a", 60), _tensors(batch, 60, 64), prompt_len=64)
    assert w.flush(timeout=60)
    stop.set()
    watcher.join()
    w.close()
    assert seen_bad == []
    for r in range(12):
        done = protocol.request_status(dump_dir, f"hsdump-m{r}").done
        assert done is not None and done.chunks == [0, 2000, 2990] and done.tokens == 3000
    assert protocol.request_status(dump_dir, "hsdump-a").done.chunks == [0, 30, 60]
    assert w.stats.requests_done == 13 and w.stats.chunks_written == 39
    assert _temp_files(dump_dir) == []


def test_cap_blocks_the_submitting_thread(dump_dir: Path) -> None:
    # Each chunk needs ~2/3 of the cap and one thread writes them in order: when submit(i)
    # returns, chunk i-2 has been written (it holds its last page until after the rename, and
    # chunk i-1 cannot have started while it was unwritten).
    hidden = 4096
    n = 64  # 64 * 4 * 4096 * 2 B = 2 MiB per chunk
    w = _writer(dump_dir, cap=3 << 20, threads=1)
    batch = _batch(n * 12, seed=3, hidden=hidden)
    for i in range(12):
        w.submit(_meta(f"hsdump-c{i}", 0), _tensors(batch, i * n, (i + 1) * n), prompt_len=n)
        assert w.inflight_bytes <= 3 << 20
        if i > 1:
            assert protocol.list_chunks(dump_dir, f"hsdump-c{i - 2}"), i
    w.close()
    assert w.stats.forward_wait_s > 0
    assert w.stats.peak_inflight_bytes <= 3 << 20
    assert w.stats.requests_done == 12


def _submit_sampled(w: DumpWriter, big: tuple[torch.Tensor, ...], count: int, seed: int
                    ) -> tuple[list[tuple[int, int]], int]:
    """Submit ``count`` requests of random sizes (the middle one: all 4000 rows of ``big``,
    2 MiB) while a thread samples (in-flight bytes, staging bytes); flush. Return the samples
    and the staging bytes right after the flush."""
    samples: list[tuple[int, int]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append((w.inflight_bytes, w.stats.staging_bytes))
            time.sleep(0.0002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    g = torch.Generator().manual_seed(seed)
    for i in range(count):
        if i == count // 2:
            w.submit(_meta("hsdump-big", 0), _tensors(big, 0, 4000), prompt_len=4000)
            continue
        n = int(torch.randint(1, 1500, (1,), generator=g))
        w.submit(_meta(f"hsdump-s{i}", 0), _tensors(big, 0, n), prompt_len=n)
    assert w.flush(timeout=60)
    after_flush = w.stats.staging_bytes
    stop.set()
    sampler.join()
    return samples, after_flush


def test_memory_stays_bounded_by_the_cap(dump_dir: Path) -> None:
    cap = 1 << 20
    w = _writer(dump_dir, cap=cap, threads=3)
    page = w.page_bytes
    big = _batch(4000, seed=4)  # 4000 tokens = 2 MiB: larger than the cap
    oversize = -(-(4000 * (SLOTS * HIDDEN * 2 + 16) + 4096) // page) * page  # bound, in pages
    samples, after_flush = _submit_sampled(w, big, 80, seed=5)
    w.close()

    assert len(samples) > 100
    over = [s for s in samples if s[0] > cap]
    # Above the cap only while the oversize chunk is in flight, alone.
    assert all(inflight <= oversize for inflight, _ in over)
    assert max(staging for _, staging in samples) <= max(cap, oversize)
    assert w.stats.peak_inflight_bytes <= oversize
    assert after_flush <= cap  # the oversize chunk's extra pages were dropped
    assert w.stats.staging_bytes == 0
    assert w.stats.requests_done == 80 and w.stats.internal_errors == 0


def test_free_space_guard_writes_an_error_marker_and_no_chunk(dump_dir: Path) -> None:
    st = os.statvfs(dump_dir)
    reserve = st.f_bavail * st.f_frsize + (1 << 30)  # more than the filesystem has free
    w = _writer(dump_dir, min_free=reserve)
    batch = _batch(32, seed=6)
    w.submit(_meta("hsdump-full", 0), _tensors(batch, 0, 16), prompt_len=None)
    w.submit(_meta("hsdump-full", 16), _tensors(batch, 16, 32), prompt_len=32)
    assert w.flush(timeout=30)
    w.close()
    err = _error(dump_dir, "hsdump-full")
    assert "not enough free space" in err.reason
    assert "SGLANG_HS_DUMP_MIN_FREE_BYTES" in err.reason
    assert protocol.list_chunks(dump_dir, "hsdump-full") == []
    assert _temp_files(dump_dir) == []
    assert w.stats.requests_failed == 1 and w.stats.chunks_written == 0


def test_write_failure_gives_an_error_marker_and_never_raises(dump_dir: Path, mode: str) -> None:
    w = _writer(dump_dir, mode=mode)
    batch = _batch(64, seed=7)
    # The final name is taken by a directory: the rename fails after the data was written.
    d = protocol.rid_dir(dump_dir, "hsdump-w1")
    protocol.make_private_dir(d / protocol.chunk_filename(0))
    w.submit(_meta("hsdump-w1", 0), _tensors(batch, 0, 32), prompt_len=None)
    w.submit(_meta("hsdump-w1", 32), _tensors(batch, 32, 64), prompt_len=64)
    # The request's directory is a file: neither chunks nor a marker can be written there.
    protocol.rid_dir(dump_dir, "hsdump-w2").write_text("in the way")
    w.submit(_meta("hsdump-w2", 0), _tensors(batch, 0, 64), prompt_len=64)
    # An unsupported dtype is refused before any copy.
    w.submit(_meta("hsdump-w3", 0), [(protocol.HIDDEN_KEY, torch.zeros(4, dtype=torch.bool))], 4)
    # Later requests are unaffected.
    w.submit(_meta("hsdump-ok", 0), _tensors(batch, 0, 64), prompt_len=64)
    assert w.flush(timeout=30)
    w.close()

    err = _error(dump_dir, "hsdump-w1")
    # Chunk 32 is written or dropped, depending on whether chunk 0 had failed when it came.
    assert "writing chunk 0 failed" in err.reason and err.chunks[0] == 0
    assert not (d / protocol.chunk_filename(0)).is_file()
    assert "not supported" in _error(dump_dir, "hsdump-w3").reason
    assert protocol.rid_dir(dump_dir, "hsdump-w2").read_text() == "in the way"
    assert protocol.request_status(dump_dir, "hsdump-ok").done is not None
    assert w.stats.chunks_failed == 2  # w1's first chunk and w2's chunk
    assert w.stats.requests_failed == 3
    assert w.stats.internal_errors == 2  # w2's marker could not be written; w3's dtype
    assert _temp_files(dump_dir) == []


def test_fail_request_and_submit_after_close(dump_dir: Path, mode: str) -> None:
    w = _writer(dump_dir, mode=mode)
    batch = _batch(16, seed=8)
    w.submit(_meta("hsdump-f", 0), _tensors(batch, 0, 8), prompt_len=None)
    w.fail_request("hsdump-f", "aborted by the client", prompt_len=16)
    w.submit(_meta("hsdump-f", 8), _tensors(batch, 8, 16), prompt_len=16)  # dropped
    assert w.flush(timeout=30)
    err = _error(dump_dir, "hsdump-f")
    assert err.reason == "aborted by the client" and err.chunks == [0]
    assert [p for p, _ in protocol.list_chunks(dump_dir, "hsdump-f")] == [0]
    w.close()
    w.submit(_meta("hsdump-late", 0), _tensors(batch, 0, 16), prompt_len=16)
    assert "shut down" in _error(dump_dir, "hsdump-late").reason
    assert w.stats.requests_failed == 2


def test_resent_rid_after_a_failure_gets_a_fresh_done_marker(dump_dir: Path, mode: str) -> None:
    """A failed rid keeps its state (late chunks are dropped), until a new attempt begins:
    the client removes the old directory and re-sends the same rid."""
    w = _writer(dump_dir, mode=mode)
    batch = _batch(64, seed=9)
    d = protocol.rid_dir(dump_dir, "hsdump-retry")
    protocol.make_private_dir(d / protocol.chunk_filename(0))  # chunk 0 cannot be renamed
    w.submit(_meta("hsdump-retry", 0), _tensors(batch, 0, 32), prompt_len=None)
    w.submit(_meta("hsdump-retry", 32), _tensors(batch, 32, 64), prompt_len=64)
    assert w.flush(timeout=30)
    assert "writing chunk 0 failed" in _error(dump_dir, "hsdump-retry").reason

    shutil.rmtree(d)  # what the client does before re-sending
    w.begin_request("hsdump-retry")
    w.submit(_meta("hsdump-retry", 0), _tensors(batch, 0, 40), prompt_len=None)
    w.submit(_meta("hsdump-retry", 40), _tensors(batch, 40, 64), prompt_len=64)
    assert w.flush(timeout=30)
    w.close()
    status = protocol.request_status(dump_dir, "hsdump-retry")
    assert status.error is None
    assert status.done == protocol.DoneMarker("hsdump-retry", 64, 64, [0, 40])
    done_json = protocol.rid_dir(dump_dir, "hsdump-retry") / protocol.DONE_MARKER
    assert json.loads(done_json.read_text()) == {"rid": "hsdump-retry", "prompt_len": 64,
                                                 "tokens": 64, "chunks": [0, 40]}


def test_aborted_attempt_leaves_no_stale_counts(dump_dir: Path, mode: str) -> None:
    w = _writer(dump_dir, mode=mode)
    batch = _batch(64, seed=10)
    w.submit(_meta("hsdump-abort", 0), _tensors(batch, 0, 20), prompt_len=None)  # then aborted
    assert w.flush(timeout=30)
    w.begin_request("hsdump-abort")
    w.submit(_meta("hsdump-abort", 0), _tensors(batch, 0, 30), prompt_len=None)
    w.submit(_meta("hsdump-abort", 30), _tensors(batch, 30, 64), prompt_len=64)
    assert w.flush(timeout=30)
    w.close()
    done = protocol.request_status(dump_dir, "hsdump-abort").done
    assert done == protocol.DoneMarker("hsdump-abort", 64, 64, [0, 30])
    for prefix_len, path in protocol.list_chunks(dump_dir, "hsdump-abort"):
        n = {0: 30, 30: 34}[prefix_len]  # the new attempt's chunk 0 replaced the old one
        assert torch.equal(load_file(path)[protocol.HIDDEN_KEY],
                           batch[0][prefix_len : prefix_len + n])


def test_copy_waits_use_blocking_events(monkeypatch) -> None:
    """A default torch.cuda.Event spins a core in synchronize(); the writer's does not.

    The real torch.cuda.Event is wrapped (the flags are not readable back from an event), and
    creating one needs no GPU."""
    made: list[dict] = []
    real = torch.cuda.Event

    def recording(**flags):
        made.append(flags)
        return real(**flags)

    monkeypatch.setattr(torch.cuda, "Event", recording)
    event = writer_module.copy_done_event()
    assert isinstance(event, real) and made == [{"blocking": True}]
    assert writer_module.copy_done_event(blocking=False) is not None  # bench_writer's 'spin'
    assert made[-1] == {"blocking": False}


def test_writer_threads_bind_to_the_writers_device(dump_dir: Path) -> None:
    """Which device the writer's threads set before their first CUDA call."""
    asked: list[str] = []

    def current() -> int:
        asked.append("current")
        return 5

    assert writer_module.bound_device_index(torch.device("cuda", 3), current) == 3
    assert asked == []  # an explicit index wins over the calling thread's device
    assert writer_module.bound_device_index(torch.device("cuda"), current) == 5
    assert writer_module.bound_device_index(CPU, current) is None
    assert asked == ["current"]
    w = _writer(dump_dir)
    assert w.device_index is None  # a CPU writer binds nothing
    assert len(w.thread_ids) == 4
    w.close()


def test_a_failed_copy_gives_its_staging_pages_back(dump_dir: Path) -> None:
    """A chunk whose copy into the staging pages fails (here: a meta tensor, which has no data)
    fails its request and returns its pages: many such chunks, each alone taking most of the
    in-flight cap, leave the cap free, so the next good chunk is not blocked behind pages that
    were never released."""
    cap = 64 * 1024
    w = _writer(dump_dir, cap=cap)
    rows = cap // (SLOTS * HIDDEN * 2) - 8  # bf16 rows: most of the cap
    done = threading.Event()

    def submit_all() -> None:
        for n in range(8):
            bad = torch.empty(rows, SLOTS, HIDDEN, dtype=torch.bfloat16, device="meta")
            w.submit(_meta(f"hsdump-bad{n}", 0), [(protocol.HIDDEN_KEY, bad)], prompt_len=rows)
        w.submit(_meta("hsdump-good", 0), _tensors(_batch(rows, seed=9), 0, rows), rows)
        done.set()

    threading.Thread(target=submit_all, daemon=True).start()
    assert done.wait(10), "a submit waited for pages that a failed copy never gave back"
    assert w.flush(timeout=30)
    w.close()
    for n in range(8):
        assert "cannot copy the chunk" in _error(dump_dir, f"hsdump-bad{n}").reason
    assert protocol.request_status(dump_dir, "hsdump-good").done is not None
    assert w.stats.internal_errors == 8 and _temp_files(dump_dir) == []


def _files_bytes(dump_dir: Path, rid: str) -> dict[str, bytes]:
    d = protocol.rid_dir(dump_dir, rid)
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_process_writer_files_equal_the_thread_writers_byte_for_byte(tmp_path: Path) -> None:
    """The same forwards through both modes give the same files, byte for byte (chunks and
    markers), with chunks spanning several pages."""
    batch = _batch(700, seed=11, hidden=256)
    out = {}
    for m in MODES:
        d = tmp_path / m
        protocol.make_private_dir(d)
        w = _writer(d, cap=1 << 20, threads=3, mode=m)
        for r in range(5):
            rid = f"hsdump-eq{r}"
            w.begin_request(rid)
            w.submit_forward(_tensors(batch, 0, 700), [Chunk(_meta(rid, 0), 0, 300, None)])
            w.submit_forward(_tensors(batch, 0, 700), [Chunk(_meta(rid, 300), 300, 700, 700)])
        w.fail_request("hsdump-eqfail", "stand-in failure", 3)
        assert w.flush(timeout=60)
        w.close()
        out[m] = {rid: _files_bytes(d, rid) for rid in
                  [f"hsdump-eq{r}" for r in range(5)] + ["hsdump-eqfail"]}
        assert w.stats.chunks_written == 10 and w.stats.requests_done == 5
        assert w.stats.requests_failed == 1 and w.stats.mode == m
    assert out["process"] == out["thread"]
    assert set(out["process"]["hsdump-eq0"]) == {protocol.chunk_filename(0),
                                                  protocol.chunk_filename(300),
                                                  protocol.DONE_MARKER}


def _wait_for(cond, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return False


def test_a_dead_writer_process_is_reported_and_never_blocks_the_forward(dump_dir: Path) -> None:
    """The writer process is killed: the request it held unfinished gets an error marker,
    every later chunk fails its request with a clear error (no hang, even with the cap full),
    the counters say so, and the writer closes."""
    cap = 256 << 10
    w = _writer(dump_dir, cap=cap, threads=2, mode="process")
    batch = _batch(400, seed=12)
    w.submit(_meta("hsdump-open", 0), _tensors(batch, 0, 100), prompt_len=None)  # no marker yet
    w.submit(_meta("hsdump-ok", 0), _tensors(batch, 0, 100), prompt_len=100)
    assert w.flush(timeout=30)
    assert protocol.request_status(dump_dir, "hsdump-ok").done is not None
    assert not protocol.request_status(dump_dir, "hsdump-open").finished
    os.kill(w.writer_pid, 9)
    assert _wait_for(lambda: w.stats.writer_process_deaths == 1)
    err = _error(dump_dir, "hsdump-open")  # it was sent, unfinished: failed on its behalf
    assert "writer process" in err.reason and "killed by signal 9" in err.reason
    assert err.chunks == [0]
    # Many chunks, each most of the cap: the forward never waits on the dead process's pages.
    t0 = time.monotonic()
    for i in range(20):
        w.submit(_meta(f"hsdump-late{i}", 0), _tensors(batch, 0, 400), prompt_len=400)
    w.submit(_meta("hsdump-open", 100), _tensors(batch, 100, 200), prompt_len=200)
    assert time.monotonic() - t0 < 10
    assert w.flush(timeout=30)
    for i in range(20):
        reason = _error(dump_dir, f"hsdump-late{i}").reason
        assert "dumping is stopped" in reason and "keeps serving" in reason
    stats = w.stats.as_dict()
    assert stats["writer_error"] is not None and "killed by signal 9" in stats["writer_error"]
    assert stats["requests_failed"] >= 21 and stats["requests_done"] == 1
    w.close()
    assert w.inflight_bytes == 0 and _temp_files(dump_dir) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP],
                         ids=lambda s: s.name)
def test_a_signalled_writer_process_writes_all_it_was_sent_then_exits(dump_dir: Path,
                                                                      sig: int) -> None:
    """A Ctrl-C or a launcher's signal reaches the server's whole process group, the writer
    process included: it ignores the signal, and on its pipe's EOF (the server closing, or
    dying) it writes every file and marker of what it was sent, then exits 0."""
    w = _writer(dump_dir, cap=4 << 20, threads=2, mode="process")
    batch = _batch(2000, seed=15)
    w.submit(_meta("hsdump-first", 0), _tensors(batch, 0, 10), prompt_len=10)
    assert w.flush(timeout=30)  # the writer process runs (past its start)
    rids = [f"hsdump-sig{r}" for r in range(12)]
    for rid in rids:  # 12 MiB through a 4 MiB cap: the last ones are in flight at the signal
        w.submit(_meta(rid, 0), _tensors(batch, 0, 1000), prompt_len=None)
        w.submit(_meta(rid, 1000), _tensors(batch, 1000, 2000), prompt_len=2000)
    os.kill(w.writer_pid, sig)
    w.close()
    for rid in rids:
        done = protocol.request_status(dump_dir, rid).done
        assert done == protocol.DoneMarker(rid, 2000, 2000, [0, 1000]), rid
        assert [p for p, _ in protocol.list_chunks(dump_dir, rid)] == [0, 1000]
    assert w._files.proc.returncode == 0  # exited on its own, not by the signal
    assert w.stats.writer_process_deaths == 0 and w.stats.writer_error is None
    assert w.stats.requests_done == 13 and _temp_files(dump_dir) == []


def test_a_dead_writer_process_leaves_consumed_requests_alone(dump_dir: Path) -> None:
    """The writer process reports each marker it writes: when it dies, a request whose marker
    (done or error) it wrote and whose directory the client then removed is not made again
    for an error marker; a request it had not finished gets one."""
    w = _writer(dump_dir, mode="process")
    batch = _batch(64, seed=16)
    w.submit(_meta("hsdump-done", 0), _tensors(batch, 0, 64), prompt_len=64)
    w.fail_request("hsdump-failed", "stand-in failure", 3)
    w.submit(_meta("hsdump-open", 0), _tensors(batch, 0, 32), prompt_len=None)
    assert w.flush(timeout=30)
    for rid in ("hsdump-done", "hsdump-failed"):
        assert protocol.request_status(dump_dir, rid).finished
        shutil.rmtree(protocol.rid_dir(dump_dir, rid))  # what the client does once it has read
    os.kill(w.writer_pid, signal.SIGKILL)
    assert _wait_for(lambda: w.stats.writer_process_deaths == 1)
    w.close()  # the death is handled (its markers written) before the waiter thread ends
    assert "killed by signal 9" in _error(dump_dir, "hsdump-open").reason
    assert sorted(p.name for p in dump_dir.iterdir()) == [
        protocol.rid_dir(dump_dir, "hsdump-open").name]


def test_a_failed_requests_later_chunks_are_not_staged(dump_dir: Path, mode: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Once a request has failed (here, or in the writer: a chunk it could not write), its
    later chunks are neither staged nor copied; its error marker stays; other requests go on."""
    w = _writer(dump_dir, mode=mode)
    staged: list[str] = []
    stage = w._stage

    def counting(tensors: list[torch.Tensor], chunks: list) -> list:
        staged.extend(st.chunk.meta.rid for st in chunks)
        return stage(tensors, chunks)

    monkeypatch.setattr(w, "_stage", counting)
    batch = _batch(96, seed=17)
    # The final name is taken by a directory: the writer fails the request.
    protocol.make_private_dir(protocol.rid_dir(dump_dir, "hsdump-unwritable")
                              / protocol.chunk_filename(0))
    rids = ("hsdump-unwritable", "hsdump-aborted", "hsdump-ok")
    for rid in rids:
        w.submit(_meta(rid, 0), _tensors(batch, 0, 32), prompt_len=None)
    w.fail_request("hsdump-aborted", "aborted by the client")
    assert w.flush(timeout=30)
    for a in (32, 64):
        for rid in rids:
            w.submit(_meta(rid, a), _tensors(batch, a, a + 32),
                     prompt_len=96 if a == 64 else None)
    assert w.flush(timeout=30)
    w.close()
    assert staged == [*rids, "hsdump-ok", "hsdump-ok"]
    assert "writing chunk 0 failed" in _error(dump_dir, "hsdump-unwritable").reason
    aborted = _error(dump_dir, "hsdump-aborted")
    assert aborted.reason == "aborted by the client" and aborted.chunks == [0]
    assert protocol.request_status(dump_dir, "hsdump-ok").done.chunks == [0, 32, 64]
    assert w.stats.requests_failed == 2 and w.stats.chunks_written == 4


def test_process_writer_memory_is_one_fixed_shared_region(dump_dir: Path,
                                                         caplog: pytest.LogCaptureFixture
                                                         ) -> None:
    """Process mode stages in one shared region of the cap's size: the in-flight bytes never
    pass the cap, the staging memory is the cap from the start and never grows, a chunk
    larger than the cap fails its request with the variable to raise, and the forward thread
    waits (rather than memory growing) when the writer falls behind."""
    cap = 1 << 20
    with caplog.at_level("INFO", logger="hsdump"):
        w = _writer(dump_dir, cap=cap, threads=2, mode="process")
    assert w.stats.staging_bytes == cap
    assert (f"writer process pid {w.writer_pid} (2 threads), staging 16 pages of 64 KiB in "
            "shared memory (2 MiB)") in caplog.text  # the cap + 1 MiB of counters and states
    big = _batch(4000, seed=13)  # 2 MiB: larger than the cap
    samples, _ = _submit_sampled(w, big, 60, seed=14)
    w.close()
    assert len(samples) > 50
    assert max(inflight for inflight, _ in samples) <= cap
    assert {staging for _, staging in samples} == {cap}
    assert w.stats.peak_inflight_bytes <= cap and w.stats.forward_wait_s > 0
    reason = _error(dump_dir, "hsdump-big").reason
    assert "in-flight cap" in reason and protocol.ENV_MAX_INFLIGHT in reason
    assert w.stats.requests_done == 59 and w.stats.internal_errors == 0
    assert w.stats.staging_bytes == 0


def test_writer_mode_setting_defaults_to_the_process_and_refuses_other_values() -> None:
    """SGLANG_HS_DUMP_WRITER picks the mode (process by default); a bad value is a clear
    start-up error naming the variable and the choices; a bad mode is refused by the writer."""
    from hsdump_patch.capture.config import ENV_WRITER_MODE, ConfigError, DumpConfig

    env = {protocol.ENV_DIR: "/dev/shm/x"}
    assert DumpConfig.from_env(env).writer_mode == "process"
    assert DumpConfig.from_env({**env, ENV_WRITER_MODE: " Thread "}).writer_mode == "thread"
    with pytest.raises(ConfigError, match="SGLANG_HS_DUMP_WRITER='fork' must be one of "
                                          "process, thread"):
        DumpConfig.from_env({**env, ENV_WRITER_MODE: "fork"})
    with pytest.raises(ValueError, match="writer mode must be one of"):
        DumpWriter(Path("/nonexistent"), max_inflight_bytes=1 << 20, min_free_bytes=0,
                   threads=1, device=CPU, mode="fork")


def test_a_failed_cuda_host_register_is_counted_logged_and_in_status(
        dump_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Process mode on CUDA: when cudaHostRegister fails part-way (here on the 4th page), the
    pages left pageable are counted (writer.pin_failed_pages in status.json), the failure is
    logged once at error level, and the pages registered are unregistered at close. No GPU:
    torch.cuda.cudart (the CUDA runtime) is a stand-in, and so are the stream and set_device."""
    from types import SimpleNamespace

    from hsdump_patch.capture.session import CaptureSession

    registered: list[int] = []
    unregistered: list[int] = []

    def register(ptr: int, nbytes: int, flags: int) -> int:
        if len(registered) == 3:
            return 2  # cudaErrorMemoryAllocation
        registered.append(ptr)
        return 0

    cudart = SimpleNamespace(cudaHostRegister=register, cudaHostUnregister=unregistered.append)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: object())
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    cap = 64 << 20  # 16 pages of 4 MiB (shared memory, never touched)
    with caplog.at_level("INFO", logger="hsdump"):
        w = DumpWriter(dump_dir, max_inflight_bytes=cap, min_free_bytes=0, threads=1,
                       device=torch.device("cuda", 0), mode="process")
        w.close()  # joins the pinning thread
    assert w.stats.pin_failed_pages == 13 and len(registered) == 3
    assert unregistered == registered
    errors = [r for r in caplog.records if "cudaHostRegister" in r.getMessage()]
    assert len(errors) == 1 and errors[0].levelname == "ERROR"
    assert ("failed at page 3: 13 of 16 pages (52 MiB) stay pageable memory, so the "
            "device-to-host copies into them will serialise with the host"
            ) in errors[0].getMessage()
    session = SimpleNamespace(writer=w, forwards_dumped=0, errors=0, prompt_lens={},
                              in_progress={}, decode_tails={})
    status = json.loads(json.dumps(CaptureSession.status(session)))  # as status.json has it
    assert status["writer"]["pin_failed_pages"] == 13


STALL_S = 0.5  # the stall bound of the tests below (SGLANG_HS_DUMP_STALL_S)


def _submit_in_time(w: DumpWriter, rid: str, tensors: list[tuple[str, torch.Tensor]],
                    prompt_len: int, limit: float = 10.0) -> float:
    """Submit one chunk from a thread, as the forward does; fail (not hang) when the submit
    has not returned within ``limit`` s. Return how long it took."""
    t0 = time.monotonic()
    t = threading.Thread(target=w.submit, args=(_meta(rid, 0), tensors, prompt_len),
                         daemon=True)
    t.start()
    t.join(limit)
    assert not t.is_alive(), f"the submit of {rid} still waits on the stalled writer"
    return time.monotonic() - t0


def _check_stall_and_recovery(w: DumpWriter, dump_dir: Path, resume: Callable[[], None],
                              who: str) -> None:
    """``w`` has a 256 KiB cap and a writer that does not move: a chunk of most of the cap is
    staged and held; the next one waits ``STALL_S`` and fails its request (the writer is then
    stalled), later ones fail at once; each gets an error marker naming the stall. After
    ``resume()`` the writer is no longer stalled and later requests are dumped."""
    from hsdump_patch.capture.config import ENV_STALL_S

    batch = _batch(400, seed=18)  # ~211 KB a chunk: 14 of the 16 pages
    try:
        assert _submit_in_time(w, "hsdump-held", _tensors(batch, 0, 400), 400) < STALL_S
        took = _submit_in_time(w, "hsdump-stall0", _tensors(batch, 0, 400), 400)
        assert STALL_S <= took < STALL_S + 5
        assert w.stats.stalled and w.stats.stalls == 1
        for i in (1, 2, 3):  # stalled, no progress: no wait at all
            assert _submit_in_time(w, f"hsdump-stall{i}", _tensors(batch, 0, 400), 400) < 0.2
        for i in range(4):
            reason = _error(dump_dir, f"hsdump-stall{i}").reason
            assert f"the hsdump {who} stalled" in reason and f"{ENV_STALL_S}=0.5 s" in reason
            assert "keeps serving" in reason
        assert not protocol.request_status(dump_dir, "hsdump-held").finished
        assert w.stats.stalled and w.stats.stalled_chunks == 4
    finally:
        resume()
    assert _wait_for(lambda: not w.stats.stalled)
    assert _submit_in_time(w, "hsdump-after", _tensors(batch, 0, 400), 400) < STALL_S + 5
    assert w.flush(timeout=30)
    w.close()
    for rid in ("hsdump-before", "hsdump-held", "hsdump-after"):
        assert protocol.request_status(dump_dir, rid).done is not None, rid
    for i in range(4):  # the marker written for the stall stays (nothing rewrites it)
        assert "stalled" in _error(dump_dir, f"hsdump-stall{i}").reason
        assert protocol.list_chunks(dump_dir, f"hsdump-stall{i}") == []
    stats = w.stats
    assert stats.requests_done == 3 and stats.requests_failed == 4
    assert stats.stalls == 1 and not stats.stalled and stats.internal_errors == 0
    assert _temp_files(dump_dir) == []


def test_a_stopped_writer_process_fails_requests_in_time_and_recovers(dump_dir: Path) -> None:
    """SIGSTOP the writer process (as a D state or a starved CPU would hold it) with the
    staging full: no submit waits longer than the stall bound, the requests get error markers
    naming the stall, the counters say stalled; after SIGCONT dumping resumes."""
    w = DumpWriter(dump_dir, max_inflight_bytes=256 << 10, min_free_bytes=0, threads=2,
                   device=CPU, mode="process", stall_s=STALL_S)
    w.submit(_meta("hsdump-before", 0), _tensors(_batch(10, seed=19), 0, 10), prompt_len=10)
    assert w.flush(timeout=30)  # the writer process runs
    pid = w.writer_pid
    os.kill(pid, signal.SIGSTOP)
    _check_stall_and_recovery(w, dump_dir, lambda: os.kill(pid, signal.SIGCONT),
                              f"writer process (pid {pid}) is")
    assert w.stats.writer_process_deaths == 0


def test_a_blocked_writer_thread_fails_requests_in_time_and_recovers(
        dump_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Thread mode: the only writer thread blocks in its write system call (a filesystem that
    stops answering) with the staging full: the same bound, markers and recovery."""
    gate = threading.Event()
    pwritev = os.pwritev

    def stuck_filesystem(fd: int, buffers: list, offset: int) -> int:
        gate.wait()
        return pwritev(fd, buffers, offset)

    w = DumpWriter(dump_dir, max_inflight_bytes=256 << 10, min_free_bytes=0, threads=1,
                   device=CPU, mode="thread", stall_s=STALL_S)
    w.submit(_meta("hsdump-before", 0), _tensors(_batch(10, seed=19), 0, 10), prompt_len=10)
    assert w.flush(timeout=30)
    monkeypatch.setattr(os, "pwritev", stuck_filesystem)
    _check_stall_and_recovery(w, dump_dir, gate.set, "writer threads are")


def test_stall_setting_defaults_to_seconds_far_below_the_watchdog() -> None:
    """SGLANG_HS_DUMP_STALL_S bounds each forward's wait for the writer (default 5 s); a value
    that is not a number of seconds in (0, 60] is a clear start-up error."""
    from hsdump_patch.capture.config import ENV_STALL_S, ConfigError, DumpConfig

    env = {protocol.ENV_DIR: "/dev/shm/x"}
    assert DumpConfig.from_env(env).stall_s == 5.0
    assert DumpConfig.from_env({**env, ENV_STALL_S: "0.25"}).stall_s == 0.25
    for bad in ("0", "-1", "301", "nan", "soon"):
        with pytest.raises(ConfigError, match=f"SGLANG_HS_DUMP_STALL_S='{bad}' must be a number "
                                              r"of seconds in \(0, 60\]"):
            DumpConfig.from_env({**env, ENV_STALL_S: bad})
