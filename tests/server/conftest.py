"""The server lane: real CPU SGLang servers. The main dump-enabled server of each model is
session-scoped and shared by every test module of the lane; specialised servers are started by
the module that needs them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness.dump_server import (
    CHUNK,
    DEEPSEEK_DRAFT_IDS,
    DumpServer,
    eagle3_dump_server,
    serving,
    start_dump_server,
    start_plain_server,
)

# The session servers. The lane's modules run grouped by the session servers they use (below),
# and each server is stopped right after the last test that uses it, not at the end of the
# session: idle CPU servers hold 2-3 GB each, which the image and Ansible lanes, running beside
# this one in `make test`, need too.
SESSION_SERVERS = ("llama_server", "deepseek_server", "kimi_server", "qwen3_style_server",
                   "plain_server")
# Modules using a server of an earlier group run first; within a group, in file order.
SERVER_GROUPS = ({"kimi_server", "qwen3_style_server"}, {"deepseek_server"}, {"llama_server"})
LANE = Path(__file__).parent
_last_user: dict[str, str] = {}
_running: dict[str, DumpServer] = {}


def _group(servers: set[str]) -> int:
    return next((i for i, g in enumerate(SERVER_GROUPS) if servers & g), len(SERVER_GROUPS))


def _servers_of(item: pytest.Item) -> set[str]:
    """The session servers ``item`` uses: its fixtures, and parameters that name one (a test
    that takes its server with ``request.getfixturevalue(param)``)."""
    names = set(getattr(item, "fixturenames", ()))
    callspec = getattr(item, "callspec", None)
    if callspec is not None:
        names |= {v for v in callspec.params.values() if isinstance(v, str)}
    return set(SESSION_SERVERS) & names


def pytest_configure(config: pytest.Config) -> None:
    for when in ("first", "last"):
        config.addinivalue_line("markers", f"{when}_on(server): the test is that session "
                                f"server's {when} user (tests/server/conftest.py)")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Order this lane's modules by :data:`SERVER_GROUPS` (a module's tests keep their order;
    other lanes' tests keep their places; a test marked ``first_on(server)`` or
    ``last_on(server)`` moves ahead of or after that server's other users), then note each
    session server's last user."""
    places = [i for i, item in enumerate(items) if LANE in item.path.parents]
    servers = {items[i].nodeid: _servers_of(items[i]) for i in places}
    used: dict[Path, set[str]] = {}
    for i in places:
        used.setdefault(items[i].path, set()).update(servers[items[i].nodeid])
    lane = sorted((items[i] for i in places), key=lambda item: _group(used[item.path]))
    for item in [it for it in lane if it.get_closest_marker("first_on")]:
        name = item.get_closest_marker("first_on").args[0]
        first = next(it for it in lane if name in servers[it.nodeid])
        if first is not item:  # run it just before the server's first other user
            lane.remove(item)
            lane.insert(lane.index(first), item)
    for item in [it for it in lane if it.get_closest_marker("last_on")]:
        name = item.get_closest_marker("last_on").args[0]
        last = [it for it in lane if name in servers[it.nodeid]][-1]
        if last is not item:  # run it just after the server's last other user
            lane.remove(item)
            lane.insert(lane.index(last) + 1, item)
    for i, item in zip(places, lane, strict=True):
        items[i] = item
        for name in servers[item.nodeid]:  # only this lane's tests use its session servers
            _last_user[name] = item.nodeid


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    """After the last user of a session server, stop it (its fixture's own stop is then a
    no-op); a use this file did not foresee fails on the retired server, loudly."""
    yield
    for name, last in _last_user.items():
        if last == item.nodeid and name in _running:
            _running.pop(name).retire(f"{name} was stopped after {item.nodeid}, its last user "
                                      "as tests/server/conftest.py reckoned it")


def _shared(request: pytest.FixtureRequest, servers: Iterator[DumpServer]
            ) -> Iterator[DumpServer]:
    """Yield the server ``servers`` starts (and stops after), noted as running under the
    fixture's name for the hook above."""
    for s in servers:
        _running[request.fixturename] = s
        yield s
        _running.pop(request.fixturename, None)


