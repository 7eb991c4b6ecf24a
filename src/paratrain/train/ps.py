"""Parameter-server data parallel: the model's parameters are kvstore keys (their names).

Each gradient is pushed the moment backward has accumulated it (a post-accumulate-grad hook), in
buckets of about `bucket_mb`, with the pull of that bucket's new values in the same round trip
(pushpull): while backward goes on, earlier buckets are already on the wire, and their new weights
come back as soon as the servers have them. `step()` only waits for what is still in flight.

    update_on="server": the servers hold the weights and run the optimizer (kv.set_optimizer with the
        local optimizer's class and its first group's hyperparameters; each other group's keys get
        that group's own with kv.set_hyperparameters); workers copy the pulled weights in.
    update_on="worker": the servers only sum; each worker pulls the mean gradient into .grad and
        steps its own optimizer.

Compression (the strategy's `compression`: kv.set_gradient_compression) shrinks every push, with
error feedback per key; with update_on="worker" the pulled mean too (the servers' own error
feedback); with update_on="server" the pulled weights go in full. A 2bit threshold applies to each
worker's gradient as pushed and to the round's mean pulled back (the servers average the rounds).

Top-k sends updates, not gradients (CompressionConfig.sends_updates says why): each worker steps
its own optimizer on its own gradient in step() and pushes the update (weights before - after);
with update_on="server" the servers apply the round's mean with SGD at lr 1 and the workers pull
the weights, with update_on="worker" the servers only average and each worker subtracts the pulled
mean from the weights it had. The workers' weights stay equal; their optimizer states differ (each
saves its own in a checkpoint), and pushes wait for the optimizer, so unlike gradient pushes they
do not overlap backward.

A worker pushes grad / accumulation_steps. In sync and bounded modes the servers apply a round's mean
over the workers that pushed to it (KVStoreConfig.average: the round counts them), so one server step
equals one single-process step on the global batch, whatever the number of workers in the round. In
async mode each push is applied on its own: one worker's step.

LR schedules with the optimizer on the servers: at each round's first push the worker compares its
groups' hyperparameters with what it last sent, and sends what changed (a scheduler's lr, OneCycle's
momentum or betas, a hand edit) as a small set_hyper message to every server, ahead of that round's
pushes on the same connections: a server reads a connection in order, so in sync mode every
worker's new values are in place before the round, which waits for every worker, applies. Nothing
waits for its reply but step(), with the round's. A change between backward and step, after the
round's first push left, raises an error (the servers may have applied the round with the old
values). A restored checkpoint's groups (the workers' optimizer state) are all sent with the next
round. In bounded and async modes a new value holds from the next update a server applies.

A gradient changed after its push (the user's own clip_grad_norm_ between backward and step, any
other in-place change, a new .grad) would be silently lost: the servers have the pushed one, and
with update_on="worker" the pulled mean overwrites it. step() finds such a change by the tensor's
version counter (bumped by every in-place op, at no cost to read) and raises an error that names
Strategy.clip_grad_norm, which clips the aggregated gradient where that is possible.

fp16 with the optimizer on the servers (sync rounds): the loss is scaled before backward as in one
process; each bucket is unscaled as it leaves (by the scale's inverse, a power of two: exact, so
unscaling each worker's gradient equals unscaling their sum) and checked for inf/NaN with
GradScaler's own op. After its last push of a round the worker sends every server its flag
(kv.overflow); every server holds the round until it has every worker's, drops it everywhere if
any is set (no value or optimizer state changes), and answers each flag with the verdict, by which
every worker's loss scale halves (or grows) alike (kvstore/server/overflow.py).

Strategy.clip_grad_norm with the optimizer on the servers: a sync round's mean is clipped there by
the global norm (_clip_on_servers). Async and bounded rounds have no one mean, so each worker clips
its own gradient (`clip_`) and pushes it whole at step(), not during backward.
"""

from __future__ import annotations

import inspect
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paratrain import kvstore
from paratrain.kvstore.consistency import Sync
from paratrain.kvstore.worker.client import DistKVStore
from paratrain.kvstore.worker.device import HostKVStore
from paratrain.metrics.trace import tracer
from paratrain.train.api import EngineBase
from paratrain.train.precision import LossScaler
from paratrain.train.strategy import Strategy, kvstore_config

logger = logging.getLogger(__name__)

