"""A CPU SGLang 0.5.23 server's environment with the capture patch on, for ``make smoke`` and
``make judge`` (never on a GPU machine: the stand-ins hide the real ``sgl_kernel``)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from hsdump_patch.protocol import ENV_DIR, ENV_FINAL

REPO = Path(__file__).resolve().parents[1]
# The CPU stand-ins SGLang 0.5.23 needs without a GPU (sgl_kernel, the CPU MLA fix).
CPU_SHIM = REPO / "tests" / "harness" / "cpu_shim"


def server_env(dump: Path) -> dict[str, str]:
    """This environment, with SGLang's CPU engine, the CPU stand-ins and the dump (final state
    included) on."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(CPU_SHIM), env.get("PYTHONPATH")) if p)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    # torch.compile's shared on-disk cache is not safe across concurrent processes: our own.
    env.setdefault("TORCHINDUCTOR_CACHE_DIR",
                   os.path.join(tempfile.gettempdir(), f"hsdump-inductor-{os.getpid()}"))
    env[ENV_DIR], env[ENV_FINAL] = str(dump), "1"
    return env