@pytest.fixture(scope="session")
def llama_server(request, tmp_path_factory, tiny_models) -> Iterator[DumpServer]:
    """Tiny Llama, dump on (auto layers + final state), chunked prefill of CHUNK tokens with
    mixed chunks (``--enable-mixed-chunk``: a prefill beside running decodes is one MIXED
    forward), and SGLang's own aux capture on (``return_hidden_states`` returns the EAGLE-3
    layers)."""
    tmp = tmp_path_factory.mktemp("llama-server")
    yield from _shared(request, eagle3_dump_server(tmp, tiny_models / "tiny-llama", "tiny-llama",
                                                   args=["--enable-mixed-chunk"]))


@pytest.fixture(scope="session")
def deepseek_server(request, tmp_path_factory, tiny_models) -> Iterator[DumpServer]:
    """Tiny DeepSeek-V3 (MLA + MoE), configured like ``llama_server`` but with 'auto' layers
    taken from a drafter config (``DEEPSEEK_DRAFT_IDS``)."""
    tmp = tmp_path_factory.mktemp("deepseek-server")
    draft = tmp / "draft-config.json"
    draft.write_text(json.dumps({"eagle_config": {"eagle_aux_hidden_state_layer_ids":
                                                  DEEPSEEK_DRAFT_IDS}}))
    yield from _shared(request, eagle3_dump_server(
        tmp, tiny_models / "tiny-deepseek-v3", "tiny-deepseek-v3",
        args=["--return-aux-hidden-state-layer-ids", *map(str, DEEPSEEK_DRAFT_IDS)],
        env={"SGLANG_HS_DUMP_DRAFT_CONFIG": str(draft)},
    ))


@pytest.fixture(scope="session")
def kimi_server(request, tmp_path_factory, tiny_kimi) -> Iterator[DumpServer]:
    """The tiny Kimi-K2.5 served text-only as SGLang serves it (``language_model_only``,
    Kimi's custom tokenizer code), float32, dump on with the final state, chunked prefill.
    SGLang's torch.compile'd MoE top-k and rotary helpers run eagerly: in float32 that changes
    nothing the tests bound, and spares this cold server ~30 s of gcc (the bfloat16 DeepSeek
    server keeps them compiled: tests/harness/cpu_shim/sitecustomize.py says why)."""
    tmp = tmp_path_factory.mktemp("kimi-server")
    yield from _shared(request, serving(start_dump_server(
        tmp, tiny_kimi[0], "tiny-kimi-k25",
        args=["--chunked-prefill-size", str(CHUNK), "--dtype", "float32", "--trust-remote-code",
              "--json-model-override-args", json.dumps({"language_model_only": True})],
        env={"SGLANG_HS_DUMP_FINAL": "1", "TORCHDYNAMO_DISABLE": "1"},
    )))


@pytest.fixture(scope="session")
def qwen3_style_server(request, tmp_path_factory, sglang_available) -> Iterator[DumpServer]:
    """A tiny float32 Llama with ChatML / Qwen3 special tokens, served with the Qwen3-style
    template through ``--chat-template`` (its tokenizer's own template is another one), SGLang's
    qwen3 reasoning and qwen25 tool-call parsers, dump on with the final state."""
    from tests.harness import make_models

    tmp = tmp_path_factory.mktemp("qwen3-style-server")
    model = make_models.make_qwen3_style(tmp / "tiny-qwen3-style")
    yield from _shared(request, serving(start_dump_server(
        tmp, model, "tiny-qwen3-style",
        args=["--chunked-prefill-size", str(CHUNK), "--dtype", "float32",
              "--chat-template", str(make_models.QWEN3_STYLE_TEMPLATE),
              "--reasoning-parser", "qwen3", "--tool-call-parser", "qwen25"],
        env={"SGLANG_HS_DUMP_FINAL": "1"},
    )))


@pytest.fixture(scope="session")
def plain_server(request, tmp_path_factory, tiny_models) -> Iterator[DumpServer]:
    """Tiny Llama without the capture, with the radix cache on and seeded sampling
    (``start_plain_server``). Its first requests must be test_regenerate.py's seeded sampling,
    which a second fresh server of the same flags repeats (that test checks it came first)."""
    tmp = tmp_path_factory.mktemp("plain-server")
    yield from _shared(request, serving(start_plain_server(tmp, tiny_models / "tiny-llama",
                                                           "plain")))
