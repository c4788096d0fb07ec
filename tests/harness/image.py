"""Fixtures for tests that need a container engine or the hsdump image (a pytest plugin of
tests/conftest.py).

``docker_engine`` makes sure a real Docker engine answers (starting ``dockerd
--iptables=false`` when root and none answers; ``make prereqs`` installs Debian's
``docker.io``); ``hsdump_image`` builds the CPU stand-in of the official SGLang image once
(``tests/image/build_standin.sh``) and the real ``Dockerfile`` on top of it with
``make image``, and returns the image tag.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.harness.needs import require

REPO = Path(__file__).resolve().parents[2]
STANDIN_TAG = "hsdump-test/sglang-standin:0.5.23"
IMAGE_TAG = "hsdump-test/hsdump-sglang:test"
DOCKERD_LOG = Path("/var/log/hsdump-test-dockerd.log")


@dataclass(frozen=True)
class Engine:
    """A working container engine CLI, and the dockerd process the fixture started (if any)."""

    cli: str
    started: subprocess.Popen | None = None

    def run(self, *args: str, check: bool = True, timeout: float = 900,
            **kw) -> subprocess.CompletedProcess:
        """Run ``<cli> args...`` capturing text output; raise with the output on failure."""
        r = subprocess.run([self.cli, *args], capture_output=True, text=True, timeout=timeout,
                           check=False, **kw)
        if check and r.returncode != 0:
            raise AssertionError(f"{self.cli} {' '.join(args[:3])}... exited {r.returncode}:\n"
                                 f"{r.stdout[-4000:]}\n{r.stderr[-4000:]}")
        return r


def _answers(cli: str) -> bool:
    return subprocess.run([cli, "info"], capture_output=True, timeout=60,
                          check=False).returncode == 0


def _start_dockerd() -> subprocess.Popen:
    require(shutil.which("dockerd") is not None, "dockerd (Debian's docker.io: make prereqs)")
    # No iptables in this sandbox: containers use --network host (no NAT, no port mapping).
    log = open(DOCKERD_LOG, "a")  # noqa: SIM115 - owned by the daemon process
    return subprocess.Popen(["dockerd", "--iptables=false"], stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)


@pytest.fixture(scope="session")
def docker_engine() -> Iterator[Engine]:
    """A Docker engine that answers; started here (and stopped at the end) if it was not."""
    cli = shutil.which("docker") or "docker"
    if shutil.which("docker") and _answers(cli):
        yield Engine(cli)
        return
    require(os.geteuid() == 0, "a running Docker engine, or root to install and start one")
    proc = _start_dockerd()
    cli = shutil.which("docker") or "/usr/bin/docker"
    deadline = time.monotonic() + 120
    while not _answers(cli):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"dockerd did not come up; see {DOCKERD_LOG}:\n"
                        f"{DOCKERD_LOG.read_text()[-3000:]}")
        time.sleep(1)
    yield Engine(cli, proc)
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def build_standin(engine: Engine, tag: str = STANDIN_TAG) -> str:
    """Build the CPU stand-in of the official SGLang image (skipped when the engine has it)."""
    venv = Path(os.environ.get("VENV", REPO / ".venv"))
    require((venv / "bin" / "python").exists(), f"the project venv at {venv} (make venv)")
    env = dict(os.environ, ENGINE=engine.cli, VENV=str(venv))
    r = subprocess.run(["bash", "tests/image/build_standin.sh", tag], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=1800, check=False)
    assert r.returncode == 0, f"stand-in build failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return tag


def make_image(engine: Engine, base: str, tag: str) -> subprocess.CompletedProcess:
    """``make image`` of the real Dockerfile FROM ``base``; returns the finished process."""
    return subprocess.run(
        ["make", "--no-print-directory", "image", f"ENGINE={engine.cli}", f"BASE_IMAGE={base}",
         f"IMAGE_TAG={tag}"],
        cwd=REPO, capture_output=True, text=True, timeout=1800, check=False)


@pytest.fixture(scope="session")
def standin_image(docker_engine: Engine) -> str:
    """Tag of the CPU stand-in of ``lmsysorg/sglang`` (sglang 0.5.23 in the system Python)."""
    return build_standin(docker_engine)


@pytest.fixture(scope="session")
def hsdump_image(docker_engine: Engine, standin_image: str) -> str:
    """Tag of the real ``Dockerfile`` built by ``make image`` on the stand-in base."""
    r = make_image(docker_engine, standin_image, IMAGE_TAG)
    assert r.returncode == 0, f"make image failed:\n{r.stdout[-5000:]}\n{r.stderr[-3000:]}"
    return IMAGE_TAG