# Optimizer settings that are not hyperparameters, or that cannot run on a server's slice.
_NOT_SENT = ("params", "initial_lr", "foreach", "fused", "capturable", "differentiable", "name")


def group_hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Per parameter group: the hyperparameters that rebuild it on the servers (plain numbers and
    lists, as they travel)."""
    # Only what the class's constructor takes: a group may hold more (torch's AdamW keeps Adam's
    # `decoupled_weight_decay`, which AdamW() refuses).
    taken = inspect.signature(type(optimizer).__init__).parameters
    every = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in taken.values())
    return [
        {
            k: _plain(v)
            for k, v in group.items()
            if k not in _NOT_SENT and v is not None and (every or k in taken)
        }
        for group in optimizer.param_groups
    ]


def server_hyperparameters(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The hyperparameters of the optimizer's first group (what set_optimizer starts every key with)."""
    return group_hyperparameters(optimizer)[0]


def changed_hyperparameters(sent: list[dict], now: list[dict]) -> list[tuple[int, dict]]:
    """Per group whose values differ from those last sent: (group index, the changed values).
    ValueError where the groups themselves changed (add_param_group): their keys are fixed."""
    if len(now) != len(sent):
        raise ValueError(
            f"the optimizer has {len(now)} parameter groups, and had {len(sent)} when the servers "
            "took it: with the optimizer on the servers the groups are fixed (add_param_group before "
            "the Trainer)"
        )
    changes = [{k: v for k, v in new.items() if old.get(k) != v} for old, new in zip(sent, now, strict=True)]
    return [(i, change) for i, change in enumerate(changes) if change]


def clip_(values: list[torch.Tensor], max_norm: float) -> float:
    """Scale `values` in place to global L2 norm at most `max_norm`, with clip_grad_norm_'s
    arithmetic (its two halves, on tensors rather than parameters); returns the norm before."""
    norm = torch.nn.utils.get_total_norm(values)
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    torch._foreach_mul_(values, coefficient.to(values[0].device))
    return float(norm)


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):  # a tensor lr (capturable schedules)
        return float(value)
    return list(value) if isinstance(value, tuple) else value


