"""Fail in seconds, before any install, when the disk cannot hold what `make test` builds.

The .venv (sglang 0.5.23: about 11 GiB, plus pip's unpacking), the test image (the stand-in
base holds the same packages again: about 11 GiB in the engine's storage) and the servers' and
tests' temporary files. Without this check a full disk shows up minutes later as pip's
"[Errno 28] No space left on device" half-way through the venv.

    python3 scripts/check_disk.py [VENV]    (default .venv; HSDUMP_MIN_FREE_GIB overrides)
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

GIB = 1 << 30
# GiB each place takes in a clean-clone run, measured (docs/PERFORMANCE.md) and rounded up.
VENV_GIB, IMAGE_GIB, TMP_GIB = 14, 13, 3


def needs(venv: Path) -> dict[Path, int]:
    """GiB needed per place; places on one file system add up on the first one named."""
    engine = Path("/var/lib/docker") if Path("/var/lib/docker").is_dir() else Path("/var/lib")
    built = (venv / ".hsdump-installed").is_file()
    by_dev: dict[int, tuple[Path, int]] = {}
    for place, gib in ((Path("."), 0 if built else VENV_GIB), (engine, IMAGE_GIB),
                       (Path("/tmp"), TMP_GIB)):
        dev = os.stat(place).st_dev
        first, total = by_dev.get(dev, (place, 0))
        by_dev[dev] = (first, total + gib)
    return dict(by_dev.values())


def main(argv: list[str]) -> int:
    venv = Path(argv[1] if len(argv) > 1 else ".venv")
    override = os.environ.get("HSDUMP_MIN_FREE_GIB")
    status = 0
    for place, gib in needs(venv).items():
        want = int(override) if override else gib
        free = shutil.disk_usage(place).free // GIB
        where = place.resolve()
        if free < want:
            print(f"check_disk: only {free} GiB free on the file system of {where}; make test "
                  f"needs about {want} GiB there (.venv with sglang ~11 GiB, the test image "
                  f"~11 GiB in the engine's storage, temporary files). Free space (old clones, "
                  f"'docker system prune -a', 'apt-get clean', pip's cache) or set "
                  f"HSDUMP_MIN_FREE_GIB to what you know it needs.", file=sys.stderr)
            status = 1
        else:
            print(f"check_disk: {free} GiB free on the file system of {where}, ~{want} GiB needed")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv))
