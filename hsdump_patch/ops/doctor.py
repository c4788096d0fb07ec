"""``hsdump doctor``: check that this Python's SGLang can host the capture patch.

Run at image build time (the Dockerfile fails when it does), so a drifted base image is caught
before any GPU time is spent: the SGLang version is a supported one, the plugin entry point
resolves, and every capture point the patch relies on still exists in the model code.
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
from collections.abc import Callable
from importlib import metadata

ENTRY_POINT_GROUP = "sglang.srt.plugins"
ENTRY_POINT_NAME = "hsdump"


def check_version(expected: str | None = None) -> list[str]:
    """The installed SGLang is one the patch supports (and ``expected``, when given)."""
    from hsdump_patch.capture.model_adapter import SUPPORTED_SGLANG_VERSIONS

    try:
        installed = metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return ["sglang is not installed in this Python "
                f"({sys.executable}): install hsdump into the SGLang image's own Python"]
    if installed not in SUPPORTED_SGLANG_VERSIONS:
        return [f"sglang {installed} is installed; hsdump {_hsdump_version()} supports "
                f"{', '.join(SUPPORTED_SGLANG_VERSIONS)} (pin the base image to a supported "
                "release, or port the capture points first)"]
    if expected and installed != expected:
        return [f"sglang {installed} is installed but {expected} was expected (the image's "
                "SGLang version label would be wrong: pass the base image's SGLang version)"]
    return []


def check_entry_point() -> list[str]:
    """SGLang will find and load the plugin: the entry point exists once and imports."""
    eps = [ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)
           if ep.name == ENTRY_POINT_NAME]
    if len(eps) != 1:
        return [f"{len(eps)} entry points named {ENTRY_POINT_NAME!r} in group "
                f"{ENTRY_POINT_GROUP!r} (expected exactly 1: is hsdump installed once, with "
                "its metadata, in this Python?)"]
    try:
        hook = eps[0].load()
    except Exception as e:  # any import failure means SGLang would only log it and go on
        return [f"entry point {eps[0].value} does not load: {type(e).__name__}: {e}"]
    if not callable(hook):
        return [f"entry point {eps[0].value} is not callable"]
    return []


def check_requirements() -> list[str]:
    """hsdump's own dependencies (installed with --no-deps) are provided by the base image."""
    missing = []
    for req in metadata.requires("hsdump") or []:
        if "extra ==" in req:
            continue
        name = re.split(r"[ ;<>=!~\[]", req, maxsplit=1)[0]
        try:
            metadata.version(name)
        except metadata.PackageNotFoundError:
            missing.append(f"{name} (hsdump requires {req}) is not installed")
    return missing


def check_capture_points() -> list[str]:
    """Every class, method and signature the capture patch hooks into is still there."""
    from hsdump_patch.capture.model_adapter import check_capture_points as check

    return check()


def checks(expect_sglang: str | None) -> list[tuple[str, Callable[[], list[str]]]]:
    """The doctor's checks, in order: (name, function returning problem messages)."""
    return [
        ("sglang version", functools.partial(check_version, expect_sglang)),
        ("plugin entry point", check_entry_point),
        ("hsdump requirements", check_requirements),
        ("capture points", check_capture_points),
    ]


def _hsdump_version() -> str:
    from hsdump_patch import __version__

    return __version__


def run(args: argparse.Namespace) -> int:
    """Entry point of ``hsdump doctor``: a table of checks; exit 1 if any fails."""
    failed = 0
    todo = checks(args.expect_sglang)
    width = max(len(name) for name, _ in todo)
    print(f"hsdump doctor (hsdump {_hsdump_version()}, python {sys.version.split()[0]})")
    for name, check in todo:
        problems = check()
        print(f"  {name:<{width}}  {'FAIL' if problems else 'ok'}")
        for p in problems:
            print(f"      - {p}")
        failed += bool(problems)
    if failed:
        print(f"hsdump doctor: {failed} check(s) failed: this SGLang cannot host the capture "
              "patch as installed", file=sys.stderr)
        return 1
    print("hsdump doctor: all checks passed")
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``hsdump doctor``."""
    p = subparsers.add_parser(
        "doctor", help="check that the installed SGLang can host the capture patch",
        description="Check the SGLang version, the sglang.srt.plugins entry point and the "
        "capture points in SGLang's model code; exit 1 when any check fails.",
    )
    p.add_argument("--expect-sglang", metavar="VERSION",
                   help="also require exactly this SGLang version (default: any supported one)")
    p.set_defaults(func=run)
