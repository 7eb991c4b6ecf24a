"""The same-host path: shared-memory rings under the frames of one connection."""

from __future__ import annotations

import os

import pytest
import torch

from paratrain.transport.client import RpcClient
from paratrain.transport.config import TransportConfig
from paratrain.transport.frame import FrameError
from paratrain.transport.rpc import Handler, Request, RpcServer
from paratrain.transport.shm import Ring

SECRET = bytes(range(32))


def test_ring_reserves_wraps_and_refuses_when_full():
    ring, _ = Ring.create(1000)
    try:
        assert ring.reserve(600) == 0
        assert ring.reserve(300) == 640  # positions are 64-byte aligned
        assert ring.reserve(300) is None  # 40 left at the end, and the start is still held
        ring.release(600)  # the reader consumed the first payload
        assert ring.reserve(300) == 1000  # the end is skipped: wraps to offset 0
        assert ring.region(1000, 300).nbytes == 300
        assert ring.reserve(500) is None
    finally:
        ring.close()


def test_an_emptied_ring_starts_again_at_its_start():
    """Once the reader released everything, the next payload goes to offset 0 (pages already mapped
    and warm), not on into the rest of the lap; the reader's checks accept it."""
    ring, _ = Ring.create(1024)
    try:
        assert ring.reserve(300) == 0
        ring.release(300)
        assert ring.reserve(300) == 1024  # offset 0 of the next lap
        assert ring.check(1024, 300).nbytes == 300
        assert ring.reserve(300) == 1344  # not empty: goes on (64-byte aligned)
        ring.release(1644)
        assert ring.reserve(100) == 2048
    finally:
        ring.close()


def test_reader_refuses_regions_outside_the_ring():
    ring, _ = Ring.create(1000)
    try:
        ring.release(500)
        with pytest.raises(FrameError, match="outside the ring"):
            ring.check(100, 10)  # before the tail: already consumed
        with pytest.raises(FrameError, match="outside the ring"):
            ring.check(900, 200)  # crosses the end
        with pytest.raises(FrameError, match="overruns"):
            ring.check(1950, 40)  # more than one capacity ahead of the tail
        assert ring.check(500, 100).nbytes == 100
    finally:
        ring.close()


def test_a_ring_opens_only_with_its_token():
    ring, token = Ring.create(4096)
    try:
        other = Ring.open(os.getpid(), ring.fd, 4096, token)
        other.view[100] = 7
        assert ring.view[100] == 7  # the same memory
        other.close()
        with pytest.raises(ValueError, match="token differs"):
            Ring.open(os.getpid(), ring.fd, 4096, b"x" * 32)
        with pytest.raises(ValueError, match="size differs"):
            Ring.open(os.getpid(), ring.fd, 8192, token)
    finally:
        ring.close()


class Echo(Handler):
    def handle(self, request: Request) -> None:
        request.reply({"rings": request.conn.recv_ring is not None}, request.tensors)


@pytest.mark.parametrize("same_host", [True, False])
def test_payloads_cross_through_the_rings_or_the_socket_with_the_same_result(same_host):
    config = TransportConfig(shm_ring_bytes=1 << 20, shm_min_bytes=1024)
    server = RpcServer(SECRET, Echo(), config=config).start()
    client = RpcClient(server.host, server.port, SECRET, config=config, same_host=same_host)
    try:
        assert client.same_host_path is same_host
        for numel in (10, 300, 100_000, 400_000):  # tiny, ring-sized, and over the 1 MiB ring
            sent = torch.randn(numel)
            out = torch.empty(numel)
            futures = [client.request("echo", {}, [sent * k], out=[None]) for k in range(4)]
            for k, future in enumerate(futures):  # several in flight: ring space is reused
                assert torch.equal(future.wait(10).tensors[0], sent * k)
            reply = client.call("echo", {}, [sent], out=[out], timeout_s=10)
            assert reply.tensors[0] is out and torch.equal(out, sent)
            assert reply.meta["rings"] is same_host
        if same_host:  # the ring-sized payloads really went through the ring
            assert client._conn.send_ring.head >= 4 * 300 * 4
    finally:
        client.close()
        server.close()


def test_a_server_with_the_path_off_declines_and_the_socket_carries_everything():
    server = RpcServer(SECRET, Echo(), config=TransportConfig(shm_ring_bytes=0)).start()
    client = RpcClient(server.host, server.port, SECRET, same_host=True)
    try:
        assert not client.same_host_path
        x = torch.randn(200_000)
        assert torch.equal(client.call("echo", {}, [x], timeout_s=10).tensors[0], x)
    finally:
        client.close()
        server.close()