class PSEngine(EngineBase):
    scales_gradients = True  # pushes grad / accumulation_steps; the servers average over workers

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        strategy: Strategy,
        ctx: Any,
        scaler: LossScaler | None = None,
    ) -> None:
        """`scaler`: fp16's loss scale, which the engine keeps with the optimizer on the servers
        (elsewhere the Trainer's GradientGate does, on the pulled mean)."""
        self.model = model
        self.strategy = strategy
        self.on_server = strategy.update_on == "server"
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not self.named:
            raise ValueError("the model has no parameters that require grad")
        self.keys = [name for name, _ in self.named]
        self.params = [p for _, p in self.named]
        self.index = {id(p): i for i, p in enumerate(self.params)}
        # The servers average each round over the workers that pushed to it (a round knows how many
        # did), so a worker pushes its own gradient, divided only over its accumulation micro-steps.
        self.kv = kvstore.create(kvstore_config(strategy, average=True), ctx)
        self.scale = 1.0 / strategy.accumulation_steps
        compression = strategy.compression_config
        if compression is not None:  # a 2bit threshold applies to each worker's own gradient
            self.kv.set_gradient_compression(compression)
        # Every worker starts from worker 0's values: its init sets the keys, and everyone pulls them.
        # With the optimizer on the workers the keys then carry gradient sums (a round's sum becomes
        # the value; version 0, the weights, is never pulled compressed).
        self.staging = [torch.empty(p.shape, dtype=p.dtype) for p in self.params]
        self.outgoing = [torch.empty(p.shape, dtype=p.dtype) for p in self.params]
        self.kv.init(self.keys, [p.detach().cpu() for p in self.params])
        self.sends_updates = compression is not None and compression.sends_updates
        self.per_worker_optimizer = self.sends_updates  # each worker's optimizer sees its own gradients
        self.before: list[torch.Tensor] = []  # update_on="worker": the weights before the step
        self.syncs_hyperparameters = self.on_server and not self.sends_updates
        self._hyper_sent: list[Any] = []  # set_hyperparameters handles of this round
        if self.on_server and self.sends_updates:
            self.kv.set_optimizer(torch.optim.SGD, lr=1.0)  # the value moves by the pushed mean update
        elif self.on_server:
            self._send_groups(optimizer)
        # Sync rounds are clipped on the servers by the norm of their mean; async and bounded ones
        # have no one mean, so each worker clips its own gradient before it leaves, as async
        # parameter-server systems do (its pushes then wait for the end of backward).
        sync = strategy.consistency == Sync()
        clip = strategy.clip_grad_norm if self.syncs_hyperparameters else None
        self.clip = clip if sync else None
        self.local_clip = None if sync else clip
        self.round = 0  # the servers' rounds (versions), counted from init or a restored state
        self.last_norm: float | None = None  # the last round's norm, before clipping
        if self.clip is not None:
            self._servers().clip_by_norm()
        self.scaler = scaler if self.syncs_hyperparameters else None
        self._found = torch.zeros(1)  # this round's pushes held inf or NaN (fp16)
        self.skipped = 0
        if self.scaler is not None:
            self._servers().check_overflow()
        self.pull_parameters()
        self.bucket_bytes = int(strategy.bucket_mb * 2**20)
        # As DDP does: the first bucket of a step is small, so the wire starts early in backward.
        self.first_bucket_bytes = min(self.bucket_bytes, 2**20)
        self.sync_now = True
        self._bucket: list[int] = []
        self._bucket_size = 0
        self._sent: set[int] = set()
        self._in_flight: list[Any] = []
        self._pushed: dict[int, tuple[int, int]] = {}
        """Per key that backward pushed: (id, version) of its .grad when backward produced it."""
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]
        self.communication_s = self.waiting_s = 0.0
        """Seconds handing buckets to the kvstore / waiting for their rounds (train/observe.py)."""

    # -- hyperparameters on the servers ------------------------------------------------------------
    def _send_groups(self, optimizer: torch.optim.Optimizer) -> None:
        """Every key gets its parameter group's hyperparameters: the servers build the first
        group's optimizer for every key, then the other groups' keys get what differs."""
        self.optimizer = optimizer
        self.group_keys = [
            [self.keys[self.index[id(p)]] for p in group["params"] if id(p) in self.index]
            for group in optimizer.param_groups
        ]
        groups = group_hyperparameters(optimizer)
        self.kv.set_optimizer(type(optimizer), **groups[0])
        self.sent = [groups[0]] * len(groups)
        self._sync_hyperparameters()
        for handle in self._hyper_sent:
            handle.wait()
        self._hyper_sent = []

    def _sync_hyperparameters(self) -> None:
        """At a round's first push: the groups' values that changed since last sent (an LR
        schedule's step, a hand edit of param_groups[i]["lr"]) go to the servers ahead of the
        pushes, on the same connections, so they hold for this round; no round trip is added
        (step() waits for the replies with the round's)."""
        now = group_hyperparameters(self.optimizer)
        for i, change in changed_hyperparameters(self.sent, now):
            if self.group_keys[i]:
                self._hyper_sent.append(self.kv.set_hyperparameters(self.group_keys[i], **change))
        self.sent = now

    def _check_hyperparameters_unchanged(self) -> None:
        """ValueError if a group's values changed after this round's first push left: the servers
        may have applied the round already with the old ones."""
        changed = changed_hyperparameters(self.sent, group_hyperparameters(self.optimizer))
        if changed:
            i, change = changed[0]
            raise ValueError(
                f"parameter group {i}'s {change} changed between backward and step, after this "
                "round's gradients left for the servers, which apply it with the values they had: "
                "change hyperparameters (and step LR schedulers) after optimizer.step() or before "
                "backward"
            )

    # -- pushing as backward goes ----------------------------------------------------------------
    def set_sync(self, sync: bool) -> None:
        self.sync_now = sync

    def _on_grad(self, param: torch.Tensor) -> None:
        if not self.sync_now or self.sends_updates or self.local_clip is not None:
            return  # an accumulation micro-step (or top-k's updates, or clipped whole): it stays in .grad
        i = self.index[id(param)]
        grad = param.grad
        assert grad is not None  # a post-accumulate-grad hook runs once the gradient exists
        self._pushed[i] = (id(grad), grad._version)
        if i in self._sent:
            return  # a second backward through the same step: sent with step()'s check below
        self._bucket.append(i)
        self._bucket_size += grad.numel() * grad.element_size()
        first = not self._in_flight
        if self._bucket_size >= (self.first_bucket_bytes if first else self.bucket_bytes):
            self._send_bucket()

    def _send_bucket(self) -> None:
        if not self._bucket:
            return
        if self.syncs_hyperparameters and not self._in_flight:
            self._sync_hyperparameters()  # the round's first push
        start = time.perf_counter()
        with torch.no_grad(), tracer().range("push", keys=len(self._bucket), bytes=self._bucket_size):
            values = [self._wire_value(i) for i in self._bucket]
            if self.local_clip is not None:  # the whole gradient is in this one bucket
                self.last_norm = clip_(values, self.local_clip)
            if self.scaler is not None:  # unscaled as they leave, and checked (see the docstring)
                torch._amp_foreach_non_finite_check_and_unscale_(values, self._found, self.scaler.inverse())
            handle = self.kv.pushpull_async(
                [self.keys[i] for i in self._bucket], values, out=[self.staging[i] for i in self._bucket]
            )
        self.communication_s += time.perf_counter() - start
        self._in_flight.append(handle)
        self._sent.update(self._bucket)
        self._bucket, self._bucket_size = [], 0

    def _wire_value(self, i: int) -> torch.Tensor:
        """The gradient as it is pushed, in this key's send buffer (made once, reused every step: the
        previous push from it finished in the last step())."""
        p, out = self.params[i], self.outgoing[i]
        if p.grad is None:
            return out.zero_()  # every key joins every round
        if p.grad.is_sparse:
            raise ValueError(
                f"parameter {self.keys[i]!r} has a sparse gradient; use kvstore.worker.embedding's "
                "DistributedEmbedding for sparse tables"
            )
        if out.dtype == p.grad.dtype and p.grad.device.type == "cpu":
            return torch.mul(p.grad, self.scale, out=out)
        return out.copy_(p.grad).mul_(self.scale)  # to the CPU

    # -- the step ---------------------------------------------------------------------------------
    def step(self, optimizer: torch.optim.Optimizer, local_step: Any) -> Any:
        if self.sends_updates:
            return self._step_update(local_step)
        if self.syncs_hyperparameters and self._in_flight:
            self._check_hyperparameters_unchanged()
        self._check_unchanged()
        self._bucket.extend(
            i for i in range(len(self.params)) if i not in self._sent and i not in self._bucket
        )
        self._send_bucket()
        verdict = None
        if self.scaler is not None:  # after the round's last push on every connection
            verdict = self._servers().overflow(self.round, bool(self._found.item()))
            self._in_flight.append(verdict)
        if self.clip is not None:
            self._clip_on_servers()
        self.round += 1
        start = time.perf_counter()
        with tracer().range("wait for round (pull)", buckets=len(self._in_flight)):
            for handle in self._hyper_sent + self._in_flight:
                handle.wait()
        self.waiting_s += time.perf_counter() - start
        self._in_flight, self._sent, self._hyper_sent = [], set(), []
        if verdict is not None:
            self._follow_verdict(any(reply["overflowed"] for reply in verdict.replies))
        with torch.no_grad():
            if self.on_server:
                for p, value in zip(self.params, self.staging, strict=True):
                    p.copy_(value)
                return None
            for p, mean in zip(self.params, self.staging, strict=True):
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                p.grad.copy_(mean)
        return local_step()

    def _servers(self) -> DistKVStore | HostKVStore:
        """The store as the job's servers' client (a host's, with aggregation='host'): rounds
        held on the servers for their norm or overflow checks run only there."""
        assert isinstance(self.kv, (DistKVStore, HostKVStore))
        return self.kv

    def _clip_on_servers(self) -> None:
        """Strategy.clip_grad_norm with the optimizer on the servers: the round's mean waits there
        while each server's share of its squared norm comes back; the scale that clips it, the
        same on every worker, releases it (as clip_grad_norm_: min(1, c / (norm + 1e-6)))."""
        assert self.clip is not None
        start = time.perf_counter()
        with tracer().range("norm of the round"):
            norm = math.sqrt(sum(self._servers().norm_shares(self.round)))
        self.waiting_s += time.perf_counter() - start
        self.last_norm = norm
        self._in_flight.append(self._servers().clip_scale(self.round, min(1.0, self.clip / (norm + 1e-6))))

    def _follow_verdict(self, overflowed: bool) -> None:
        """The loss scale follows the servers' verdict on the round, the same on every worker."""
        assert self.scaler is not None
        self.scaler.update(torch.tensor([float(overflowed)]))
        self._found.zero_()
        if overflowed:
            self.skipped += 1
            logger.info(
                "step skipped: a worker's gradient held inf or NaN (loss scale now %g)", self.scaler.scale
            )

    def after_step(self, trainer: Any) -> None:
        if self.last_norm is not None:  # logged as grad_norm, as the workers' own clipping is
            trainer.gate.last_norm = self.last_norm
        if self.scaler is not None:
            trainer.gate.skipped = self.skipped

    def _step_update(self, local_step: Any) -> Any:
        """Top-k: this worker's optimizer steps on its gradient; the update (before - after) is
        pushed, and the weights become the servers' (or the old weights less the pulled mean)."""
        with torch.no_grad():
            if self.scale != 1.0:
                for p in self.params:
                    if p.grad is not None:
                        p.grad.mul_(self.scale)
            if not self.on_server and not self.before:
                self.before = [torch.empty_like(p) for p in self.params]
            for i, p in enumerate(self.params):
                self.outgoing[i].copy_(p)
                if self.before:
                    self.before[i].copy_(p)
        result = local_step()
        start = time.perf_counter()
        with torch.no_grad():
            for out, p in zip(self.outgoing, self.params, strict=True):
                out.sub_(p.detach().to(out.device))
            size = sum(out.numel() * out.element_size() for out in self.outgoing)
            with tracer().range("push", keys=len(self.keys), bytes=size):
                handle = self.kv.pushpull_async(self.keys, self.outgoing, out=self.staging)
            self.communication_s += time.perf_counter() - start
            start = time.perf_counter()
            with tracer().range("wait for round (pull)", buckets=1):
                handle.wait()
            self.waiting_s += time.perf_counter() - start
            for i, (p, value) in enumerate(zip(self.params, self.staging, strict=True)):
                if self.on_server:
                    p.copy_(value)
                else:
                    p.copy_(self.before[i] - value.to(p.device))
        return result

    def _check_unchanged(self) -> None:
        """ValueError if a gradient changed since its push (see the module docstring)."""
        for i, then in self._pushed.items():
            grad = self.params[i].grad
            now = None if grad is None else (id(grad), grad._version)
            if now != then:
                self._pushed.clear()
                raise ValueError(
                    f"the gradient of {self.keys[i]!r} changed after backward pushed it to the servers "
                    "(torch.nn.utils.clip_grad_norm_ or another change between backward and step?); "
                    "the change would be lost: with architecture='ps' set Strategy.clip_grad_norm "
                    "instead of clipping in the loop"
                    + (" (with the optimizer on the servers: in sync mode)" if self.on_server else "")
                )
        self._pushed.clear()

    def pull_parameters(self, keys: list | None = None, outs: list[torch.Tensor] | None = None) -> None:
        """The parameters become the servers' values of `keys` (default: the parameters' keys)."""
        outs = self.staging if outs is None else outs
        with tracer().range("pull"):
            self.kv.pull(self.keys if keys is None else keys, out=outs)
        with torch.no_grad():
            for p, value in zip(self.params, outs, strict=True):
                p.copy_(value)

    def join(self) -> None:
        """Elastic: this worker joined the running job; the others wait at a barrier meanwhile."""
        if self.clip is not None or self.scaler is not None:  # its rounds would count from its
            field = "clip_grad_norm" if self.clip is not None else "precision='fp16'"  # start
            raise ValueError(
                f"Strategy.{field} with the optimizer on the servers cannot take a worker that joins "
                "a running job yet (the servers hold each round for every member's norm share or "
                "check, and a joiner's rounds count from its start): use update_on='worker'"
            )
        assert isinstance(self.kv, DistKVStore)  # only a job with servers is elastic
        self.kv.join()
        self.pull_parameters()

    # -- checkpoints ------------------------------------------------------------------------------
    def save(self, folder: Path) -> None:
        """Every worker calls it: the servers' values and optimizer state (worker 0 writes)."""
        self.kv.save_state(folder / "servers.pt")

    def restore(self, folder: Path) -> None:
        self.kv.load_state(folder / "servers.pt")
        self.round = 0  # the servers' versions start again from the state
        if self.on_server:
            self.pull_parameters()
        if self.syncs_hyperparameters:  # the restored groups' values (a schedule's lr) go with the
            self.sent = [{} for _ in self.sent]  # next round, whatever the servers started with

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self.kv.close()
