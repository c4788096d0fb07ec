"""The capture patch: everything that runs inside the SGLang server process."""
