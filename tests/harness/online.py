"""A local Mooncake and SpecForge 0.2.0's own online-training producer pieces, for the bridge's
tests and benchmark (test-only; SpecForge's code comes from ``$HSDUMP_SPECFORGE_PATH``)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hsdump_patch.client.bridge import Bridge, mooncake_commands
from hsdump_patch.ops.launch import free_port


def wait_port(port: int, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not listen on {port} within 30s")


@contextlib.contextmanager
def local_mooncake(logs: Path) -> Iterator[dict[str, str]]:
    """A Mooncake master and HTTP metadata server on free ports of 127.0.0.1 only (their logs
    under ``logs``), stopped on exit; their endpoints."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or spec.origin is None:
        raise RuntimeError("mooncake is not importable: install mooncake-transfer-engine-non-cuda "
                           "(requirements-test.txt)")
    package = Path(spec.origin).parent
    rpc, metrics, meta = free_port(), free_port(), free_port()
    # The wheel's own master binary (its console script only execs it).
    master, metadata = mooncake_commands(rpc, meta, metrics_port=metrics,
                                         master=str(package / "mooncake_master"),
                                         python=sys.executable)
    with open(logs / "master.log", "w") as master_log, \
            open(logs / "metadata.log", "w") as meta_log:
        procs = [
            subprocess.Popen([*master, "-rpc_thread_num=2"], stdout=master_log,
                             stderr=subprocess.STDOUT),
            subprocess.Popen(metadata,
                             env={**os.environ, "PYTHONPATH": str(package.parent)},
                             stdout=meta_log, stderr=subprocess.STDOUT),
        ]
        try:
            wait_port(rpc, procs[0], "mooncake_master")
            wait_port(meta, procs[1], "the metadata server")
            yield {"master": f"127.0.0.1:{rpc}", "metadata": f"http://127.0.0.1:{meta}/metadata"}
        finally:
            for p in procs:
                p.terminate()
                p.wait(timeout=30)


def sf_adapter(store, bridge: Bridge | None, lose_response: bool = False, url: str = ""):
    """SpecForge's own adapter for eagle3's server-streaming layout, posting to ``bridge``."""
    from specforge.inference.adapters.server_capture import (
        ServerCaptureSchema,
        SGLangServerCaptureAdapter,
    )

    def post(url: str, json_body: dict[str, Any], timeout: float) -> Any:
        assert url.endswith("/generate")
        rows = bridge.generate(json_body)
        if lose_response:
            raise ConnectionError("response lost after the bridge answered")
        return rows

    # specforge/algorithms/eagle3/providers.py: server_streaming ServerCaptureLayout
    schema = ServerCaptureSchema(aux_feature="hidden_state", last_hidden_feature="target",
                                 passthrough=(("input_ids", "input_ids", ()),
                                              ("loss_mask", "loss_mask", ())),
                                 attention_mask_feature="attention_mask")
    # Without a bridge object: SpecForge's own HTTP client (requests) to the bridge at ``url``.
    return SGLangServerCaptureAdapter(url or "http://bridge", store, run_id="run",
                                      algorithm="eagle3", schema=schema,
                                      post_fn=post if bridge is not None else None)


def sf_capture(layers: tuple[int, ...], hidden: int):
    """SpecForge's capture config for eagle3: aux ``layers`` (its ids), final state, ids, masks."""
    from specforge.inference.capture import CaptureConfig

    return CaptureConfig.from_strategy(
        {"hidden_state", "target", "input_ids", "loss_mask", "attention_mask"}, layers,
        target_repr="hidden_state", target_hidden_size=hidden)


# Debian's libraries Mooncake's wheel links (the official SGLang image ships them; the CPU
# stand-in of it does not).
RDMA_LIBS = "libibverbs1 librdmacm1 libnuma1"


def image_with_rdma_libs(engine, base: str) -> str:
    """Tag of ``base`` with Debian's :data:`RDMA_LIBS` added (built with the host's network;
    the caller removes it)."""
    tag = f"{base.rsplit(':', 1)[0]}:bridge-libs-{os.getpid()}"
    engine.run("build", "--network", "host", "-t", tag, "-", input=(
        f"FROM {base}\nRUN apt-get update && apt-get install -y --no-install-recommends "
        f"{RDMA_LIBS} && rm -rf /var/lib/apt/lists/*\n"))
    return tag
