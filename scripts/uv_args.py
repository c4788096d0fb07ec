"""Print the ``uv pip install`` options that make uv install from where this machine's pip
configuration points (index, extra indexes, find-links, constraints, trusted hosts).

uv reads neither pip.conf nor ``PIP_*`` variables; ``make venv`` installs the requirements with
uv (it unpacks wheels in parallel: ~40 s instead of pip's ~2.5 min on a 2-core machine) and
passes pip's own configuration, as ``pip config list`` reports it, through this script. Run with
the venv's Python: ``python scripts/uv_args.py`` prints one word per line (no value holds
whitespace: pip splits its lists on it).
"""

from __future__ import annotations

import ast
import subprocess
import sys

# pip option -> uv option; the value of each is a whitespace-separated list.
LISTS = {"extra-index-url": "--extra-index-url", "find-links": "--find-links",
         "constraint": "--constraint", "trusted-host": "--allow-insecure-host"}
SINGLE = {"index-url": "--index-url"}
FLAGS = {"no-index": "--no-index"}
TRUE = {"1", "true", "yes", "on"}


def pip_config(python: str = sys.executable) -> dict[str, str]:
    """``pip config list`` as {option: value}, for the ``global`` and ``install`` sections and
    ``PIP_*`` variables; a later line (a higher-priority file, the environment) wins."""
    out = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True,
                         text=True, check=True).stdout
    config: dict[str, str] = {}
    for line in out.splitlines():
        name, sep, value = line.partition("=")
        section, _, option = name.rpartition(".")
        if sep and section in ("global", "install", ":env:"):
            config[option] = ast.literal_eval(value)
    return config


def uv_args(config: dict[str, str]) -> list[str]:
    """The uv options equivalent to ``config``; pip takes the best version across every index,
    so uv is told to do the same."""
    args = ["--index-strategy", "unsafe-best-match"]
    for option, flag in SINGLE.items():
        if config.get(option):
            args += [flag, config[option]]
    for option, flag in LISTS.items():
        for value in config.get(option, "").split():
            args += [flag, value]
    args += [flag for option, flag in FLAGS.items() if config.get(option, "").lower() in TRUE]
    if config.get("cert"):  # uv's own CA roots would not hold a CA pip was told to trust
        args.append("--native-tls")
    return args


if __name__ == "__main__":
    print("\n".join(uv_args(pip_config())))
