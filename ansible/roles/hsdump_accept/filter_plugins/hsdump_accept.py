"""Filters of hsdump_accept: parse what dcgmi, nvidia-smi and nccl-tests print.

Formats as NVIDIA documents them: `dcgmi diag` and `dcgmi health -c` print a two-column
table (``| name | result |``, messages on ``Error``/``Warning`` rows continued on rows with an
empty name); `nvidia-smi nvlink -s` prints ``GPU i: <name> (UUID: ...)`` then one
``Link n: <speed> GB/s`` or ``Link n: <inactive>`` line per link; nccl-tests' all_reduce_perf
ends with ``# Out of bounds values : <n> OK|FAILED`` and ``# Avg bus bandwidth    : <GB/s>``
(NVIDIA/nccl-tests src/common.cu), its rows are ``size count type redop root`` then time,
algbw, busbw, #wrong out-of-place and again in-place.
"""

from __future__ import annotations

import re

ROW = re.compile(r"^\|\s*(?P<name>[^|]*?)\s*\|\s*(?P<value>[^|]*?)\s*\|$")
RESULTS = ("Pass", "Fail", "Warn", "Skip")
MESSAGE_ROWS = ("Error", "Warning", "Info")
LINK = re.compile(r"^\s*Link (\d+): (.*?)\s*$")
GPU = re.compile(r"^GPU (\d+): (.*?)(?: \(UUID: .*\))?\s*$")
NCCL_ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+\S+\s+\S+\s+-?\d+\s+(.*)$")


def dcgm_table(text: str) -> dict:
    """``dcgmi diag``: {tests: [{name, result, messages}], metadata: {name: value}, failed: [...]}.

    A row whose result starts with Pass/Fail/Warn/Skip is a test; Error/Warning/Info rows and
    their continuation rows (empty name) are that test's messages; other rows are metadata.
    dcgmi wraps a message at the cell's width, mid-word: the raw cells are joined as they are."""
    tests: list[dict] = []
    metadata: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        m = ROW.match(line)
        if not m or line.startswith(("|-----", "+-----")):
            continue
        name, value = m["name"], m["value"]
        raw = line.split("|")[2][1:-2]  # "| <cell text, padded> |" without the frame's spaces
        if name == "Diagnostic" and value == "Result":
            continue
        if name in MESSAGE_ROWS and tests:
            tests[-1]["messages"].append(raw)
        elif not name and tests and tests[-1]["messages"]:
            tests[-1]["messages"][-1] += raw
        elif value.split(" ")[0] in RESULTS:
            tests.append({"name": name, "result": value, "messages": []})
        elif name:
            metadata[name] = value
    for t in tests:
        t["messages"] = [" ".join(msg.split()) for msg in t["messages"]]
    failed = [t for t in tests if t["result"].startswith("Fail")]
    return {"tests": tests, "metadata": metadata, "failed": failed}


def dcgm_health(text: str) -> dict:
    """``dcgmi health -c``: {overall: Healthy|Warning|Failure|None, messages: [...]}."""
    overall = None
    messages: list[str] = []
    for line in text.splitlines():
        m = ROW.match(line.strip())
        if not m:
            continue
        if m["name"].startswith("Overall Health"):
            overall = m["value"]
        elif overall is not None and m["value"]:
            if m["name"]:
                messages.append(f"{m['name']}: {m['value']}")
            elif messages:
                messages[-1] += " " + m["value"]
    return {"overall": overall, "messages": messages}


def nvlink_status(text: str) -> dict:
    """``nvidia-smi nvlink -s``: {gpus: [{index, name, active, inactive: [link ids], gbs}]}."""
    gpus: list[dict] = []
    for line in text.splitlines():
        g = GPU.match(line.strip())
        if g:
            gpus.append({"index": int(g[1]), "name": g[2], "active": 0, "inactive": [], "gbs": []})
            continue
        m = LINK.match(line)
        if m and gpus:
            speed = m[2]
            if "inactive" in speed or not speed.endswith("GB/s"):
                gpus[-1]["inactive"].append(int(m[1]))
            else:
                gpus[-1]["active"] += 1
                gpus[-1]["gbs"].append(float(speed.split()[0]))
    return {"gpus": gpus}


