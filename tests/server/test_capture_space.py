"""A dump dir running out of space yields error markers, never a full disk or a dead server."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import requests

from hsdump_patch import protocol
from tests.harness.dump_server import prompt, start_dump_server
from tests.harness.dumps import wait_finished
from tests.harness.needs import require

pytestmark = pytest.mark.server

FS_SIZE = 1 << 20
RESERVE = 256 << 10


@pytest.fixture(scope="module")
def small_fs_server(tiny_models, tmp_path_factory):
    require(os.geteuid() == 0 and shutil.which("mount") is not None,
            "root and mount(8), to mount a 1 MiB tmpfs as the dump dir")
    tmp = tmp_path_factory.mktemp("space")
    dump_dir = tmp / "dump-small"
    dump_dir.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={FS_SIZE},mode=0700", "tmpfs",
                    str(dump_dir)], check=True)
    try:
        s = start_dump_server(tmp, tiny_models / "tiny-llama", "small",
                              env={"SGLANG_HS_DUMP_MIN_FREE_BYTES": str(RESERVE)})
        assert s.dump_dir == dump_dir
        yield s
        s.server.stop()
    finally:
        subprocess.run(["umount", "-l", str(dump_dir)], check=False)


def free_bytes(path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def test_full_dump_dir_gives_error_markers_and_the_server_keeps_serving(small_fs_server):
    s = small_fs_server
    ids = prompt(1, 100)  # ~40 KB of hidden states per request
    outcomes: list[str] = []
    for i in range(30):
        rid = f"hsdump-space-{i}"
        s.server.generate(ids, rid=rid)
        status = wait_finished(s.dump_dir, rid)
        assert status.finished, f"{rid}: no marker within 60 s (a dropped request)"
        outcomes.append("done" if status.done else "error")
        if status.error:
            assert "not enough free space" in status.error.reason
            assert "SGLANG_HS_DUMP_MIN_FREE_BYTES" in status.error.reason
            assert protocol.list_chunks(s.dump_dir, rid) == []
        # The reserve is only eaten into by the markers: a directory and a small file per
        # failed request, one tmpfs page (4 KiB) each.
        assert free_bytes(s.dump_dir) >= RESERVE - 2 * 4096 * outcomes.count("error")
    assert outcomes[0] == "done" and outcomes[-1] == "error"
    assert outcomes == sorted(outcomes)  # every request succeeds until space runs out
    # The server is alive and well, and dumps again once the space is freed: a new rid, and
    # a failed rid re-sent (as a resumed client run does, after removing its directory).
    assert requests.get(f"{s.url}/health_generate", timeout=60).status_code == 200
    for entry in os.scandir(s.dump_dir):
        if entry.is_dir():
            shutil.rmtree(entry.path)
    s.server.generate(ids, rid="hsdump-space-again")
    assert wait_finished(s.dump_dir, "hsdump-space-again").done is not None
    failed = f"hsdump-space-{outcomes.index('error')}"
    s.server.generate(ids, rid=failed)
    status = wait_finished(s.dump_dir, failed, timeout=30)
    assert status.error is None and status.done.prompt_len == len(ids)
