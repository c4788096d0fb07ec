"""Real Ansible against this machine: lint, syntax, preflight, /dev/shm, deploy, extract, teardown.

The playbooks run with a local connection on the test machine itself (tests/ansible/playbooks/
holds the inventories and the CPU-host variables). The deploy sequence runs once for the module: a
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
import shlex
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
import torch
import yaml

from tests.harness.ansible import (
    ANSIBLE_DIR,
    CASES,
    CPU_VARS,
    DEBIAN_TAG,
    ONE_HOST,
    TWO_HOSTS,
    Run,
    _debian_image,
    _docker,
)
from tests.harness.needs import require
from tests.harness.server import CPU_SHIM, free_port

# docker_engine and hsdump_image come from tests/harness/image.py, ansible from
# tests/harness/ansible.py (plugins of tests/conftest.py).
PLAYBOOKS = ("deploy.yml", "teardown.yml", "extract.yml", "verify.yml", "upgrade.yml")
SHIM_MOUNT = "/opt/hsdump-cpu-shim"  # where cpu-host.yml's PYTHONPATH expects the harness




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


def _is_shm_entry(line: str) -> bool:
    """An fstab line that mounts /dev/shm (not a comment)."""
    fields = line.split()
    return len(fields) >= 4 and not line.lstrip().startswith("#") and fields[1] == "/dev/shm"


def fstab_shm_line() -> str | None:
    return next(filter(_is_shm_entry, Path("/etc/fstab").read_text().splitlines()), None)


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
        f"echo '{i}, NVIDIA RTX PRO 6000 Blackwell Server Edition, 570.86.15, 97887, Disabled, 0'\n"
        for i in range(8)))
    smi.chmod(0o755)
    run = ansible.playbook("deploy.yml", ONE_HOST, tags="preflight", path_prepend=bin_dir,
                           extra={"hsdump_gpu_checks": True})
    assert run.rc != 0
    flat = " ".join(run.output.split())
    assert "check the GPU count" in flat and "check the GPU model" in flat  # both passed
    assert ("cpu-host runs NVIDIA driver 570.86.15; the CUDA 13 images need >= 580.65.06"
            in flat), flat[-3000:]


def test_preflight_ram_tolerance_string_override_and_missing_model(ansible, tmp_path):
    """-e overrides arrive as strings; a nominal size passes within the tolerance; a missing
    model dir fails with the path and the setting, in seconds."""
    mem_kib = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0])
    nominal = math.ceil(mem_kib / 2**20)  # e.g. "1024" on a host reporting 1007 GiB
    missing = tmp_path / "no-such-model"
    run = ansible.playbook("deploy.yml", ONE_HOST, tags="preflight", extra={
        "hsdump_preflight_min_ram_gib": str(nominal), "hsdump_model_dir": str(missing)})
    flat = " ".join(run.output.split())
    assert run.rc != 0 and run.recap()["cpu-host"]["failed"] == 1, run.output[-4000:]
    assert f"The model at cpu-host:{missing} (hsdump_model_dir) is missing or incomplete" in flat
    assert f"{missing} does not exist or is not a directory" in flat
    assert "check the RAM" in flat and "less than hsdump_preflight_min_ram_gib" not in flat
    too_much = ansible.playbook("deploy.yml", ONE_HOST, tags="preflight", extra={
        "hsdump_preflight_min_ram_gib": str(2 * nominal), "hsdump_model_dir": str(missing)})
    assert too_much.rc != 0
    too_much_flat = " ".join(too_much.output.split())
    assert f"less than hsdump_preflight_min_ram_gib={2 * nominal}" in too_much_flat


def test_preflight_finds_a_truncated_shard(ansible, tiny_models, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_models / "tiny-llama", model)
    shard = next(model.glob("*.safetensors"))
    size = shard.stat().st_size
    with shard.open("r+b") as f:
        f.truncate(size - 1000)
    run = ansible.playbook("deploy.yml", ONE_HOST, tags="preflight",
                           extra={"hsdump_model_dir": str(model)})
    flat = " ".join(run.output.split())
    assert run.rc != 0, flat[-3000:]
    assert f"{shard.name}: {size - 1000} bytes, its header implies {size} (truncated copy?)" in flat


def test_preflight_fails_on_a_fabric_that_is_not_up(ansible, tiny_models, tmp_path):
    """An HGX B200 host without Fabric Manager: nvidia-smi lists 8 healthy GPUs, but the
    fabric state is not Completed; preflight names the fix instead of a crash-looping server."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    # Stand-in for the driver's CLI: the query output and the `-q` fabric section of such a host.
    smi.write_text('#!/bin/sh\nif [ "$1" = -q ]; then\n' + "".join(
        f"echo 'GPU 0000:{i:02x}:00.0'; echo '    Fabric';"
        " echo '        State                 : In Progress';"
        " echo '        Status                : N/A'\n" for i in range(8))
        + "exit 0\nfi\n" + "".join(
        f"echo '{i}, NVIDIA B200, 580.95.05, 183359, Disabled, 0'\n" for i in range(8)))
    smi.chmod(0o755)
    run = ansible.playbook("deploy.yml", ONE_HOST, tags="preflight", path_prepend=bin_dir,
                           extra={"hsdump_gpu_checks": True, "hsdump_preflight_gpu_count": 8,
                                  "hsdump_model_dir": str(tiny_models / "tiny-llama")})
    flat = " ".join(run.output.split())
    assert run.rc != 0
    assert "check the driver version" in flat and "check that MIG is off" in flat
    assert ("The NVLink fabric on cpu-host is not up (nvidia-smi -q: state In Progress, status N/A)"
            in flat), flat[-3000:]
    assert "hsdump_driver_fabricmanager=true" in flat


# Stand-ins for the driver's tools on an 8x H200 host, in the formats of NVIDIA's nvidia-smi
# (query CSV, `-q`, `-q -d ROW_REMAPPER`) and of the kernel log (dmesg).
H200_BUS = [f"00000000:{b:02X}:00.0" for b in (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)]


def _h200_smi(bin_dir: Path, *, recovery: dict[int, str], pending: set[int],
              failure: set[int]) -> None:
    """``nvidia-smi`` for 8 healthy H200s except the given row remapper and recovery flags."""
    def block(i: int, lines: list[str]) -> str:
        return "".join(f"echo '{x}'\n" for x in [f"GPU {H200_BUS[i]}", *lines])
    full = "".join(block(i, [
        "    Product Name                          : NVIDIA H200",
        "    Fabric", "        State                             : Completed",
        "        Status                            : Success",
        "    GPU Reset Status",
        "        Reset Required                    : Requested functionality has been deprecated",
        f"    GPU Recovery Action                   : {recovery.get(i, 'None')}",
    ]) for i in range(8))
    rows = "".join(block(i, [
        "    Remapped Rows", "        Correctable Error                 : 0",
        f"        Uncorrectable Error               : {int(i in pending)}",
        f"        Pending                           : {'Yes' if i in pending else 'No'}",
        f"        Remapping Failure Occurred        : {'Yes' if i in failure else 'No'}",
        "        Bank Remap Availability Histogram",
        "            Max                           : 639 bank(s)"]) for i in range(8))
    smi = bin_dir / "nvidia-smi"
    smi.write_text(
        '#!/bin/sh\nhead() { echo "==============NVSMI LOG=============="; echo;'
        " echo 'Driver Version                            : 580.95.05'; echo;"
        " echo 'Attached GPUs                             : 8'; }\n"
        f'if [ "$*" = "-q -d ROW_REMAPPER" ]; then head\n{rows}exit 0; fi\n'
        f'if [ "$1" = -q ]; then head\n{full}exit 0; fi\n'
        + "".join(f"echo '{i}, NVIDIA H200, 580.95.05, 143771, Disabled, 0'\n" for i in range(8)))
    smi.chmod(0o755)


def _dmesg(bin_dir: Path, lines: list[str]) -> None:
    dmesg = bin_dir / "dmesg"
    dmesg.write_text("#!/bin/sh\n" + "".join(f"echo \"{x}\"\n" for x in lines))
    dmesg.chmod(0o755)


DRIVER_LOAD = ("NVRM: loading NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build"
               "  (dvs-builder@U22-I3-AF03-09-1)  Tue Sep 23 09:21:06 UTC 2025")
XID_79 = ("NVRM: Xid (PCI:0000:2a:00): 79, pid='<unknown>', name=<unknown>, "
          "GPU has fallen off the bus.")


def test_preflight_gpu_faults_xid_since_driver_load_row_remapper_recovery(ansible, tmp_path):
    """An Xid from before the driver's last load no longer fails (a reset never clears dmesg,
    a reload does); a pending remap, a remapping failure and a recovery action fail with the
    fix per GPU; an Xid after the load asks for a reboot, not a GPU reset."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    extra = {"hsdump_gpu_checks": True, "hsdump_preflight_gpu_count": 8}
    _h200_smi(bin_dir, recovery={2: "Reboot", 3: "Drain P2P"}, pending={0}, failure={1})
    _dmesg(bin_dir, [f"[    4.901234] {DRIVER_LOAD}", f"[ 8123.456789] {XID_79}",
                     f"[ 9001.000001] {DRIVER_LOAD}"])  # the modules were reloaded since
    faults = ansible.playbook("deploy.yml", ONE_HOST, tags="preflight", path_prepend=bin_dir,
                              extra=extra)
    flat = " ".join(faults.output.split())
    assert faults.rc != 0 and "check for fatal Xid errors since the driver" in flat, flat[-3000:]
    assert "check the NVLink fabric" in flat
    b = H200_BUS
    assert (f"cpu-host has GPU(s) that need attention before the server can use them: GPU {b[0]}:"
            f" a row remapping is pending (nvidia-smi -q -d ROW_REMAPPER): reset the GPU "
            f"(`nvidia-smi -r -i {b[0]}`, no process on it) or reboot to apply it; GPU {b[1]}: "
            '"Remapping Failure Occurred: Yes"') in flat, flat[-3000:]
    assert "take the GPU out of service, run the field diagnostic and RMA it" in flat
    assert f'GPU {b[2]}: "GPU Recovery Action: Reboot": reboot the host' in flat
    assert f'GPU {b[3]}: "GPU Recovery Action: Drain P2P": stop every process doing peer' in flat
    _h200_smi(bin_dir, recovery={}, pending=set(), failure=set())
    _dmesg(bin_dir, [f"[    4.901234] {DRIVER_LOAD}", f"[ 8123.456789] {XID_79}"])
    xid = ansible.playbook("deploy.yml", ONE_HOST, tags="preflight", path_prepend=bin_dir,
                           extra=extra)
    flat = " ".join(xid.output.split())
    assert xid.rc != 0 and xid.recap()["cpu-host"]["failed"] == 1, flat[-3000:]
    assert (f"cpu-host logged NVIDIA Xid 79 since the NVIDIA driver was last loaded (dmesg: "
            f"[ 8123.456789] {XID_79}). A GPU reset does not clear this record") in flat, \
        flat[-3000:]
    assert "then reboot the host or reload the nvidia kernel modules" in flat


# Stand-in for infiniband-diags' `ibstat` on a host with two InfiniBand HCAs and a RoCE NIC,
# in its documented layout (CA '<name>', then per port State / Physical state / Rate / Link
# layer); each port's state and physical state come from a file the test rewrites.
IBSTAT = """#!/bin/sh
while read -r hca state phys layer; do
  printf "CA '%s'\\n\\tCA type: MT4129\\n\\tNumber of ports: 1\\n" "$hca"
  printf "\\tFirmware version: 28.41.1000\\n"
  printf "\\tHardware version: 0\\n\\tNode GUID: 0x9c63c003005548ae\\n\\tPort 1:\\n"
  printf "\\t\\tState: %s\\n\\t\\tPhysical state: %s\\n\\t\\tRate: 400\\n" "$state" "$phys"
  printf "\\t\\tBase lid: 987\\n\\t\\tLMC: 0\\n\\t\\tSM lid: 359\\n\\t\\tLink layer: %s\\n" "$layer"
