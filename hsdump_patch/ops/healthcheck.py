"""The image's HEALTHCHECK: ``python3 -m hsdump_patch.ops.healthcheck``; exit 0 = healthy.

Node rank 0 (``HSDUMP_NODE_RANK``, default 0) serves HTTP: healthy when
``http://$HSDUMP_PROBE_HOST:$HSDUMP_PORT/ready`` answers 200 (probe host default 127.0.0.1).
Worker nodes (rank >= 1) have no HTTP server: healthy while an SGLang process runs.
Not ``/health``: in SGLang 0.5.23 it runs a real generation on every probe.
"""

from __future__ import annotations

import os
import sys
import urllib.request
from pathlib import Path


def ready_url(env: dict[str, str]) -> str:
    """The /ready URL of this container's server."""
    host = env.get("HSDUMP_PROBE_HOST") or "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # IPv6 literal
    return f"http://{host}:{env.get('HSDUMP_PORT', '30000')}/ready"


def sglang_running(proc: Path = Path("/proc")) -> bool:
    """Whether a process other than this one runs SGLang (``hsdump serve`` execs into it)."""
    me = os.getpid()
    for d in proc.iterdir():
        if not d.name.isdigit() or int(d.name) == me:
            continue
        try:
            if b"sglang" in (d / "cmdline").read_bytes():
                return True
        except OSError:  # the process ended meanwhile
            continue
    return False


def main() -> int:
    if int(os.environ.get("HSDUMP_NODE_RANK", "0")) >= 1:
        return 0 if sglang_running() else 1
    try:
        with urllib.request.urlopen(ready_url(dict(os.environ)), timeout=5) as r:
            return 0 if r.status == 200 else 1
    except OSError:
        return 1


if __name__ == "__main__":
    sys.exit(main())
