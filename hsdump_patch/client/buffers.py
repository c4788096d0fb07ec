"""Reusable byte buffers for reading chunks and assembling records.

A fresh multi-hundred-MB allocation page-faults on first touch (slow on VMs and gVisor hosts
whose memory is mapped lazily); the client reads and assembles every record into buffers it
reuses, so after the first few records no byte is touched for the first time. Memory stays
bounded: a buffer is lent to one user at a time, a miss discards a free buffer before
allocating, and a buffer is kept for reuse only while all buffers together stay within
``limit_bytes``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

_ROUND = 1 << 24  # allocate in 16 MiB steps, so records of similar sizes share buffers


class BufferPool:
    """Lends byte buffers of at least a requested size (see the module docstring): memoryviews
    of 64-byte aligned torch allocations."""

    def __init__(self, limit_bytes: int,
                 on_drop: Callable[[memoryview], None] | None = None) -> None:
        """``on_drop(buf)`` runs for each buffer the pool lets go of, before it does (to undo
        what a user set up once for the buffer's whole life, such as a registration)."""
        self.limit = limit_bytes
        self.on_drop = on_drop
        self._free: list[memoryview] = []
        self._held = 0  # bytes of every buffer, free or lent
        self._lock = threading.Lock()

    def _take(self, nbytes: int) -> memoryview:
        dropped: list[memoryview] = []
        with self._lock:
            fits = [b for b in self._free if len(b) >= nbytes]
            if fits:
                buf = min(fits, key=len)
                self._free.remove(buf)
                return buf
            if self._free:  # every free one is too small: give one back instead of adding one
                dropped.append(self._free.pop())
                self._held -= len(dropped[-1])
            size = -(-nbytes // _ROUND) * _ROUND
            while self._free and self._held + size > self.limit:
                dropped.append(self._free.pop(0))
                self._held -= len(dropped[-1])
            self._held += size
        self._drop(dropped)
        return memoryview(torch.empty(size, dtype=torch.uint8).numpy())

    def _give(self, buf: memoryview) -> None:
        with self._lock:
            if self._held <= self.limit:
                self._free.append(buf)
                return
            self._held -= len(buf)  # more was lent at once than the limit: shrink back
        self._drop([buf])

    def _drop(self, bufs: list[memoryview]) -> None:
        if self.on_drop is not None:
            for buf in bufs:
                self.on_drop(buf)

    @contextmanager
    def lend(self, nbytes: int) -> Iterator[memoryview]:
        """A buffer of at least ``nbytes`` for the ``with`` block; views of it must not outlive
        the block."""
        buf = self._take(nbytes)
        try:
            yield buf
        finally:
            self._give(buf)


def tensor_at(buf: memoryview | bytearray, offset: int, dtype: torch.dtype,
              shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of ``shape`` over ``buf[offset:]`` with its own exact-size storage (so
    ``torch.save`` writes just these bytes, as for a freshly allocated tensor)."""
    count = 1
    for d in shape:
        count *= d
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype, count=count, offset=offset).view(shape)


def torch_dtype(name: str) -> torch.dtype:
    """``bfloat16`` -> ``torch.bfloat16`` (names as in server.json)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in server.json")
    return dtype