done < "$(dirname "$0")/ports"
"""
ALL_ACTIVE = ("mlx5_0 Active LinkUp InfiniBand\nmlx5_1 Active LinkUp InfiniBand\n"
              "mlx5_2 Active LinkUp Ethernet\n")


def _host_interface() -> tuple[str, str]:
    """(name, IPv4 address) of this machine's first interface other than loopback and docker."""
    for line in subprocess.run(["ip", "-4", "-o", "addr"], check=True, capture_output=True,
                               text=True).stdout.splitlines():
        fields = line.split()
        if fields[1] != "lo" and not fields[1].startswith("docker"):
            return fields[1], fields[3].split("/")[0]
    require(False, "a network interface with an IPv4 address besides loopback")
    raise AssertionError("unreachable")


def test_preflight_multi_node_network_fails_clearly(ansible, tiny_models, tmp_path):
    """A two-node replica over InfiniBand: the socket interface (unset, not on the host), the
    RDMA devices, the HCA ports NCCL_IB_HCA selects (Down, no subnet manager), GPUDirect
    (no peer-memory client) and memlock each fail preflight within a minute, naming the host,
    the interface or HCA port and what to do; the good host passes. Stand-ins: `ibstat`, an
    RDMA device node in a scratch /dev/infiniband, the peer-memory sysfs file."""
    require(os.geteuid() == 0, "root (mknod of a stand-in RDMA device node)")
    ifname, address = _host_interface()
    bin_dir, devices = tmp_path / "bin", tmp_path / "infiniband"
    bin_dir.mkdir()
    devices.mkdir()
    (bin_dir / "ibstat").write_text(IBSTAT)
    (bin_dir / "ibstat").chmod(0o755)
    ports = bin_dir / "ports"
    ports.write_text(ALL_ACTIVE)
    subprocess.run(["mknod", str(devices / "uverbs0"), "c", "231", "192"], check=True)
    peermem = tmp_path / "memory_peers" / "nvidia-peermem" / "version"
    peermem.parent.mkdir(parents=True)
    peermem.write_text("1.0\n")
    good = {"hsdump_server_nnodes": 2, "hsdump_server_tp_size": 16, "hsdump_server_node_rank": 1,
            "hsdump_server_dist_init_addr": f"{address}:50000", "hsdump_net_ib": True,
            "hsdump_net_socket_ifname": ifname, "hsdump_net_ib_devices_dir": str(devices),
            "hsdump_net_ib_hca": "=mlx5_0,mlx5_1", "hsdump_net_gdr": "peermem",
            "hsdump_preflight_peermem_files": [str(peermem)],
            "hsdump_server_ulimits": ["memlock:-1:-1", "stack:67108864:67108864"],
            "hsdump_model_dir": str(tiny_models / "tiny-llama")}

    def run(**changes) -> str:
        started = time.monotonic()
        r = ansible.playbook("deploy.yml", ONE_HOST, tags="preflight", path_prepend=bin_dir,
                             extra={**good, **changes})
        flat = " ".join(r.output.split())
        assert time.monotonic() - started < 60, flat[-2000:]
        assert r.rc != 0 and r.recap()["cpu-host"]["failed"] == 1, flat[-3000:]
        return flat

    passed = ansible.playbook("deploy.yml", ONE_HOST, tags="preflight", path_prepend=bin_dir,
                              extra=good)
    passed.assert_ok("preflight of a good InfiniBand node")
    for task in ("check the socket interface of the multi-node replica",
                 "check the HCA ports NCCL will use", "check GPUDirect RDMA", "check memlock"):
        assert f"Preflight | {task}" in passed.output
    flat = run(hsdump_net_socket_ifname="")
    assert ("cpu-host is node 1 of a 2-node replica, and hsdump_net_socket_ifname=\"\" is empty: "
            "NCCL (bootstrap, out-of-band) and PyTorch gloo would bind the address the hostname "
            "resolves to (127.0.1.1 on Ubuntu)") in flat, flat[-3000:]
    assert f"network of hsdump_server_dist_init_addr ({address}:50000)" in flat
    flat = run(hsdump_net_socket_ifname="ib9")
    assert "hsdump_net_socket_ifname=\"ib9\" is not an interface of this host (it has " in flat
    flat = run(hsdump_net_ib_devices_dir=str(tmp_path / "none"))
    assert (f"cpu-host has no RDMA devices (no uverbs* in {tmp_path / 'none'}), but hsdump_net_ib "
            "asks for InfiniBand/RoCE: NCCL would fall back to TCP sockets") in flat, flat[-3000:]
    ports.write_text(ALL_ACTIVE.replace("mlx5_1 Active LinkUp", "mlx5_1 Down Polling"))
    flat = run()
    assert ("cpu-host: HCA ports selected by NCCL_IB_HCA==mlx5_0,mlx5_1 (hsdump_net_ib_hca) are not"
            " Active (mlx5_1 port 1: State Down, Physical state Polling, InfiniBand)") in flat, \
        flat[-3000:]
    assert "Down / Polling: check the cable" in flat and '(e.g. "^mlx5_1")' in flat
    # Leaving the Down port out (NCCL_IB_HCA's exclusion syntax) passes.
    run_ok = ansible.playbook("deploy.yml", ONE_HOST, tags="preflight", path_prepend=bin_dir,
                              extra={**good, "hsdump_net_ib_hca": "^mlx5_1"})
    run_ok.assert_ok("preflight with the Down port excluded")
    ports.write_text("mlx5_0 Initializing LinkUp InfiniBand\nmlx5_1 Initializing LinkUp "
                     "InfiniBand\n")
    flat = run(hsdump_net_ib_hca="")
    assert ("cpu-host: no HCA port is Active (mlx5_0 port 1: State Initializing, Physical state "
            "LinkUp, InfiniBand; mlx5_1 port 1: State Initializing") in flat, flat[-3000:]
    assert "Initializing: no subnet manager answers on this InfiniBand fabric" in flat
    ports.write_text(ALL_ACTIVE)
    peermem.unlink()
    flat = run()
    assert (f"cpu-host: hsdump_net_gdr=peermem but no peer-memory client is registered (none of "
            f"{peermem}): NCCL would stage every transfer through host memory. Load "
            "nvidia-peermem (`modprobe nvidia-peermem`") in flat, flat[-3000:]
    flat = run(hsdump_net_gdr="none", hsdump_server_ulimits=[])
    assert ("cpu-host: hsdump_server_ulimits=[] does not give the containers an unlimited "
            "memlock, which RDMA needs") in flat, flat[-3000:]


def _remount_shm(size: int) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size // 1024}k", "/dev/shm"], check=True)


def _shm_used() -> int:
    out = subprocess.run(["df", "-B1", "--output=used", "/dev/shm"], check=True,
                         capture_output=True, text=True).stdout
    return int(out.split()[-1])


def test_shm_grown_persisted_and_idempotent(ansible, host_shm):
    kib = expected_shm_kib()
    smaller = kib * 1024 - 2**30  # 1 GiB below the target (other jobs' files must still fit)
    require(_shm_used() + 2**28 < smaller, "/dev/shm with less than 7 GiB in use")
    _remount_shm(smaller)
    # A host without a /dev/shm line (host_shm puts the original fstab back): the changes
    # counted below are then the role's own, whatever an earlier job left in fstab.
    fstab = Path("/etc/fstab")
    lines = fstab.read_text().splitlines(keepends=True) if fstab.exists() else []
    before = "".join(line for line in lines if not _is_shm_entry(line))
    fstab.write_text(before)
    first = ansible.playbook(CASES / "shm.yml", ONE_HOST)
    first.assert_ok("hsdump_shm")
    assert first.recap()["cpu-host"]["changed"] == 2, (  # the fstab line, the remount
        f"fstab before:\n{before}\n{first.output[-4000:]}")
    assert _shm_bytes() == kib * 1024
    assert fstab_shm_line().split() == ["tmpfs", "/dev/shm", "tmpfs",
                                        f"rw,nosuid,nodev,size={kib}k", "0", "0"]
    again = ansible.playbook(CASES / "shm.yml", ONE_HOST)
    again.assert_ok("hsdump_shm, second run")
    assert again.recap()["cpu-host"]["changed"] == 0, again.output[-4000:]
    # The line kept, the live size smaller again (remounted by hand, or a runtime's own mount):
    # the role grows it back and leaves the line as it is (CI met this case by chance).
    persisted = fstab.read_text()
    _remount_shm(smaller)
    shrunk = ansible.playbook(CASES / "shm.yml", ONE_HOST)
    shrunk.assert_ok("hsdump_shm, live size smaller than the fstab line's")
    assert shrunk.recap()["cpu-host"]["changed"] == 1, shrunk.output[-4000:]  # the remount
    assert _shm_bytes() == kib * 1024
    assert fstab.read_text() == persisted


def test_shm_never_shrinks(ansible, host_shm):
    """A /dev/shm larger than the target (1-2 TiB hosts) is left alone, live and in fstab."""
    larger = expected_shm_kib() * 1024 + 2**30
    _remount_shm(larger)
    fstab_before = Path("/etc/fstab").read_text()
    run = ansible.playbook(CASES / "shm.yml", ONE_HOST)
    run.assert_ok("hsdump_shm on a larger /dev/shm")
    assert run.recap()["cpu-host"]["changed"] == 0, run.output[-4000:]
    assert _shm_bytes() == larger
    assert Path("/etc/fstab").read_text() == fstab_before


