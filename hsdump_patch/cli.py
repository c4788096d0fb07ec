"""The ``hsdump`` command line: one sub-command per module, each adding its own parser."""

from __future__ import annotations

import argparse
import importlib
import sys

# Each module defines ``add_parser(subparsers)``, which registers one sub-command and sets
# ``func`` (taking the parsed namespace, returning an exit code) as its default.
SUBCOMMAND_MODULES: tuple[str, ...] = (
    "hsdump_patch.ops.serve",
    "hsdump_patch.ops.doctor",
    "hsdump_patch.client.extract",
    "hsdump_patch.client.regenerate",
    "hsdump_patch.client.smoke",
    "hsdump_patch.client.handoff",
    "hsdump_patch.client.bridge",
    "hsdump_patch.ops.verify",
)


def build_parser() -> argparse.ArgumentParser:
    """Return the top-level parser with every sub-command registered."""
    parser = argparse.ArgumentParser(
        prog="hsdump",
        description="Extract EAGLE-3 training data (hidden states) from an SGLang server.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``hsdump`` console script."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("hsdump: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
