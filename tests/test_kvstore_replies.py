"""The server's reply senders (kvstore/server/replies.py), without processes or sockets."""

from __future__ import annotations

import threading

from paratrain.kvstore.server.replies import ReplySenders


class Conn:
    """What the senders use of a connection: its identity and whether it is closed."""

    closed = False


def test_replies_leave_in_order_from_a_thread_per_connection_and_a_failing_job_stops_none() -> None:
    senders = ReplySenders("server 0")
    a, b = Conn(), Conn()
    ran: list[tuple[str, int, str]] = []
    done = threading.Event()
    gate = threading.Event()

    def job(name: str, i: int) -> None:
        ran.append((name, i, threading.current_thread().name))

    def fail() -> None:
        raise RuntimeError("a bug in one reply")

    senders.send(a, gate.wait)  # a's sender is held: b's replies must not wait behind it
    for i in range(3):
        senders.send(b, lambda i=i: job("b", i))
    senders.send(b, fail)
    senders.send(b, lambda: job("b", 3))
    senders.send(b, done.set)
    assert done.wait(10.0)
    assert [(n, i) for n, i, _ in ran] == [("b", 0), ("b", 1), ("b", 2), ("b", 3)]
    assert {t for _, _, t in ran} == {"server 0-reply"} and ran[0][2] != threading.current_thread().name
    ran.clear()
    a_done = threading.Event()
    senders.send(a, lambda: (job("a", 0), a_done.set()))
    gate.set()
    senders.close(a)
    a.closed = True
    senders.send(a, lambda: job("a", 1))  # after the end: runs here, where its send would fail at once
    assert a_done.wait(10.0)  # what was queued before the end still ran, on a's sender
    here = threading.current_thread().name
    assert sorted((n, i, t == here) for n, i, t in ran) == [("a", 0, False), ("a", 1, True)]
    senders.close(b)
