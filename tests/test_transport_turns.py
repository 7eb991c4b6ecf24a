"""A caller reads its own reply (transport/turns.py): what it reads for others still reaches them.

One RPC server (or a raw one) in this process; no other processes.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from paratrain.errors import TransportError
from paratrain.transport import frame, handshake
from paratrain.transport.client import RpcClient
from paratrain.transport.config import TransportConfig
from paratrain.transport.connection import Connection
from paratrain.transport.frame import Header
from paratrain.transport.rpc import Handler, Request, RpcServer

pytestmark = pytest.mark.timeout(60)

SECRET = bytes(range(32))
WAIT_S = 10.0
CONFIG = TransportConfig(connect_timeout_s=5.0, handshake_timeout_s=5.0, request_timeout_s=WAIT_S)


class NoticeHandler(Handler):
    """notify: n one-way notices on the caller's connection, then the reply; drop: close it."""

    def handle(self, request: Request) -> None:
        if request.op == "notify":
            for i in range(request.meta["n"]):
                request.conn.send("notice", 0, {"i": i}, [torch.tensor([i])])
            request.reply({"sent": request.meta["n"]})
        elif request.op == "drop":
            request.conn.close()


@pytest.fixture
def server() -> Iterator[RpcServer]:
    srv = RpcServer(SECRET, NoticeHandler(), host="127.0.0.1", port=0).start()
    try:
        yield srv
    finally:
        srv.close()


def test_notices_a_caller_reads_run_on_the_reader_thread_in_order(server: RpcServer) -> None:
    seen: list[tuple[int, str]] = []
    done = threading.Event()

    def on_message(header: Header, tensors: list[torch.Tensor]) -> None:
        assert tensors[0].item() == header.meta["i"]
        seen.append((header.meta["i"], threading.current_thread().name))
        if len(seen) == 60:
            done.set()

    client = RpcClient(server.host, server.port, SECRET, config=CONFIG, on_message=on_message)
    try:
        assert client._turns is not None, "this platform has epoll: the caller reads"
        for _ in range(3):
            assert client.call("notify", {"n": 20}).meta == {"sent": 20}
        assert done.wait(WAIT_S)
        assert [i for i, _ in seen] == list(range(20)) * 3
        assert {name for _, name in seen} == {client._reader.name}  # never the caller's thread
        assert client.call("notify", {"n": 0}).meta == {"sent": 0}  # the caller reads on
    finally:
        client.close()


def test_a_reply_is_seen_only_after_the_notices_sent_before_it_have_run(server: RpcServer) -> None:
    # The scheduler sends its abort notice before failing a waiting call: the notice must have run
    # (the node exits as aborted) before the call's caller sees the failed reply.
    ran: list[int] = []

    def on_message(header: Header, tensors: list[torch.Tensor]) -> None:
        time.sleep(0.2)  # a callback that takes a while: the reply is read long before it ends
        ran.append(header.meta["i"])

    client = RpcClient(server.host, server.port, SECRET, config=CONFIG, on_message=on_message)
    try:
        assert client._turns is not None, "this platform has epoll: the caller reads"
        for n in (1, 3):
            ran.clear()
            assert client.call("notify", {"n": n}).meta == {"sent": n}
            assert ran == list(range(n))
        ran.clear()
        assert client.request("notify", {"n": 2}).wait(WAIT_S).meta == {"sent": 2}
        assert ran == [0, 1]
    finally:
        client.close()


def test_a_connection_that_breaks_under_a_reading_caller_is_closed_once_by_the_reader(
    server: RpcServer,
) -> None:
    closes: list[tuple[Exception | None, str]] = []
    client = RpcClient(
        server.host,
        server.port,
        SECRET,
        config=CONFIG,
        on_close=lambda error: closes.append((error, threading.current_thread().name)),
    )
    try:
        with pytest.raises(TransportError, match="lost"):
            client.call("drop")
        client._reader.join(WAIT_S)
        assert not client._reader.is_alive()
        assert len(closes) == 1 and closes[0][1] == client._reader.name
        with pytest.raises(TransportError, match="down"):
            client.call("notify", {"n": 1})
    finally:
        client.close()


def test_a_caller_reads_the_replies_of_other_threads_requests(server: RpcServer) -> None:
    client = RpcClient(server.host, server.port, SECRET, config=CONFIG)
    try:
        futures = [client.request("notify", {"n": 0}) for _ in range(50)]  # replies race the call
        assert client.call("notify", {"n": 1}).meta == {"sent": 1}
        assert [f.wait(WAIT_S).meta for f in futures] == [{"sent": 0}] * 50
    finally:
        client.close()


def test_a_caller_alone_on_its_connection_reads_its_own_replies(server: RpcServer) -> None:
    """The point of the read turns: no reply of a lone caller's `call` goes through the reader thread
    (with the turns off, as where `supported()` is false, the reader thread reads every one).
    Replies to `request()` then `wait()` are not counted: one may come before the `wait` and be read
    by the reader thread, by design."""
    client = RpcClient(server.host, server.port, SECRET, config=CONFIG)
    readers: list[str] = []
    dispatch = client._dispatch

    def counting(header: Header, tensors: list[torch.Tensor]) -> None:
        readers.append(threading.current_thread().name)
        dispatch(header, tensors)

    client._dispatch = counting  # type: ignore[method-assign]
    try:
        for _ in range(40):
            assert client.call("notify", {"n": 0}).meta == {"sent": 0}
        assert readers == [threading.current_thread().name] * 40
    finally:
        client.close()


def test_a_reply_that_stalls_longer_than_the_read_tick_inside_its_frame_still_arrives() -> None:
    """The caller waits in recv with the socket's receive timeout as a tick (client.py): a tick that
    passes inside a frame must not break the frame. The raw server below sends its reply in two
    parts, 0.3 s apart (three ticks), once inside the prefix and once inside the payload."""
    listener = socket.create_server(("127.0.0.1", 0))
    payload = torch.arange(4096, dtype=torch.int64)

    def serve() -> None:
        sock, _ = listener.accept()
        with sock:
            recv_key, send_key = handshake.accept(sock, SECRET)
            conn = Connection(sock, recv_key, send_key, "client")
            for seq, cut in enumerate((10, 5000)):
                header, _ = conn.read()
                head, _ = frame.encode(frame.MacKey(send_key), seq, "reply", header.id, {}, [payload])
                data = head + payload.numpy().tobytes()
                sock.sendall(data[:cut])
                time.sleep(0.3)
                sock.sendall(data[cut:])
            with contextlib.suppress(TransportError):
                conn.read()  # until the client closes

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client = RpcClient("127.0.0.1", listener.getsockname()[1], SECRET, config=CONFIG)
    try:
        for _ in range(2):
            assert torch.equal(client.call("slow").tensors[0], payload)
    finally:
        client.close()
        thread.join(WAIT_S)
        listener.close()


def test_a_call_waiting_longer_than_the_read_tick_keeps_its_deadline(server: RpcServer) -> None:
    client = RpcClient(server.host, server.port, SECRET, config=CONFIG)
    try:
        with pytest.raises(TimeoutError, match="no reply"):
            client.call("hold", timeout_s=0.35)  # NoticeHandler never answers it
        assert client.call("notify", {"n": 0}).meta == {"sent": 0}
    finally:
        client.close()
