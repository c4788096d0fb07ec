"""hsdump: extract EAGLE-3 training data (intermediate hidden states) from an SGLang server.

Architecture (one subpackage per side of the file protocol):

* ``hsdump_patch.capture``: runs inside the SGLang server (a ``sglang.srt.plugins`` plugin).
* ``hsdump_patch.protocol``: the on-disk format shared by both sides.
* ``hsdump_patch.client``: the ``hsdump`` CLI that sends prompts and writes training records.
* ``hsdump_patch.ops``: container and deployment helpers (``hsdump serve``, ``hsdump doctor``).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("hsdump")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"
