"""The capture installed on one model runner: collectors at the chosen layers, per-forward
bookkeeping, and hand-off of each request's rows to the writer.

Installed identically on every tensor-parallel rank (so the collective sequence is the same
everywhere); only the writer rank (attention-TP rank 0) copies rows and writes files.

Device memory: the writer rank packs each dumped forward's rows into a ``[T, S, H]`` buffer.
``CAPTURE_BUFFERS`` (2) of them are reserved at install time (``reserve_rows`` rows each: the
most tokens one forward can prefill) and used in turn (:class:`CaptureBuffers`), so the extra
memory is fixed, logged at start-up and never grows with the CPU running ahead; a forward
larger than the reservation grows its buffer once (logged). Two buffers, not one, so that no
forward waits for the previous forward's device-to-host copies (they start after its last
layer): forward N only waits, on the stream, for forward N-2's, long finished.

Every rank writes a marker at install; the first dumped forward on each rank checks that all
ranks of its node have one, and refuses to serve otherwise (SGLang only logs a plugin hook
that fails to apply, which would leave that rank silently without capture).

The writer rank keeps ``status.json`` in the dump dir: its counters and how many requests it
keeps state for (per-request bookkeeping exists only for dumped prefill chunks, so those
counts return to their level once the requests are dumped); refreshed after a dumped forward,
at most every ``STATUS_INTERVAL_S``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from hsdump_patch import __version__, protocol
from hsdump_patch.capture.config import ENV_LAYERS, ConfigError, DumpConfig
from hsdump_patch.capture.model_adapter import (
    DecoderStack,
    eagle3_serving_layers,
    locate_decoder_stack,
)
from hsdump_patch.capture.writer import Chunk, DumpWriter

logger = logging.getLogger("hsdump")

_MAX_TRACKED = 100_000
STATUS_INTERVAL_S = 1.0  # the writer rank refreshes status.json at most this often


class _Collector:
    """A ``capture_gathered`` collector for one slot; chains to SGLang's own collector."""

    __slots__ = ("inner", "session", "slot")

    def __init__(self, session: CaptureSession, slot: int, inner: Any) -> None:
        self.session = session
        self.slot = slot
        self.inner = inner

    def capture(self, tensor: torch.Tensor, *, owned: bool = False) -> None:
        state = self.session.state
        if state is not None:
            state.store(self.slot, tensor)
        if self.inner is not None:
            self.inner.capture(tensor, owned=owned)


class CaptureNotInstalled(RuntimeError):
    """A rank of this server runs without the capture: the server must not serve dumps."""


