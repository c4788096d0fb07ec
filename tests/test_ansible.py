"""Real Ansible against this machine: lint, syntax, preflight, /dev/shm, deploy, extract, teardown.

The playbooks run with a local connection on the test machine itself (tests/ansible/ holds the
inventories and the CPU-host variables). The deploy sequence runs once for the module: a
``--check`` run on the fresh host, the real run, and a second run that must change nothing;
the tests then inspect what those runs left, run extract.yml over a two-host inventory, and
finally teardown.yml. The air-gapped image path (a ``docker save`` tarball copied from the
controller, loaded, its id verified) is exercised on its own with a tiny image: moving the
11 GB CPU test image through a tarball would cost CI ~15 minutes and prove nothing more.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
import torch
import yaml

from tests.conftest import require
from tests.harness.server import CPU_SHIM, free_port

# docker_engine and hsdump_image come from tests/fixtures_image.py (a conftest plugin).
ROOT = Path(__file__).resolve().parents[1]
ANSIBLE_DIR = ROOT / "ansible"
CASES = ROOT / "tests" / "ansible"
CPU_VARS = CASES / "cpu-host.yml"
ONE_HOST = CASES / "inventory-one.yml"
TWO_HOSTS = CASES / "inventory-two.yml"
PLAYBOOKS = ("deploy.yml", "teardown.yml", "extract.yml")
SHIM_MOUNT = "/opt/hsdump-cpu-shim"  # where cpu-host.yml's PYTHONPATH expects the harness
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
                 timeout: float = 1500) -> Run:
        """Run ``ansible-playbook`` from ansible/ with the CPU-host vars plus ``extra``."""
        cmd = [str(self.bin / "ansible-playbook"), "-i", str(inventory), str(playbook),
               "-e", f"@{CPU_VARS}"]
        if extra:
            var_file = self.tmp / f"vars-{uuid.uuid4().hex[:8]}.json"
            var_file.write_text(json.dumps(extra))
            cmd += ["-e", f"@{var_file}"]
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


def _shm_bytes() -> int:
    out = subprocess.run(["df", "-B1", "--output=size", "/dev/shm"], check=True,
                         capture_output=True, text=True).stdout
    return int(out.split()[-1])


@pytest.fixture(scope="module")
def host_shm() -> Iterator[None]:
    """Let a test resize /dev/shm and edit /etc/fstab; put both back afterwards."""
    require(os.geteuid() == 0, "root (the tests remount /dev/shm and edit /etc/fstab)")
    fstab = Path("/etc/fstab")
    saved = fstab.read_bytes() if fstab.exists() else None
    size = _shm_bytes()
    yield
    if saved is None:
        fstab.unlink(missing_ok=True)
    else:
        fstab.write_bytes(saved)
    subprocess.run(["mount", "-o", f"remount,size={size // 1024}k", "/dev/shm"], check=True)
    assert _shm_bytes() == size


def expected_shm_kib() -> int:
    """The documented /dev/shm formula, recomputed from the CPU-host vars."""
    v = yaml.safe_load(CPU_VARS.read_text())
    in_flight = (v["hsdump_shm_tokens_in_flight"] * v["hsdump_shm_slots"]
                 * v["hsdump_shm_hidden_size"] * v["hsdump_shm_dtype_bytes"])
    need = max(v["hsdump_shm_min_gib"] * 2**30,
               in_flight * v["hsdump_shm_headroom"] + v["hsdump_shm_reserve_gib"] * 2**30)
    return math.ceil(need / 4096) * 4


def fstab_shm_line() -> str | None:
    for line in Path("/etc/fstab").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 4 and not line.lstrip().startswith("#") and fields[1] == "/dev/shm":
            return line
    return None


# ----------------------------------------------------------------------------- static checks


def test_lint_production_profile_offline(ansible):
    r = subprocess.run([str(ansible.bin / "ansible-lint"), "--nocolor"], cwd=ANSIBLE_DIR,
                       capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    assert "Profile 'production' was required, and it passed" in out, out[-2000:]


@pytest.mark.parametrize("playbook", PLAYBOOKS)
def test_syntax_check(ansible, playbook):
    r = subprocess.run([str(ansible.bin / "ansible-playbook"), "--syntax-check", "-i",
                        str(ONE_HOST), playbook], cwd=ANSIBLE_DIR, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


# ----------------------------------------------------------------------------- preflight, shm


def test_preflight_without_gpus_fails_clearly(ansible):
    require(shutil.which("nvidia-smi") is None, "a machine without nvidia-smi")
    run = ansible.playbook("deploy.yml", ONE_HOST, tags="preflight",
                           extra={"hsdump_gpu_checks": True})
    assert run.rc != 0, run.output[-4000:]
    assert run.recap()["cpu-host"]["failed"] == 1
    flat = " ".join(run.output.split())
    assert "No usable GPU on cpu-host: nvidia-smi is not installed (not on PATH)" in flat, flat
    assert "set hsdump_gpu_checks=false and hsdump_gpu_mode=none" in flat


def test_preflight_parses_gpus_and_rejects_an_old_driver(ansible, tmp_path):
    # Stand-in for the driver's CLI only: prints what nvidia-smi prints for this query on an
    # 8x RTX PRO 6000 host with a pre-CUDA-13 driver; the role's parsing and checks are real.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + "".join(
        f"echo '{i}, NVIDIA RTX PRO 6000 Blackwell Server Edition, 570.86.15, 97887'\n"
        for i in range(8)))
    smi.chmod(0o755)
    run = ansible.playbook("deploy.yml", ONE_HOST, tags="preflight", path_prepend=bin_dir,
                           extra={"hsdump_gpu_checks": True})
    assert run.rc != 0
    flat = " ".join(run.output.split())
    assert "check the GPU count" in flat and "check the GPU model" in flat  # both passed
    assert ("cpu-host runs NVIDIA driver 570.86.15; the CUDA 13 images need >= 580.65.06"
            in flat), flat[-3000:]


def test_shm_resized_persisted_and_idempotent(ansible, host_shm):
    kib = expected_shm_kib()
    assert kib * 1024 != _shm_bytes(), "pick test vars that change the size"
    first = ansible.playbook(CASES / "shm.yml", ONE_HOST)
    first.assert_ok("hsdump_shm")
    assert first.recap()["cpu-host"]["changed"] == 2  # the fstab line, the remount
    assert _shm_bytes() == kib * 1024
    assert fstab_shm_line().split() == ["tmpfs", "/dev/shm", "tmpfs",
                                        f"rw,nosuid,nodev,size={kib}k", "0", "0"]
    again = ansible.playbook(CASES / "shm.yml", ONE_HOST)
    again.assert_ok("hsdump_shm, second run")
    assert again.recap()["cpu-host"]["changed"] == 0, again.output[-4000:]


# ----------------------------------------------------------------------------- deploy sequence


@dataclass
class Deployment:
    """What the module's deploy sequence used and what its runs returned."""

    vars: dict
    image_id: str
    check_fresh: Run
    first: Run
    second: Run


