"""The extraction client: sends prompts to a patched server and writes training records."""