def pcie_links(text: str) -> list[dict]:
    """nvidia-smi --query-gpu=index,name,pci.bus_id,pcie.link.gen.current,pcie.link.gen.max,
    pcie.link.width.current,pcie.link.width.max --format=csv,noheader (one line per GPU)."""
    keys = ("index", "name", "bus_id", "gen_current", "gen_max", "width_current", "width_max")
    rows = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != len(keys):
            continue
        row = dict(zip(keys, fields, strict=True))
        for k in ("index", "gen_current", "gen_max", "width_current", "width_max"):
            row[k] = int(row[k]) if row[k].isdigit() else None
        rows.append(row)
    return rows


def nccl_result(text: str) -> dict:
    """all_reduce_perf output: {avg_busbw_gbs, out_of_bounds, rows: [{bytes, busbw_oop,
    busbw_ip}]} (bus bandwidths in GB/s, out-of-place and in-place)."""
    avg = oob = None
    rows = []
    for line in text.splitlines():
        if line.startswith("# Avg bus bandwidth"):
            avg = float(line.split(":", 1)[1].split()[0])
        elif line.startswith("# Out of bounds values"):
            oob = int(line.split(":", 1)[1].split()[0])
        else:
            m = NCCL_ROW.match(line)
            cols = m[3].split() if m else []
            if len(cols) >= 8:
                rows.append({"bytes": int(m[1]), "busbw_oop": float(cols[2]),
                             "busbw_ip": float(cols[6])})
    return {"avg_busbw_gbs": avg, "out_of_bounds": oob, "rows": rows}


def pcie_problems(rows: list[dict], gen: int, width: int) -> list[str]:
    """A message for each GPU whose link is below Gen ``gen`` x``width``. The generation is
    read from pcie.link.gen.max (what GPU and slot negotiated: the current one drops at idle
    to save power), the width from pcie.link.width.current."""
    out = []
    for g in rows:
        if (g["gen_max"] or 0) < gen or (g["width_current"] or 0) < width:
            out.append(
                f"PCIe: GPU {g['index']} ({g['bus_id']}) links at Gen{g['gen_max']}"
                f" x{g['width_current']} (current Gen{g['gen_current']}, max width"
                f" x{g['width_max']}), expected Gen{gen} x{width}:"
                " reseat the card or its riser, check the slot's link settings in the BIOS"
                " (lspci -vv: LnkSta), or set hsdump_accept_pcie_gen/_width for this host.")
    return out


def nvlink_problems(status: dict, links: int, gpus: int) -> list[str]:
    """A message for each GPU with fewer than ``links`` active NVLink links."""
    seen = status["gpus"]
    out = [] if len(seen) == gpus else [
        f"NVLink: nvidia-smi nvlink -s lists {len(seen)} GPUs, nvidia-smi --query-gpu {gpus}."]
    for g in seen:
        if g["active"] < links:
            out.append(
                f"NVLink: GPU {g['index']} has {g['active']} of {links} links active"
                f" (inactive: {', '.join(map(str, g['inactive'])) or 'none listed'}): check"
                " Fabric Manager (journalctl -u nvidia-fabricmanager) and nvidia-smi nvlink -e;"
                " a link that stays down after a reboot is a hardware fault (RMA).")
    return out


