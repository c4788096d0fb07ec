#!/usr/bin/python
"""Ansible module: check that a model directory holds a complete safetensors checkpoint.

Read-only. ``config.json`` must parse; with ``model.safetensors.index.json`` every shard its
weight map names must exist, otherwise every ``*.safetensors`` file is checked. Each shard's
size must equal what its own header implies (8 + header length + the end of the last tensor),
which catches truncated copies without reading 600 GB. An optional size manifest
(``<bytes> <relative path>`` per line, as ``find DIR -type f -printf '%s %P\\n'`` writes it)
is checked too. Used by hsdump_preflight and hsdump_weights (shared through the hsdump role).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: hsdump_model_check
short_description: Check a safetensors checkpoint directory (config, index, shard sizes)
options:
  path: {description: Model directory on the managed host., type: path, required: true}
  manifest: {description: "Optional size manifest on the managed host, lines of `<bytes> <relative path>`.", type: path}
author: hsdump
"""

RETURN = r"""
problems: {description: What is missing or wrong, one line each (empty when complete)., type: list, returned: always}
shards: {description: Number of shard files checked., type: int, returned: always}
total_bytes: {description: Bytes in the checked shards., type: int, returned: always}
"""


def expected_size(shard: Path) -> int:
    """The file size a safetensors file's header implies."""
    with shard.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"]
    return 8 + n + max(ends, default=0)


def check(model: Path, manifest: Path | None) -> tuple[list[str], int, int]:
    """(problems, shards checked, bytes) for the checkpoint in ``model``."""
    if not model.is_dir():
        return [f"{model} does not exist or is not a directory"], 0, 0
    problems: list[str] = []
    try:
        json.loads((model / "config.json").read_text())
    except (OSError, ValueError) as e:
        problems.append(f"config.json: {e}")
    index = model / "model.safetensors.index.json"
    if index.exists():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError) as e:
            return [*problems, f"{index.name}: {e}"], 0, 0
    else:
        names = sorted(p.name for p in model.glob("*.safetensors"))
        if not names:
            problems.append("no model.safetensors.index.json and no *.safetensors file")
    total = 0
    for name in names:
        shard = model / name
        if not shard.is_file():
            problems.append(f"{name}: missing (named by the index)")
            continue
        size = shard.stat().st_size
        total += size
        try:
            want = expected_size(shard)
        except (OSError, ValueError, struct.error, KeyError, TypeError) as e:
            problems.append(f"{name}: unreadable safetensors header ({e})")
            continue
        if size != want:
            problems.append(f"{name}: {size} bytes, its header implies {want} (truncated copy?)")
    if manifest:
        for line in manifest.read_text().splitlines():
            if not line.strip():
                continue
            want_s, rel = line.split(None, 1)
            f = model / rel.strip()
            if not f.is_file():
                problems.append(f"{rel.strip()}: missing (named by the manifest)")
            elif f.stat().st_size != int(want_s):
                problems.append(f"{rel.strip()}: {f.stat().st_size} bytes, manifest says {want_s}")
    return problems, len(names), total


def main() -> None:
    module = AnsibleModule(argument_spec={"path": {"type": "path", "required": True},
                                          "manifest": {"type": "path"}},
                           supports_check_mode=True)
    manifest = Path(module.params["manifest"]) if module.params["manifest"] else None
    problems, shards, total = check(Path(module.params["path"]), manifest)
    module.exit_json(changed=False, problems=problems, shards=shards, total_bytes=total)


if __name__ == "__main__":
    main()
