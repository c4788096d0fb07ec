"""Filters for multi-node networking: parse `ibstat`, select ports as NCCL_IB_HCA does, read
NCCL's INFO log.

Formats: `ibstat` (infiniband-diags) prints ``CA '<name>'`` then, per port, ``Port <n>:`` with
``State:`` (Active, Down, Initializing, Armed), ``Physical state:`` (LinkUp, Polling, Disabled),
``Rate:`` and ``Link layer:`` (InfiniBand, or Ethernet for RoCE). NCCL_IB_HCA (NCCL's
environment variable docs): comma-separated name prefixes, ``=`` for exact names, a leading
``^`` to exclude, ``:<port>`` to name one port. NCCL_DEBUG=INFO (NCCL's net and transport
setup) logs ``NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/RoCE ...; OOB eth0:<addr>`` or ``NET/IB :
No device found.``, ``Using network IB`` or ``Using network Socket``, ``NET/IB : GPU Direct
RDMA (nvidia-peermem|DMABUF) enabled for HCA ...`` or ``... Disabled for HCA ...``, and per
channel ``Channel 00/0 : 0[0] -> 8[0] [send] via NET/IB/0/GDRDMA`` (``NET/IB/0`` without
GPUDirect, ``NET/Socket/0`` over TCP, ``P2P/...``/``SHM/...`` inside a node).
"""

from __future__ import annotations

import re

CA = re.compile(r"^CA '(?P<hca>[^']+)'")
PORT = re.compile(r"^\s+Port (?P<port>\d+):\s*$")
FIELD = re.compile(r"^\s+(?P<key>State|Physical state|Rate|Link layer):\s*(?P<value>.*?)\s*$")
USING_IB = re.compile(r"NET/IB : Using (?P<list>(?:\[\d+\]\S+\s*)+)")
USING_NET = re.compile(r"Using network (?P<net>\S+)")
CHANNEL_VIA = re.compile(r"Channel \d+/\d+ : .* via (?P<via>\S+)")
GDR = re.compile(r"NET/IB : GPU Direct RDMA (?:\((?P<how>[^)]+)\) enabled|(?P<off>Disabled))"
                 r" for HCA \d+ '(?P<hca>[^']+)")
WARN = re.compile(r"NCCL WARN (?P<msg>.*)$")


def hsdump_ibstat(text: str) -> list[dict]:
    """`ibstat` -> [{hca, port, state, physical_state, rate, link_layer}], one per port."""
    ports: list[dict] = []
    hca = None
    for line in text.splitlines():
        if m := CA.match(line):
            hca = m["hca"]
        elif (m := PORT.match(line)) and hca is not None:
            ports.append({"hca": hca, "port": int(m["port"]), "state": "", "physical_state": "",
                          "rate": "", "link_layer": ""})
        elif (m := FIELD.match(line)) and ports and ports[-1]["hca"] == hca:
            ports[-1][m["key"].lower().replace(" ", "_")] = m["value"]
    return ports


def _selected(port: dict, spec: str) -> bool:
    """NCCL_IB_HCA's matching for one port (an empty spec selects every port)."""
    spec = spec.strip()
    if not spec:
        return True
    exclude = spec.startswith("^")
    spec = spec.lstrip("^")
    exact = spec.startswith("=")
    spec = spec.lstrip("=")
    hit = False
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, num = item.partition(":")
        named = port["hca"] == name if exact else port["hca"].startswith(name)
        if named and (not num or int(num) == port["port"]):
            hit = True
            break
    return hit != exclude


def hsdump_ib_select(ports: list[dict], spec: str) -> list[dict]:
    """The ports of ``ports`` that NCCL_IB_HCA=``spec`` lets NCCL use."""
    return [p for p in ports if _selected(p, spec or "")]


def hsdump_nccl_net(text: str) -> dict:
    """NCCL_DEBUG=INFO output -> {networks, ib_ports, no_ib_device, via, gdr, warnings}.

    ``networks``: every ``Using network X`` (one per rank); ``via``: the transport of every
    channel connection (``NET/IB/0/GDRDMA``, ``NET/Socket/0``, ``P2P/CUMEM``, ...);
    ``gdr``: {hca: "nvidia-peermem"|"DMABUF"|"Disabled"}."""
    networks: list[str] = []
    ib_ports: list[str] = []
    via: list[str] = []
    gdr: dict[str, str] = {}
    warnings: list[str] = []
    for line in text.splitlines():
        if m := USING_IB.search(line):
            ib_ports += [p.split("]", 1)[1] for p in m["list"].split() if "]" in p]
        if m := USING_NET.search(line):
            networks.append(m["net"])
        if m := CHANNEL_VIA.search(line):
            via.append(m["via"])
        # An "enabled" line wins over an earlier "Disabled" for the same HCA.
        if (m := GDR.search(line)) and (m["how"] or m["hca"] not in gdr):
            gdr[m["hca"]] = m["how"] or "Disabled"
        if m := WARN.search(line):
            warnings.append(m["msg"])
    return {"networks": sorted(set(networks)), "ib_ports": sorted(set(ib_ports)),
            "no_ib_device": "NET/IB : No device found" in text, "via": via, "gdr": gdr,
            "warnings": warnings}


def hsdump_sections(text: str) -> dict[str, list[str]]:
    """Output of a probe that prints ``== <name>`` before each part -> {name: [lines]}."""
    out: dict[str, list[str]] = {}
    key = ""
    for line in text.splitlines():
        if line.startswith("== "):
            key = line[3:].strip()
            out[key] = []
        else:
            out.setdefault(key, []).append(line)
    return out


class FilterModule:
    def filters(self):
        return {"hsdump_ibstat": hsdump_ibstat, "hsdump_ib_select": hsdump_ib_select,
                "hsdump_nccl_net": hsdump_nccl_net, "hsdump_sections": hsdump_sections}