def dcgm_problems(rc: int, out: str, level: int, timeout_s: int) -> list[str]:
    """What `timeout <s> dcgmi diag -r <level>` found wrong, each with the fix."""
    if rc == 127:
        return ["DCGM: dcgmi is not installed: set hsdump_dcgm_install=true and run"
                " deploy.yml --tags dcgm, or skip with -e hsdump_accept_dcgm_diag_level=0."]
    if rc == 124:
        return [f"DCGM: dcgmi diag -r {level} did not finish within"
                f" hsdump_accept_dcgm_diag_timeout_s={timeout_s} s: a GPU that hangs; rerun"
                " it by hand and look at the last test it reached."]
    table = dcgm_table(out)
    msgs = [f"DCGM diag -r {level}: {t['name']}: {t['result']}"
            + (f": {' '.join(t['messages'])}" if t["messages"] else "") for t in table["failed"]]
    if not table["tests"]:
        tail = " ".join(out.split()[-40:])
        msgs.append(f"DCGM: dcgmi diag -r {level} printed no results (exit {rc}): {tail} --"
                    " is the host engine running? systemctl enable --now nvidia-dcgm"
                    " (hsdump_dcgm_install installs and starts it).")
    elif rc != 0 and not msgs:
        msgs.append(f"DCGM: dcgmi diag -r {level} exited {rc} without a failed test:"
                    f" {' '.join(out.split()[-40:])}")
    return msgs


def nccl_problems(rc: int, out: str, min_gbs: float, timeout_s: int, platform: str) -> list[str]:
    """What `timeout <s> all_reduce_perf ...` found wrong, each with the fix."""
    if rc == 127:
        return ["NCCL: all_reduce_perf (hsdump_accept_nccl_bin) is not on the host: build"
                " NVIDIA/nccl-tests (make MPI=0 CUDA_HOME=/usr/local/cuda) and set"
                " hsdump_accept_nccl_bin to build/all_reduce_perf, or skip with"
                " -e hsdump_accept_nccl=false."]
    if rc == 124:
        return [f"NCCL: all_reduce_perf did not finish within hsdump_accept_nccl_timeout_s="
                f"{timeout_s} s: a hang, typically PCIe P2P through an IOMMU/ACS (set"
                " NCCL_P2P_DISABLE=1 in hsdump_server_env, or iommu=pt and ACS off)."]
    r = nccl_result(out)
    tail = " ".join(out.split()[-30:])
    if rc != 0:
        return [f"NCCL: all_reduce_perf failed (exit {rc}): {tail}"]
    msgs = []
    if r["out_of_bounds"]:
        msgs.append(f"NCCL: all_reduce_perf found {r['out_of_bounds']} wrong values: a GPU or"
                    " link corrupts data; run dcgmi diag -r 3"
                    " (-e hsdump_accept_dcgm_diag_level=3).")
    if r["avg_busbw_gbs"] is None:
        msgs.append(f"NCCL: no '# Avg bus bandwidth' line in all_reduce_perf's output: {tail}")
    elif r["avg_busbw_gbs"] < min_gbs:
        msgs.append(
            f"NCCL: average all-reduce bus bandwidth {r['avg_busbw_gbs']:g} GB/s is below"
            f" hsdump_accept_nccl_min_busbw_gbs={min_gbs:g} ({platform}): check the NVLink state"
            " and Fabric Manager (HGX), the PCIe links above, NCCL_P2P_DISABLE/NCCL_* in"
            " hsdump_server_env, and nvidia-smi topo -m; rerun with NCCL_DEBUG=INFO.")
    return msgs


class FilterModule:
    """The filters above, prefixed ``hsdump_``."""

    def filters(self) -> dict:
        return {"hsdump_dcgm_table": dcgm_table, "hsdump_dcgm_health": dcgm_health,
                "hsdump_nvlink_status": nvlink_status, "hsdump_pcie_links": pcie_links,
                "hsdump_nccl_result": nccl_result,
                "hsdump_pcie_problems": pcie_problems, "hsdump_nvlink_problems": nvlink_problems,
                "hsdump_dcgm_problems": dcgm_problems, "hsdump_nccl_problems": nccl_problems}
