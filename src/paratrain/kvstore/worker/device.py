"""MXNet's *_device modes: the workers of one host reduce among themselves first, and one of them (the
lowest rank on the host, its leader) talks to the servers; the others get the result locally.

The host-local reduce and broadcast run on torch.distributed: Gloo for CPU tensors, and where CUDA is
available NCCL for CUDA tensors (the reduction then runs on the GPU and only the leader copies the sum
to the host; that path has not yet run on a GPU machine). The servers count one member per host in
their rounds.

Rounds held on the servers (clipping by the global norm, fp16's overflow checks: train/ps.py) would
deadlock a pushpull that waits for its round inside the call, so once they are on, `pushpull_async`
reduces and pushes at once and pulls (then broadcasts) in its handle's wait(), after the round's
norm and checks were sent. The leader asks for the norm and sends the host's check (any worker's
overflow, reduced) and the scale; the others get the norm and the verdict from it. Every worker of
a host makes the same calls in the same order, so the host's collectives match.
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
        self._held = False  # rounds wait on the servers for a norm or checks (see the docstring)
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
        if not self._held:
            self.pushpull(keys, values, out)
            return Handle([])
        outs = as_lists(keys, out)[1]
        keys, values = as_lists(keys, values)
        self._check(keys, values, outs)
        sums = self._reduce(values)
        pushed = self._inner.push(keys, sums) if self._inner is not None else None

        def pull() -> None:
            if pushed is not None and self._inner is not None:
                pushed.wait()
                self._inner.pull(keys, outs)
            self._broadcast(outs)

        return Handle([], after=[pull])

    # -- rounds held on the servers (train/ps.py) ---------------------------------------------------
    def clip_by_norm(self) -> None:
        self._leader_then_all(lambda kv: kv.clip_by_norm())
        self._held = True

    def norm_shares(self, clock: int) -> list[float]:
        """The squared norm of round `clock`'s mean, summed by the leader over the servers' shares
        (one value: every host's leader sums the same shares in the same order)."""
        total = torch.zeros(1, dtype=torch.float64)
        if self._inner is not None:
            total += sum(self._inner.norm_shares(clock))
        self._broadcast([total])
        return [float(total)]

    def clip_scale(self, clock: int, scale: float) -> Handle:
        return self._inner.clip_scale(clock, scale) if self._inner is not None else Handle([])

    def check_overflow(self) -> None:
        self._leader_then_all(lambda kv: kv.check_overflow())
        self._held = True

    def overflow(self, clock: int, found: bool) -> Handle:
        """The host's check (whether any of its workers found inf or NaN), sent by the leader; after
        wait(), the servers' verdict in the handle's replies on every worker of the host."""
        flag = torch.tensor([float(found)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        sent = self._inner.overflow(clock, bool(flag.item())) if self._inner is not None else None
        handle = Handle([])

        def verdict() -> None:
            overflowed = torch.zeros(1)
            if sent is not None:
                sent.wait()
                overflowed.fill_(float(any(reply["overflowed"] for reply in sent.replies)))
            self._broadcast([overflowed])
            handle.replies = [{"overflowed": bool(overflowed.item())}]

        handle.after.append(verdict)
        return handle

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
