"""Test-only scaffolding: CPU stand-ins and tiny models. Never shipped in the package or image."""