class _ForwardState:
    """What one dumped forward has captured so far (rows packed as ``[T, S, H]``).

    Made in the forward pre-hook, before the first layer. There the device is idle (the
    first layers of a prefill forward are host-bound), so every microsecond of host time
    here adds to the forward's device time (issue 17): it only takes its capture buffer,
    without a CUDA call in the usual case (:meth:`CaptureBuffers.acquire`)."""

    __slots__ = ("buf", "buffers", "captured", "dsts", "dumped_rows", "error", "forward_batch",
                 "rows")

    def __init__(self, buffers: CaptureBuffers | None, forward_batch: Any, rows: int) -> None:
        self.buffers = buffers  # None on a non-writer rank: nothing is stored
        self.forward_batch = forward_batch
        self.rows = rows
        self.buf: torch.Tensor | None = None  # the whole buffer: this forward's are rows[:rows]
        self.captured: set[int] = set()
        self.error: str | None = None
        self.dumped_rows: frozenset[int] = frozenset()  # batch rows (requests) to hand off
        self.dsts: list[torch.Tensor] = []  # the buffer's slots, widened (CaptureBuffers.views)
        if buffers is not None:
            try:
                self.buf = buffers.acquire(rows)
                self.dsts = buffers.views
            except Exception as e:  # runs in the forward pre-hook: it must never raise
                self.error = f"taking the capture buffer failed: {type(e).__name__}: {e}"

    def store(self, slot: int, tensor: torch.Tensor) -> None:
        """Pack ``tensor``'s first ``rows`` rows into ``slot``. The first store of a forward
        runs while the device waits for the host (issue 17), so the usual case makes two
        ATen calls (a view and the copy) into the slot's view made with the buffer."""
        # Runs inside SGLang's layer code: it must never raise.
        if self.buf is None or self.error is not None:
            return
        try:
            rows = self.rows
            if tensor.shape[0] < rows:
                raise ValueError(f"captured {tensor.shape[0]} rows, the batch has {rows}")
            src = tensor if tensor.shape[0] == rows else tensor.narrow(0, 0, rows)
            dst = self.dsts[slot]
            wide = dst.dtype
            if (wide != src.dtype and src.dtype == self.buf.dtype and src.dim() == 2
                    and src.shape[1] == self.buf.shape[2]
                    and _aligned(src, src.element_size(), wide.itemsize)):
                (dst if dst.shape[0] == rows else dst.narrow(0, 0, rows)).copy_(src.view(wide))
            else:
                copy_rows(self.buf[:rows, slot], src)
            self.captured.add(slot)
        except Exception as e:
            self.error = f"capture of slot {slot} failed: {type(e).__name__}: {e}"

    def store_final(self, slot: int, tensor: torch.Tensor) -> None:
        """:meth:`store` for the final post-norm state, on the writer's copy stream: the
        forward's own stream does not wait for this copy. Unlike a layer's residual, which
        later layers update in place, SGLang does not write to the final state after the
        forward; its memory is kept from reuse until the copy ends (``record_stream``)."""
        if self.buffers is None:
            return
        with self.buffers.writer.on_copy_stream(tensor):
            self.store(slot, tensor)


_WIDE_DTYPES = (torch.complex128, torch.int64, torch.int32)  # 16, 8, 4-byte elements


