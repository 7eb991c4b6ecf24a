"""MXNet's *_device modes: the workers of one host reduce among themselves first, and one of them (the
lowest rank on the host, its leader) talks to the servers; the others get the result locally.

The host-local reduce and broadcast run on torch.distributed: Gloo for CPU tensors, and where CUDA is
available NCCL for CUDA tensors (the reduction then runs on the GPU and only the leader copies the sum
to the host; that path has not yet run on a GPU machine). The servers count one member per host in
their rounds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from paratrain.cluster.context import Context
from paratrain.cluster.rendezvous import init_torch_distributed
from paratrain.errors import KVStoreError
from paratrain.kvstore.api import Handle, Keys, KVStoreConfig
from paratrain.kvstore.compressed import compression_config
from paratrain.kvstore.worker.checks import (
    as_lists,
    check_call,
    check_init_value,
)
from paratrain.kvstore.worker.client import DistKVStore


def host_groups(hosts: list[str]) -> list[list[int]]:
    """Worker ranks grouped by host, in order of each host's lowest rank."""
    groups: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        groups.setdefault(host, []).append(rank)
    return list(groups.values())


class HostKVStore:
    def __init__(self, ctx: Context, config: KVStoreConfig) -> None:
        self.rank, self.num_workers = ctx.rank, ctx.num_workers
        hosts = ctx.barrier(name="kvstore-hosts", data=ctx.spec.host if ctx.spec else "")
        groups = host_groups([hosts[r] for r in range(ctx.num_workers)])
        if torch.cuda.is_available():  # CUDA tensors reduce over NCCL (not yet run on a GPU here)
            local = next(g for g in groups if self.rank in g)
            torch.cuda.set_device(local.index(self.rank) % torch.cuda.device_count())
        init_torch_distributed(ctx, "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
        # new_group is collective: every worker creates every group, in the same order.
        made = [(g, dist.new_group(g)) for g in groups]
        leaders = [g[0] for g in groups]
        leader_group = dist.new_group(leaders)
        self._local, self._group = next((g, pg) for g, pg in made if self.rank in g)
        self.leader = self._local[0]
        self.is_leader = self.rank == self.leader
        self.config = config
        self._specs: dict[Any, tuple[list[int], torch.dtype]] = {}  # every worker checks its own calls
        self._inner = (
            DistKVStore(
                ctx,
                config,
                members=leaders,
                barrier=lambda _name: dist.barrier(group=leader_group),
                weight=len(self._local),
            )
            if self.is_leader
            else None
        )
        dist.barrier()

    def _reduce(self, values: list) -> list[torch.Tensor]:
        sums = [v.detach().clone() for v in values]
        works = [dist.reduce(t, dst=self.leader, group=self._group, async_op=True) for t in sums]
        for work in works:
            work.wait()
        return sums

    def _broadcast(self, outs: list) -> None:
        works = [dist.broadcast(t, src=self.leader, group=self._group, async_op=True) for t in outs]
        for work in works:
            work.wait()

    def _leader_then_all(self, fn: Callable[[DistKVStore], Any]) -> None:
        if self._inner is not None:
            fn(self._inner)
        dist.barrier()

    def _spec(self, key: Any) -> tuple[list[int], torch.dtype]:
        if key not in self._specs:
            raise KVStoreError(f"key {key!r} was never initialized (call kv.init first)")
        return self._specs[key]

    def _check(self, keys: list, values: list | None, outs: list | None) -> None:
        """A worker checks its own arguments before the host's collectives, where a bad one would
        fail or hang the other workers of the host."""
        check_call(keys, values, outs, self._spec, self.config.refuse_non_finite, self.rank)

    def init(self, keys: Keys, values: Any) -> None:
        keys, values = as_lists(keys, values)
        for key, value in zip(keys, values, strict=True):
            check_init_value(key, value)
            known = self._specs.get(key)
            if known is not None and known != (list(value.shape), value.dtype):
                raise ValueError(
                    f"key {key!r} was initialized as {known[1]}{known[0]}; "
                    f"init as {value.dtype}{list(value.shape)} is not allowed"
                )
        self._leader_then_all(lambda kv: kv.init(keys, values))
        for key, value in zip(keys, values, strict=True):
            self._specs.setdefault(key, (list(value.shape), value.dtype))

    def push(self, keys: Keys, values: Any) -> Handle:
        keys, values = as_lists(keys, values)
        self._check(keys, values, None)
        sums = self._reduce(values)
        return self._inner.push(keys, sums) if self._inner is not None else Handle([])

    def pull(self, keys: Keys, out: Any) -> None:
        keys, outs = as_lists(keys, out)
        self._check(keys, None, outs)
        if self._inner is not None:
            self._inner.pull(keys, outs)
        self._broadcast(outs)

    def pull_async(self, keys: Keys, out: Any) -> Handle:
        self.pull(keys, out)
        return Handle([])

    def pushpull(self, keys: Keys, values: Any, out: Any) -> None:
        outs = as_lists(keys, out)[1]  # before `keys` becomes a list: one key's out is one tensor
        keys, values = as_lists(keys, values)
        self._check(keys, values, outs)
        sums = self._reduce(values)
        if self._inner is not None:
            self._inner.pushpull(keys, sums, outs)
        self._broadcast(outs)

    def pushpull_async(self, keys: Keys, values: Any, out: Any) -> Handle:
        self.pushpull(keys, values, out)
        return Handle([])

    def set_optimizer(self, optimizer: str | type, **hyperparameters: Any) -> None:
        self._leader_then_all(lambda kv: kv.set_optimizer(optimizer, **hyperparameters))

    def set_hyperparameters(self, keys: Keys, **hyperparameters: Any) -> Handle:
        """The host's leader sends them (every worker of the host has the same: sync rounds)."""
        if self._inner is None:
            return Handle([])
        return self._inner.set_hyperparameters(keys, **hyperparameters)

    def set_gradient_compression(self, compression: Any) -> None:
        """The host's leader compresses what it sends (the reduce within a host is not)."""
        compression_config(compression)  # checked on every worker
        self._leader_then_all(lambda kv: kv.set_gradient_compression(compression))

    def barrier(self) -> None:
        dist.barrier()

    def stats(self) -> dict:
        """The servers' counts per key (see DistKVStore.stats), as the host's leader sees them."""
        return self._inner.stats() if self._inner is not None else {}

    def save_state(self, path: Any) -> None:
        self._leader_then_all(lambda kv: kv.save_state(path))

    def load_state(self, path: Any) -> None:
        self._leader_then_all(lambda kv: kv.load_state(path))

    def close(self) -> None:
        if self._inner is not None:
            self._inner.close()
