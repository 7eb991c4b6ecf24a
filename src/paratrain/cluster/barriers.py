"""The scheduler's named barriers: a small all-gather over the live workers.

A barrier {group, name} completes once every live worker has arrived (servers take part in "all"
by serving, finished workers have left, and a worker dropped from an elastic job takes back what it
brought); each waiter is then replied with every arrived worker's data, in rank order.

Not thread-safe: the scheduler calls every method with its lock held, and `release` without it.
"""

from __future__ import annotations

from typing import Any

from paratrain.cluster.membership import Node
from paratrain.transport.rpc import Request

Key = tuple[str, str]
Released = tuple[list[Request], list[list]]
"""The waiters of a completed barrier and what each worker brought: [[rank, data], ...]."""


class Barriers:
    def __init__(self) -> None:
        self._arrived: dict[Key, list[tuple[Request, Node, Any]]] = {}

    def arrive(self, key: Key, request: Request, node: Node, data: Any) -> None:
        self._arrived.setdefault(key, []).append((request, node, data))

    def forget(self, node: Node) -> None:
        """A dropped worker's arrivals are taken back (it is no longer waited for either)."""
        for key, arrived in self._arrived.items():
            self._arrived[key] = [entry for entry in arrived if entry[1] is not node]

    def complete(self, members: int) -> list[Released]:
        """Take out every barrier that `members` workers have reached."""
        released = []
        for key, arrived in list(self._arrived.items()):
            if len(arrived) >= members:
                del self._arrived[key]
                released.append(([r for r, _, _ in arrived], [[n.rank, data] for _, n, data in arrived]))
        return released

    def waiting(self) -> list[Request]:
        """Every request still waiting in a barrier (an aborted job fails them)."""
        return [request for arrived in self._arrived.values() for request, _, _ in arrived]

    @staticmethod
    def release(released: list[Released], reply: Any) -> None:
        """Reply to every waiter of each completed barrier with what each worker brought to it;
        `reply(request, data)` sends one reply (the scheduler's, quiet if the waiter is gone)."""
        for waiters, data in released:
            ordered = sorted(data, key=lambda pair: pair[0])
            for waiter in waiters:
                reply(waiter, ordered)
