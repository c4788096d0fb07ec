"""Sweeping what killed clients left in the dump dir (``dumpdir.sweep``, used by ``hsdump
extract`` for its own run's rids and by a starting bridge for dead bridges' rids): real
directories in tmp_path, no server."""

from __future__ import annotations

import os
import time
from pathlib import Path

from hsdump_patch import protocol
from hsdump_patch.client.bridge import LOCK_PREFIX, LOCK_SUFFIX, Bridge
from hsdump_patch.client.dumps import dumpdir
from hsdump_patch.client.extract import STALE_QUIET_S, Extraction, ExtractSettings, request_id

INFO = protocol.ServerInfo(
    model="/m", architecture="LlamaForCausalLM", layers=(1, 2), layers_source="test",
    has_final=True, hidden_size=8, num_hidden_layers=4, dtype="bfloat16", tp_size=1,
    rid_prefix="hsdump-", sglang_version="0.5.23", hsdump_version="test", pid=1)


def request_dir(dump: Path, rid: str, age: float = 0.0, marker: str | None = None) -> Path:
    """A request directory with one chunk (and ``marker``), last changed ``age`` seconds ago."""
    d = protocol.rid_dir(dump, rid)
    protocol.make_private_dir(d)
    (d / protocol.chunk_filename(0)).write_bytes(b"x")
    if marker == protocol.DONE_MARKER:
        protocol.write_json_atomic(d / marker, protocol.DoneMarker(rid, 1, 1, [0]).to_json())
    elif marker == protocol.ERROR_MARKER:
        protocol.write_json_atomic(d / marker, protocol.ErrorMarker(rid, "x", [0]).to_json())
    when = time.time() - age
    for path in [*d.iterdir(), d]:
        os.utime(path, (when, when))
    return d


def left(dump: Path) -> set[str]:
    return {p.name for p in dump.iterdir() if p.is_dir()}


def test_sweep_removes_owned_final_dirs_and_keeps_changing_and_foreign_ones(tmp_path) -> None:
    """Owned directories go once final: a done or an error marker at once, none once quiet
    for ``quiet`` seconds (what a killed client's aborted request leaves); one that changed
    more recently and every directory not owned stay; the count says what is left."""
    gone = [request_dir(tmp_path, "mine-done", marker=protocol.DONE_MARKER),
            request_dir(tmp_path, "mine-error", marker=protocol.ERROR_MARKER),
            request_dir(tmp_path, "mine-killed", age=60)]
    kept = [request_dir(tmp_path, "mine-writing"),
            request_dir(tmp_path, "other-killed", age=60, marker=protocol.DONE_MARKER)]
    (tmp_path / "mine-file").write_text("not a directory")
    assert dumpdir.sweep(tmp_path, lambda name: name.startswith("mine-"), quiet=5) == 1
    assert left(tmp_path) == {d.name for d in kept}
    assert not any(d.exists() for d in gone)
    assert (tmp_path / "mine-file").exists()


def test_sweep_waits_up_to_timeout_for_a_directory_to_settle(tmp_path) -> None:
    """A directory still changing is left without a timeout; with one, it goes once quiet."""
    request_dir(tmp_path, "mine-writing")
    assert dumpdir.sweep(tmp_path, lambda name: True, quiet=0.5) == 1
    t0 = time.monotonic()
    assert dumpdir.sweep(tmp_path, lambda name: True, quiet=0.5, timeout=10) == 0
    assert 0 < time.monotonic() - t0 < 5 and left(tmp_path) == set()


def test_extract_sweeps_what_a_killed_run_left_of_its_own_rids_only(tmp_path) -> None:
    """Before and after a run, ``hsdump extract`` removes its own run's directories of the
    shard's samples that are final, partial ones of a killed run included; those still
    changing, those of samples outside the shard and of other runs (another extractor's
    --out) stay."""
    dump = tmp_path / "dump"
    dump.mkdir()
    settings = ExtractSettings(server="http://x", out=tmp_path / "out", dump_dir=dump)
    run = Extraction(settings, INFO, client=None, run_id="run1", render_key="k")
    gone = [request_dir(dump, run.rid("a"), age=STALE_QUIET_S + 60),
            request_dir(dump, run.rid("b"), marker=protocol.DONE_MARKER)]
    kept = [request_dir(dump, run.rid("c")),
            request_dir(dump, run.rid("outside"), age=STALE_QUIET_S + 60),
            request_dir(dump, request_id("hsdump-", "run2", "a"), age=STALE_QUIET_S + 60)]
    assert run.sweep_dump_dir(["a", "b", "c"]) == 1
    assert left(dump) == {d.name for d in kept}
    assert not any(d.exists() for d in gone)


def test_a_starting_bridge_removes_what_dead_bridges_left_and_nothing_live(tmp_path) -> None:
    """A dead bridge (its lock file left, held by nobody): its partial and finished request
    directories and its lock file go when a bridge starts. A live bridge's in-flight
    directory, another client's and the new bridge's own lock stay; close removes that."""
    protocol.write_json_atomic(tmp_path / protocol.SERVER_INFO, INFO.to_json())
    live = Bridge(tmp_path, sink=None, engine=None)  # type: ignore[arg-type]
    kept = [request_dir(tmp_path, live._rid(), age=60),
            request_dir(tmp_path, request_id("hsdump-", "run1", "a"), age=60)]
    dead_lock = tmp_path / f"{LOCK_PREFIX}0123456789ab{LOCK_SUFFIX}"
    dead_lock.write_bytes(b"")
    gone = [request_dir(tmp_path, f"hsdump-bridge-0123456789ab-{i}", age=60,
                        marker=protocol.DONE_MARKER if i else None) for i in range(2)]
    bridge = Bridge(tmp_path, sink=None, engine=None)  # type: ignore[arg-type]
    assert bridge.left_by_dead == 0
    assert left(tmp_path) == {d.name for d in kept}
    assert not any(d.exists() for d in gone) and not dead_lock.exists()
    locks = {p.name for p in tmp_path.glob(f"{LOCK_PREFIX}*")}
    assert locks == {f"{LOCK_PREFIX}{b.owner}{LOCK_SUFFIX}" for b in (live, bridge)}
    bridge.close()
    live.close()
    assert list(tmp_path.glob(f"{LOCK_PREFIX}*")) == []