def _docker(*args: str, check: bool = True) -> str:
    return subprocess.run(["docker", *args], check=check, capture_output=True, text=True).stdout


def test_image_loaded_from_a_tarball_and_verified(ansible, docker_engine, tmp_path):
    """The air-gapped path: `docker save` tarball on the controller, copied, loaded, id checked,
    staged copy removed; a second run fetches nothing; a wrong id fails with its message."""
    name, tag = "hsdump-ansible-tiny", f"ci-{uuid.uuid4().hex[:8]}"
    content = tmp_path / "rootfs"
    content.mkdir()
    (content / "hello.txt").write_text("a tiny image for the tarball path\n")
    tar = subprocess.run(["tar", "-C", str(content), "-cf", "-", "."], check=True,
                         capture_output=True).stdout
    subprocess.run(["docker", "import", "-", f"{name}:{tag}"], input=tar, check=True,
                   capture_output=True)
    image_id = _docker("image", "inspect", "-f", "{{.Id}}", f"{name}:{tag}").strip()
    tarball = tmp_path / f"{name}-{tag}.tar"
    _docker("save", "-o", str(tarball), f"{name}:{tag}")
    _docker("rmi", f"{name}:{tag}")
    v = {"hsdump_image_name": name, "hsdump_image_tag": tag, "hsdump_image_id": image_id,
         "hsdump_image_source": "tarball", "hsdump_image_tarball": str(tarball),
         "hsdump_state_dir": str(tmp_path / "state")}
    try:
        first = ansible.playbook("deploy.yml", ONE_HOST, extra=v, tags="image")
        first.assert_ok("deploy.yml --tags image (tarball)")
        assert first.recap()["cpu-host"]["changed"] > 0
        assert _docker("image", "inspect", "-f", "{{.Id}}", f"{name}:{tag}").strip() == image_id
        assert not (tmp_path / "state" / tarball.name).exists()  # no second copy left behind
        second = ansible.playbook("deploy.yml", ONE_HOST, extra=v, tags="image")
        second.assert_ok("second deploy.yml --tags image")
        assert second.recap()["cpu-host"]["changed"] == 0
        wrong = ansible.playbook("deploy.yml", ONE_HOST, tags="image",
                                 extra={**v, "hsdump_image_id": "sha256:" + "0" * 64})
        assert wrong.rc != 0
        assert f"has id {image_id}, expected hsdump_image_id=sha256:" in wrong.output
    finally:
        _docker("rmi", f"{name}:{tag}", check=False)