# ----------------------------------------------------------------------------- a Debian host


@dataclass
class DebianHost:
    """A Debian bookworm container that Ansible manages over its docker connection."""

    name: str
    inventory: Path

    def sh(self, script: str, check: bool = True) -> str:
        return _docker("exec", self.name, "sh", "-c", script, check=check)




@pytest.fixture(scope="module")
def debian_host(docker_engine, tmp_path_factory) -> Iterator[DebianHost]:
    """The Debian image (_debian_image) run as a container with apt's lists fetched."""
    _debian_image()
    name = f"hsdump-debian-{uuid.uuid4().hex[:8]}"
    # Host networking: the sandbox's engine has no NAT, and apt needs the Debian mirror.
    _docker("run", "-d", "--name", name, "--network", "host", DEBIAN_TAG, "sleep", "infinity")
    inventory = tmp_path_factory.mktemp("debian") / "inventory.yml"
    inventory.write_text(yaml.safe_dump({"all": {"children": {"hsdump_hosts": {
        "hosts": {"debian-host": {"ansible_host": name}},
        "vars": {"ansible_connection": "community.docker.docker",
                 "ansible_python_interpreter": "/usr/bin/python3", "ansible_become": False}}}}}))
    host = DebianHost(name, inventory)
    try:
        host.sh("apt-get update -qq")
        yield host
    finally:
        _docker("rm", "-f", name, check=False)


def test_docker_ce_is_kept_and_docker_io_refused(ansible, debian_host):
    """An installed Docker CE is used as it is; docker_source=distro fails with the reason."""
    # The package record of Docker CE (what dpkg and apt see); its binaries are not needed.
    control = ("Package: docker-ce\\nVersion: 5:28.0.0-1\\nArchitecture: all\\n"
               "Maintainer: hsdump tests\\nDescription: Docker CE package record\\n")
    debian_host.sh(f"mkdir -p /tmp/dce/DEBIAN && printf '{control}' > /tmp/dce/DEBIAN/control"
                   " && dpkg-deb -b /tmp/dce /tmp/docker-ce.deb >/dev/null"
                   " && dpkg -i /tmp/docker-ce.deb >/dev/null")
    refused = ansible.playbook(CASES / "engine.yml", debian_host.inventory,
                               extra={"hsdump_container_runtime_docker_source": "distro"})
    flat = " ".join(refused.output.split())
    assert refused.rc != 0, refused.output[-4000:]
    assert ("debian-host already has a Docker engine (docker-ce), and "
            "hsdump_container_runtime_docker_source=distro would install docker.io over it") in flat
    kept = ansible.playbook(CASES / "engine.yml", debian_host.inventory)
    kept.assert_ok("engine.yml with Docker CE installed")
    assert debian_host.sh("dpkg-query -W -f='${Status}' docker.io 2>/dev/null", check=False) \
        != "install ok installed"
    assert "install ok installed" in debian_host.sh("dpkg-query -W -f='${Status}' docker-ce")
    again = ansible.playbook(CASES / "engine.yml", debian_host.inventory)
    again.assert_ok("engine.yml, second run")
    assert again.recap()["debian-host"]["changed"] == 0, again.output[-3000:]


# Stand-ins for NVIDIA's CUDA apt repository: a flat file: repository of small packages with
# the real names (two builds of Fabric Manager and NSCQ: the driver's and a newer one apt would
# prefer), and a cuda-keyring package that adds it, as the real one adds
# developer.download.nvidia.com/compute/cuda/repos/<distro>/<arch>/ (sources.list.d). A second
# one, already configured, stands in for Ubuntu's restricted archive: the precompiled driver's
# packages, one of them pulling in a dependency (libnvidia-compute) that only a hold on every
# installed NVIDIA package keeps in place.
CUDA_STANDIN = r"""
set -e
ctl() {  # name version dir [depends]: the DEBIAN/control of a package
  mkdir -p $3/DEBIAN && chmod -R 755 $3
  printf 'Package: %s\nVersion: %s\nArchitecture: all\n' "$1" "$2" > $3/DEBIAN/control
  [ -z "$4" ] || printf 'Depends: %s\n' "$4" >> $3/DEBIAN/control
  printf 'Maintainer: hsdump tests\nDescription: stand-in\n' >> $3/DEBIAN/control
}
deb() {  # name version repo [depends]: a package of that name and version, empty
  d=$(mktemp -d); ctl "$1" "$2" $d "$4"
  dpkg-deb -b $d "$3/$1_$2_all.deb" >/dev/null; rm -rf $d
}
repo=/srv/cuda-standin; mkdir -p $repo
for v in 580.95.05-1 580.105.08-1; do
  deb nvidia-fabricmanager-580 $v $repo; deb libnvidia-nscq-580 $v $repo
done
deb nvlsm 2025.06.6-1 $repo; deb libnvsdm-580 580.95.05-1 $repo
index() {  # repo: its Packages file
  (cd $1 && for f in *.deb; do
    dpkg-deb -f $f; echo "Filename: ./$f"; echo "Size: $(stat -c %s $f)"
    echo "SHA256: $(sha256sum $f | cut -d' ' -f1)"; echo
  done > Packages)
}
index $repo
u=/srv/ubuntu-standin; mkdir -p $u; v=580.95.05-0ubuntu0.24.04.2
deb nvidia-headless-no-dkms-580-server-open $v $u libnvidia-compute-580-server
deb libnvidia-compute-580-server $v $u; deb nvidia-utils-580-server $v $u
deb nvidia-compute-utils-580-server $v $u
deb linux-modules-nvidia-580-server-open-generic 6.8.0-87.88 $u
index $u; echo "deb [trusted=yes] file:$u ./" > /etc/apt/sources.list.d/ubuntu-standin.list
apt-get update -qq -o Dir::Etc::sourcelist=sources.list.d/ubuntu-standin.list \
  -o Dir::Etc::sourceparts=- -o APT::Get::List-Cleanup=0
k=$(mktemp -d); ctl cuda-keyring 1.1-1 $k; mkdir -p $k/etc/apt/sources.list.d
echo "deb [trusted=yes] file:$repo ./" > $k/etc/apt/sources.list.d/cuda-debian12-x86_64.list
dpkg-deb -b $k /srv/cuda-keyring_1.1-1_all.deb >/dev/null
"""
FM_PACKAGES = ("nvidia-fabricmanager-580", "libnvidia-nscq-580", "nvlsm", "libnvsdm-580")
DRIVER_PACKAGES = ("nvidia-headless-no-dkms-580-server-open", "libnvidia-compute-580-server",
                   "nvidia-utils-580-server", "nvidia-compute-utils-580-server",
                   "linux-modules-nvidia-580-server-open-generic")
# Stand-ins for the host's tools, printing what the real ones print: `mokutil --sb-state`
# ("SecureBoot enabled"), `modinfo -F version nvidia`, modprobe (silent on success; its
# "Module ... not found", or "could not insert ...: Invalid argument" as for nvidia-peermem
# on an inbox ib_core, otherwise; the loaded module appears under /sys/module, "-" as "_"),
# systemctl (the unit properties `systemctl show` prints, `is-enabled`; every action logged), the
# `nvidia-smi -q` Fabric section of an HGX GPU (the states of FABRIC_STATES one call after the
# other, the last one for good), and a reboot that loads the module version of NEXT_LOADED.
SYS_MODULE = "/run/hsdump-test-sys-module"
SYSTEMD = "/run/hsdump-test-systemd"
LOADED = "/run/hsdump-test-nvidia-version"
NEXT_LOADED = "/run/hsdump-test-next-loaded"
FABRIC_STATES = "/run/hsdump-test-fabric"
BOOT_ID = "/run/hsdump-test-boot-id"
HOST_TOOLS = {
    "mokutil": "echo 'SecureBoot enabled'",
    "modinfo": "echo 580.95.05",
    "modprobe": f"""if [ -e /run/hsdump-test-no-$1 ]; then
  echo "modprobe: FATAL: Module $1 not found in directory /lib/modules/$(uname -r)" >&2; exit 1
fi
if [ -e /run/hsdump-test-einval-$1 ]; then
  echo "modprobe: ERROR: could not insert '$(echo $1 | tr - _)': Invalid argument" >&2; exit 1
fi
mkdir -p {SYS_MODULE}/$(echo $1 | tr - _)""",
    "systemctl": f"""d={SYSTEMD}; mkdir -p $d; u=${{2%.service}}
case $1 in
  daemon-reload) ;;
  show) a=inactive; s=dead; e=disabled
    [ -e $d/$u.active ] && a=active && s=running; [ -e $d/$u.enabled ] && e=enabled
    printf 'Id=%s.service\\nLoadState=loaded\\nActiveState=%s\\nSubState=%s\\n' $u $a $s
    printf 'UnitFileState=%s\\n' $e ;;
  is-enabled) [ -e $d/$u.enabled ] && echo enabled && exit 0; echo disabled; exit 1 ;;
  enable) touch $d/$u.enabled; echo "enable $u" >> $d/log ;;
  start|restart) touch $d/$u.active; echo "$1 $u" >> $d/log ;;
  *) echo "stand-in systemctl: $*" >&2; exit 1 ;;
esac""",
    "nvidia-smi": f"""[ "$1" = -q ] || exit 1
f={FABRIC_STATES}; state=$(head -n1 $f); [ "$(wc -l < $f)" -gt 1 ] && sed -i 1d $f
status=N/A; [ "$state" = Completed ] && status=Success
echo '==============NVSMI LOG=============='; printf '%-42s: %s\\n' 'Driver Version' 580.95.05
for b in 18 2a 3a 5d; do echo "GPU 00000000:$b:00.0"
  printf '    %-38s: %s\\n' 'Product Name' 'NVIDIA B200'; echo '    Fabric'
  printf '        %-34s: %s\\n' State "$state" Status $status CliqueId N/A ClusterUUID N/A
done""",
    "hsdump-test-reboot": f"cat {NEXT_LOADED} > {LOADED}; date +%s%N > {BOOT_ID}",
}


@pytest.fixture
def host_tools(debian_host) -> Iterator[None]:
    """HOST_TOOLS in /usr/local/sbin (ahead of /usr/local/bin on PATH) for one test, removed
    after it: a later test's own stand-ins (the CDI test's nvidia-smi) must not be shadowed."""
    sbin = "/usr/local/sbin"
    debian_host.sh("".join(f"printf '%s\\n' '#!/bin/sh' {shlex.quote(body)} > {sbin}/{name}; "
                           f"chmod 755 {sbin}/{name}; " for name, body in HOST_TOOLS.items()))
    yield
    debian_host.sh("rm -f " + " ".join(f"{sbin}/{name}" for name in HOST_TOOLS), check=False)


