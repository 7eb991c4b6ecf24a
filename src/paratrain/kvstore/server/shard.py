"""One shard's state on a server, driven by method calls: no sockets, no frames (server.py does the
wire). Unit-tested on its own (tests/test_shard_state.py).

A shard is elements [start, stop) of one key: its value, version, open rounds, optimizer and
counters. What a push does is the consistency policy's (consistency.py): join its round or apply at
once. `_apply` is the single place where the value changes (an optimizer step, a round's sum or
mean becoming the value, or an async push added to it): every update goes through it, in one order
per key, which is what a backup server would replay.

A round knows who pushed to it and how many workers those pushes stand for (`weight`: one per
worker, or a host's count where a host's workers reduce first), so with `Rules.average` its update
is the mean over the workers that pushed, whatever their number: a round of fewer members (after
a worker left) still gives the right mean.

Memory: a push's payload is received into a pooled buffer of its shard (`buffer`); the first push of
a round becomes its accumulator and later ones are added into it. A shard kept in shared memory
(shared.py, `region`) also has buffers that same-host workers add their pushes into themselves
(`opened`: round -> buffer). Pulls read the value in place: a round is applied only when no pull
is reading it (`readers`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from paratrain.kvstore import optim, protocol
from paratrain.kvstore.api import KVError
from paratrain.kvstore.server.rules import Clocks, Push, Rules
from paratrain.kvstore.shared import Region

# Spent gradient buffers a shard keeps for reuse (a fresh big tensor costs page faults). Buffers in
# use are bounded too: one per push being received, plus one accumulator per round in flight (at
# most staleness + 1 rounds, since pulls hold workers back).
POOL_BUFFERS = 4
COUNTS = ("pushes", "pulls", "bytes_in", "bytes_out", "late")


@dataclass
class Round:
    """An open round: the sum of its pushes so far, who pushed, and the workers they stand for."""

    acc: torch.Tensor
    pushed: set[int]
    weight: int


@dataclass
class ShardState:
    """Elements [start, stop) of one key, held by this server."""

    key: Any
    start: int
    stop: int
    numel: int
    shape: list[int]
    dtype: str
    value: torch.Tensor
    rules: Rules = field(default_factory=Rules)
    version: int = 0
    rounds: dict[int, Round] = field(default_factory=dict)
    pool: list[torch.Tensor] = field(default_factory=list)
    readers: int = 0
    param: torch.nn.Parameter | None = None
    optimizer: torch.optim.Optimizer | None = None
    cond: threading.Condition = field(default_factory=threading.Condition)
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTS, 0))
    """What this shard has served: pushes, pulls and their bytes, and the pushes dropped for
    arriving after their round was applied (`late`: backup workers) (read by `stats`)."""
    read: dict[int, int] = field(default_factory=dict)
    """Per worker rank: the version its last pull got (a push's staleness counts from it)."""
    region: Region | None = None
    """Shared shards only: the value is region.buffers[value_buffer]; opened maps a round to the
    buffer open for its pushes."""
    value_buffer: int = 0
    opened: dict[int, int] = field(default_factory=dict)
    mirror: Region | None = None
    """Replicated servers on one host, on a backup: the buffers its primary writes new values into
    (mirror.py). Its value may be one of them; they never go to the pool."""
    lent: frozenset[int] = frozenset()
    """Replicated servers on one host, on a primary: the buffers of `region` that a backup holds
    as its value or is sent (mirror.py, lending): none is opened for a round or written."""
    lending: bool = True
    """Off only while `reclaim` takes the value back from the backups."""
    borrowed: Region | None = None
    """On a backup: its primary's region, mapped; the value may be one of its buffers (never
    written here, never pooled)."""
    chain: list[int] = field(default_factory=list)
    """Replicated servers (replica.py): the servers holding this slice, primary first."""
    on_applied: Callable[[ShardState], None] | None = None
    """Replicated servers: called after every update, holding cond: sends the new state to the
    backups; `replicated(version)` once they hold it. Pulls and acknowledgements wait for
    `durable`, not `version`."""
    on_stall: Callable[[], None] | None = None
    """Replicated servers: called before waiting for a buffer a backup holds (sends what this
    thread holds back for the backups: Replicator.flush)."""
    durable: int = 0
    """Replicated servers: the version the backups hold."""
    applied: dict[int, Clocks] = field(default_factory=dict)
    """Async pushes: per worker rank, the clocks of its pushes applied (a repeat is dropped)."""
    shares: dict[int, float] = field(default_factory=dict)
    scales: dict[int, float] = field(default_factory=dict)
    """Rules.clip: per complete round held back, the squared norm of its mean (`norm_share`), and
    the scale that releases it (`set_scale`)."""
    verdicts: dict[int, bool] = field(default_factory=dict)
    """Rules.overflow: per round, whether some worker's gradient held inf or NaN (`set_verdict`):
    then the round is dropped, not applied."""
    offsets: dict[int, int] = field(default_factory=dict)
    """Per joiner that pushed this shard: the round its clock 0 stands for (it pushes and pulls
    in its own clocks, counted from its start; the shard shifts them)."""
    caught_up: dict[int, int] = field(default_factory=dict)
    """Backup workers: per worker, the rounds it skipped, having pulled newer values than its
    clock (its clocks plus this are the shard's: catch_up)."""

    # -- elastic membership -----------------------------------------------------------------------
    def waits_for(self) -> frozenset[int]:
        """The workers a round waits for: the members, and the joiners that pushed this shard."""
        return self.rules.members | (self.offsets.keys() & self.rules.joiners)

    def admit(self, push: Push) -> Push:
        """A push in the shard's clocks (the policy's: a joiner's are shifted in round models)."""
        return self.rules.policy.admit(self, push)

    def admit_joiner(self, push: Push) -> Push:
        """A joiner's push in the shard's rounds, in the shard's clocks. One that did not `join`
        first joins with its first push (the round applied next: it may have missed rounds)."""
        if push.rank not in self.rules.joiners:
            return push
        with self.cond:
            if push.rank not in self.offsets:
                self.join(push.rank, push.clock)
            push.clock += self.offsets[push.rank]
            return push

    def join(self, rank: int, clock: int = 0) -> None:
        """Rounds wait for joiner `rank` from the next one on, which its clock `clock` stands for
        (after those its dead predecessor of the same rank pushed to)."""
        with self.cond:
            start = self.version
            while start in self.rounds and rank in self.rounds[start].pushed:
                start += 1
            self.offsets[rank] = start - clock

    def pull_version(self, rank: int, min_version: int) -> int:
        """A pull's min_version in this shard's versions (a joiner's are shifted)."""
        if min_version == 0:
            return 0
        return min_version + self.offsets.get(rank, 0) + self.caught_up.get(rank, 0)

    def catch_up(self, push: Push) -> Push:
        """Backup workers: a push joins the round of the version its worker last pulled (a late
        worker's clock lags the rounds applied without it), in the shard's clocks from then on."""
        with self.cond:
            push.clock += self.caught_up.get(push.rank, 0)
            round_ = self.rules.policy.joins(push.clock, self.read.get(push.rank, 0))
            if round_ != push.clock:
                self.caught_up[push.rank] = self.caught_up.get(push.rank, 0) + round_ - push.clock
                push.clock = round_
            return push

    def forget(self, rank: int) -> None:
        """A joiner left or died: the rank's shift goes (a later worker of that rank starts anew)."""
        with self.cond:
            self.offsets.pop(rank, None)
            self.caught_up.pop(rank, None)

    # -- buffers ----------------------------------------------------------------------------------
    def buffer(self) -> torch.Tensor:
        with self.cond:
            return self.pool.pop() if self.pool else torch.empty_like(self.value)

    def recycle(self, buffer: torch.Tensor) -> None:
        """Keep a spent buffer for the next push, up to POOL_BUFFERS per shard; free the rest (and
        never a mirror buffer or a borrowed one: its primary may write into it)."""
        if _within(buffer, self.mirror) or _within(buffer, self.borrowed):
            return
        if len(self.pool) < POOL_BUFFERS:
            self.pool.append(buffer)

    def describe(self) -> str:
        return f"key {self.key!r} [{self.start}, {self.stop})"

    def writing(self) -> AbstractContextManager[None]:
        """Hold while changing the value in place: waits for same-host workers reading it."""
        return self.region.writing(self.value_buffer) if self.region is not None else nullcontext()

    def share(self, region: Region) -> None:
        """Keep the value in `region` (shared memory), with its other buffers open for rounds."""
        region.buffers[0].copy_(self.value)
        region.publish(0, 0)
        self.region, self.value, self.value_buffer = region, region.buffers[0], 0
        with self.cond:
            self.open_free_buffers()

    def open_free_buffers(self) -> None:
        """Open every idle shared buffer for the next round that has neither a buffer nor a
        payload-built sum; holds cond."""
        if self.region is None:
            return
        busy = {self.value_buffer, *self.opened.values(), *self.lent}
        lendable = self.lendable()
        for b in range(self.region.count):
            if b not in busy:
                round_ = self.version
                while round_ in self.opened or (round_ in self.rounds and not lendable):
                    round_ += 1
                self.region.open(b, round_)
                self.opened[round_] = b
                entry = self.rounds.get(round_)
                if entry is not None:  # lending: a round begun from payloads moves into the buffer
                    self.region.add(round_, entry.acc)
                    if entry.acc is not self.value:
                        self.recycle(entry.acc)
                    entry.acc = self.region.buffers[b]

    def lendable(self) -> bool:
        """Whether the backups may take the value as it is, in this server's memory (mirror.py):
        a shared shard whose rounds' sums become the value, so none is written in place (the
        policy's)."""
        return self.rules.policy.lends(self)

    def reclaim(self) -> None:
        """Before the value is written in place (holds cond): where a backup holds its buffer, send
        the backups a copy of it and wait until they no longer hold it."""
        if self.region is None or self.value_buffer not in self.lent or self.on_applied is None:
            return
        self.lending = False
        try:
            self.on_applied(self)
            while self.value_buffer in self.lent:
                self.stall()
        finally:
            self.lending = True

    def stall(self) -> None:
        """Wait for a backup to give a buffer back (holds cond); what this thread has yet to send
        the backups goes first (replica.py, Replicator.flush)."""
        if self.on_stall is not None:
            self.on_stall()
        self.cond.wait()

    def disown(self) -> None:
        """On a backup: a value in the primary's memory becomes this server's own (a copy), before
        this server serves it or writes it (its primary died or the job lost it)."""
        with self.cond:
            if not _within(self.value, self.borrowed):
                return
            self.settle()
            self._own(self.value.clone())

    def holding(self) -> int | None:
        """On a backup: which of the primary's buffers (`borrowed`) is the value, None: none."""
        if self.borrowed is None:
            return None
        for b, buffer in enumerate(self.borrowed.buffers):
            if buffer.data_ptr() == self.value.data_ptr():
                return b
        return None

    # -- push -------------------------------------------------------------------------------------
    def check(self, push: Push) -> None:
        """Refuse a push that cannot join this shard (before anything of its frame is counted)."""
        grad = push.grad
        if grad is not None and (grad.dtype != self.value.dtype or grad.numel() != self.value.numel()):
            raise KVError(f"push to {self.describe()}: {grad.dtype}[{grad.numel()}] does not match")
        self.rules.policy.check(self, push)

    def check_arrival(self, push: Push) -> None:
        if push.grad is None:
            raise KVError(f"push to {self.describe()}: async pushes carry their payload")

    def check_round(self, push: Push, late: bool = False) -> None:
        """`late`: a push to a round already applied passes (it is dropped: join_or_drop)."""
        grad = push.grad
        with self.cond:
            if push.clock < self.version:
                if late:
                    return
                raise KVError(f"push to {self.describe()} for round {push.clock}, already applied")
            entry = self.rounds.get(push.clock)
            if entry is not None and push.rank in entry.pushed:
                raise KVError(f"worker {push.rank} pushed {self.describe()} twice in round {push.clock}")
            if grad is None and push.clock not in self.opened:
                raise KVError(f"{self.describe()}: no shared buffer is open for round {push.clock}")

    def push(self, push: Push) -> None:
        """A checked push: the policy joins it to its round or applies it now."""
        self.counts["pushes"] += 1
        self.counts["bytes_in"] += self.value.numel() * self.value.element_size()
        self.rules.policy.on_push(self, push)

    def repeat(self, push: Push) -> bool:
        """Whether this push was applied (or joined its round) already: a worker that failed over
        to this server sends again what the dead primary had not acknowledged."""
        with self.cond:
            return self.rules.policy.repeated(self, push)

    def was_applied(self, push: Push) -> bool:
        return push.rank in self.applied and self.applied[push.rank].has(push.clock)

    def in_round(self, push: Push) -> bool:
        entry = self.rounds.get(push.clock)
        return push.clock < self.version or (entry is not None and push.rank in entry.pushed)

    def apply_now(self, push: Push) -> None:
        """Apply one push on its own (async); its payload is consumed here (a ring view will do).
        Its clock and its update are one step (settle first): were cond let go between them, a
        copy for the backups (`replica`, from another push's update) could carry the clock
        without the update, and the push, sent again after a fail-over, would be dropped there."""
        assert push.grad is not None
        with self.cond:
            self.settle()
            self.applied.setdefault(push.rank, Clocks()).add(push.clock)
            self._apply(push.grad)
            if push.owned:
                self.recycle(push.grad)

    def join_round(self, push: Push) -> None:
        """Add a push to round `push.clock` (`grad` None: the worker added it into the round's
        shared buffer itself), then apply the rounds that are complete."""
        grad = push.grad
        with self.cond:
            entry = self.rounds.get(push.clock)
            b = self.opened.get(push.clock)
            if b is not None:  # the round sums in a shared buffer
                assert self.region is not None
                if grad is not None and not self.region.add(push.clock, grad):
                    raise KVError(f"{self.describe()}: round {push.clock}'s buffer closed early")
                acc = self.region.buffers[b]
                if grad is not None and push.owned:
                    self.recycle(grad)
            elif entry is None:  # the first push becomes the round's accumulator
                assert grad is not None
                acc = grad if push.owned else self.buffer().copy_(grad)  # cond is re-entrant
            else:
                assert grad is not None  # a push without a payload has its round's buffer open
                acc = entry.acc
                acc.add_(grad)
                if push.owned:
                    self.recycle(grad)
            if entry is None:
                self.rounds[push.clock] = Round(acc, {push.rank}, push.weight)
            else:
                entry.pushed.add(push.rank)
                entry.weight += push.weight
            self.apply_complete_rounds()

    def join_or_drop(self, push: Push) -> None:
        """Backup workers: join the push's round, or drop it (counted) where the round was applied
        without it; one step under cond, so no round closes between the look and the join."""
        with self.cond:
            if push.clock >= self.version:
                self.join_round(push)
                return
            self.counts["late"] += 1
            if push.grad is not None and push.owned:
                self.recycle(push.grad)

    def apply_complete_rounds(self) -> None:
        """Apply, in order, the rounds that are complete (the policy's: every member pushed, or
        enough of them), also after a member left."""
        with self.cond:
            while True:
                entry = self.rounds.get(self.version)
                if entry is None or not self.rules.policy.round_complete(entry.pushed, self.waits_for()):
                    return
                if self.readers:  # a pull is being sent from the value: wait, then look again
                    self.cond.wait()
                    continue
                if self.version not in self.opened and self.lendable():
                    self.stall()  # until a backup gives a buffer back (mirror.py, release)
                    continue
                released = self._release(entry)
                if released is None:
                    return  # held until the global norm, or every worker's overflow check, is known
                scale, overflowed = released
                del self.rounds[self.version]
                b = self.opened.pop(self.version, None)
                if b is not None:
                    assert self.region is not None
                    self.region.close_round(b)
                if overflowed:
                    self._skip()
                else:
                    if scale != 1.0:
                        entry.acc.mul_(scale)
                    self._apply(entry.acc, entry.weight, buffer=b)
                if b is None and entry.acc is not self.value:  # spent: an optimizer's or a copy's input
                    self.recycle(entry.acc)
                self.open_free_buffers()

    def _release(self, entry: Round) -> tuple[float, bool] | None:
        """A complete round's (clipping scale, overflowed): (1.0, False) without Rules.clip and
        Rules.overflow; None while what they wait for is not known (with Rules.clip its share
        of the squared norm is noted for norm_share). Holds cond."""
        clip, overflow = self.rules.clip, self.rules.overflow
        if clip and self.version not in self.shares and self.version not in self.scales:
            divisor = entry.weight if self.rules.average else 1
            self.shares[self.version] = float(entry.acc.double().square().sum()) / divisor**2
            self.cond.notify_all()
        if (clip and self.version not in self.scales) or (overflow and self.version not in self.verdicts):
            return None
        # This round's share stays until the next one applies: a worker may still ask for it
        # (another's scale applied the round first), and none asks for an older one (its pushes
        # of the next round follow its question).
        self.shares.pop(self.version - 1, None)
        return self.scales.pop(self.version, 1.0), self.verdicts.pop(self.version, False)

    def _skip(self) -> None:
        """A round some worker's gradient overflowed in: the version moves on, the value and the
        optimizer's state stay as they were (fp16's skipped step; holds cond)."""
        self.settle()
        with self.writing():
            self.version += 1
            if self.region is not None:
                self.region.stamp(self.version)
        if self.on_applied is not None:
            self.on_applied(self)

    def norm_share(self, round_: int) -> float:
        """The squared norm of round `round_`'s mean on this slice, once the round is complete."""
        with self.cond:
            while round_ not in self.shares:
                if round_ < self.version:
                    raise KVError(f"{self.describe()}: round {round_} was applied already")
                self.cond.wait()
            return self.shares[round_]

    def set_scale(self, round_: int, scale: float) -> None:
        """Round `round_` is clipped by `scale`, then applied (a repeat from another worker: no-op)."""
        with self.cond:
            if round_ >= self.version:
                self.scales[round_] = scale
                self.apply_complete_rounds()

    def set_verdict(self, round_: int, overflowed: bool) -> None:
        """Whether round `round_` is dropped (some worker's gradient held inf or NaN) or applied."""
        with self.cond:
            if round_ >= self.version:
                self.verdicts[round_] = overflowed
                self.apply_complete_rounds()

    def _apply(self, grad: torch.Tensor, weight: int = 1, buffer: int | None = None) -> None:
        """The one update of the value (`_update`); on replicated servers the new state is sent to
        the backups (holds cond: nothing changes while it is sent)."""
        self._update(grad, weight, buffer)
        if self.on_applied is not None:
            self.on_applied(self)

    def settle(self) -> None:
        """Wait until no pull reads the value (holds cond). Until cond is let go, none can begin
        (begin_read takes it), so what follows changes the state in one step."""
        while self.readers:
            self.cond.wait()

    def replicated(self, version: int) -> None:
        """The backups hold `version`: pulls and acknowledgements waiting for it may go."""
        with self.cond:
            self.durable = max(self.durable, version)

    def _update(self, grad: torch.Tensor, weight: int = 1, buffer: int | None = None) -> None:
        """The one update of the value: an optimizer step, or without one a round's sum (or mean)
        becoming the value, or an async push added to it (the policy's). `weight`: the workers a
        round's sum stands for (its mean divides by it). `buffer`: the shared buffer that holds
        `grad` (it is returned to the shard's free buffers). Waits until no pull reads the value;
        holds cond."""
        self.settle()
        self.rules.policy.update(self, grad, weight, buffer)

    def apply_arrival(self, grad: torch.Tensor) -> None:
        """One push applied on its own: an optimizer step, or added to the value."""
        self._write(grad, lambda: self.value.add_(grad))

    def apply_round(self, grad: torch.Tensor, weight: int, buffer: int | None) -> None:
        """A complete round: an optimizer step, or its sum (mean) becoming the value."""
        if self.rules.average and weight > 1:
            grad.div_(weight)
        if self.optimizer is None and (buffer is not None or self.region is None):
            # The round's sum becomes the value: no reader holds the old one (the reader count;
            # same-host readers hold a lock on its buffer, which open_free_buffers waits for).
            if buffer is None:
                self.recycle(self.value)
            else:  # before the version moves: a pull found ready (without cond) reads it at once
                assert self.region is not None
                self.region.publish(buffer, self.version + 1)
                self.value_buffer = buffer
            self.value, self.version = grad, self.version + 1
            return
        # else a round summed outside the shared buffers: into the shared value
        self._write(grad, lambda: self.value.copy_(grad))

    def _write(self, grad: torch.Tensor, without_optimizer: Callable[[], Any]) -> None:
        """The value changed in place: an optimizer step on `grad`, or `without_optimizer`."""
        self.reclaim()  # a backup may hold the value's buffer: never written under it
        self.settle()
        with self.writing():
            if self.optimizer is not None:
                assert self.param is not None
                self.param.grad = grad
                self.optimizer.step()
                self.param.grad = None
            else:
                without_optimizer()
            self.version += 1
            if self.region is not None:
                self.region.stamp(self.version)

    # -- pull -------------------------------------------------------------------------------------
    def served(self, rank: int) -> None:
        """A pull of worker `rank` is answered with the value at this version (pinned, or read by
        the worker from shared memory): counted, and its next push's staleness (and, with backup
        workers, its round) counts from here. Before the reply goes, so its next push finds it."""
        self.read[rank] = self.version
        self.counts["pulls"] += 1
        self.counts["bytes_out"] += self.value.numel() * self.value.element_size()

    def ready(self, min_version: int) -> bool:
        return (self.version if self.on_applied is None else self.durable) >= min_version

    def begin_read(self) -> torch.Tensor:
        """The value, held unchanged until end_read (a round waits for its readers)."""
        with self.cond:
            self.readers += 1
            return self.value

    def end_read(self) -> None:
        with self.cond:
            self.readers -= 1
            self.cond.notify_all()

    def waiting(self, need: int) -> dict | None:
        """Why a pull for version `need` waits: the round applied next and the members that have not
        pushed it (None: it does not wait)."""
        with self.cond:
            if self.version >= need:
                return None
            entry = self.rounds.get(self.version)
            missing = sorted(self.waits_for() - (entry.pushed if entry is not None else set()))
            where = {"key": self.key, "start": self.start, "stop": self.stop}
            return where | {"version": self.version, "round": self.version, "missing": missing}

    def stats(self, waiting_pulls: int) -> dict:
        where = {"key": self.key, "start": self.start, "stop": self.stop, "version": self.version}
        return where | {"open_rounds": len(self.rounds), "waiting_pulls": waiting_pulls, **self.counts}

    # -- optimizer and state ----------------------------------------------------------------------
    def attach_optimizer(self, path: str, hyper: dict) -> None:
        with self.cond:
            self.reclaim()  # its steps write the value in place
            self.disown()
            self.param = torch.nn.Parameter(self.value, requires_grad=True)
            self.value = self.param.data
            self.optimizer = optim.build(path, hyper, self.param)

    def set_hyper(self, hyper: dict) -> None:
        """New hyperparameters for the optimizer's next steps (not during one: holds cond)."""
        with self.cond:
            if self.optimizer is None:
                raise KVError(f"{self.describe()}: set_hyper before set_optimizer")
            optim.set_hyperparameters(self.optimizer, hyper)

    def state(self) -> tuple[dict, list[torch.Tensor]]:
        """This shard's entry of a state file and its tensors: value, then optimizer state."""
        with self.cond:
            state = self._optimizer_state()
            entry = {"key": self.key, "start": self.start, "stop": self.stop, "numel": self.numel}
            entry |= {"shape": self.shape, "dtype": self.dtype, "version": self.version, "state": list(state)}
            return entry, [self.value.clone()] + [t.clone() for t in state.values()]

    def _optimizer_state(self) -> dict[str, torch.Tensor]:
        if self.optimizer is None:
            return {}
        assert self.param is not None  # an optimizer has its parameter
        return optim.state_tensors(self.optimizer, self.param)

    def replica(self, sender: int | None = None) -> tuple[protocol.Replicate, list[torch.Tensor]]:
        """What a backup needs (holds cond, so nothing changes while it is sent): version, the
        async pushes applied, the value and the optimizer state, uncopied. `sender`: this server
        (backups refuse copies from a server the job lost: fence.py); None in a frame of several."""
        state = self._optimizer_state()
        copy = protocol.Replicate(
            key=self.key,
            start=self.start,
            stop=self.stop,
            version=self.version,
            applied=[[rank, c.below, sorted(c.ahead)] for rank, c in self.applied.items()],
            state=list(state),
            sender=sender,
        )
        return copy, [self.value, *state.values()]

    def restore(
        self, version: int, value: torch.Tensor, state: dict[str, torch.Tensor], applied: dict[int, Clocks]
    ) -> None:
        """A backup takes the primary's state at `version` (an older one, arriving late, is
        ignored). Its open rounds are dropped: only a primary has rounds."""
        with self.cond:
            self.settle()  # first: an update applied while waiting would make this copy older
            if version < self.version:
                return
            self._take(value.reshape(-1))
            self.version = self.durable = version
            self.applied = applied
            self.rounds = {}
            if state:
                if self.optimizer is None:
                    raise KVError(f"{self.describe()}: the primary runs an optimizer, this backup none")
                assert self.param is not None
                optim.load_state_tensors(self.optimizer, self.param, state)

    def _take(self, value: torch.Tensor) -> None:
        """Make `value` (received for this shard: its own buffer, or its primary's: `borrowed`) the
        value, without a copy where it can; the old value's buffer is kept for the next one (holds
        cond, no readers). An optimizer's parameter never borrows (its steps write it)."""
        if self.region is not None or value.dtype != self.value.dtype or value.numel() != self.value.numel():
            if _within(self.value, self.borrowed):
                self._own(value.clone())
            else:
                self.value.copy_(value)
            return
        if self.param is not None and _within(value, self.borrowed):
            value = value.clone()
        self.recycle(self.value)
        self._own(value)

    def _own(self, value: torch.Tensor) -> None:
        if self.param is not None:  # the optimizer keeps its parameter; only its data moves
            self.param.data = value
            self.value = self.param.data
        else:
            self.value = value

    def load(self, value: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        """Restart from a saved value (and optimizer state) at version 0, every round dropped."""
        with self.cond:
            self.reclaim()
            self.disown()
            self.settle()
            with self.writing():
                self.value.copy_(value.reshape(-1))
                self.version, self.rounds, self.durable, self.applied = 0, {}, 0, {}
                self.read, self.caught_up = {}, {}
                self.shares, self.scales, self.verdicts = {}, {}, {}
                if self.region is not None:
                    self.region.stamp(0)
            if self.region is not None:
                for b in self.opened.values():  # every buffer opens again, from round 0
                    self.region.close_round(b)
            self.opened = {}
            self.open_free_buffers()
            if state:
                if self.optimizer is None:
                    raise KVError("the state has optimizer state: call set_optimizer before load_state")
                assert self.param is not None
                optim.load_state_tensors(self.optimizer, self.param, state)


def _within(tensor: torch.Tensor, region: Region | None) -> bool:
    """Whether `tensor` is one of `region`'s buffers."""
    return region is not None and any(tensor.data_ptr() == b.data_ptr() for b in region.buffers)