@pytest.fixture(scope="module")
def deployment(ansible, host_shm, docker_engine, hsdump_image, tiny_models,
               tmp_path_factory) -> Iterator[Deployment]:
    """Check-mode run on the fresh host, then deploy.yml twice; teardown.yml afterwards."""
    tmp = tmp_path_factory.mktemp("deploy")
    tag = f"ci-{uuid.uuid4().hex[:8]}"
    name = "hsdump-ansible-test"
    # The image is present on the host with the expected id, so the image role verifies it
    # and fetches nothing (the tarball path has its own test below).
    _docker("tag", hsdump_image, f"{name}:{tag}")
    image_id = _docker("image", "inspect", "-f", "{{.Id}}", f"{name}:{tag}").strip()
    tarball = tmp / "not-needed.tar"
    v = {
        "hsdump_image_name": name, "hsdump_image_tag": tag, "hsdump_image_id": image_id,
        "hsdump_image_source": "tarball", "hsdump_image_tarball": str(tarball),
        "hsdump_container_name": f"{name}-{tag}",
        "hsdump_server_port": free_port(),
        "hsdump_model_dir": str(tiny_models / "tiny-llama"),
        "hsdump_dump_dir": f"/dev/shm/{name}-{tag}",
        "hsdump_output_dir": str(tmp / "output"),
        "hsdump_data_dir": str(tmp / "data"),
        "hsdump_state_dir": str(tmp / "state"),
        "hsdump_config_dir": str(tmp / "etc"),
        "hsdump_smoke_fetch_dir": str(tmp / "reports"),
        "hsdump_extract_fetch_dir": str(tmp / "reports"),
        "hsdump_server_extra_volumes": [f"{CPU_SHIM}:{SHIM_MOUNT}:ro"],
    }
    try:
        check_fresh = ansible.playbook("deploy.yml", ONE_HOST, extra=v, check=True)
        first = ansible.playbook("deploy.yml", ONE_HOST, extra=v)
        second = ansible.playbook("deploy.yml", ONE_HOST, extra=v) if first.rc == 0 else first
        yield Deployment(v, image_id, check_fresh, first, second)
    finally:
        _docker("rm", "-f", v["hsdump_container_name"], check=False)
        _docker("rmi", f"{name}:{tag}", check=False)
        shutil.rmtree(v["hsdump_dump_dir"], ignore_errors=True)
        tarball.unlink(missing_ok=True)


