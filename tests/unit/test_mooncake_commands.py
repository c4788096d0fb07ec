"""The Mooncake commands hsdump prints (``hsdump bridge`` when it cannot reach Mooncake) and the
suite runs: they listen on 127.0.0.1 unless told otherwise (no Mooncake needed)."""

from __future__ import annotations

from types import SimpleNamespace

from hsdump_patch import protocol
from hsdump_patch.client import bridge
from hsdump_patch.client.bridge import mooncake_commands, mooncake_hint


def test_the_mooncake_commands_listen_on_this_host_only_unless_told() -> None:
    """mooncake_master binds its RPC and metrics servers to 0.0.0.0 and the HTTP metadata
    server its --host to 0.0.0.0 by default: the commands name 127.0.0.1 for all three; an
    explicit address opens them."""
    master, metadata = mooncake_commands()
    assert master == ["mooncake_master", "-rpc_address=127.0.0.1", "-rpc_port=50051",
                      "-metrics_host=127.0.0.1", "-metrics_port=9003"]
    assert metadata == ["python", "-m", "mooncake.http_metadata_server", "--host", "127.0.0.1",
                        "--port", "8080"]
    master, metadata = mooncake_commands(50151, 18080, host="10.0.0.5")
    assert "-rpc_address=10.0.0.5" in master and "-metrics_host=10.0.0.5" in master
    assert "-rpc_port=50151" in master and metadata[-4:] == ["--host", "10.0.0.5", "--port",
                                                            "18080"]


def test_the_hint_has_the_flags_ports_and_says_how_to_open_them() -> None:
    hint = mooncake_hint("mc:50151", "http://mc:18080/metadata")
    assert ("`mooncake_master -rpc_address=127.0.0.1 -rpc_port=50151 -metrics_host=127.0.0.1 "
            "-metrics_port=9003`") in hint, hint
    assert "`python -m mooncake.http_metadata_server --host 127.0.0.1 --port 18080`" in hint
    assert "listen on 127.0.0.1 only" in hint and "0.0.0.0" in hint
    assert "-rpc_port=50051" in mooncake_hint("mc", "http://mc/metadata")


def test_hsdump_bridge_prints_them_when_mooncake_setup_fails(tmp_path, monkeypatch,
                                                              capsys) -> None:
    """A Mooncake the bridge cannot set up ends ``hsdump bridge`` with exit 2, Mooncake's error
    and the commands of a local Mooncake on the flags' ports, bound to 127.0.0.1."""
    from hsdump_patch.cli import main as cli

    info = protocol.ServerInfo(
        model="/m", architecture="LlamaForCausalLM", layers=(2,), layers_source="test",
        has_final=True, hidden_size=8, num_hidden_layers=4, dtype="bfloat16", tp_size=1,
        rid_prefix="hsdump-", sglang_version="0.5.23", hsdump_version="test", pid=1)
    protocol.write_json_atomic(tmp_path / protocol.SERVER_INFO, info.to_json())
    monkeypatch.setattr(bridge.torch, "set_num_threads", lambda n: None)  # this process's
    monkeypatch.setattr(bridge.requests, "get",
                        lambda *a, **k: SimpleNamespace(raise_for_status=lambda: None))

    def refuse(**kw: object) -> None:
        raise RuntimeError("Mooncake setup failed (status -1)")

    monkeypatch.setattr(bridge.MooncakeSink, "connect", refuse)
    assert cli(["bridge", "--dump-dir", str(tmp_path), "--mooncake-master", "127.0.0.1:50151",
                "--mooncake-metadata", "http://127.0.0.1:18080/metadata"]) == 2
    err = capsys.readouterr().err
    assert "Mooncake setup failed (status -1)" in err, err
    assert "-rpc_address=127.0.0.1 -rpc_port=50151 -metrics_host=127.0.0.1" in err, err
    assert "--host 127.0.0.1 --port 18080" in err, err