def copy_rows(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for same-dtype tensors whose rows are contiguous, moved as the
    widest elements their layout allows: a strided bf16 copy into a ``[T, S, H]`` slot runs
    at a fraction of the bandwidth of the same bytes moved as 16-byte elements."""
    if src.dtype == dst.dtype and src.shape == dst.shape and src.dim() == 2:
        size = src.element_size()
        for wide in _WIDE_DTYPES:
            w = wide.itemsize
            if w > size and all(_aligned(t, size, w) for t in (dst, src)):
                dst.view(wide).copy_(src.view(wide))
                return
    dst.copy_(src)


def _aligned(t: torch.Tensor, size: int, w: int) -> bool:
    """Whether ``t.view(dtype of w bytes)`` is valid and lands on ``w``-byte addresses."""
    return (t.stride(1) == 1 and (t.shape[1] * size) % w == 0 and (t.stride(0) * size) % w == 0
            and t.data_ptr() % w == 0)


def slot_views(buf: torch.Tensor) -> list[torch.Tensor]:
    """Each slot of a ``[T, S, H]`` buffer as a ``[T, H']`` view in the widest elements that
    :func:`copy_rows` would pick for it (the buffer's own dtype if none fits)."""
    size = buf.element_size()
    for wide in _WIDE_DTYPES:
        w = wide.itemsize
        if w > size and (buf.shape[2] * size) % w == 0 and buf.data_ptr() % w == 0:
            buf = buf.view(wide)
            break
    return [buf[:, s] for s in range(buf.shape[1])]


CAPTURE_BUFFERS = 2


class CaptureBuffers:
    """The writer rank's ``[T, S, H]`` device buffers, used in turn by dumped forwards.

    A forward's fill must not overwrite rows whose device-to-host copies are still running.
    Those copies start after the forward's last layer, so with one buffer (``count=1``, the
    ordering before issue 17) forward N+1 waited at its first capture for all of forward N's
    copies. With ``count`` buffers, forward N reuses forward N-count's buffer and waits (on
    the stream, never on the host) only for that forward's copies. Memory: ``count`` buffers.
    """

    def __init__(self, writer: DumpWriter, slots: int, hidden: int, dtype: torch.dtype,
                 device: torch.device, count: int = CAPTURE_BUFFERS) -> None:
        if count < 1:
            raise ValueError(f"count must be >= 1, not {count}")
        self.writer = writer
        self.slots, self.hidden, self.dtype, self.device = slots, hidden, dtype, device
        self._bufs: list[torch.Tensor | None] = [None] * count
        self._copied: list[torch.cuda.Event | None] = [None] * count  # its last copies
        self._views: list[list[torch.Tensor]] = [[] for _ in range(count)]  # slot_views
        self.views: list[torch.Tensor] = []  # the slot views of the buffer acquired last
        self._next = 0
        self._current: int | None = None

    @property
    def count(self) -> int:
        return len(self._bufs)

    @property
    def nbytes(self) -> int:
        """Device bytes held by the buffers now."""
        return sum(b.nbytes for b in self._bufs if b is not None)

    def reserve(self, rows: int) -> None:
        """Allocate every buffer for ``rows`` tokens now (at install: fail early, log size)."""
        for i in range(self.count):
            self._ensure(i, rows)
        one = self._bufs[0]
        assert one is not None
        logger.info(
            "hsdump: capture buffer of %d tokens x %d states x %d (%.0f MiB) on %s, %d used in "
            "turn: %.0f MiB of device memory in all", rows, self.slots, self.hidden,
            one.nbytes / (1 << 20), self.device, self.count, self.nbytes / (1 << 20))

    def _ensure(self, i: int, rows: int) -> torch.Tensor:
        buf = self._bufs[i]
        if buf is None or buf.shape[0] < rows:
            if buf is not None:
                logger.warning(
                    "hsdump: a forward of %d tokens exceeds the reserved %d; growing capture "
                    "buffer %d (lower --mem-fraction-static if memory is tight)",
                    rows, buf.shape[0], i)
            self._bufs[i] = None  # its pending copies keep its memory (record_stream)
            buf = self._bufs[i] = torch.empty((rows, self.slots, self.hidden), dtype=self.dtype,
                                              device=self.device)
            self._views[i] = slot_views(buf)
        return buf

    def acquire(self, rows: int) -> torch.Tensor:
        """The next buffer, whole (the forward's rows are its first ``rows``), free for writing
        on the current stream. If the copies of the forward that used it last (``count``
        forwards ago) may still run, the stream waits for them; usually :meth:`handed_off`
        has already seen them end, and this makes no CUDA call."""
        i = self._current = self._next
        self._next = (i + 1) % len(self._bufs)
        buf = self._ensure(i, rows)
        self.views = self._views[i]
        copied = self._copied[i]
        if copied is not None:
            self._copied[i] = None
            if not copied.query():
                torch.cuda.current_stream().wait_event(copied)
        return buf

    def handed_off(self) -> None:
        """The forward that acquired a buffer has submitted all its rows to the writer.

        Also forgets the next buffer's copy event if its copies have ended: here, after the
        last layer, the host is far ahead of the device, unlike in the next pre-hook."""
        if self._current is not None:
            self._copied[self._current] = self.writer.copies_event()
            self._current = None
        copied = self._copied[self._next]
        if copied is not None and copied.query():
            self._copied[self._next] = None


def _forward_batch_of(args: tuple, kwargs: dict) -> Any:
    fb = kwargs.get("forward_batch")
    if fb is None and len(args) > 2:
        fb = args[2]
    return fb


def _is_writer_rank() -> bool:
    try:
        from sglang.srt.runtime_context import get_parallel

        p = get_parallel()
        return p.attn_tp_rank == 0 and getattr(p, "attn_cp_rank", 0) == 0
    except Exception:
        return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def runner_device(device: Any, gpu_id: int | None) -> torch.device:
    """The model runner's device with its index (``runner.device`` is a bare "cuda")."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and gpu_id is not None:
        return torch.device("cuda", gpu_id)
    return device


def reserve_rows(server_args: Any) -> int:
    """The most tokens one prefill forward holds: the chunk size, else the prefill budget."""
    from sglang.srt.arg_groups.overrides import resolved_view

    view = resolved_view(server_args)
    chunk = int(view.chunked_prefill_size or -1)
    return chunk if chunk > 0 else int(view.max_prefill_tokens)


def _model_dtype(runner: Any, stack: DecoderStack) -> torch.dtype:
    dtype = getattr(getattr(runner, "model_config", None), "dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    return next(p.dtype for p in stack.inner.parameters() if p.is_floating_point())


class CaptureSession:
    """Hooks on one model runner. Create once per runner, after CUDA-graph setup."""

    def __init__(self, config: DumpConfig, runner: Any) -> None:
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        self.config = config
        self.extend_mode = ForwardMode.EXTEND
        # MIXED: --enable-mixed-chunk's prefill beside running decodes (their rows are tails)
        self.prefill_modes = (ForwardMode.EXTEND, ForwardMode.MIXED)
        # (rid, prefix length) of decode tails seen by ForwardBatch.init_new, not yet forwarded
        self.decode_tails: OrderedDict[tuple[str, int], None] = OrderedDict()
        self.stack = locate_decoder_stack(runner.model)
        self.layers, self.layers_source = self._resolve_layers()
        self.slots = len(self.layers) + int(config.dump_final)
        self.is_writer = _is_writer_rank()
        self.device = runner_device(runner.device, getattr(runner, "gpu_id", None))
        self.dtype = _model_dtype(runner, self.stack)
        self.state: _ForwardState | None = None
        self.prompt_lens: OrderedDict[str, int] = OrderedDict()  # fed by ForwardBatch.init_new
        self.in_progress: OrderedDict[str, None] = OrderedDict()
        self.errors = 0
        self.forwards_dumped = 0
        self._status_at = 0.0  # time.monotonic() of the last status.json
        server_args = runner.server_args
        self.tp_size = int(getattr(server_args, "tp_size", 1) or 1)
        self.model_name = str(getattr(server_args, "served_model_name", None)
                              or getattr(server_args, "model_path", ""))
        import sglang

        self.sglang_version = sglang.__version__
        self.writer: DumpWriter | None = None
        self.buffers: CaptureBuffers | None = None
        protocol.make_private_dir(config.dump_dir)
        self.rank_marker, self.peer_markers = _rank_markers(config.dump_dir, server_args)
        self.peers_checked = False
        if self.is_writer:
            self.writer = DumpWriter(
                config.dump_dir,
                max_inflight_bytes=config.max_inflight_bytes,
                min_free_bytes=config.min_free_bytes,
                threads=config.writer_threads,
                device=self.device,
                mode=config.writer_mode,
                stall_s=config.stall_s,
            )
            self.buffers = CaptureBuffers(self.writer, self.slots, self.stack.hidden_size,
                                          self.dtype, self.device)
            self.buffers.reserve(reserve_rows(server_args))
            info = protocol.ServerInfo(
                model=self.model_name,
                architecture=self.stack.architecture,
                layers=tuple(self.layers),
                layers_source=self.layers_source,
                has_final=config.dump_final,
                hidden_size=self.stack.hidden_size,
                num_hidden_layers=self.stack.num_layers,
                dtype=str(self.dtype).removeprefix("torch."),
                tp_size=self.tp_size,
                rid_prefix=config.rid_prefix,
                sglang_version=self.sglang_version,
                hsdump_version=__version__,
                pid=os.getpid(),
            )
            protocol.write_json_atomic(config.dump_dir / protocol.SERVER_INFO, info.to_json())
            self.write_status()
        self._install()
        protocol.write_json_atomic(self.rank_marker, {"launcher": os.getppid(), "pid": os.getpid(),
                                                      "writer": self.is_writer})
        logger.info(
            "hsdump: capturing the residual stream at the input of layers %s (%s) of %s "
            "(%d layers)%s; rids starting with %r; dump dir %s; %s rank",
            self.layers, self.layers_source, self.stack.architecture, self.stack.num_layers,
            " + final post-norm state" if config.dump_final else "", config.rid_prefix,
            config.dump_dir, "writer" if self.is_writer else "non-writer",
        )

    # ------------------------------------------------------------------ set-up

    def _resolve_layers(self) -> tuple[list[int], str]:
        n = self.stack.num_layers
        if self.config.layers is not None:
            layers, source = list(self.config.layers), f"{ENV_LAYERS}"
        else:
            draft = self.config.draft_layer_ids
            layers = eagle3_serving_layers(self.stack, list(draft) if draft else None)
            source = (f"auto from drafter ids {list(draft)} in {self.config.draft_config}"
                      if draft else "auto: SGLang's default EAGLE-3 layers")
        bad = [i for i in layers if not 0 <= i < n]
        if bad:
            raise ConfigError(
                f"{ENV_LAYERS}: capture indices {bad} are out of range for "
                f"{self.stack.architecture} with {n} decoder layers (valid: 0..{n - 1}; index i = "
                "input of layer i = HF output_hidden_states[i]). For the final post-norm state set "
                "SGLANG_HS_DUMP_FINAL=1."
            )
        return layers, source

    def check_peers(self) -> None:
        """Raise :class:`CaptureNotInstalled` unless every rank of this node installed."""
        launcher = os.getppid()
        for rank, path in self.peer_markers:
            try:
                ok = json.loads(path.read_text()).get("launcher") == launcher
            except (OSError, ValueError):
                ok = False
            if not ok:
                raise CaptureNotInstalled(
                    f"hsdump: the capture is not installed on TP rank {rank} of this server (no "
                    f"{path} from this launch): SGLang only logs a plugin hook that fails to "
                    "apply. Look in that rank's log for 'Failed to apply hooks' or 'Skipping "
                    "plugin hsdump', and check that hsdump is installed in its environment and "
                    "not excluded by SGLANG_PLUGINS. Refusing to serve dumps."
                )
        self.peers_checked = True

    def _install(self) -> None:
        for slot, index in enumerate(self.layers):
            boundary = self.stack.layers[index].attn_boundary
            boundary.prepare = self._wrap_prepare(boundary.prepare, slot)
        self.stack.inner.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        self.stack.inner.register_forward_hook(self._after_forward, with_kwargs=True)

    def _wrap_prepare(self, prepare: Any, slot: int) -> Any:
        def prepare_with_capture(hidden_states, forward_batch, **call):
            if self.state is not None and self.state.forward_batch is forward_batch:
                call["capture_gathered"] = _Collector(self, slot, call.get("capture_gathered"))
            return prepare(hidden_states, forward_batch, **call)

        return prepare_with_capture

    # ------------------------------------------------------------------ per forward

    def record_prompt_lengths(self, batch: Any, fb: Any = None) -> None:
        """From ``ForwardBatch.init_new`` (``batch``, its result ``fb``): remember the prompt
        length of each dumped request prefilled in this forward, and which of its dumped rows
        are decode tails.

        Only extend forwards are looked at (decode steps hold no prompt rows). A row whose
        prefix reaches the prompt's end is a request still decoding, as a one-token extend
        (prefix = sequence length - 1): ``--enable-mixed-chunk`` adds every running request
        to a prefill forward that way. It is neither dumped nor a new attempt.
        """
        if fb is None or fb.forward_mode not in self.prefill_modes:
            return
        reqs, prefixes = getattr(batch, "reqs", None) or (), fb.extend_prefix_lens_cpu
        if prefixes is None or len(prefixes) != len(reqs):
            return
        prefix = self.config.rid_prefix
        for req, prefix_len in zip(reqs, prefixes, strict=True):
            rid = req.rid
            if not (isinstance(rid, str) and rid.startswith(prefix)):
                continue
            prompt_len = len(req.origin_input_ids)
            if prefix_len >= prompt_len:
                self.decode_tails[(rid, int(prefix_len))] = None
            else:
                self.prompt_lens[rid] = prompt_len
        for tracked in (self.prompt_lens, self.decode_tails):
            while len(tracked) > _MAX_TRACKED:
                tracked.popitem(last=False)

    def _dumped_rows(self, fb: Any) -> list[int]:
        """Indices of the rows of ``fb`` to dump: dumped rids, decode tails left out."""
        prefix = self.config.rid_prefix
        rows = []
        for i, (rid, prefix_len) in enumerate(zip(fb.rids, fb.extend_prefix_lens_cpu,
                                                  strict=True)):
            if not (isinstance(rid, str) and rid.startswith(prefix)):
                continue
            if self.decode_tails.pop((rid, int(prefix_len)), False) is None:
                continue  # a decode tail (popped: each is forwarded once)
            rows.append(i)
        return rows

    def _dumpable(self, fb: Any) -> bool:
        if fb is None or fb.forward_mode not in self.prefill_modes:
            return False
        if getattr(fb, "_original_forward_mode", None) not in (None, fb.forward_mode):
            return False
        rids, lens = fb.rids, fb.extend_seq_lens_cpu
        if not rids or lens is None or len(rids) != len(lens):
            return False
        return not (self.device.type == "cuda" and torch.cuda.is_current_stream_capturing())

    def _before_forward(self, module: Any, args: tuple, kwargs: dict) -> None:
        self.state = None
        try:
            fb = _forward_batch_of(args, kwargs)
            if not self._dumpable(fb):
                return
            rows = self._dumped_rows(fb)
            if not rows:
                return
        except Exception:
            self._count_error("deciding whether to dump a forward")
            return
        if not self.peers_checked:
            self.check_peers()  # raises into the scheduler: refuse to serve
        self.state = _ForwardState(self.buffers, fb, int(sum(fb.extend_seq_lens_cpu)))
        self.state.dumped_rows = frozenset(rows)

    def _after_forward(self, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        state, self.state = self.state, None
        if state is None or not self.is_writer:
            return
        try:
            self._hand_off(state, output)
        except Exception as e:
            self._count_error("handing a forward's rows to the writer")
            self._fail_batch(state, f"internal error in the capture patch: {type(e).__name__}: {e}")
        finally:
            if self.buffers is not None:
                self.buffers.handed_off()
        self.forwards_dumped += 1
        if time.monotonic() - self._status_at >= STATUS_INTERVAL_S:
            try:
                self.write_status()
            except Exception:
                self._count_error("writing status.json")

    def status(self) -> dict[str, Any]:
        """The writer rank's counters and the sizes of its per-request bookkeeping."""
        assert self.writer is not None
        return {
            "pid": os.getpid(),
            "updated": time.time(),
            "forwards_dumped": self.forwards_dumped,
            "capture_errors": self.errors,
            "tracked": {"prompt_lens": len(self.prompt_lens),
                        "in_progress": len(self.in_progress),
                        "decode_tails": len(self.decode_tails),
                        "writer_requests": self.writer.tracked_requests},
            "writer": self.writer.stats.as_dict(),
        }

    def write_status(self) -> None:
        """Write ``status.json`` (writer rank) now."""
        self._status_at = time.monotonic()
        protocol.write_json_atomic(self.config.dump_dir / protocol.STATUS, self.status(),
                                   fsync=False)

    def _hand_off(self, state: _ForwardState, output: Any) -> None:
        t0 = time.perf_counter()
        if self.config.dump_final:
            final = output[0] if isinstance(output, tuple) else output
            state.store_final(self.slots - 1, final)
        missing = sorted(set(range(self.slots)) - state.captured)
        if state.error is None and missing:
            state.error = (f"capture points did not fire for slots {missing} (layers "
                           f"{[self.layers[s] for s in missing if s < len(self.layers)]})")
        if state.error is not None:
            self._count_error(state.error, with_traceback=False)
            self._fail_batch(state, state.error)
            return
        fb = state.forward_batch
        ids = fb.input_ids[: state.rows].to(torch.int64, copy=True)
        positions = fb.positions[: state.rows].to(torch.int64, copy=True)
        assert self.writer is not None and state.buf is not None
        chunks = []
        start = 0
        for i, (rid, n, prefix_len) in enumerate(zip(fb.rids, fb.extend_seq_lens_cpu,
                                                     fb.extend_prefix_lens_cpu, strict=True)):
            if i in state.dumped_rows:
                chunk = self._chunk(rid, int(prefix_len), int(n), start)
                if chunk is not None:
                    chunks.append(chunk)
            start += n
        # One call for the forward: one stream wait and one event for all its copies.
        self.writer.submit_forward([(protocol.HIDDEN_KEY, state.buf[: state.rows]),
                                    (protocol.INPUT_IDS_KEY, ids),
                                    (protocol.POSITIONS_KEY, positions)], chunks)
        logger.debug("hsdump: handed %d rows to the writer in %.2f ms", state.rows,
                     (time.perf_counter() - t0) * 1e3)

    def _track_chunk(self, rid: str, prefix_len: int, n: int) -> tuple[int | None, bool]:
        """Return (prompt length if this chunk ends the prompt else None, is first chunk)."""
        prompt_len = self.prompt_lens.get(rid)
        last = prompt_len is not None and prefix_len + n >= prompt_len
        # Chunk 0 always starts a request: a re-sent rid after a failed or aborted attempt.
        first = prefix_len == 0 or rid not in self.in_progress
        if first and self.writer is not None:
            self.writer.begin_request(rid)
        if last:
            self.prompt_lens.pop(rid, None)
            self.in_progress.pop(rid, None)
        elif first:
            self.in_progress[rid] = None
            while len(self.in_progress) > _MAX_TRACKED:
                self.in_progress.popitem(last=False)
        return (prompt_len if last else None), first

    def _chunk(self, rid: str, prefix_len: int, n: int, start: int) -> Chunk | None:
        """The chunk of ``rid`` at batch rows ``[start, start + n)``, or None when the
        request fails instead (its first tokens came from a prefix cache)."""
        assert self.writer is not None
        ends_at, first = self._track_chunk(rid, prefix_len, n)
        if first and prefix_len > 0:
            self.writer.fail_request(
                rid,
                f"the first {prefix_len} tokens came from a prefix cache and were not "
                "recomputed, so they have no hidden states (run with --disable-radix-cache)",
                ends_at,
            )
            return None
        meta = protocol.ChunkMeta(
            rid=rid, prefix_len=prefix_len, layers=tuple(self.layers),
            has_final=self.config.dump_final, model=self.model_name, tp_size=self.tp_size,
            sglang_version=self.sglang_version, hsdump_version=__version__,
        )
        return Chunk(meta, start, start + n, ends_at)

    def _fail_batch(self, state: _ForwardState, reason: str) -> None:
        if self.writer is None:
            return
        fb = state.forward_batch
        for i, (rid, n, prefix_len) in enumerate(zip(fb.rids, fb.extend_seq_lens_cpu,
                                                     fb.extend_prefix_lens_cpu, strict=True)):
            if i in state.dumped_rows:
                ends_at, _ = self._track_chunk(rid, int(prefix_len), int(n))
                self.writer.fail_request(rid, reason, ends_at)

    def _count_error(self, what: str, *, with_traceback: bool = True) -> None:
        self.errors += 1
        log = logger.exception if with_traceback else logger.error
        log("hsdump: error while %s (%d so far); the server keeps serving", what, self.errors)


def _rank_markers(dump_dir: Path, server_args: Any) -> tuple[Path, list[tuple[int, Path]]]:
    """This rank's install marker, and ``(tp rank, marker)`` of every rank on this node.

    Other nodes write to their own node's dump dir; ``--dp-size`` replicas on one node share
    it, so the name holds the DP rank too.
    """
    from sglang.srt.runtime_context import get_parallel

    p = get_parallel()
    tp_rank, tp_size = int(p.tp_rank), int(p.tp_size)
    try:
        dp_rank = int(p.dp_rank or 0)
    except (AttributeError, RuntimeError, ValueError):  # not stamped: no DP replicas
        dp_rank = 0
    nnodes = max(1, int(getattr(server_args, "nnodes", 1) or 1))
    per_node = max(1, tp_size // nnodes)
    node = tp_rank // per_node

    def marker(rank: int) -> Path:
        return protocol.install_marker(dump_dir, rank, dp_rank)

    peers = range(node * per_node, min(tp_size, (node + 1) * per_node))
    return marker(tp_rank), [(r, marker(r)) for r in peers]
