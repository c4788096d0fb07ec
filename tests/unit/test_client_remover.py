"""The dump dir's background remover (the bridge removes request directories behind its
answers): bounded, drained on close, and never leaves a directory behind (no server needed)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from hsdump_patch import protocol
from hsdump_patch.client.dumps import dumpdir


def make_request_dir(dump: Path, rid: str) -> Path:
    d = protocol.rid_dir(dump, rid)
    protocol.make_private_dir(d)
    (d / protocol.chunk_filename(0)).write_bytes(b"x")
    (d / protocol.DONE_MARKER).write_text("{}")
    return d


@pytest.fixture
def gated(monkeypatch) -> threading.Event:
    """Removal blocks until the returned event is set (a slow filesystem, held at will)."""
    gate = threading.Event()
    remove = dumpdir.remove_request

    def slow_remove(dump_dir: Path, rid: str) -> None:
        assert gate.wait(30), "the test never opened the gate"
        remove(dump_dir, rid)

    monkeypatch.setattr(dumpdir, "remove_request", slow_remove)
    return gate


def test_puts_return_before_removal_and_at_most_limit_wait(tmp_path, gated) -> None:
    """Two puts return while nothing is removed yet; a third waits until one is done; then
    every directory goes."""
    dirs = [make_request_dir(tmp_path, f"hsdump-r{i}") for i in range(3)]
    remover = dumpdir.Remover(tmp_path, limit=2)
    remover.put("hsdump-r0")
    remover.put("hsdump-r1")
    assert remover.pending == 2 and all(d.exists() for d in dirs)
    third = threading.Thread(target=remover.put, args=("hsdump-r2",))
    third.start()
    third.join(0.5)
    assert third.is_alive(), "a put went past the limit of pending removals"
    gated.set()
    third.join(30)
    assert remover.wait_idle(30) and remover.pending == 0
    assert [d.exists() for d in dirs] == [False] * 3
    remover.close()


def test_close_removes_what_waits_and_a_later_put_removes_at_once(tmp_path, gated) -> None:
    """Closing waits for the pending removals (the bridge's shutdown drains the dump dir); a
    request answered after it removes its own directory before the put returns."""
    dirs = [make_request_dir(tmp_path, f"hsdump-r{i}") for i in range(3)]
    remover = dumpdir.Remover(tmp_path, limit=4)
    remover.put("hsdump-r0")
    remover.put("hsdump-r1")
    assert not remover.wait_idle(0.2)
    gated.set()
    remover.close()
    assert remover.pending == 0 and not dirs[0].exists() and not dirs[1].exists()
    remover.put("hsdump-r2")
    assert not dirs[2].exists()


def test_a_limit_below_one_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="limit >= 1"):
        dumpdir.Remover(tmp_path, limit=0)
