"""`paratrain serve`'s front: both of uvicorn's parsers on sockets that send at once, and the
sources the commands take."""

from __future__ import annotations

import http.client
import socket
from pathlib import Path

import pytest
import torch
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from paratrain.serve.http import HttpServer, http_protocol

MODELS = Path(__file__).parent / "serve_models.py"


def _hello(request: object) -> PlainTextResponse:
    return PlainTextResponse("hello " * 100)


@pytest.mark.parametrize("parser", ["h11", "httptools"])
def test_every_accepted_connection_sends_without_delay_under_both_parsers(parser):
    """asyncio sets TCP_NODELAY only on a listening socket made as IPPROTO_TCP; without it an answer
    written in two sends (h11: headers, then body) waits for the client's delayed ACK."""
    server = HttpServer(Starlette(routes=[Route("/", _hello)]), parser=parser).start()
    try:
        client = http.client.HTTPConnection(server.host, server.port, timeout=30)
        for _ in range(2):  # keep-alive: the second answer on the same connection
            client.request("GET", "/")
            reply = client.getresponse()
            assert reply.status == 200 and reply.read() == b"hello " * 100
        (connection,) = server.server.server_state.connections
        expected = {"h11": "H11Protocol", "httptools": "HttpToolsProtocol"}[parser]
        assert type(connection).__name__.endswith(expected)  # wrapped by the connection guard
        accepted = connection.transport.get_extra_info("socket")
        assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        assert server.sock.proto == socket.IPPROTO_TCP
        client.close()
    finally:
        server.close()


def test_an_unknown_parser_is_refused_by_name():
    with pytest.raises(ValueError, match="parser='picohttp' is not one of auto, httptools, h11"):
        http_protocol("picohttp")


def test_serve_and_export_take_a_jobs_output_folder(tmp_path, monkeypatch):
    """As `paratrain checkpoints` and load_latest do: OUTPUT_DIR means OUTPUT_DIR/checkpoints."""
    from click.testing import CliRunner
    from safetensors.torch import load_file

    from paratrain import checkpoint
    from paratrain.launch.cli import main
    from paratrain.serve.model import load_factory

    model = load_factory(f"{MODELS}:mlp")()
    folder = checkpoint.staging_dir(tmp_path / "out" / "checkpoints", 3)
    checkpoint.save_file(folder / "model.pt", {"model": model.state_dict(), "optimizer": {}})
    checkpoint.commit(tmp_path / "out" / "checkpoints", 3, {})

    result = CliRunner().invoke(main, ["export", str(tmp_path / "out"), str(tmp_path / "m.safetensors")])
    assert result.exit_code == 0, result.output
    assert torch.equal(load_file(tmp_path / "m.safetensors")["0.weight"], model[0].weight)

    served = []
    monkeypatch.setattr(HttpServer, "run", lambda self: served.append(self.url))  # built, not run
    args = ["--model", f"{MODELS}:mlp", "--port", "0", "--reload-interval", "0", str(tmp_path / "out")]
    result = CliRunner().invoke(main, ["serve", *args])
    assert result.exit_code == 0 and len(served) == 1, result.output
    assert "from " + str(tmp_path / "out" / "checkpoints") in result.output