class TestDeploy:
    """Runs in order: deploy checks, extract over two hosts, then teardown."""

    def test_check_mode_on_fresh_host(self, deployment):
        deployment.check_fresh.assert_ok("deploy.yml --check")

    def test_deploy_converges(self, deployment):
        deployment.first.assert_ok("deploy.yml")
        v = deployment.vars
        info = json.loads(_docker("inspect", v["hsdump_container_name"]))[0]
        assert info["State"]["Running"]
        assert info["Image"] == deployment.image_id
        assert info["HostConfig"]["IpcMode"] == "host"
        assert info["HostConfig"]["NetworkMode"] == "host"
        port = v["hsdump_server_port"]
        listening = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], check=True,
                                   capture_output=True, text=True).stdout.splitlines()
        # Column 4 of `ss -ltn` is the local address: loopback only, nothing on 0.0.0.0 or [::].
        assert {line.split()[3] for line in listening if line.strip()} == {f"127.0.0.1:{port}"}
        mounts = {m["Destination"]: m for m in info["Mounts"]}
        assert mounts[SHIM_MOUNT]["RW"] is False and mounts["/model"]["RW"] is False
        assert requests.get(f"http://127.0.0.1:{port}/ready", timeout=10).status_code == 200

    def test_shm_sized_and_persisted(self, deployment):
        deployment.first.assert_ok("deploy.yml")
        kib = expected_shm_kib()
        assert _shm_bytes() == kib * 1024
        assert f"size={kib}k" in fstab_shm_line()

    def test_smoke_report_fetched_and_passed(self, deployment):
        deployment.first.assert_ok("deploy.yml")
        report = Path(deployment.vars["hsdump_smoke_fetch_dir"]) / "cpu-host" / "smoke-report.json"
        verdict = json.loads(report.read_text())
        assert verdict["passed"] is True, verdict
        assert verdict["checks"] and all(c["passed"] for c in verdict["checks"])
        assert "all-reduce across the GPUs" in deployment.first.output

    def test_second_run_changes_nothing(self, deployment):
        deployment.second.assert_ok("deploy.yml, second run")
        assert deployment.second.recap()["cpu-host"]["changed"] == 0, deployment.second.output

    def test_extract_two_hosts_write_each_sample_once(self, ansible, deployment, tmp_path):
        ids = [f"s{i}" for i in range(8)]  # 5 + 3 over the two shards
        dataset = tmp_path / "dataset.jsonl"
        dataset.write_text("".join(json.dumps({"id": i, "messages": [
            {"role": "user", "content": f"Question {i}: what is the capital of France?"},
            {"role": "assistant", "content": "Paris is the capital of France." * (1 + k % 3)},
        ]}) + "\n" for k, i in enumerate(ids)))
        run = ansible.playbook("extract.yml", TWO_HOSTS,
                               extra={**deployment.vars, "hsdump_extract_dataset": str(dataset)})
        run.assert_ok("extract.yml")
        base = Path(deployment.vars["hsdump_output_dir"]) / "extract"
        shards = sorted(base.glob("shard-*-of-2"))
        assert [s.name for s in shards] == ["shard-0-of-2", "shard-1-of-2"]
        seen: list[str] = []
        for shard in shards:
            entries = [json.loads(line) for m in shard.glob("manifest.*.jsonl")
                       for line in m.read_text().splitlines()]
            assert entries, f"{shard} wrote nothing"
            for e in entries:
                record = torch.load(shard / e["file"], weights_only=True)
                assert len(record["input_ids"]) > 0 and record["hidden_states"]
            assert sorted(p.name for p in shard.glob("*.pt")) == sorted(e["file"] for e in entries)
            seen += [e["id"] for e in entries]
        assert sorted(seen) == sorted(ids)  # every sample, exactly once across the shards
        for host in ("cpu-host-a", "cpu-host-b"):
            assert (Path(deployment.vars["hsdump_extract_fetch_dir"]) / host
                    / "extract-report.json").is_file()

    def test_teardown_leaves_host_clean(self, ansible, deployment):
        run = ansible.playbook("teardown.yml", ONE_HOST, extra=deployment.vars)
        run.assert_ok("teardown.yml")
        v = deployment.vars
        assert _docker("ps", "-aq", "--filter", f"name=^{v['hsdump_container_name']}$") == ""
        assert _docker("ps", "-aq", "--filter", "label=io.hsdump.managed=true") == ""
        assert _docker("images", "-q", f"{v['hsdump_image_name']}:{v['hsdump_image_tag']}") == ""
        for key in ("hsdump_dump_dir", "hsdump_state_dir", "hsdump_config_dir"):
            assert not Path(v[key]).exists(), key
        # Training records are data: teardown keeps them.
        assert (Path(v["hsdump_output_dir"]) / "extract").is_dir()
