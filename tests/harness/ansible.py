"""Shared by the Ansible lane (tests/ansible/test_ansible*.py; a pytest plugin of
tests/conftest.py): the paths, the ``ansible`` fixture that runs real ansible-playbook, the
Debian host image, a docker helper."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.harness.needs import require

ROOT = Path(__file__).resolve().parents[2]
ANSIBLE_DIR = ROOT / "ansible"
CASES = ROOT / "tests" / "ansible" / "playbooks"
CPU_VARS = CASES / "cpu-host.yml"
ONE_HOST = CASES / "inventory-one.yml"
TWO_HOSTS = CASES / "inventory-two.yml"
RECAP = re.compile(r"^(\S+)\s+:\s+ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)",
                   re.MULTILINE)


@dataclass
class Run:
    """One finished ansible-playbook run."""

    rc: int
    output: str

    def recap(self) -> dict[str, dict[str, int]]:
        """``host -> {ok, changed, unreachable, failed}`` from the PLAY RECAP."""
        return {m[1]: dict(zip(("ok", "changed", "unreachable", "failed"),
                               map(int, m.groups()[1:]), strict=True))
                for m in RECAP.finditer(self.output)}

    def assert_ok(self, what: str) -> None:
        assert self.rc == 0, f"{what} failed (rc={self.rc}):\n{self.output[-8000:]}"
        assert self.recap(), f"{what}: no PLAY RECAP:\n{self.output[-4000:]}"
        assert all(r["failed"] == 0 and r["unreachable"] == 0 for r in self.recap().values())


@dataclass
class Ansible:
    """The Ansible tools of .venv-ansible and a scratch dir for their temp and var files."""

    bin: Path
    tmp: Path

    def playbook(self, playbook: str | Path, inventory: Path, *, extra: dict | None = None,
                 check: bool = False, tags: str | None = None, path_prepend: Path | None = None,
                 vault: tuple[Path, Path] | None = None, timeout: float = 1500) -> Run:
        """Run ``ansible-playbook`` from ansible/ with the CPU-host vars plus ``extra``, and
        ``vault`` = (encrypted vars file, its password file) when given."""
        cmd = [str(self.bin / "ansible-playbook"), "-i", str(inventory), str(playbook),
               "-e", f"@{CPU_VARS}"]
        if extra:
            var_file = self.tmp / f"vars-{uuid.uuid4().hex[:8]}.json"
            var_file.write_text(json.dumps(extra))
            cmd += ["-e", f"@{var_file}"]
        if vault:
            cmd += ["-e", f"@{vault[0]}", "--vault-password-file", str(vault[1])]
        if check:
            cmd.append("--check")
        if tags:
            cmd += ["--tags", tags]
        env = dict(os.environ, ANSIBLE_NOCOLOR="1", ANSIBLE_FORCE_COLOR="0",
                   ANSIBLE_LOCAL_TEMP=str(self.tmp / "local"),
                   ANSIBLE_REMOTE_TEMP=str(self.tmp / "remote"))
        if path_prepend:
            env["PATH"] = f"{path_prepend}{os.pathsep}{env['PATH']}"
        r = subprocess.run(cmd, cwd=ANSIBLE_DIR, env=env, capture_output=True, text=True,
                           timeout=timeout)
        return Run(r.returncode, r.stdout + r.stderr)


@pytest.fixture(scope="session")
def ansible(tmp_path_factory) -> Ansible:
    """ansible + ansible-lint from ansible/requirements-dev.txt (``make ansible-venv``)."""
    r = subprocess.run(["make", "-s", "ansible-venv"], cwd=ROOT, capture_output=True, text=True)
    tools = ROOT / ".venv-ansible" / "bin"
    require(r.returncode == 0 and (tools / "ansible-playbook").exists(),
            f"make ansible-venv (rc={r.returncode}): {r.stderr[-2000:]}")
    return Ansible(tools, tmp_path_factory.mktemp("ansible"))


def _docker(*args: str, check: bool = True) -> str:
    return subprocess.run(["docker", *args], check=check, capture_output=True, text=True).stdout


# A Debian bookworm host image (Debian's minbase with python3) for Ansible's docker connection
# and stand-in containers.
DEBIAN_TAG = "hsdump-test/debian-host:bookworm"
# Its own root file system: the stand-in image's (tests/image/build_standin.sh) has pip and curl,
# which a bare host lacks, and sharing one folder let whichever ran first decide its packages.
DEBIAN_ROOTFS = ROOT / ".cache" / "image" / "rootfs-bookworm-host"


def _debian_image() -> str:
    """DEBIAN_TAG: Debian's minbase with python3, bootstrapped once into .cache, imported."""
    if _docker("images", "-q", DEBIAN_TAG).strip() != "":
        return DEBIAN_TAG
    if not (DEBIAN_ROOTFS / ".complete").exists():
        require(shutil.which("debootstrap") is not None, "debootstrap (make prereqs)")
        subprocess.run(["debootstrap", "--variant=minbase", "--include=python3", "bookworm",
                        str(DEBIAN_ROOTFS), "http://deb.debian.org/debian"], check=True,
                       capture_output=True, timeout=1200)
        (DEBIAN_ROOTFS / ".complete").touch()
    tar = subprocess.Popen(["tar", "-C", str(DEBIAN_ROOTFS), "-c", "."], stdout=subprocess.PIPE)
    subprocess.run(["docker", "import", "-", DEBIAN_TAG], stdin=tar.stdout, check=True,
                   capture_output=True)
    assert tar.wait() == 0
    return DEBIAN_TAG
