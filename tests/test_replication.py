"""Replicated servers (JobConfig.replication; kvstore/server/replica.py): placement as a pure
function, the shard state's dedupe and replication without processes (many seeds), and the counting
job: servers SIGKILLed at random moments, every key ends at exactly the acknowledged pushes."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from paratrain.cluster.config import JobConfig
from paratrain.kvstore.consistency import Async, Sync
from paratrain.kvstore.placement import Placement, replicas
from paratrain.kvstore.server.shard import Clocks, Push, Rules, ShardState
from paratrain.testing import run_job

JOBS = Path(__file__).parent / "jobs"


def test_each_slice_has_its_primary_then_the_next_servers_as_backups() -> None:
    assert replicas(0, 3, 2) == [0, 1] and replicas(2, 3, 2) == [2, 0] and replicas(1, 3, 3) == [1, 2, 0]
    assert replicas(4, 5, 1) == [4]
    placement = Placement(3, slice_elements=10)
    for numel in (4, 30, 4, 4):  # a sliced key: every slice's chain starts at its own server
        for piece in placement.place(numel, 4):
            chain = replicas(piece.server, 3, 2)
            assert chain[0] == piece.server and len(set(chain)) == 2
    with pytest.raises(ValueError, match="replication=3 needs at least as many servers, but the job has 2"):
        replicas(0, 2, 3)
    with pytest.raises(ValueError, match="replication=0 must be an int >= 1"):
        replicas(0, 2, 0)
    with pytest.raises(ValueError, match=r"JobConfig.replication=0 must be an int >= 1"):
        JobConfig(replication=0)


class Killed(Exception):
    """The primary died at this step."""


class Pair:
    """A slice on a primary and one backup, in this process: the primary forwards each update as
    replica.Replicator does, and dies (raises Killed) at step `die_at` of its pushes and forwards."""

    def __init__(self, rules: Rules, die_at: int) -> None:
        self.primary, self.backup = self._shard(rules), self._shard(rules)
        self.primary.on_applied = self._forward
        self.backup.on_applied = lambda state: state.replicated(state.version)  # promoted: alone
        self.steps, self.die_at, self.alive = 0, die_at, True

    @staticmethod
    def _shard(rules: Rules) -> ShardState:
        state = ShardState("w", 0, 3, 3, [3], "float32", torch.zeros(3), rules)
        state.attach_optimizer("torch.optim.SGD", {"lr": 1.0})  # a push of -1 adds one
        return state

    def tick(self) -> None:
        self.steps += 1
        if self.alive and self.steps == self.die_at:
            self.alive = False
            raise Killed

    def _forward(self, state: ShardState) -> None:
        self.tick()  # dies before the backup has the update
        meta, tensors = state.replica()
        names = meta["state"]
        self.backup.restore(
            meta["version"],
            tensors[0].clone(),
            dict(zip(names, [t.clone() for t in tensors[1:]], strict=True)),
            {rank: Clocks(below, set(ahead)) for rank, below, ahead in meta["applied"]},
        )
        self.tick()  # dies after, before anyone is acknowledged
        state.replicated(meta["version"])

    def send(self, push: Push) -> None:
        """What a server does with a push (repeats dropped); on the primary it may die first."""
        target = self.primary if self.alive else self.backup
        if target is self.primary:
            self.tick()
        if not target.repeat(push):
            target.check(push)
            target.push(push)

    def serving(self) -> ShardState:
        return self.primary if self.alive else self.backup


def grad() -> torch.Tensor:
    return torch.full((3,), -1.0)


def run_async(seed: int, workers: int = 3, pushes: int = 6) -> tuple[int, Pair]:
    chance = random.Random(seed)
    steps = 3 * workers * pushes  # each push, then before and after its forward
    pair = Pair(Rules(Async(), frozenset(range(workers))), die_at=chance.randrange(1, steps + 1))
    order = [w for w in range(workers) for _ in range(pushes)]
    chance.shuffle(order)
    clocks, acknowledged = [0] * workers, 0
    for w in order:
        push = Push(w, clocks[w], grad())
        while True:  # the worker sends again until acknowledged (fails over once)
            try:
                pair.send(Push(push.rank, push.clock, push.grad.clone()))
                break
            except Killed:
                continue
        clocks[w] += 1
        acknowledged += 1
    return acknowledged, pair


def run_sync(seed: int, workers: int = 3, rounds: int = 5) -> tuple[int, Pair]:
    chance = random.Random(seed)
    steps = (workers + 2) * rounds  # each push, then before and after the round's forward
    pair = Pair(Rules(Sync(), frozenset(range(workers))), die_at=chance.randrange(1, steps + 1))
    acknowledged = 0
    for r in range(rounds):
        unacknowledged = list(range(workers))
        chance.shuffle(unacknowledged)
        sent: list[int] = []
        for w in unacknowledged:
            try:
                pair.send(Push(w, r, grad()))
                sent.append(w)
            except Killed:  # every push of this round is unacknowledged: all go to the backup
                for again in [*sent, w]:
                    pair.send(Push(again, r, grad()))
                sent.append(w)
        # a push is acknowledged once its round is on the backups (`durable`), never before
        assert pair.serving().ready(r + 1)
        acknowledged += len(sent)
    return acknowledged, pair


@pytest.mark.parametrize("run", [run_async, run_sync], ids=["async", "sync"])
def test_a_primary_dying_at_any_step_loses_no_acknowledged_push_and_applies_none_twice(run) -> None:
    for seed in range(40):  # the primary dies at a different step of the job each time
        acknowledged, pair = run(seed)
        assert not pair.alive
        value = pair.serving().value
        assert value.eq(acknowledged).all(), (seed, value.tolist(), acknowledged)
        assert pair.serving().durable == pair.serving().version


def test_a_backup_takes_only_newer_state_and_repeats_are_recognised() -> None:
    rules = Rules(Async(), frozenset({0, 1}))
    primary, backup = Pair._shard(rules), Pair._shard(rules)
    primary.on_applied = lambda state: state.replicated(state.version)
    primary.push(Push(0, 0, grad()))
    primary.push(Push(1, 0, grad()))
    meta, tensors = primary.replica()
    primary.push(Push(1, 2, grad()))  # clock 1 failed over and comes later
    meta, tensors = primary.replica()
    assert meta["version"] == 3 and sorted(meta["applied"]) == [[0, 1, []], [1, 1, [2]]]
    applied = {0: Clocks(1), 1: Clocks(1, {2})}
    backup.restore(3, tensors[0].clone(), dict(zip(meta["state"], tensors[1:], strict=True)), applied)
    backup.restore(1, torch.zeros(3), {}, {})  # a late, older copy changes nothing
    assert backup.version == backup.durable == 3 and backup.value.tolist() == [3.0, 3.0, 3.0]
    assert backup.repeat(Push(0, 0, grad())) and not backup.repeat(Push(0, 1, grad()))
    assert backup.repeat(Push(1, 2, grad())) and not backup.repeat(Push(1, 1, grad()))
    backup.push(Push(1, 1, grad()))
    assert backup.applied[1] == Clocks(3) and backup.value.tolist() == [4.0, 4.0, 4.0]
    sync = Pair._shard(Rules(Sync(), frozenset({0, 1})))
    sync.on_applied = lambda state: state.replicated(state.version)
    sync.push(Push(0, 0, grad()))
    assert sync.repeat(Push(0, 0, grad())) and not sync.repeat(Push(1, 0, grad()))
    assert not sync.ready(1)
    sync.push(Push(1, 0, grad()))
    assert sync.repeat(Push(1, 0, grad())) and sync.ready(1)


@pytest.mark.parametrize("mode,seed", [("sync", 3), ("async", 8)])
def test_counting_job_with_a_server_sigkilled_ends_at_exactly_the_acknowledged_pushes(
    tmp_path: Path, mode: str, seed: int
) -> None:
    outcome = run_job(
        JOBS / "replication_count.py",
        workers=2,
        servers=2,
        args=[mode, "12", str(seed), str(tmp_path)],
        server_losses=1,
        timeout_s=120,
    )
    assert "killed by signal SIGKILL; the job goes on" in outcome.stderr  # the launcher
    for rank in range(2):
        assert outcome.lines("worker", rank, "stdout") == ["count ok 24"]