def test_driver_role_installs_holds_and_gates_the_reboot(ansible, debian_host, host_tools):
    """hsdump_driver on Debian: the DKMS flavour under Secure Boot stops the play before any
    install; --check is clean on the fresh host; Fabric Manager's packages come from NVIDIA's
    CUDA repository, which the role adds (cuda-keyring), Fabric Manager and NSCQ at the
    installed driver's version although a newer build is there; every installed NVIDIA package
    is held and listed for unattended-upgrades; a run that needs a reboot fails with the
    versions and the flag; a reboot after which the old module still runs fails saying what to
    check; after a good one it loads ib_umad and mlx5_ib (failing on a missing module with the
    package that has it), restarts nvidia-persistenced for its new override, waits out the
    fabric's "In Progress", and a second run changes nothing; a fabric that never completes
    fails after the bounded wait. Stand-ins: HOST_TOOLS, small Debian packages for the NVIDIA
    ones, and files for the running module's version and /sys/module (a container cannot
    write them)."""
    debian_host.sh(f"echo 575.57.08 > {LOADED}; echo 575.57.08 > {NEXT_LOADED}; "
                   f"echo boot-1 > {BOOT_ID}; printf 'In Progress\\nIn Progress\\nCompleted\\n' "
                   f"> {FABRIC_STATES}; touch /run/hsdump-test-no-mlx5_ib")
    debian_host.sh(CUDA_STANDIN)
    # What the apt module installs on its first real run, which --check cannot (it runs on its
    # own here, without the Docker CE test's runs before it).
    debian_host.sh("apt-get install -qq -y python3-apt >/dev/null")
    v = {"hsdump_driver_install": True, "hsdump_driver_fabricmanager": True,
         "hsdump_driver_kernel_flavour": "generic",
         "hsdump_driver_cuda_keyring_url": "/srv/cuda-keyring_1.1-1_all.deb",
         "hsdump_driver_loaded_version_file": LOADED, "hsdump_driver_sys_module_dir": SYS_MODULE,
         "hsdump_driver_fabric_poll_s": 1, "hsdump_driver_fabric_wait_s": 20,
         "hsdump_driver_reboot_command": "/usr/local/sbin/hsdump-test-reboot",
         "hsdump_driver_boot_time_command": f"cat {BOOT_ID}"}

    def run(check: bool = False, **extra):
        r = ansible.playbook(CASES / "driver.yml", debian_host.inventory, extra={**v, **extra},
                             check=check)
        return r, " ".join(r.output.split())

    # A distribution NVIDIA's CUDA repository lacks stops the play before any install.
    no_repo, flat = run(hsdump_driver_cuda_repo_distros=["ubuntu2204", "ubuntu2404"])
    assert no_repo.rc != 0 and "install the driver packages" not in flat, flat[-3000:]
    assert ("needs nvlsm and libnvsdm from NVIDIA's CUDA repository, which has no debian12 "
            "directory (only ubuntu2204, ubuntu2404)") in flat, flat[-3000:]
    assert "set hsdump_driver_cuda_repo=false" in flat
    # So does Secure Boot with DKMS, which builds a module Secure Boot refuses to load.
    dkms, flat = run(hsdump_driver_flavour="dkms")
    assert dkms.rc != 0 and "install the driver packages" not in flat, flat[-3000:]
    assert ("debian-host boots with Secure Boot on (mokutil --sb-state: SecureBoot enabled), "
            "which refuses the unsigned nvidia module that hsdump_driver_flavour=dkms builds"
            in flat and "Use hsdump_driver_flavour=precompiled" in flat), flat[-3000:]
    check, _ = run(check=True)
    check.assert_ok("driver.yml --check on a fresh host")
    needs_reboot, flat = run()
    assert needs_reboot.rc != 0
    assert ("debian-host needs a reboot to load NVIDIA driver 580.95.05 (loaded: 575.57.08). "
            "Reboot it, or rerun with -e hsdump_driver_reboot=true") in flat, flat[-3000:]
    versions = debian_host.sh("dpkg-query -W -f='${Package} ${Version}\\n' "
                              + " ".join(FM_PACKAGES))
    assert dict(line.split() for line in versions.splitlines()) == {
        "nvidia-fabricmanager-580": "580.95.05-1", "libnvidia-nscq-580": "580.95.05-1",
        "nvlsm": "2025.06.6-1", "libnvsdm-580": "580.95.05-1"}, versions
    held = debian_host.sh("dpkg --get-selections " + " ".join(DRIVER_PACKAGES + FM_PACKAGES))
    assert dict(zip(held.split()[::2], held.split()[1::2], strict=True)) == dict.fromkeys(
        DRIVER_PACKAGES + FM_PACKAGES, "hold"), held
    assert 'Unattended-Upgrade::Package-Blacklist:: "libnvidia-(?!container)";' in \
        debian_host.sh("apt-config dump")
    assert "--persistence-mode" in debian_host.sh(
        "cat /etc/systemd/system/nvidia-persistenced.service.d/override.conf")
    # The reboot comes back with the old module (Secure Boot refused the new one, say).
    stale, flat = run(hsdump_driver_reboot=True)
    assert stale.rc != 0
    assert ("After the reboot debian-host runs nvidia module 575.57.08 (none: not loaded) while "
            "580.95.05 is installed (none: not for this kernel). Check `mokutil --sb-state`"
            in flat), flat[-3000:]
    # A good reboot; mlx5_ib is not there (a cloud kernel without linux-modules-extra).
    debian_host.sh(f"echo 580.95.05 > {NEXT_LOADED}")
    no_mlx5, flat = run(hsdump_driver_reboot=True)
    assert no_mlx5.rc != 0 and debian_host.sh(f"cat {LOADED}") == "580.95.05\n"
    assert ("debian-host: modprobe: FATAL: Module mlx5_ib not found in directory /lib/modules/"
            in flat and "On Ubuntu mlx5_ib and ib_umad are in linux-modules-extra-" in flat), \
        flat[-3000:]
    # Meanwhile someone let apt take the newer (held) build: the next run puts it back; and an
    # older role's override is still in place, with nvidia-persistenced running on it: the new
    # one takes effect through a restart, as no reboot follows.
    debian_host.sh("apt-get install -qq -y --allow-change-held-packages --allow-downgrades "
                   "nvidia-fabricmanager-580=580.105.08-1 >/dev/null; "
                   "rm /run/hsdump-test-no-mlx5_ib; echo '[Service]' > "
                   "/etc/systemd/system/nvidia-persistenced.service.d/override.conf; "
                   f"rm -f {SYSTEMD}/log; touch {SYSTEMD}/nvidia-persistenced.active")
    first, _ = run()
    first.assert_ok("driver.yml after the reboot")
    assert debian_host.sh("dpkg-query -W -f='${Version}' nvidia-fabricmanager-580") \
        == "580.95.05-1"
    assert debian_host.sh(f"ls {SYS_MODULE}").split() == ["ib_umad", "mlx5_ib"]
    assert debian_host.sh("command -v ibstat && cat /etc/modules-load.d/hsdump-nvidia-fabric.conf"
                          ).split()[1:] == ["ib_umad", "mlx5_ib"]
    actions = debian_host.sh(f"cat {SYSTEMD}/log").splitlines()
    assert actions == ["restart nvidia-persistenced", "start nvidia-fabricmanager"], actions
    assert debian_host.sh(f"cat {FABRIC_STATES}") == "Completed\n"  # polled until Completed
    second, _ = run()
    second.assert_ok("driver.yml, second run")
    assert second.recap()["debian-host"]["changed"] == 0, second.output[-3000:]
    assert debian_host.sh(f"cat {SYSTEMD}/log").splitlines() == actions
    # Fabric Manager up, but the fabric never leaves "In Progress": a bounded wait, then why.
    debian_host.sh(f"echo 'In Progress' > {FABRIC_STATES}")
    stuck, flat = run(hsdump_driver_fabric_wait_s=2)
    assert stuck.rc != 0
    assert ("nvidia-fabricmanager runs on debian-host, but after 2 s the NVLink fabric is not up "
            "(nvidia-smi -q: State : In Progress; Status : N/A). Check `systemctl status "
            "nvidia-fabricmanager` and /var/log/fabricmanager.log") in flat, flat[-3000:]


def test_weights_placed_resumed_verified_and_preflight_demands_only_what_is_missing(
        ansible, debian_host, tiny_models):
    """hsdump_weights from a local mirror path with its SHA256SUMS: copied and checked, nothing
    to do on a second run; a truncated shard (an interrupted copy) is completed by the next run;
    a shard of the right size with wrong bytes (which `rsync --append-verify` skips) fails the
    sha256 check, is removed and copied again; with the weights in place preflight demands no
    free space for them (it demanded 750 GiB whenever a source was set)."""
    debian_host.sh("rm -rf /mirror && mkdir -p /mirror")
    _docker("cp", f"{tiny_models / 'tiny-llama'}/.", f"{debian_host.name}:/mirror/tiny-llama")
    debian_host.sh("cd /mirror/tiny-llama && find . -type f ! -name SHA256SUMS -printf '%P\\0'"
                   " | xargs -0 sha256sum > SHA256SUMS")  # as docs/operations.md says
    v = {"hsdump_weights_source": "/mirror/tiny-llama", "hsdump_model_dir": "/models/tiny-llama"}
    first = ansible.playbook(CASES / "weights.yml", debian_host.inventory, extra=v)
    first.assert_ok("weights.yml")
    shard = "/models/tiny-llama/model.safetensors"
    full = debian_host.sh(f"stat -c %s {shard}").strip()
    assert full == debian_host.sh("stat -c %s /mirror/tiny-llama/model.safetensors").strip()
    second = ansible.playbook(CASES / "weights.yml", debian_host.inventory, extra=v)
    second.assert_ok("weights.yml, second run")
    assert second.recap()["debian-host"]["changed"] == 0, second.output[-3000:]
    debian_host.sh(f"truncate -s {int(full) // 2} {shard}")
    resumed = ansible.playbook(CASES / "weights.yml", debian_host.inventory, extra=v)
    resumed.assert_ok("weights.yml after an interrupted copy")
    assert resumed.recap()["debian-host"]["changed"] == 1
    same = f"cmp {shard} /mirror/tiny-llama/model.safetensors && echo same"
    assert debian_host.sh(same).strip() == "same"
    debian_host.sh(f"printf 'not the weights' | dd of={shard} bs=1 seek={int(full) // 2}"
                   " conv=notrunc 2>/dev/null")  # same size, wrong bytes
    assert debian_host.sh(f"stat -c %s {shard}").strip() == full
    repaired = ansible.playbook(CASES / "weights.yml", debian_host.inventory, extra=v)
    repaired.assert_ok("weights.yml with a corrupt shard")
    assert "model.safetensors" in " ".join(repaired.output.split())
    assert debian_host.sh(same, check=False).strip() == "same", repaired.output[-3000:]
    placed = ansible.playbook("deploy.yml", debian_host.inventory, tags="preflight", extra=v)
    placed.assert_ok("preflight with the weights in place")


