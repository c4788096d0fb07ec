"""Test-only: a real CPU SGLang server with the capture patch on (its dump directory beside
it), the prefill chunk size the dump servers use, and random token prompts."""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.harness import server as srv

# Small chunks so ordinary test prompts are split across several prefill forwards.
CHUNK = 32
# The drafter layer ids the DeepSeek server is configured with, through a drafter config for
# the patch and --return-aux-hidden-state-layer-ids for SGLang's own capture: both must resolve
# them with DeepSeek's convention (first id 1: every id + 1 -> capture before layers 2, 4, 6).
DEEPSEEK_DRAFT_IDS = [1, 3, 5]


@dataclass
class DumpServer:
    """A running server with the capture patch active, and its dump directory."""

    server: srv.Server
    dump_dir: Path
    model: Path
    env: dict[str, str] = field(default_factory=dict)  # what it started with beyond cpu_env
    retired: str | None = None  # why the server was stopped early (a session server)

    @property
    def url(self) -> str:
        if self.retired:
            raise RuntimeError(f"this server was stopped: {self.retired}")
        return self.server.url

    def retire(self, why: str) -> None:
        """Stop the server; a later use of its URL fails with ``why`` (not a connection
        error), and so does a request through ``server`` (its URL names the reason)."""
        self.server.stop()
        self.retired = why
        self.server.url = f"stopped://{why.replace(' ', '-')}"


def start_dump_server(tmp: Path, model: Path, name: str, *, args: list[str] = (),
                      env: dict[str, str] | None = None, tp: int = 1,
                      dump: bool = True) -> DumpServer:
    """Start a server for ``model``; with ``dump`` the patch is on, writing under ``tmp``."""
    dump_dir = tmp / f"dump-{name}"
    # The final state is on by default; these servers add it only when asked (env).
    full_env = {"SGLANG_HS_DUMP_DIR": str(dump_dir), "SGLANG_HS_DUMP_FINAL": "0"} if dump else {}
    full_env.update(env or {})
    server = srv.start(model, tmp / f"server-{name}.log", args=list(args), env=full_env, tp=tp)
    return DumpServer(server, dump_dir, model, full_env)


# A line the capture plugin wrote to a server log: every message of its "hsdump" logger, and its
# refusals, start "hsdump: "; its writer process also prefixes each line. Not the bare word,
# which a server log holds in any path of a checkout named hsdump (SGLang's warnings name their
# file) and in a dump-like rid.
PLUGIN_LOG = re.compile(r"(?<![\w./-])hsdump: |hsdump writer process ")


def plugin_log_lines(log: str) -> list[str]:
    """The lines of ``log`` (a server's) that the capture plugin wrote."""
    return [line for line in log.splitlines() if PLUGIN_LOG.search(line)]


# The plain server's sampling seed (--random-seed): seeded sampling is repeatable across servers.
PLAIN_SEED = 7


def start_plain_server(tmp: Path, model: Path, name: str) -> DumpServer:
    """Start a server WITHOUT the capture (no ``SGLANG_HS_DUMP_DIR``) and WITH SGLang's default
    radix cache (a configuration the capture refuses), sampling from a generator seeded with
    ``PLAIN_SEED``; its ``dump_dir`` is never written."""
    radix_on = [a for a in srv.EXTRACTION_ARGS if a != "--disable-radix-cache"]
    server = srv.start(model, tmp / f"server-{name}.log", args=["--random-seed", str(PLAIN_SEED)],
                       extraction_args=radix_on)
    return DumpServer(server, tmp / f"dump-{name}", model)


def prefills(s: DumpServer) -> int:
    """How many prefill batches the server has logged (its warm-up's included)."""
    return s.server.log().count("Prefill batch")


def eagle3_dump_server(tmp: Path, model: Path, name: str, *, args: list[str] = (),
                       env: dict[str, str] | None = None) -> Iterator[DumpServer]:
    """A dump server (final state on, chunked prefill of CHUNK tokens, SGLang's own EAGLE-3
    aux capture on) for a fixture to yield; stopped after."""
    yield from serving(start_dump_server(
        tmp, model, name,
        args=["--chunked-prefill-size", str(CHUNK), "--enable-return-aux-hidden-states",
              "--speculative-algorithm", "EAGLE3", *args],
        env={"SGLANG_HS_DUMP_FINAL": "1", **(env or {})},
    ))


def serving(s: DumpServer) -> Iterator[DumpServer]:
    """Yield ``s`` (for a fixture), then stop it."""
    yield s
    s.server.stop()


def prompt(seed: int, length: int) -> list[int]:
    """``length`` random token ids (BOS first), the same for the same seed."""
    rng = random.Random(seed)
    return [1] + [rng.randrange(10, 1000) for _ in range(length - 1)]
