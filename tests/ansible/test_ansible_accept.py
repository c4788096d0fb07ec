"""Real Ansible: GPU acceptance (hsdump_accept in verify.yml) and upgrade.yml, on this machine.

No GPU here: stand-ins for `nvidia-smi`, `dcgmi` and nccl-tests' `all_reduce_perf` print what
the real tools print (formats from NVIDIA's documentation and nccl-tests' src/common.cu), pass
and fail, and log how they were called. The roles' parsing, thresholds, report and messages
are real. upgrade.yml runs over two inventory hosts (both this machine) whose server
containers are shell stand-ins that log their start and stop, with `hsdump extract`-named
processes running in them.
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
from pathlib import Path

import pytest
import yaml

from tests.harness.ansible import CASES, ONE_HOST, _debian_image, _docker

W_NAME, W_VALUE = 25, 46  # dcgmi's table: "| <name:25> | <value:46> |", messages cut at 45


def _row(name: str, value: str) -> str:
    return f"| {name:<{W_NAME}} | {value:<{W_VALUE}} |"


def dcgm_diag(failures: dict[str, str] | None = None) -> str:
    """`dcgmi diag -r 2` output (DCGM user guide's example layout); ``failures``: test -> the
    Error message dcgmi wraps at the cell's width."""
    failures = failures or {}
    rule = "+" + "-" * (W_NAME + 2) + "+" + "-" * (W_VALUE + 2) + "+"
    out = ["Successfully ran diagnostic for group.", rule, _row("Diagnostic", "Result"),
           rule.replace("-", "="), "|-----  Metadata  ----------+" + "-" * (W_VALUE + 2) + "|",
           _row("DCGM Version", "4.2.3"), _row("Driver Version Detected", "580.95.05"),
           "|-----  Deployment  --------+" + "-" * (W_VALUE + 2) + "|"]
    sections = {"Deployment": ["Denylist", "NVML Library", "CUDA Main Library",
                               "Permissions and OS Blocks", "Persistence Mode",
                               "Environment Variables", "Page Retirement/Row Remap",
                               "Graphics Processes", "Inforom"],
                "Integration": ["PCIe"], "Hardware": ["GPU Memory", "Diagnostic"],
                "Stress": ["Memory Bandwidth"]}
    for section, tests in sections.items():
        if section != "Deployment":
            out.append(f"+-----  {section}  " + "-" * (18 - len(section)) + "+"
                       + "-" * (W_VALUE + 2) + "+")
        for test in tests:
            if test in failures:
                out.append(_row(test, "Fail"))
                msg = failures[test]
                chunks = [msg[i:i + 45] for i in range(0, len(msg), 45)]
                out += [_row("Error" if i == 0 else "", c) for i, c in enumerate(chunks)]
            else:
                out.append(_row(test, "Pass" if section == "Deployment" else "Pass - All"))
    return "\n".join([*out, rule]) + "\n"


def nccl_output(ngpus: int, busbw: float, gpu: str) -> str:
    """all_reduce_perf -b 8M -e 1G -f 2 -g <n> output (nccl-tests 2.x), busbw at large sizes."""
    head = [f"# nThread 1 nGpus {ngpus} minBytes 8388608 maxBytes 1073741824 step: 2(factor)"
            " warmup iters: 5 iters: 20 agg iters: 1 validation: 1 graph: 0", "#",
            "# Using devices"]
    head += [f"#  Rank {i:2d} Group  0 Pid   4242 on gpu-node device {i:2d}"
             f" [0000:{i + 0x18:02x}:00] {gpu}" for i in range(ngpus)]
    head += ["#", "#" + " " * 62 + "out-of-place                       in-place",
             "#       size         count      type   redop    root     time   algbw   busbw"
             " #wrong     time   algbw   busbw #wrong",
             "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)"
             "            (us)  (GB/s)  (GB/s)"]
    rows, bws = [], []
    for k in range(8):  # 8M .. 1G
        size = 8 * 2**20 * 2**k
        bw = busbw * (0.55 + 0.45 * k / 7)
        bws += [bw, bw]
        alg = bw * ngpus / (2 * (ngpus - 1))
        t = size / alg / 1e3
        rows.append(f"{size:>12} {size // 4:>13} {'float':>9} {'sum':>7} {-1:>7} {t:>8.1f}"
                    f" {alg:>7.2f} {bw:>7.2f} {0:>6} {t:>8.1f} {alg:>7.2f} {bw:>7.2f} {0:>6}")
    tail = ["# Out of bounds values : 0 OK", f"# Avg bus bandwidth    : {sum(bws) / len(bws):g}",
            "#"]
    return "\n".join(head + rows + tail) + "\n"


HEALTHY = "\n".join([
    "+---------------------------+------------------------------------------------+",
    "| Health Monitor Report                                                      |",
    "+===========================+================================================+",
    _row("Overall Health:", "Healthy"),
    "+---------------------------+------------------------------------------------+"]) + "\n"


def nvlink_status(gpus: int, gpu: str, inactive: dict[int, list[int]] | None = None) -> str:
    """`nvidia-smi nvlink -s` of an HGX B200: 18 NVLink 5 links per GPU."""
    inactive = inactive or {}
    out = []
    for i in range(gpus):
        out.append(f"GPU {i}: {gpu} (UUID: GPU-{uuid.UUID(int=i)})")
        out += [f"\t Link {n}: " + ("<inactive>" if n in inactive.get(i, []) else "53.125 GB/s")
                for n in range(18)]
    return "\n".join(out) + "\n"


def smi_query(gpu: str, widths: dict[int, int] | None = None) -> str:
    """nvidia-smi --query-gpu=index,name,pci.bus_id,pcie.link.gen.current,pcie.link.gen.max,
    pcie.link.width.current,pcie.link.width.max: idle GPUs, their current gen down to 1."""
    widths = widths or {}
    return "".join(f"{i}, {gpu}, 00000000:{0x18 + i:02X}:00.0, 1, 5, {widths.get(i, 16)}, 16\n"
                   for i in range(8))


def stand_ins(bin_dir: Path, log: Path, *, query: str, nvlink: str, diag: str, diag_rc: int,
              nccl: str, nccl_rc: int, health: str = HEALTHY) -> None:
    """nvidia-smi, dcgmi and all_reduce_perf that print the given outputs and log their calls
    (all_reduce_perf also the NCCL_* and HSDUMP_TEST_* environment) to ``log``."""
    bin_dir.mkdir(exist_ok=True)
    files = {"smi-query": query, "smi-nvlink": nvlink, "diag": diag, "health": health,
             "nccl": nccl}
    for name, text in files.items():
        (bin_dir / f"{name}.out").write_text(text)
    scripts = {
        "nvidia-smi": f'echo "nvidia-smi $*" >> {log}\n'
                      f'case "$1" in nvlink) cat {bin_dir}/smi-nvlink.out;;'
                      f' *) cat {bin_dir}/smi-query.out;; esac\n',
        "dcgmi": f'echo "dcgmi $*" >> {log}\n'
                 f'case "$1" in diag) cat {bin_dir}/diag.out; exit {diag_rc};;'
                 f' health) [ "$2" = -c ] && cat {bin_dir}/health.out; exit 0;; esac\nexit 2\n',
        "all_reduce_perf": 'echo "nccl $* $(env | grep -E "^(NCCL|HSDUMP_TEST)_" | sort'
                           f' | tr "\\n" " ")" >> {log}\ncat {bin_dir}/nccl.out\nexit {nccl_rc}\n',
    }
    for name, body in scripts.items():
        path = bin_dir / name
        path.write_text("#!/bin/sh\n" + body)
        path.chmod(0o755)


def _accept_vars(tmp_path: Path) -> dict:
    return {"hsdump_gpu_checks": True, "hsdump_accept_fetch_dir": str(tmp_path / "reports"),
            "hsdump_container_name": f"hsdump-accept-none-{uuid.uuid4().hex[:6]}"}


def test_accept_hgx_b200_passes_with_every_number_in_the_report(ansible, docker_engine,
                                                                  tmp_path):
    """verify.yml --tags accept on an HGX B200 stand-in: --check runs no diagnostic and no
    all-reduce; the run passes with DCGM level 2, health watches, 8 x 18 NVLink links, Gen5
    x16 (idle GPUs at Gen1 current), the bus bandwidth and the server's NCCL env; the report
    holds the numbers; a second run changes nothing."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    stand_ins(bin_dir, log, query=smi_query("NVIDIA B200"), diag=dcgm_diag(), diag_rc=0,
              nvlink=nvlink_status(8, "NVIDIA B200"), nccl=nccl_output(8, 701.3, "NVIDIA B200"),
              nccl_rc=0)
    v = {**_accept_vars(tmp_path), "hsdump_accept_dcgm_health": True,
         "hsdump_server_env": {"NCCL_NVLS_ENABLE": "1"}}
    report = tmp_path / "reports" / "cpu-host" / "accept-report.json"
    check = ansible.playbook("verify.yml", ONE_HOST, extra=v, tags="accept", check=True,
                             path_prepend=bin_dir)
    check.assert_ok("verify.yml --tags accept --check")
    assert "dcgmi" not in log.read_text() and "nccl" not in log.read_text()
    assert not report.exists()
    first = ansible.playbook("verify.yml", ONE_HOST, extra=v, tags="accept", path_prepend=bin_dir)
    first.assert_ok("verify.yml --tags accept")
    calls = log.read_text().splitlines()
    assert "dcgmi diag -r 2" in calls and "dcgmi health -s a" in calls, calls
    assert "nccl -b 8M -e 1G -f 2 -g 8 NCCL_NVLS_ENABLE=1 " in calls, calls
    r = json.loads(report.read_text())
    assert r["passed"] is True and r["problems"] == []
    assert r["expected"] == {"platform": "hgx_b200", "pcie_gen": 5, "pcie_width": 16,
                             "nvlink_links": 18, "nccl_min_busbw_gbs": 400.0}
    assert [(g["index"], g["gen_current"], g["gen_max"], g["width_current"]) for g in r["gpus"]] \
        == [(i, 1, 5, 16) for i in range(8)]
    assert [(g["active"], g["inactive"]) for g in r["nvlink"]["gpus"]] == [(18, [])] * 8
    assert r["dcgm_diag"]["level"] == 2 and r["dcgm_diag"]["failed"] == []
    assert {t["name"]: t["result"] for t in r["dcgm_diag"]["tests"]}["Memory Bandwidth"] \
        == "Pass - All"
    assert r["dcgm_health"]["overall"] == "Healthy"
    nccl = r["nccl"]
    assert [row["bytes"] for row in nccl["rows"]] == [8 * 2**20 * 2**k for k in range(8)]
    assert nccl["rows"][-1]["busbw_oop"] == 701.3 and nccl["out_of_bounds"] == 0
    assert nccl["avg_busbw_gbs"] == pytest.approx(sum(
        701.3 * (0.55 + 0.45 * k / 7) for k in range(8)) / 8, abs=0.01)
    assert "GPU acceptance passed on cpu-host (hgx_b200): 8 GPUs, all-reduce bus bandwidth" \
        in first.output
    second = ansible.playbook("verify.yml", ONE_HOST, extra=v, tags="accept",
                              path_prepend=bin_dir)
    second.assert_ok("verify.yml --tags accept, second run")
    assert second.recap()["cpu-host"]["changed"] == 0, second.output[-3000:]


def test_accept_failures_stop_the_run_naming_the_fix(ansible, docker_engine, tmp_path):
    """An RTX PRO 6000 box with a GPU at x8, persistence mode off (DCGM level 3 requested) and
    a low bus bandwidth; an HGX B200 with two NVLink links down, no DCGM host engine and an
    all-reduce that crashes: each run fails with every finding and its fix, report written."""
    pro = "NVIDIA RTX PRO 6000 Blackwell Server Edition"
    persistence = ('Persistence mode for GPU 0 is currently disabled. The DCGM diagnostic'
                   ' requires peristence mode to be enabled. Enable persistence mode by'
                   ' running "nvidia-smi -i <gpuId> -pm 1 " as root.')
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    stand_ins(bin_dir, log, query=smi_query(pro, widths={5: 8}), nvlink="", diag_rc=226,
              diag=dcgm_diag({"Persistence Mode": persistence}), nccl=nccl_output(8, 9.8, pro),
              nccl_rc=0)
    v = {**_accept_vars(tmp_path), "hsdump_accept_dcgm_diag_level": "3"}
    run = ansible.playbook("verify.yml", ONE_HOST, extra=v, tags="accept", path_prepend=bin_dir)
    flat = " ".join(run.output.split())
    assert run.rc != 0 and run.recap()["cpu-host"]["failed"] == 1, run.output[-4000:]
    assert "GPU acceptance failed on cpu-host (rtx_pro_6000)" in flat, flat[-4000:]
    assert ("PCIe: GPU 5 (00000000:1D:00.0) links at Gen5 x8 (current Gen1, max width x16),"
            " expected Gen5 x16: reseat the card or its riser") in flat
    assert f"DCGM diag -r 3: Persistence Mode: Fail: {persistence}" in flat
    assert ("below hsdump_accept_nccl_min_busbw_gbs=15 (rtx_pro_6000): check the NVLink state"
            in flat)
    assert "nvidia-smi nvlink" not in log.read_text()  # no NVLink on this platform
    assert "dcgmi diag -r 3" in log.read_text()
    report = json.loads((tmp_path / "reports" / "cpu-host" / "accept-report.json").read_text())
    assert report["passed"] is False and len(report["problems"]) == 3
    assert report["nccl"]["avg_busbw_gbs"] < 15 and report["dcgm_diag"]["rc"] == 226

    # The HGX B200 with its faults: the failure outputs of the real tools.
    no_engine = ("Error: unable to establish a connection to the specified host: localhost\n"
                 "Error: Unable to connect to host engine. Host engine connection"
                 " invalid/disconnected.\n")
    crash = nccl_output(8, 700, "NVIDIA B200").split("#       size")[0] + (
        "gpu-node: Test NCCL failure common.cu:1279 'unhandled cuda error (run with"
        " NCCL_DEBUG=INFO for details) / '\n .. gpu-node pid 4242: Test failure common.cu:1090\n")
    stand_ins(bin_dir, log, query=smi_query("NVIDIA B200"), diag=no_engine, diag_rc=255,
              nvlink=nvlink_status(8, "NVIDIA B200", {3: [4, 9]}), nccl=crash, nccl_rc=1)
    hgx = ansible.playbook("verify.yml", ONE_HOST, extra=_accept_vars(tmp_path), tags="accept",
                           path_prepend=bin_dir)
    flat = " ".join(hgx.output.split())
    assert hgx.rc != 0, hgx.output[-4000:]
    assert ("NVLink: GPU 3 has 16 of 18 links active (inactive: 4, 9): check Fabric Manager"
            in flat), flat[-4000:]
    assert "DCGM: dcgmi diag -r 2 printed no results (exit 255)" in flat
    assert "Unable to connect to host engine" in flat
    assert "systemctl enable --now nvidia-dcgm" in flat
    assert "NCCL: all_reduce_perf failed (exit 1)" in flat
    assert "Test NCCL failure common.cu:1279 'unhandled cuda error" in flat


# NVIDIA's CUDA repository as a flat file: repository holding an empty package named like
# DCGM 4's (datacenter-gpu-manager-4-cuda13), and a cuda-keyring package that adds it.
DCGM_REPO = r"""
set -e
pkg() {  # name version out.deb [file to ship]
  d=$(mktemp -d); mkdir -p $d/DEBIAN
  printf 'Package: %s\nVersion: %s\nArchitecture: all\nMaintainer: t\nDescription: t\n' $1 $2 \
    > $d/DEBIAN/control
  if [ -n "$4" ]; then mkdir -p $d$(dirname $4); echo "$5" > $d$4; fi
  dpkg-deb -b $d $3 >/dev/null; rm -rf $d
}
mkdir -p /srv/repo && cd /srv/repo
pkg datacenter-gpu-manager-4-cuda13 1:4.2.3-1 dcgm.deb
{ dpkg-deb -f dcgm.deb; echo "Filename: ./dcgm.deb"; echo "Size: $(stat -c %s dcgm.deb)"
  echo "SHA256: $(sha256sum dcgm.deb | cut -d' ' -f1)"; } > Packages
pkg cuda-keyring 1.1-1 /srv/cuda-keyring.deb /etc/apt/sources.list.d/cuda.list \
  "deb [trusted=yes] file:/srv/repo ./"
"""


def test_dcgm_installed_from_the_cuda_repository(ansible, docker_engine, tmp_path):
    """hsdump_dcgm on a Debian container: --check is clean on the fresh host; the run adds the
    CUDA repository (cuda-keyring) and installs datacenter-gpu-manager-4-cuda13 from it; a
    second run changes nothing."""
    name = f"hsdump-dcgm-{uuid.uuid4().hex[:8]}"
    _docker("run", "-d", "--name", name, "--network", "host", _debian_image(), "sleep", "infinity")
    inventory = tmp_path / "inventory.yml"
    inventory.write_text(yaml.safe_dump({"all": {"children": {"hsdump_hosts": {
        "hosts": {"dcgm-host": {"ansible_host": name}},
        "vars": {"ansible_connection": "community.docker.docker", "ansible_become": False,
                 "ansible_python_interpreter": "/usr/bin/python3"}}}}}))
    v = {"hsdump_dcgm_install": True, "hsdump_dcgm_manage_services": False,
         "hsdump_dcgm_cuda_keyring_url": "/srv/cuda-keyring.deb"}
    try:
        # python3-apt, which Ubuntu's server images ship (the apt module's --check needs it).
        _docker("exec", name, "sh", "-c", "apt-get update -qq && apt-get install -qq -y"
                " python3-apt >/dev/null && " + DCGM_REPO)
        check = ansible.playbook(CASES / "dcgm.yml", inventory, extra=v, check=True)
        check.assert_ok("dcgm.yml --check on a fresh host")
        first = ansible.playbook(CASES / "dcgm.yml", inventory, extra=v)
        first.assert_ok("dcgm.yml")
        installed = _docker("exec", name, "dpkg-query", "-W", "-f=${Version}",
                            "datacenter-gpu-manager-4-cuda13", check=False)
        second = ansible.playbook(CASES / "dcgm.yml", inventory, extra=v)
    finally:
        _docker("rm", "-f", name, check=False)
    assert first.recap()["dcgm-host"]["changed"] == 2, first.output[-3000:]
    assert installed == "1:4.2.3-1"
    second.assert_ok("dcgm.yml, second run")
    assert second.recap()["dcgm-host"]["changed"] == 0, second.output[-3000:]


# ----------------------------------------------------------------------------- upgrade.yml
SERVER = ("echo start {n} >> /log/events; trap 'echo stop {n} >> /log/events; exit 0' TERM;"
          " while :; do sleep 1; done")
# An `hsdump extract` client (argv as docker top shows it): one that finishes two seconds after
# the drain first looked at it (the docker stand-in logs `docker top`), one that runs until
# interrupted (SIGINT, as Ctrl-C; hsdump exits 130 then).
EXTRACT_ENDS = ("exec -a 'hsdump extract' bash -c 'until grep -q \"docker-top {c}\" /log/events;"
                " do sleep 0.5; done; sleep 2; echo extract-done {n} >> /log/events'")
# Logs each `docker top` (how the drain polls), then runs the real docker.
DOCKER_TOP_LOGGED = '[ "$1" = top ] && echo "docker-top $2" >> {log}\nexec {docker} "$@"\n'

EXTRACT_RUNS = ("exec -a 'hsdump extract' bash -c 'trap \"echo extract-interrupted {n}"
                " >> /log/events; exit 130\" INT; sleep 600 & wait'")


def _events(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def _wait_for(path: Path, line: str) -> None:
    deadline = time.monotonic() + 30
    while line not in _events(path):
        assert time.monotonic() < deadline, f"{line!r} never logged: {_events(path)}"
        time.sleep(0.2)


def test_upgrade_drains_verifies_and_restarts_host_by_host(ansible, docker_engine, tiny_models,
                                                           tmp_path):
    """upgrade.yml over two hosts (the driver install off here, the reboot skipped by its flag):
    --check touches nothing; host a waits for its extraction, stops, is accepted and started
    before host b is touched; b's extraction outlives the drain limit, so b fails untouched
    naming -e hsdump_upgrade_drain=stop; with it b's extraction is interrupted (SIGINT) and b
    cycles; without hsdump_upgrade_force an up-to-date fleet is left alone (changed=0)."""
    logdir = tmp_path / "log"
    logdir.mkdir()
    events = logdir / "events"
    bin_dir = tmp_path / "bin"
    stand_ins(bin_dir, events, query=smi_query("NVIDIA B200"), diag=dcgm_diag(), diag_rc=0,
              nvlink=nvlink_status(8, "NVIDIA B200"), nccl=nccl_output(8, 701.3, "NVIDIA B200"),
              nccl_rc=0)
    names = {h: f"hsdump-upgrade-{h}-{uuid.uuid4().hex[:6]}" for h in ("a", "b")}
    inventory = tmp_path / "inventory.yml"
    inventory.write_text(yaml.safe_dump({"all": {"children": {"hsdump_hosts": {
        "hosts": {f"cpu-{h}": {"hsdump_container_name": names[h],
                               "hsdump_accept_nccl_env": {"HSDUMP_TEST_HOST": h},
                               "hsdump_upgrade_drain_timeout_s": 40 if h == "a" else 3}
                  for h in names},
        "vars": {"ansible_connection": "local", "ansible_become": False,
                 "ansible_python_interpreter": "{{ ansible_playbook_python }}"}}}}}))
    v = {"hsdump_upgrade_force": True, "hsdump_upgrade_reboot": False,
         "hsdump_upgrade_wait_ready": False, "hsdump_upgrade_accept": True,
         "hsdump_upgrade_drain_poll_s": 1, "hsdump_model_dir": str(tiny_models / "tiny-llama"),
         "hsdump_accept_fetch_dir": str(tmp_path / "reports"),
         "hsdump_output_dir": str(tmp_path / "output"), "hsdump_state_dir": str(tmp_path)}
    docker = bin_dir / "docker"
    docker.write_text("#!/bin/sh\n" + DOCKER_TOP_LOGGED.format(log=events,
                                                               docker=shutil.which("docker")))
    docker.chmod(0o755)
    image = _debian_image()
    try:
        for h, name in names.items():
            _docker("run", "-d", "--name", name, "-v", f"{logdir}:/log", image, "bash", "-c",
                    SERVER.format(n=h))
            _wait_for(events, f"start {h}")
        check = ansible.playbook("upgrade.yml", inventory, extra=v, check=True,
                                 path_prepend=bin_dir)
        check.assert_ok("upgrade.yml --check")
        # --check runs the read-only nvidia-smi queries only: nothing stopped, nothing run.
        assert [e for e in _events(events) if not e.startswith(("nvidia-smi", "docker-top"))] \
            == ["start a", "start b"], _events(events)
        n_check = len(_events(events))
        _docker("exec", "-d", names["a"], "bash", "-c", EXTRACT_ENDS.format(n="a", c=names["a"]))
        _docker("exec", "-d", names["b"], "bash", "-c", EXTRACT_RUNS.format(n="b"))
        first = ansible.playbook("upgrade.yml", inventory, extra=v, path_prepend=bin_dir)
        flat = " ".join(first.output.split())
        after_first = [e for e in _events(events)[n_check:] if e != f"docker-top {names['b']}"]
        b_running = json.loads(_docker("inspect", names["b"]))[0]["State"]["Running"]
        stopped = ansible.playbook("upgrade.yml", inventory, path_prepend=bin_dir, extra={
            **v, "hsdump_upgrade_group": "cpu-b", "hsdump_upgrade_drain": "stop"})
        after_stop = [e for e in _events(events)[n_check:] if e != f"docker-top {names['b']}"]
        again = ansible.playbook("upgrade.yml", inventory, path_prepend=bin_dir,
                                 extra={**v, "hsdump_upgrade_force": False})
        running = {h: json.loads(_docker("inspect", n))[0]["State"]["Running"]
                   for h, n in names.items()}
    finally:
        for name in names.values():
            _docker("rm", "-f", name, check=False)
    assert first.rc != 0 and first.recap()["cpu-a"]["failed"] == 0, first.output[-4000:]
    assert first.recap()["cpu-b"]["failed"] == 1
    # Host a completely (extraction finished, stopped, accepted, started) before b is touched.
    # a's drain saw the extraction (and polled again) until it ended, then stopped the server.
    top_a = f"docker-top {names['a']}"
    polls = after_first.index("extract-done a")
    assert polls >= 1 and set(after_first[:polls]) == {top_a}, after_first
    assert after_first[polls:] == ["extract-done a", top_a, "stop a",
                           "nvidia-smi --query-gpu=index,name,pci.bus_id,pcie.link.gen.current,"
                           "pcie.link.gen.max,pcie.link.width.current,pcie.link.width.max"
                           " --format=csv,noheader", "nvidia-smi nvlink -s", "dcgmi diag -r 2",
                           "nccl -b 8M -e 1G -f 2 -g 8 HSDUMP_TEST_HOST=a ", "start a"], after_first
    assert "hsdump_upgrade_reboot=false: cpu-a was NOT rebooted" in flat
    assert (f"cpu-b: an extraction still runs in {names['b']} after"
            " hsdump_upgrade_drain_timeout_s=3 s") in flat, flat[-4000:]
    assert "Nothing on this host was changed" in flat and "-e hsdump_upgrade_drain=stop" in flat
    assert b_running
    stopped.assert_ok("upgrade.yml -e hsdump_upgrade_drain=stop on cpu-b")
    b_cycle = after_stop[len(after_first):]
    assert b_cycle[:2] == ["extract-interrupted b", "stop b"] and b_cycle[-1] == "start b", b_cycle
    assert "nccl -b 8M -e 1G -f 2 -g 8 HSDUMP_TEST_HOST=b " in b_cycle
    again.assert_ok("upgrade.yml on an up-to-date fleet")
    assert {h: r["changed"] for h, r in again.recap().items()} == {"cpu-a": 0, "cpu-b": 0}
    assert [e for e in _events(events)[n_check:] if not e.startswith("docker-top")] \
        == [e for e in after_stop if not e.startswith("docker-top")]
    assert running == {"a": True, "b": True}
    assert "up to date" in again.output