# Stand-ins for the tools the CDI tasks call, printing what the real ones print: nvidia-smi's
# driver_version query (the version in /run/hsdump-test-driver), `nvidia-ctk cdi generate` (a
# spec that mounts the driver's libraries by their versioned names, as the real one does; its
# logrus lines) and `nvidia-ctk runtime configure --cdi.enabled` (merges features.cdi into
# daemon.json), `docker version` of a Docker 28.1 engine, and the `systemctl` calls on the
# toolkit's nvidia-cdi-refresh unit (active after its oneshot run: RemainAfterExit; its
# ExecStart is `nvidia-ctk cdi generate`, NVIDIA_CTK_CDI_OUTPUT_FILE_PATH=/var/run/cdi/nvidia.yaml).
CDI_STANDINS = r"""
set -e
cat > /usr/local/bin/nvidia-smi <<'X'
#!/bin/sh
for i in 0 1 2 3 4 5 6 7; do cat /run/hsdump-test-driver; done
X
cat > /usr/local/bin/nvidia-ctk <<'X'
#!/bin/sh
v=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -n 1)
case "$1 $2" in
"cdi generate")
  out=${NVIDIA_CTK_CDI_OUTPUT_FILE_PATH:-}
  for a in "$@"; do case $a in --output=*) out=${a#--output=};; esac; done
  mkdir -p "$(dirname "$out")"
  { echo '---'; echo 'cdiVersion: 0.5.0'; echo 'containerEdits:'; echo '  mounts:'
    for l in libcuda.so libnvidia-ml.so libnvidia-ptxjitcompiler.so; do
      echo "  - containerPath: /usr/lib/x86_64-linux-gnu/$l.$v"
      echo "    hostPath: /usr/lib/x86_64-linux-gnu/$l.$v"
      echo '    options: [ro, nosuid, nodev, bind]'
    done
    echo 'devices:'; echo '- containerEdits:'; echo '    deviceNodes:'
    echo '    - path: /dev/nvidia0'; echo '  name: "0"'; echo 'kind: nvidia.com/gpu'; } > "$out"
  echo 'INFO[0000] Auto-detected mode as "nvml"' >&2
  echo "INFO[0000] Generated CDI spec with version 0.5.0" >&2;;
"runtime configure")
  python3 -c 'import json, pathlib; p = pathlib.Path("/etc/docker/daemon.json")
p.parent.mkdir(exist_ok=True); c = json.loads(p.read_text()) if p.exists() else {}
c.setdefault("features", {})["cdi"] = True; p.write_text(json.dumps(c, indent=4))'
  echo 'INFO[0000] Wrote updated config to /etc/docker/daemon.json' >&2
  echo 'INFO[0000] It is recommended that docker daemon be restarted.' >&2;;
*) echo "nvidia-ctk stand-in: $*" >&2; exit 1;;
esac
X
printf '#!/bin/sh\necho 28.1.1\n' > /usr/local/bin/docker
cat > /usr/local/sbin/systemctl-refresh <<'X'
#!/bin/sh
case "$1 $2" in
"cat nvidia-cdi-refresh.service")
  printf '[Service]\nType=oneshot\nExecStart=/usr/bin/nvidia-ctk cdi generate\n';;
"show nvidia-cdi-refresh.service")
  printf 'Id=nvidia-cdi-refresh.service\nLoadState=loaded\nActiveState=active\nSubState=exited\n';;
"restart nvidia-cdi-refresh.service")
  NVIDIA_CTK_CDI_OUTPUT_FILE_PATH=/var/run/cdi/nvidia.yaml nvidia-ctk cdi generate;;
*) echo "Unit $2 could not be found." >&2; exit 1;;
esac
X
chmod 755 /usr/local/bin/nvidia-smi /usr/local/bin/nvidia-ctk /usr/local/bin/docker \
  /usr/local/sbin/systemctl-refresh
"""


def test_cdi_spec_follows_the_driver_and_docker_before_28_2_gets_features_cdi(ansible,
                                                                               debian_host):
    """A CDI spec generated for the old driver is regenerated after a driver update (it was
    generated once, `creates:`); Docker 28.1 gets features.cdi (CDI is on by default from
    28.2, not 28.0); --check changes nothing; a second run changes nothing; with the
    toolkit's nvidia-cdi-refresh service the role restarts it instead of writing its own."""
    host = debian_host
    host.sh(CDI_STANDINS)
    spec = "/etc/cdi/nvidia.yaml"
    host.sh(f"rm -rf /etc/cdi /var/run/cdi /etc/docker/daemon.json && echo 570.86.15 > "
            f"/run/hsdump-test-driver && nvidia-ctk cdi generate --output={spec} 2>/dev/null"
            " && echo 580.95.05 > /run/hsdump-test-driver")  # the driver update (and reboot)
    v = {"hsdump_gpu_mode": "cdi"}
    try:
        check = ansible.playbook(CASES / "cdi.yml", host.inventory, extra=v, check=True)
        check.assert_ok("cdi.yml --check")
        assert "libcuda.so.570.86.15" in host.sh(f"cat {spec}")
        assert host.sh("ls /etc/docker/daemon.json", check=False) == ""
        first = ansible.playbook(CASES / "cdi.yml", host.inventory, extra=v)
        first.assert_ok("cdi.yml")
        assert first.recap()["debian-host"]["changed"] == 2, first.output[-3000:]
        text = host.sh(f"cat {spec}")
        assert "libcuda.so.580.95.05" in text and "570.86.15" not in text, text
        assert json.loads(host.sh("cat /etc/docker/daemon.json")) == {"features": {"cdi": True}}
        second = ansible.playbook(CASES / "cdi.yml", host.inventory, extra=v)
        second.assert_ok("cdi.yml, second run")
        assert second.recap()["debian-host"]["changed"] == 0, second.output[-3000:]
        # Toolkit >= 1.18: nvidia-cdi-refresh owns /var/run/cdi/nvidia.yaml; after the next
        # driver update the role restarts it (RemainAfterExit: a start would do nothing).
        host.sh("cp /usr/local/sbin/systemctl-refresh /usr/local/bin/systemctl"
                " && echo 590.44.01 > /run/hsdump-test-driver")
        refresh = ansible.playbook(CASES / "cdi.yml", host.inventory, extra=v)
        refresh.assert_ok("cdi.yml with nvidia-cdi-refresh")
        assert refresh.recap()["debian-host"]["changed"] == 1, refresh.output[-3000:]
        assert "libcuda.so.590.44.01" in host.sh("cat /var/run/cdi/nvidia.yaml")
        assert "libcuda.so.580.95.05" in host.sh(f"cat {spec}")  # not the role's any more
    finally:
        host.sh("rm -f /usr/local/bin/nvidia-smi /usr/local/bin/nvidia-ctk /usr/local/bin/docker"
                " /usr/local/bin/systemctl /usr/local/sbin/systemctl-refresh", check=False)


RDMA_MODULES = ("mlx5_ib", "ib_uverbs", "rdma_ucm")


def test_rdma_role_loads_modules_and_peermem_and_raises_memlock(ansible, debian_host, host_tools):
    """hsdump_rdma on Debian: --check changes nothing; it installs rdma-core, ibverbs-utils and
    infiniband-diags (Debian's packages), loads mlx5_ib, ib_uverbs and rdma_ucm now and at
    boot, and raises memlock for every login; nvidia-peermem refused by an inbox ib_core
    ("Invalid argument") stops the play with hsdump_net_gdr=peermem, naming DOCA-OFED and
    DMA-BUF, and is left to preflight with auto; once it loads it is loaded at boot too; second
    runs change nothing. Stand-ins: HOST_TOOLS' modprobe and a scratch /sys/module."""
    host = debian_host
    modules_load, limits = "/etc/modules-load.d/hsdump-rdma.conf", \
        "/etc/security/limits.d/90-hsdump-rdma.conf"
    host.sh(f"rm -rf {SYS_MODULE} {modules_load} {limits} /run/hsdump-test-no-mlx5_ib; "
            "touch /run/hsdump-test-einval-nvidia-peermem")
    # What the package module installs on its first real run, which --check cannot.
    host.sh("apt-get install -qq -y python3-apt >/dev/null")
    v = {"hsdump_net_ib": True, "hsdump_net_gdr": "peermem",
         "hsdump_rdma_sys_module_dir": SYS_MODULE}

    def run(check: bool = False, **extra) -> tuple[Run, str]:
        r = ansible.playbook(CASES / "rdma.yml", host.inventory, extra={**v, **extra},
                             check=check)
        return r, " ".join(r.output.split())

    check, _ = run(check=True)
    check.assert_ok("rdma.yml --check")
    assert host.sh(f"ls {modules_load} {limits} 2>/dev/null", check=False) == ""
    refused, flat = run()
    assert refused.rc != 0, flat[-3000:]
    assert ("debian-host: modprobe: ERROR: could not insert 'nvidia_peermem': Invalid argument. "
            "nvidia-peermem needs the peer-memory API of MLNX_OFED / DOCA-OFED's ib_core") \
        in flat, flat[-3000:]
    assert "hsdump_net_gdr=dmabuf" in flat and "The HCA driver" not in flat
    installed = host.sh("dpkg-query -W -f='${Package} ${db:Status-Status}\\n' rdma-core "
                        "ibverbs-utils infiniband-diags")
    assert sorted(installed.splitlines()) == ["ibverbs-utils installed",
                                              "infiniband-diags installed",
                                              "rdma-core installed"], installed
    assert sorted(host.sh(f"ls {SYS_MODULE}").split()) == sorted(RDMA_MODULES)
    auto, flat = run(hsdump_net_gdr="auto")
    auto.assert_ok("rdma.yml with hsdump_net_gdr=auto and no peer-memory API")
    assert host.sh(f"grep -v '^#' {modules_load}").split() == list(RDMA_MODULES)
    assert "root hard memlock unlimited" in host.sh(f"cat {limits}")
    again, _ = run(hsdump_net_gdr="auto")
    again.assert_ok("rdma.yml, second run")
    assert again.recap()["debian-host"]["changed"] == 0, again.output[-3000:]
    host.sh("rm /run/hsdump-test-einval-nvidia-peermem")  # DOCA-OFED's ib_core, say
    loaded, _ = run()
    loaded.assert_ok("rdma.yml with nvidia-peermem loading")
    assert loaded.recap()["debian-host"]["changed"] == 2, loaded.output[-3000:]
    assert host.sh(f"grep -v '^#' {modules_load}").split() == [*RDMA_MODULES, "nvidia-peermem"]
    assert host.sh(f"ls -d {SYS_MODULE}/nvidia_peermem").strip()
    last, _ = run()
    last.assert_ok("rdma.yml, second run with nvidia-peermem")
    assert last.recap()["debian-host"]["changed"] == 0, last.output[-3000:]


