#!/usr/bin/python
"""Ansible module: check that a model directory holds a complete safetensors checkpoint.

Read-only. ``config.json`` must parse; with ``model.safetensors.index.json`` every shard its
weight map names must exist, otherwise every ``*.safetensors`` file is checked. Each shard's
size must equal what its own header implies (8 + header length + the end of the last tensor),
which catches truncated copies without reading 600 GB. An optional size manifest
(``<bytes> <relative path>`` per line, as ``find DIR -type f -printf '%s %P\\n'`` writes it)
is checked too. With a sha256 manifest (``sha256sum`` output, paths relative to the model dir)
every file it names is hashed and compared; the hashes are kept in a cache file keyed by inode,
size, mtime and ctime, so a file that has not changed since it was verified is not read again.
Used by hsdump_preflight and hsdump_weights (shared through the hsdump role).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: hsdump_model_check
short_description: Check a safetensors checkpoint directory (config, index, shard sizes)
options:
  path: {description: Model directory on the managed host., type: path, required: true}
  manifest: {description: "Optional size manifest on the managed host, lines of `<bytes> <relative path>`.", type: path}
  sha256_manifest: {description: "Optional sha256sum-format manifest; a relative path is taken from I(path).", type: path}
  sha256_cache: {description: "JSON file keeping the hashes of verified files (written when they change).", type: path}
author: hsdump
"""

RETURN = r"""
problems: {description: What is missing or wrong, one line each (empty when complete)., type: list, returned: always}
shards: {description: Number of shard files checked., type: int, returned: always}
total_bytes: {description: Bytes in the checked shards., type: int, returned: always}
sha256_mismatch: {description: "Files (relative paths) whose sha256 differs from the manifest's.", type: list, returned: always}
sha256_read_bytes: {description: Bytes hashed in this run (0 when every file was cached)., type: int, returned: always}
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


def _stat_key(f: Path) -> list[int]:
    st = f.stat()
    return [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _sha256(f: Path) -> str:
    h = hashlib.sha256()
    with f.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def check_sha256(model: Path, manifest: Path, cache_path: Path | None
                 ) -> tuple[list[str], list[str], int]:
    """(problems, mismatching relative paths, bytes hashed) against a sha256sum manifest."""
    if not manifest.is_file():
        return [f"{manifest}: no such sha256 manifest"], [], 0
    cache: dict = {}
    if cache_path and cache_path.is_file():
        try:
            cache = json.loads(cache_path.read_text())
        except ValueError:
            cache = {}
    problems: list[str] = []
    mismatch: list[str] = []
    fresh: dict = {}
    read = 0
    for n, line in enumerate(manifest.read_text().splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split(None, 1)
        if len(parts) != 2 or len(parts[0]) != 64:
            problems.append(f"{manifest.name} line {n}: not `<sha256>  <path>`")
            continue
        want, rel = parts[0].lower(), parts[1].strip().lstrip("*")
        f = model / rel
        if f.resolve() == manifest.resolve():
            continue
        if not f.is_file():
            problems.append(f"{rel}: missing (named by {manifest.name})")
            continue
        key = _stat_key(f)
        cached = cache.get(rel)
        if cached and cached[:4] == key:
            got = cached[4]
        else:
            got = _sha256(f)
            read += key[1]
        fresh[rel] = [*key, got]
        if got != want:
            mismatch.append(rel)
            problems.append(f"{rel}: sha256 {got}, {manifest.name} says {want}")
    if cache_path and fresh != cache:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(fresh))
        os.replace(tmp, cache_path)
    return problems, mismatch, read


def main() -> None:
    module = AnsibleModule(argument_spec={"path": {"type": "path", "required": True},
                                          "manifest": {"type": "path"},
                                          "sha256_manifest": {"type": "path"},
                                          "sha256_cache": {"type": "path"}},
                           supports_check_mode=True)
    model = Path(module.params["path"])
    manifest = Path(module.params["manifest"]) if module.params["manifest"] else None
    problems, shards, total = check(model, manifest)
    mismatch: list[str] = []
    read = 0
    if module.params["sha256_manifest"] and model.is_dir():
        sums = model / module.params["sha256_manifest"]  # an absolute path stays as it is
        cache = Path(module.params["sha256_cache"]) if module.params["sha256_cache"] else None
        if module.check_mode:
            cache = None
        more, mismatch, read = check_sha256(model, sums, cache)
        problems += more
    module.exit_json(changed=False, problems=problems, shards=shards, total_bytes=total,
                     sha256_mismatch=mismatch, sha256_read_bytes=read)


if __name__ == "__main__":
    main()
