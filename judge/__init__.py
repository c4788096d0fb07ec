"""The judge (``make judge``, docs/judge.md): drafters trained on hsdump's records, measured.
Development tooling beside the package: never shipped in the package or the image."""