# ----------------------------------------------------------------------------- deploy sequence


@dataclass
class Deployment:
    """What the module's deploy sequence used and what its runs returned."""

    vars: dict
    image_id: str
    check_fresh: Run
    first: Run
    second: Run




def _tiny_image(tmp_path: Path, ref: str) -> str:
    """Import a one-file image as ``ref``; returns its id."""
    content = tmp_path / "rootfs"
    content.mkdir()
    (content / "hello.txt").write_text("a tiny image for the image role's tests\n")
    tar = subprocess.run(["tar", "-C", str(content), "-cf", "-", "."], check=True,
                         capture_output=True).stdout
    subprocess.run(["docker", "import", "-", ref], input=tar, check=True, capture_output=True)
    return _docker("image", "inspect", "-f", "{{.Id}}", ref).strip()


def test_image_loaded_from_a_tarball_and_verified(ansible, docker_engine, tmp_path):
    """The air-gapped path: `docker save` tarball on the controller, copied, loaded, id checked,
    staged copy removed; a second run fetches nothing; a wrong id fails with its message."""
    name, tag = "hsdump-ansible-tiny", f"ci-{uuid.uuid4().hex[:8]}"
    image_id = _tiny_image(tmp_path, f"{name}:{tag}")
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


@pytest.fixture
def registry(docker_engine, tmp_path) -> Iterator[tuple[str, str, str, Path]]:
    """Docker's own registry (Debian's docker-registry) on loopback with a bcrypt htpasswd
    login: yields (host:port, user, password, its log). Docker trusts 127.0.0.0/8 over HTTP."""
    require(shutil.which("docker-registry") and shutil.which("htpasswd"),
            "docker-registry and htpasswd (make prereqs)")
    user, password = "hsdump-ci", f"pw-{uuid.uuid4().hex}"
    root = tmp_path / "registry"
    root.mkdir()
    (root / "htpasswd").write_text(subprocess.run(
        ["htpasswd", "-Bbn", user, password], check=True, capture_output=True, text=True).stdout)
    addr = f"127.0.0.1:{free_port()}"
    (root / "config.yml").write_text(yaml.safe_dump({
        "version": 0.1, "storage": {"filesystem": {"rootdirectory": str(root / "data")}},
        "http": {"addr": addr},
        "auth": {"htpasswd": {"realm": "hsdump-ci", "path": str(root / "htpasswd")}}}))
    log = root / "registry.log"
    with log.open("w") as out:
        proc = subprocess.Popen(["docker-registry", "serve", str(root / "config.yml")],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:  # 401 = up and asking for the login
            try:
                if requests.get(f"http://{addr}/v2/", timeout=2).status_code == 401:
                    break
            except requests.ConnectionError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        yield addr, user, password, log
    finally:
        _docker("logout", addr, check=False)
        proc.terminate()
        proc.wait(30)


def test_image_pulled_from_the_registry_with_the_vault_password(ansible, registry, tmp_path):
    """hsdump_image_source=pull: the pulled name carries hsdump_image_registry (not Docker
    Hub's library/), and the login reads the inventory vault's registry password (never
    printed); without that password the play stops before the login, naming the variable."""
    addr, user, password, log = registry
    name, tag = "hsdump-ansible-pull", f"ci-{uuid.uuid4().hex[:8]}"
    remote = f"{addr}/{name}:{tag}"
    image_id = _tiny_image(tmp_path, remote)
    subprocess.run(["docker", "login", "-u", user, "--password-stdin", addr], input=password,
                   check=True, capture_output=True, text=True)
    _docker("push", remote)
    _docker("logout", addr)
    _docker("rmi", remote)
    secret, vault = tmp_path / "vault-pass", tmp_path / "vault.yml"
    secret.write_text(uuid.uuid4().hex)
    vault.write_text(yaml.safe_dump({"vault_hsdump_image_registry_password": password}))
    subprocess.run([str(ansible.bin / "ansible-vault"), "encrypt", "--vault-password-file",
                    str(secret), str(vault)], check=True, capture_output=True)
    assert password not in vault.read_text()
    v = {"hsdump_image_name": name, "hsdump_image_tag": tag, "hsdump_image_id": image_id,
         "hsdump_image_source": "pull", "hsdump_image_registry": addr,
         "hsdump_image_registry_username": user, "hsdump_state_dir": str(tmp_path / "state")}
    try:
        no_vault = ansible.playbook("deploy.yml", ONE_HOST, extra=v, tags="image")
        flat = " ".join(no_vault.output.split())
        assert no_vault.rc != 0, flat[-3000:]
        assert ("hsdump_image_registry_username is set for cpu-host, but the registry password "
                "is empty: put vault_hsdump_image_registry_password in the inventory vault "
                "file") in flat, flat[-3000:]
        pulled = ansible.playbook("deploy.yml", ONE_HOST, extra=v, tags="image",
                                  vault=(vault, secret))
        pulled.assert_ok("deploy.yml --tags image (pull with the vault password)")
        assert password not in pulled.output
        assert _docker("image", "inspect", "-f", "{{.Id}}", remote).strip() == image_id
        assert _docker("images", "-q", f"{name}:{tag}") == ""  # nothing from docker.io
        # The registry checked the login of Ansible's pull against its htpasswd.
        assert any('msg="authorized request"' in line and "ansible-community.docker" in line
                   for line in log.read_text().splitlines())
    finally:
        _docker("rmi", remote, check=False)


# Stand-in for the image's `hsdump verify --work DIR ...`: records the environment and arguments
# it got in DIR, then hangs, as a TP all-reduce over PCIe P2P hangs without NCCL_P2P_DISABLE.
VERIFY_HANGS = """#!/bin/sh
[ "$1" = verify ] && [ "$2" = --work ] || { echo "usage: hsdump verify --work DIR" >&2; exit 2; }
env > "$3/env.txt"
echo "$@" > "$3/args.txt"
exec sleep infinity
"""


def test_verify_gets_the_server_env_and_its_container_is_removed_on_timeout(ansible, docker_engine,
                                                                            tmp_path):
    """verify.yml runs `hsdump verify` with hsdump_server_env; when its async limit fires, the
    -verify container (not only the docker CLI) is gone before the server starts again."""
    image = f"hsdump-ansible-verify:ci-{uuid.uuid4().hex[:8]}"
    server = f"hsdump-ansible-verify-{uuid.uuid4().hex[:6]}"
    stub = tmp_path / "hsdump"
    stub.write_text(VERIFY_HANGS)
    stub.chmod(0o755)
    builder = _docker("create", _debian_image(), "true").strip()
    _docker("cp", str(stub), f"{builder}:/usr/local/bin/hsdump")
    _docker("commit", builder, image)
    _docker("rm", builder)
    # The running server it stops and starts again: a shell that exits on SIGTERM.
    _docker("run", "-d", "--name", server, "--entrypoint", "sh", image, "-c",
            "trap 'exit 0' TERM; while :; do sleep 1; done")
    name, tag = image.rsplit(":", 1)
    v = {"hsdump_image_name": name, "hsdump_image_tag": tag, "hsdump_container_name": server,
         "hsdump_output_dir": str(tmp_path / "output"), "hsdump_verify_timeout_s": 20,
         "hsdump_verify_fetch_dir": str(tmp_path / "reports"),
         "hsdump_server_env": {"NCCL_P2P_DISABLE": "1"}}
    since = _docker("info", "-f", "{{.SystemTime}}").strip()
    try:
        run = ansible.playbook("verify.yml", ONE_HOST, extra=v)
        events = _docker("events", "--since", since, "--until", _docker(
            "info", "-f", "{{.SystemTime}}").strip(), "--filter", "type=container",
            "--format", "{{.Actor.Attributes.name}} {{.Action}}").splitlines()
        verify_left = _docker("ps", "-aq", "--filter", f"name=^{server}-verify$").strip()
        server_running = json.loads(_docker("inspect", server))[0]["State"]["Running"]
    finally:
        _docker("rm", "-f", f"{server}-verify", server, check=False)
        _docker("rmi", image, check=False)
    flat = " ".join(run.output.split())
    assert run.rc != 0, flat[-3000:]
    assert ("hsdump verify did not finish within hsdump_verify_timeout_s=20 s on cpu-host"
            in flat), flat[-3000:]
    env = (tmp_path / "output" / "verify" / "env.txt").read_text().splitlines()
    assert "NCCL_P2P_DISABLE=1" in env, env
    assert verify_left == "", "the -verify container outlived the play"
    assert server_running
    # Order: the server stopped, the verify container destroyed, then the server started.
    # (The engine is shared: keep this test's two containers, skip other and empty lines.)
    seen = [e for e in events if e.split()[:1] in ([server], [f"{server}-verify"])
            and e.split()[-1] in ("start", "destroy")]
    assert seen[-2:] == [f"{server}-verify destroy", f"{server} start"], events


def server_vars(image: str, tiny_models: Path, tmp: Path) -> dict:
    """Variables for a server container of ``image`` with its own name, port and dirs."""
    name, tag = image.rsplit(":", 1)
    return {
        "hsdump_image_name": name, "hsdump_image_tag": tag,
        "hsdump_container_name": f"{name.replace('/', '-')}-{tag}-{uuid.uuid4().hex[:6]}",
        "hsdump_server_port": free_port(),
        "hsdump_model_dir": str(tiny_models / "tiny-llama"),
        "hsdump_dump_dir": f"/dev/shm/hsdump-ansible-{uuid.uuid4().hex[:8]}",
        "hsdump_output_dir": str(tmp / "output"),
        "hsdump_data_dir": str(tmp / "data"),
        "hsdump_state_dir": str(tmp / "state"),
        "hsdump_config_dir": str(tmp / "etc"),
        "hsdump_cache_dir": str(tmp / "cache"),
        "hsdump_smoke_fetch_dir": str(tmp / "reports"),
        "hsdump_extract_fetch_dir": str(tmp / "reports"),
        "hsdump_server_log_fetch_dir": str(tmp / "reports"),
        "hsdump_server_extra_volumes": [f"{CPU_SHIM}:{SHIM_MOUNT}:ro"],
    }


# ----------------------------------------------------------------------------- fail fast
# The old wait only polled /ready: every one of these cost hsdump_server_ready_timeout_s
# (2400 s by default, 600 s in cpu-host.yml). Now the container state of every node is
# checked every round (hsdump_server_wait_round_s=10 here). Most of the time to failure is
# SGLang's own start in the container (imports; on the worker, the rendezvous with node 0
# before it reads the model): 46 s and 113 s measured on the loaded 2-core CI machine.
FAIL_FAST_S = 240


def test_fail_fast_on_a_crash_looping_server_with_a_bad_flag(ansible, docker_engine, hsdump_image,
                                                             tiny_models, tmp_path):
    cpu = yaml.safe_load(CPU_VARS.read_text())
    v = {**server_vars(hsdump_image, tiny_models, tmp_path), "hsdump_server_allreduce": False,
         "hsdump_server_restart_policy": "unless-stopped",
         "hsdump_server_extra_args": [*cpu["hsdump_server_extra_args"], "--no-such-flag"]}
    try:
        started = time.monotonic()
        run = ansible.playbook("deploy.yml", ONE_HOST, tags="server", extra=v)
        elapsed = time.monotonic() - started
    finally:
        _docker("rm", "-f", v["hsdump_container_name"], check=False)
    flat = " ".join(run.output.split())
    print(f"crash loop reported after {elapsed:.0f} s")
    assert run.rc != 0 and run.recap()["cpu-host"]["failed"] == 1, run.output[-4000:]
    assert elapsed < FAIL_FAST_S, f"took {elapsed:.0f} s"
    assert "The hsdump server replica cpu-host did not start: a node failed" in flat, flat[-4000:]
    assert (f"==== cpu-host (node rank 0): container {v['hsdump_container_name']} crash-looping"
            in flat)
    assert "setting to change: a server flag is wrong: fix hsdump_server_extra_args" in flat
    assert "unrecognized arguments: --no-such-flag" in flat  # from the container's own log
    saved = Path(v["hsdump_server_log_fetch_dir"]) / "cpu-host" / "server.log"
    assert "unrecognized arguments: --no-such-flag" in saved.read_text()


def test_fail_fast_on_a_worker_node_with_logs_from_every_node(ansible, docker_engine, hsdump_image,
                                                              tiny_models, tmp_path):
    """Two-node replica: node 1's model dir holds a broken config.json. Node 0 never gets
    /ready; the worker's failure ends the wait of both, with both nodes' logs."""
    v = server_vars(hsdump_image, tiny_models, tmp_path)
    base = v.pop("hsdump_container_name")
    names = {h: f"{base}-{h[-1]}" for h in ("cpu-node-0", "cpu-node-1")}
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    models = {"cpu-node-0": v.pop("hsdump_model_dir"), "cpu-node-1": str(broken)}
    inventory = tmp_path / "inventory.yml"
    inventory.write_text(yaml.safe_dump({"all": {"children": {"hsdump_hosts": {
        "hosts": {h: {"hsdump_server_node_rank": int(h[-1]), "hsdump_container_name": names[h],
                      "hsdump_model_dir": models[h]} for h in names},
        "vars": {"ansible_connection": "local",
                 "ansible_python_interpreter": "{{ ansible_playbook_python }}",
                 "ansible_become": False}}}}}))
    v.update({"hsdump_server_allreduce": False, "hsdump_server_nnodes": 2,
              "hsdump_server_tp_size": 2,
              "hsdump_server_dist_init_addr": f"127.0.0.1:{free_port()}"})
    try:
        started = time.monotonic()
        run = ansible.playbook("deploy.yml", inventory, tags="server", extra=v)
        elapsed = time.monotonic() - started
    finally:
        for name in names.values():
            _docker("rm", "-f", name, check=False)
    flat = " ".join(run.output.split())
    print(f"worker failure reported after {elapsed:.0f} s")
    assert run.rc != 0, run.output[-4000:]
    assert {h: r["failed"] for h, r in run.recap().items()} == {"cpu-node-0": 1, "cpu-node-1": 1}
    assert elapsed < FAIL_FAST_S, f"took {elapsed:.0f} s"
    assert "The hsdump server replica cpu-node-0, cpu-node-1 did not start: a node failed" in flat
    assert "==== cpu-node-0 (node rank 0): container" in flat, flat[-6000:]
    assert f"==== cpu-node-1 (node rank 1): container {names['cpu-node-1']} exited" in flat
    assert "the model at hsdump_model_dir is missing or incomplete" in flat
    for host in names:  # every node's log, in the message and on the controller
        log = (Path(v["hsdump_server_log_fetch_dir"]) / host / "server.log").read_text()
        assert log.strip() and " ".join(log.split()[-20:]) in flat, host


# Stand-ins for a two-node replica over InfiniBand, in one image: torchrun + NCCL for the
# all-reduce check (`python3 -m torch.distributed.run ...`) decide the transport as NCCL does
# from what the container has (uverbs devices in /dev/infiniband and CAP_IPC_LOCK: IB, else
# "No device found" and sockets, or an error under NCCL_NET=IB) and print NCCL_DEBUG=INFO's
# lines for it (GPUDirect as HSDUMP_TEST_GDR says: the host's peer-memory state); the
# server (`hsdump serve`) answers /ready on node 0 and idles on the worker.
TORCHRUN_NCCL = r"""#!/bin/sh
rank=0; for a; do case $a in --node-rank=*) rank=${a#*=};; esac; done
h=$(hostname); ifn=${NCCL_SOCKET_IFNAME#=}; addr="$ifn:10.0.0.$((rank + 1))<0>"
log() { echo "$h:$$:$$ [0] NCCL INFO $*"; }
[ -z "$NCCL_SOCKET_IFNAME" ] || log "NCCL_SOCKET_IFNAME set by environment to $NCCL_SOCKET_IFNAME"
log "Bootstrap : Using $addr"
cap=$(sed -n 's/^CapEff:[[:space:]]*//p' /proc/self/status)
if ls /dev/infiniband/uverbs* >/dev/null 2>&1 && [ $(( (0x$cap >> 14) & 1 )) = 1 ]; then
  [ -z "$NCCL_IB_HCA" ] || log "NCCL_IB_HCA set to $NCCL_IB_HCA"
  log "NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB [RO]; OOB $addr"
  log "Using network IB"
  if [ -n "$HSDUMP_TEST_GDR" ]; then
    log "NET/IB : GPU Direct RDMA ($HSDUMP_TEST_GDR) enabled for HCA 0 'mlx5_0"; net=NET/IB/0/GDRDMA
  else log "NET/IB : GPU Direct RDMA Disabled for HCA 0 'mlx5_0'"; net=NET/IB/0; fi
else
  log "NET/IB : No device found."
  [ "$NCCL_NET" != IB ] || { echo "$h:$$:$$ [0] NCCL WARN Error: network IB not found."; exit 1; }
  log "NET/Socket : Using [0]$addr"; log "Using network Socket"; net=NET/Socket/0
fi
log "Channel 00/0 : $((2 * rank))[0] -> $((2 * rank + 1))[1] via P2P/CUMEM"
log "Channel 00/0 : $((2 * rank + 1))[1] -> $((2 - 2 * rank))[0] [send] via $net"
log "Channel 00/0 : $((3 - 2 * rank))[1] -> $((2 * rank))[0] [receive] via $net"
[ "$rank" != 0 ] || echo '{"ok": true, "world": 4, "backend": "nccl", "mib": 4, "seconds": 0.01}'
"""
SERVE_READY = """#!/bin/sh
[ "${HSDUMP_NODE_RANK:-0}" = 0 ] || exec sleep infinity
mkdir -p /tmp/www && touch /tmp/www/ready
exec /usr/bin/python3 -m http.server --bind "$HSDUMP_PROBE_HOST" "$HSDUMP_PORT" --directory /tmp/www
"""


def test_multi_node_ib_containers_and_the_nccl_transport_check(ansible, docker_engine,
                                                               tiny_models, tmp_path):
    """Two nodes (both this machine) of a replica with hsdump_net_ib: the all-reduce check runs
    as one job across the nodes, its containers and the servers get /dev/infiniband,
    CAP_IPC_LOCK and NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME/NCCL_IB_HCA/NCCL_NET, and NCCL's log
    proves NET/IB with GPUDirect; a second run changes nothing. NCCL without GPUDirect, and
    NCCL falling back to sockets (no uverbs device in the container), fail before the server
    starts, naming the host and what NCCL logged."""
    require(os.geteuid() == 0, "root (mknod of a stand-in RDMA device node)")
    ifname, address = _host_interface()
    image = f"hsdump-ansible-ib:ci-{uuid.uuid4().hex[:8]}"
    builder = _docker("create", _debian_image(), "true").strip()
    for name, body in (("python3", TORCHRUN_NCCL), ("hsdump-serve", SERVE_READY)):
        script = tmp_path / name
        script.write_text(body)
        script.chmod(0o755)
        _docker("cp", str(script), f"{builder}:/usr/local/bin/{name}")
    _docker("commit", "--change", 'ENTRYPOINT ["/usr/local/bin/hsdump-serve"]', builder, image)
    _docker("rm", builder)
    devices, empty = tmp_path / "infiniband", tmp_path / "no-uverbs"
    devices.mkdir()
    empty.mkdir()
    subprocess.run(["mknod", str(devices / "uverbs0"), "c", "231", "192"], check=True)
    # A host whose ib_uverbs is not loaded: rdma_cm only, no uverbs device for NCCL.
    subprocess.run(["mknod", str(empty / "rdma_cm"), "c", "10", "58"], check=True)
    v = server_vars(image, tiny_models, tmp_path)
    base = v.pop("hsdump_container_name")
    names = {h: f"{base}-{h[-1]}" for h in ("cpu-node-0", "cpu-node-1")}
    inventory = tmp_path / "inventory.yml"
    inventory.write_text(yaml.safe_dump({"all": {"children": {"hsdump_hosts": {
        "hosts": {h: {"hsdump_server_node_rank": int(h[-1]), "hsdump_container_name": names[h]}
                  for h in names},
        "vars": {"ansible_connection": "local",
                 "ansible_python_interpreter": "{{ ansible_playbook_python }}",
                 "ansible_become": False}}}}}))
    v.update({"hsdump_server_nnodes": 2, "hsdump_server_tp_size": 4,
              "hsdump_server_dist_init_addr": f"{address}:{free_port()}",
              "hsdump_net_allreduce_port": free_port(), "hsdump_server_allreduce": True,
              "hsdump_server_allreduce_backend": "nccl", "hsdump_server_allreduce_nproc": 2,
              "hsdump_net_ib": True, "hsdump_net_socket_ifname": ifname,
              "hsdump_net_ib_hca": "=mlx5_0,mlx5_1", "hsdump_net_ib_devices_dir": str(devices),
              "hsdump_net_gdr": "peermem",
              "hsdump_server_env": {"HSDUMP_TEST_GDR": "nvidia-peermem"}})
    try:
        first = ansible.playbook("deploy.yml", inventory, tags="server", extra=v)
        first.assert_ok("deploy.yml --tags server, two nodes over InfiniBand")
        flat = " ".join(first.output.split())
        assert ("NCCL ran the all-reduce across 2 nodes over NET/IB (mlx5_0:1/IB, mlx5_1:1/IB): "
                "2 channel connections via NET/IB/0/GDRDMA; GPUDirect RDMA: nvidia-peermem") \
            in flat, flat[-3000:]
        for name in names.values():
            host_config = json.loads(_docker("inspect", name))[0]["HostConfig"]
            env = dict(e.split("=", 1) for e in json.loads(_docker("inspect", name))[0]
                       ["Config"]["Env"])
            assert host_config["Devices"] == [{"PathOnHost": str(devices),
                                               "PathInContainer": "/dev/infiniband",
                                               "CgroupPermissions": "rwm"}], host_config
            assert {c.removeprefix("CAP_") for c in host_config["CapAdd"]} == {"IPC_LOCK"}
            assert {k: env.get(k) for k in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME",
                                            "NCCL_IB_HCA", "NCCL_NET")} == {
                "NCCL_SOCKET_IFNAME": f"={ifname}", "GLOO_SOCKET_IFNAME": ifname,
                "NCCL_IB_HCA": "=mlx5_0,mlx5_1", "NCCL_NET": "IB"}, env
        again = ansible.playbook("deploy.yml", inventory, tags="server", extra=v)
        again.assert_ok("deploy.yml --tags server, second run")
        assert {h: r["changed"] for h, r in again.recap().items()} == dict.fromkeys(names, 0)
        no_gdr = ansible.playbook("deploy.yml", inventory, tags="server",
                                  extra={**v, "hsdump_server_env": {"HSDUMP_TEST_GDR": ""}})
        flat = " ".join(no_gdr.output.split())
        assert no_gdr.rc != 0, flat[-3000:]
        assert ("The all-reduce across the 2 nodes of the replica did not run over "
                "InfiniBand/RoCE on cpu-node-0 (node 0): channels via NET/IB/0: without "
                "/GDRDMA, GPUDirect RDMA is off (NCCL: mlx5_0 GPU Direct RDMA Disabled)") \
            in flat, flat[-3000:]
        sockets = ansible.playbook("deploy.yml", inventory, tags="server", extra={
            **v, "hsdump_net_ib_devices_dir": str(empty), "hsdump_net_nccl_net": ""})
        flat = " ".join(sockets.output.split())
        assert sockets.rc != 0, flat[-3000:]
        assert ("did not run over InfiniBand/RoCE on cpu-node-1 (node 1): NCCL chose network "
                "Socket (\"NET/IB : No device found\": the container sees no usable HCA port), "
                "so every cross-node all-reduce would go over TCP sockets") in flat, flat[-3000:]
        assert "HCA ports NCCL used: none" in flat
    finally:
        for name in names.values():
            _docker("rm", "-f", name, f"{name}-allreduce", check=False)


def test_deploy_runs_the_bridge_beside_the_server_on_localhost(ansible, docker_engine,
                                                               hsdump_image, tiny_models,
                                                               tmp_path):
    """hsdump_server_bridge: the server container runs `hsdump serve --bridge` with the Mooncake
    endpoints given, the bridge bound to 127.0.0.1 only; SpecForge's own producer gets refs
    through it that its own store reads; check mode and a second run change nothing.
    (The image gets Debian's RDMA libraries Mooncake links, as the official base has them.)"""
    from tests.harness.needs import specforge_on_path
    from tests.harness.online import image_with_rdma_libs, local_mooncake, sf_adapter, sf_capture

    specforge_on_path()
    image = image_with_rdma_libs(docker_engine, hsdump_image)
    bport = free_port()
    v = {}
    try:
        with local_mooncake(tmp_path) as ep:
            v = {**server_vars(image, tiny_models, tmp_path), "hsdump_server_allreduce": False,
                 "hsdump_server_bridge": True,
                 "hsdump_server_bridge_mooncake_master": ep["master"],
                 "hsdump_server_bridge_mooncake_metadata": ep["metadata"],
                 "hsdump_server_bridge_port": bport, "hsdump_server_bridge_segment_size": "32MiB",
                 "hsdump_server_bridge_extra_args": ["--local-buffer-size=8MiB"]}
            first = ansible.playbook("deploy.yml", ONE_HOST, tags="server", extra=v)
            first.assert_ok("deploy.yml with the bridge")
            assert "Server | wait until the bridge answers" in first.output
            check = ansible.playbook("deploy.yml", ONE_HOST, tags="server", extra=v, check=True)
            check.assert_ok("deploy.yml --check with the bridge")
            second = ansible.playbook("deploy.yml", ONE_HOST, tags="server", extra=v)
            second.assert_ok("deploy.yml with the bridge, second run")
            for run in (check, second):
                assert run.recap()["cpu-host"]["changed"] == 0, run.output[-4000:]
            args = json.loads(_docker("inspect", v["hsdump_container_name"]))[0]["Args"]
            assert args[args.index("--mooncake-master") + 1] == ep["master"], args
            listening = subprocess.run(["ss", "-ltnH", f"sport = :{bport}"], check=True,
                                       capture_output=True, text=True).stdout.splitlines()
            assert {ln.split()[3] for ln in listening if ln.strip()} == {f"127.0.0.1:{bport}"}
            from specforge.runtime.data_plane.mooncake_store import MooncakeFeatureStore

            store = MooncakeFeatureStore(store_id=f"a{uuid.uuid4().hex[:6]}", setup_kwargs={
                "local_hostname": "127.0.0.1", "metadata_server": ep["metadata"],
                "master_server_addr": ep["master"], "global_segment_size": 0,
                "local_buffer_size": 16 << 20})
            info = requests.get(f"http://127.0.0.1:{bport}/get_model_info", timeout=30).json()
            assert info["model_path"] == "/model", info  # passed through to the server
            dump = json.loads((Path(v["hsdump_dump_dir"]) / "server.json").read_text())
            hidden, layers = dump["hidden_size"], sorted(dump["layers"])
            from specforge.runtime.contracts import PromptTask

            tasks = [PromptTask(task_id=f"t{n}", run_id="run", source_id=f"s{n}",
                                payload={"input_ids": list(range(3, 3 + length)),
                                         "loss_mask": [1] * length}, max_length=4096)
                     for n, length in enumerate((11, 40))]
            refs = sf_adapter(store, None, url=f"http://127.0.0.1:{bport}").produce_refs(
                tasks, capture=sf_capture(tuple(lay - 1 for lay in layers), hidden))
            for task, ref in zip(tasks, refs, strict=True):
                got, handle = store.get(ref)
                n = len(task.payload["input_ids"])
                assert got["hidden_state"].shape == (1, n, len(layers) * hidden)
                assert got["target"].shape == (1, n, hidden)
                assert torch.isfinite(got["hidden_state"].float()).all()
                assert got["input_ids"].tolist() == [task.payload["input_ids"]]
                store.release(handle)
    finally:
        if v:
            _docker("rm", "-f", v["hsdump_container_name"], check=False)
            shutil.rmtree(v["hsdump_dump_dir"], ignore_errors=True)
        _docker("rmi", image, check=False)


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
    v = {**server_vars(f"{name}:{tag}", tiny_models, tmp), "hsdump_image_id": image_id,
         "hsdump_image_source": "tarball", "hsdump_image_tarball": str(tarball)}
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
        # Observability and restarts: rotated logs, Prometheus metrics, JIT caches on the host.
        log = info["HostConfig"]["LogConfig"]
        assert log == {"Type": "json-file", "Config": {"max-size": "100m", "max-file": "5"}}
        assert "--enable-metrics" in info["Args"]
        metrics = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
        assert metrics.status_code == 200 and "sglang" in metrics.text
        env = dict(e.split("=", 1) for e in info["Config"]["Env"])
        assert env["TRITON_CACHE_DIR"] == f"{v['hsdump_cache_dir']}/triton"
        assert mounts[v["hsdump_cache_dir"]]["RW"] is True
        assert "HF_TOKEN" not in env
        # The image's HEALTHCHECK, as node 0 and as a worker node (an SGLang process runs).
        for rank in ("0", "1"):
            r = subprocess.run(["docker", "exec", "-e", f"HSDUMP_NODE_RANK={rank}",
                                v["hsdump_container_name"], "python3", "-m",
                                "hsdump_patch.ops.healthcheck"], capture_output=True, text=True)
            assert r.returncode == 0, (rank, r.stdout, r.stderr)

    def test_shm_at_least_the_target(self, deployment):
        deployment.first.assert_ok("deploy.yml")
        assert _shm_bytes() >= expected_shm_kib() * 1024

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

    def test_redeploy_does_not_replace_a_container_running_an_extraction(self, ansible,
                                                                           deployment):
        """A changed setting would recreate the container; with an `hsdump extract` running in
        it the play refuses, until hsdump_server_force_recreate."""
        v = deployment.vars
        name = v["hsdump_container_name"]
        started = json.loads(_docker("inspect", name))[0]["State"]["StartedAt"]
        # A process named like the extraction client (its argv[0]), for as long as the check.
        _docker("exec", "-d", name, "bash", "-c", "exec -a 'hsdump extract' sleep 120")
        try:
            changed = {**v, "hsdump_server_allreduce": False,
                       "hsdump_server_env": {**yaml.safe_load(CPU_VARS.read_text())[
                           "hsdump_server_env"], "HSDUMP_TEST_CHANGE": "1"}}
            run = ansible.playbook("deploy.yml", ONE_HOST, tags="server", extra=changed)
        finally:
            for line in _docker("top", name, "-eo", "pid,args").splitlines():
                if "hsdump extract" in line:
                    os.kill(int(line.split()[0]), signal.SIGTERM)
        flat = " ".join(run.output.split())
        assert run.rc != 0, run.output[-4000:]
        assert "and an `hsdump extract` runs in it" in flat
        assert "-e hsdump_server_force_recreate=true" in flat
        assert json.loads(_docker("inspect", name))[0]["State"]["StartedAt"] == started

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
