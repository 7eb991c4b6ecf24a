"""Replicated servers (JobConfig.replication; kvstore/server/replica.py): placement as a pure
function, the shard state's dedupe and replication without processes (many seeds), and the counting
job: servers SIGKILLed at random moments, every key ends at exactly the acknowledged pushes."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest
import torch

from paratrain.cluster.config import JobConfig
from paratrain.kvstore import protocol
from paratrain.kvstore.api import KVError
from paratrain.kvstore.consistency import Async, Sync
from paratrain.kvstore.placement import Placement, replicas
from paratrain.kvstore.server import mirror
from paratrain.kvstore.server.mirror import Batch, Mirrors
from paratrain.kvstore.server.rejoin import install, installation
from paratrain.kvstore.server.replica import Replicator
from paratrain.kvstore.server.rules import Clocks, Push, Rules
from paratrain.kvstore.server.server import KVServer
from paratrain.kvstore.server.shard import ShardState
from paratrain.kvstore.worker.failover import Payload, Servers
from paratrain.testing import run_job
from paratrain.transport.client import Future, Reply
from paratrain.transport.config import TransportConfig
from paratrain.transport.frame import Header
from paratrain.transport.rpc import Request

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
        meta, tensors = replica_meta(state)
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


def replica_meta(shard: ShardState) -> tuple[dict, list[torch.Tensor]]:
    """A slice's `replicate` frame as its backup reads it: the map and the tensors."""
    copy, tensors = shard.replica()
    return copy.to_meta(), tensors


def test_a_backup_takes_only_newer_state_and_repeats_are_recognised() -> None:
    rules = Rules(Async(), frozenset({0, 1}))
    primary, backup = Pair._shard(rules), Pair._shard(rules)
    primary.on_applied = lambda state: state.replicated(state.version)
    primary.push(Push(0, 0, grad()))
    primary.push(Push(1, 0, grad()))
    meta, tensors = replica_meta(primary)
    primary.push(Push(1, 2, grad()))  # clock 1 failed over and comes later
    meta, tensors = replica_meta(primary)
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


def test_an_async_copy_never_carries_a_clock_without_its_update() -> None:
    """The interleaving that lost one acknowledged push in CI: two async pushes wait while a pull
    reply reads the value; the update applied first is copied to the backup, and the primary dies
    before the second one's copy. That copy must not list the second push's clock without its
    update, or the push, sent again to the backup, is dropped there as a repeat and lost."""
    rules = Rules(Async(), frozenset({0, 1}))
    primary, backup = Pair._shard(rules), Pair._shard(rules)
    copies: list[tuple[dict, list[torch.Tensor]]] = []

    def forward(state: ShardState) -> None:
        meta, tensors = replica_meta(state)
        copies.append((meta, [t.clone() for t in tensors]))
        state.replicated(state.version)

    primary.on_applied = forward
    primary.begin_read()  # a pull's reply is being sent from the value
    pushes = [Push(0, 0, grad()), Push(1, 0, grad())]
    threads = [threading.Thread(target=primary.push, args=(push,)) for push in pushes]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 10
    while len(primary.cond._waiters) < 2 and time.monotonic() < deadline:  # type: ignore[attr-defined]
        time.sleep(0.001)  # both pushes wait for the reader
    primary.end_read()
    for thread in threads:
        thread.join(10)
    assert primary.value.tolist() == [2.0] * 3 and len(copies) == 2
    meta, tensors = copies[0]  # the backup got the first copy only: the primary died then
    applied = {rank: Clocks(below, set(ahead)) for rank, below, ahead in meta["applied"]}
    backup.restore(meta["version"], tensors[0], {}, applied)
    for push in pushes:  # neither was acknowledged: both are sent again to the backup
        if not backup.repeat(push):
            backup.push(Push(push.rank, push.clock, grad()))
    assert backup.value.tolist() == [2.0] * 3, backup.value.tolist()


def frame(op: str, meta: dict, tensors: list[torch.Tensor]) -> Request:
    """A request as a server's read loop hands it over (id 0: its replies go nowhere)."""
    return Request(None, Header(op, meta=meta), tensors)  # type: ignore[arg-type]


def test_a_restarted_server_installs_the_state_then_takes_updates_and_serves_alone() -> None:
    """The catch-up without processes: a live server's slice, with momentum (optimizer state) and
    async clocks, is installed on a fresh server, which then takes forwarded updates in order,
    drops an update of a slice not installed yet while catching up, and, once the live one died,
    serves alone: nothing acknowledged lost, nothing applied twice."""
    live, restarted = KVServer(0), KVServer(1)
    for server in (live, restarted):
        server.configure({"mode": "async", "members": [0, 1], "replication": 2, "servers": [["h", 1]] * 2})
    live.set_optimizer("torch.optim.SGD", {"lr": 1.0, "momentum": 0.5})
    live.set_hyper(["w"], {"lr": 0.5})  # the key's own (its group's, its LR schedule's), before it exists
    live.replicator.dead.add(1)  # server 1 is dead: its forwards are skipped
    meta = {"key": "w", "start": 0, "stop": 3, "numel": 3, "shape": [3], "dtype": "float32", "chain": [1, 0]}
    shard = live.adopt(meta)
    for clock in range(3):
        shard.push(Push(0, clock, grad()))
    shard.push(Push(1, 1, grad()))  # worker 1's clock 0 is still to come
    restarted.replicator.catching_up = True
    other = dict(meta, key="v")
    restarted._replicate(
        frame("replicate", other | {"version": 9, "applied": [], "state": []}, [torch.ones(3)])
    )
    assert restarted.shard_list() == []  # dropped: not installed yet
    with shard.cond:
        installing, tensors = installation(shard, live.optimizer_of("w"))
    install(restarted, frame("install", installing.to_meta(), [t.clone() for t in tensors]))
    copy = restarted.shard_list()[0]
    assert copy.chain == [1, 0] and copy.version == shard.version == 4
    assert copy.optimizer.param_groups[0]["lr"] == shard.optimizer.param_groups[0]["lr"] == 0.5
    assert torch.equal(copy.value, shard.value) and copy.applied == shard.applied
    assert torch.equal(
        copy.optimizer.state[copy.param]["momentum_buffer"],
        shard.optimizer.state[shard.param]["momentum_buffer"],
    )
    shard.push(Push(1, 0, grad()))  # forwarded in order after the install
    forward_meta, tensors = replica_meta(shard)
    restarted._replicate(frame("replicate", forward_meta, [t.clone() for t in tensors]))
    restarted.replicator.catching_up = False
    with pytest.raises(KVError, match="not on server 1"):
        restarted._replicate(
            frame("replicate", other | {"version": 9, "applied": [], "state": []}, [torch.ones(3)])
        )
    restarted.replicator.dead.add(0)  # the live one died: the restarted copy serves alone
    for push in (Push(1, 0, grad()), Push(0, 2, grad()), Push(0, 3, grad())):  # two repeats, one new
        if not copy.repeat(push):
            copy.push(push)
    reference = KVServer(2)
    reference.configure({"mode": "async", "members": [0, 1]})
    reference.set_optimizer("torch.optim.SGD", {"lr": 1.0, "momentum": 0.5})
    reference.set_hyper(["w"], {"lr": 0.5})
    alone = reference.adopt(meta)
    for rank, clock in ((0, 0), (0, 1), (0, 2), (1, 1), (1, 0), (0, 3)):
        alone.push(Push(rank, clock, grad()))
    assert copy.version == 6 and torch.equal(copy.value, alone.value), (copy.value, alone.value)
    late = forward_meta | {"sender": 0, "version": 6}  # sent by server 0 just before it died
    restarted._replicate(frame("replicate", late, [torch.zeros(3)]))
    assert torch.equal(copy.value, alone.value)  # dropped: taking it would lose the pushes above


class FakeClient:
    """A server connection that records requests; their futures are answered by hand."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict, Future]] = []
        self.carried: list[tuple[object, object]] = []  # (tensors, out) of each request

    def request(self, op: str, meta: dict, tensors: object = (), out: object = None) -> Future:
        future = Future(op, None)
        self.sent.append((op, meta, future))
        self.carried.append((tensors, out))
        return future


def test_a_request_that_used_the_primarys_shared_memory_fails_over_with_its_payload() -> None:
    """A same-host primary keeps its slices in shared memory: the worker added its push there and
    would read the pulled value there. Sent again to the backup, the request carries the push and
    takes the value in the reply; the Handle no longer reads this frame from the dead primary."""
    clients = [FakeClient() for _ in range(2)]
    servers = Servers(clients, 2)  # type: ignore[arg-type]
    push, dest = torch.ones(3), torch.empty(3)
    reads = [("primary's region", dest), ("another frame's region", torch.empty(3))]
    meta = {"keys": ["w"], "clocks": [0]}
    payload = Payload(dict(meta), [push], [dest], reads, reads[:1])
    assert servers.in_place(0)
    handle = servers.request(0, "pushpull", meta | {"added": [True], "read": [True]}, (), [], payload)
    assert clients[0].sent[0][1]["added"] == [True] and clients[0].carried[0] == ((), [])
    servers.lost(0, "killed")
    servers.fail_over(0)
    assert not servers.in_place(0)
    assert clients[1].sent[0][1] == meta | {"dead": [0]} and clients[1].carried[0] == ([push], [dest])
    assert [name for name, _ in reads] == ["another frame's region"]
    clients[1].sent[0][2]._set(Reply({}, []), None)
    assert handle.wait(1).meta == {}


def test_requests_fail_over_as_soon_as_their_server_dies_not_when_waited_for() -> None:
    """After a first fail-over one server serves two chains; when it dies too, both of a worker's
    requests to it go to the next copies at once (waiting on one would deadlock a sync round whose
    other pushes wait behind the other)."""
    clients = [FakeClient() for _ in range(3)]
    servers = Servers(clients, 3)  # type: ignore[arg-type]
    servers.lost(1, "killed")
    first, second = servers.request(1, "push", {"n": 1}), servers.request(0, "push", {"n": 2})
    answered = servers.request(0, "push", {"n": 3})
    assert [meta["n"] for _, meta, _ in clients[0].sent] == [2, 3] and len(clients[2].sent) == 1
    clients[0].sent[1][2]._set(Reply({}, []), None)  # n=3 was answered before server 0 died
    servers.lost(0, "killed")
    servers.fail_over(0)
    assert [meta["n"] for _, meta, _ in clients[2].sent] == [1, 2]
    assert clients[2].sent[1][1]["dead"] == [0, 1]
    clients[2].sent[1][2]._set(Reply({"ok": 1}, []), None)
    assert second.wait(1).meta == {"ok": 1} and answered.wait(1).meta == {} and not first.done()


def test_rejoined_servers_come_last_and_an_older_list_of_the_dead_does_not_kill_them_again() -> None:
    servers = Servers([None] * 3, 2)  # type: ignore[list-item]
    servers.lost(0, "killed")
    assert servers.order(0) == [1] and servers.serving(2) == 2
    servers.back(0, None)  # type: ignore[arg-type]
    assert servers.order(0) == [1, 0] and servers.order(2) == [2, 0] and servers.serving(0) == 1
    servers.lost(1, "killed")
    assert servers.serving(0) == 0  # every other copy dead: the rejoined one serves
    replicator = Replicator(1, b"")
    replicator.configure(2, [["h", 1], ["h", 2], ["h", 3]])
    replicator.mark_dead([0])
    assert not replicator.serves([2, 0], without=2) and replicator.serves([0, 1], without=2)
    replicator.rejoined(0, ("h", 4))
    assert replicator.address(0) == ("h", 4) and 0 not in replicator.dead
    replicator.mark_dead([0])  # a worker's list from before the rejoin
    assert 0 not in replicator.dead and replicator.others() == [0, 2]
    replicator._lost(0, None, client=object())  # type: ignore[arg-type]  # its earlier process's link
    assert 0 not in replicator.dead
    replicator._lost(0, None)  # this server's own loss of it counts
    assert 0 in replicator.dead and 0 not in replicator.back


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "mode,servers,seed,sums", [("sync", 2, 5, True), ("sync", 2, 3, False), ("async", 3, 2, False)]
)
def test_a_restarted_server_catches_up_and_the_job_survives_another_death(
    tmp_path: Path, mode: str, servers: int, seed: int, sums: bool
) -> None:
    """A server is SIGKILLed and restarted; once it caught up ANOTHER server dies: with r=2 the
    job survives that only if the restarted one holds every acknowledged update. With `sums` the
    rounds' sums are the values (no server optimizer), which same-host backups take in their
    primary's memory (mirror.py, lending); otherwise a server SGD runs, whose value and state go
    through the backup's own buffers."""
    outcome = run_job(
        JOBS / "replication_count.py",
        workers=2,
        servers=servers,
        args=[mode, "10", str(seed), str(tmp_path), "rejoin", *(["sums"] if sums else [])],
        server_losses=1,
        max_restarts=1,
        timeout_s=200,
    )
    assert "killed by signal SIGKILL; the job goes on (restart 1 of 1)" in outcome.stderr
    assert "killed by signal SIGKILL; the job goes on (not restarted: all 1 used)" in outcome.stderr
    counts = [outcome.lines("worker", rank, "stdout") for rank in range(2)]
    assert counts[0] == counts[1] and counts[0][0].startswith("count ok "), counts


class Loopback:
    """A same-host backup's connection, answered in this process: `mirror` and `borrow` at once,
    `replicate` frames taken by the backup at once and acknowledged by hand."""

    config = TransportConfig()

    def __init__(self, backup: KVServer) -> None:
        self.backup, self.sent, self.unanswered = backup, [], []

    def call(self, op: str, meta: dict, timeout_s: float | None = None) -> Reply:
        if op == "borrow":
            return Reply(self.backup.replicator.borrowed.check(meta["arena"]))
        assert op == "mirror"
        return Reply(mirror.offer(self.backup, meta))

    def request(self, op: str, meta: dict, tensors: list) -> Future:
        self.sent.append((meta, list(tensors)))
        reply = self.backup._replicate(frame(op, meta, list(tensors)))
        future = Future(op, None)
        self.unanswered.append((future, reply))
        return future

    def answer(self) -> None:
        for future, reply in self.unanswered:
            future._set(Reply(reply), None)
        self.unanswered = []

    def close(self) -> None:
        pass


def test_a_same_host_backup_takes_values_through_its_buffers_and_never_holds_the_one_written() -> None:
    """mirror.py: the value goes into the buffer the backup does not hold, the frame carries no
    value; while the last frame is unanswered a copy goes in the frame; a primary that dies while
    writing leaves the backup's value whole; the backup never pools its buffers."""
    primary, backup = KVServer(0), KVServer(1)
    for server in (primary, backup):
        server.configure({"mode": "sync", "members": [0], "replication": 2, "servers": [["h", 1]] * 2})
    meta = {"key": "w", "start": 0, "stop": 3, "numel": 3, "shape": [3], "dtype": "float32", "chain": [0, 1]}
    shard, copy = primary.adopt(meta), backup.adopt(meta)
    mirrors, link = Mirrors(0), Loopback(backup)

    def forward(value: float) -> Future:
        shard.value.fill_(value)
        shard.version += 1
        return mirrors.send(1, link, shard, *shard.replica(sender=0))

    first = forward(1.0)
    assert link.sent[-1][0]["buffer"] == 0 and link.sent[-1][1] == []  # no value in the frame
    assert copy.value.data_ptr() == copy.mirror.buffers[0].data_ptr() and copy.value.eq(1).all()
    second = forward(2.0)  # the first is unanswered: its buffer is not surely free
    assert "buffer" not in link.sent[-1][0] and len(link.sent[-1][1]) == 1
    assert copy.value.eq(2).all() and copy.version == 2
    for future in (first, second):
        future._set(Reply({}), None)
    forward(3.0)._set(Reply({}), None)
    assert link.sent[-1][0]["buffer"] == 1 and copy.value.data_ptr() == copy.mirror.buffers[1].data_ptr()
    buffers = {b.data_ptr() for b in copy.mirror.buffers}
    assert not any(b.data_ptr() in buffers for b in copy.pool)  # the TCP copy's buffer went, not 0
    copy.mirror.buffers[link_free(mirrors)].fill_(float("nan"))  # the primary dies mid-copy
    assert copy.value.eq(3).all() and copy.version == 3
    backup.replicator.dead.add(0)  # the backup takes over: a round's sum becomes its value
    copy.push(Push(0, 3, torch.full((3,), 5.0)))
    assert copy.value.eq(5).all() and not any(b.data_ptr() in buffers for b in copy.pool)
    mirrors.close()


def test_a_same_host_backup_takes_the_optimizer_state_through_its_buffers_too() -> None:
    primary, backup = KVServer(0), KVServer(1)
    for server in (primary, backup):
        server.configure({"mode": "async", "members": [0], "replication": 2, "servers": [["h", 1]] * 2})
        server.set_optimizer("torch.optim.SGD", {"lr": 1.0, "momentum": 0.5})
    meta = {"key": "m", "start": 0, "stop": 3, "numel": 3, "shape": [3], "dtype": "float32", "chain": [0, 1]}
    shard, copy = primary.adopt(meta), backup.adopt(meta)
    primary.replicator.dead.add(1)  # its own forwards skip server 1: they go through `mirrors` here
    mirrors, link = Mirrors(0), Loopback(backup)
    for clock in range(3):
        shard.push(Push(0, clock, torch.arange(3.0)))
        mirrors.send(1, link, shard, *shard.replica(sender=0))._set(Reply({}), None)
        assert link.sent[-1][0]["mirrored"] == ["momentum_buffer"] and link.sent[-1][1] == []
        assert torch.equal(copy.value, shard.value) and copy.version == shard.version == clock + 1
        momentum = [s.optimizer.state[s.param]["momentum_buffer"] for s in (shard, copy)]
        assert torch.equal(*momentum) and copy.applied == shard.applied
    mirrors.close()


def link_free(mirrors: Mirrors) -> int:
    (only,) = mirrors._links.values()
    free = only.free()
    assert free is not None and free != only.held
    return free


def test_a_same_host_backup_holds_the_primarys_own_buffer_which_no_round_writes_until_given_back() -> None:
    """mirror.py, lending: a round's sum is the value and the backup's, in the primary's memory (no
    copy); the buffers a backup holds or is sent open for no round; a round without a free buffer
    waits until the backup answers; a backup that takes over makes the value its own."""
    primary, backup = KVServer(0), KVServer(1)
    for server in (primary, backup):
        server.configure({"mode": "sync", "members": [0], "replication": 2, "servers": [["h", 1]] * 2})
    meta = {"key": "w", "start": 0, "stop": 3, "numel": 3, "shape": [3], "dtype": "float32", "chain": [0, 1]}
    shard, copy = primary.adopt(meta), backup.adopt(meta)
    shard.share(primary.arena().region(3, torch.float32, 3))  # a value and two round buffers
    mirrors, link = Mirrors(0), Loopback(backup)
    shard.on_applied = lambda s: mirrors.send(1, link, s, *s.replica(sender=0))
    region = shard.region

    def round_(clock: int, value: float) -> None:
        shard.push(Push(0, clock, torch.full((3,), value)))

    round_(0, 1.0)
    assert "lent" in link.sent[-1][0] and link.sent[-1][1] == []  # the frame carries no value
    assert copy.value.eq(1).all() and copy.holding() == shard.value_buffer == 1
    round_(1, 2.0)  # unanswered: the backup may hold either of the last two values
    assert shard.lent == {1, 2} and set(shard.opened.values()) == {0}
    round_(2, 3.0)  # every buffer is the value or lent: round 3 waits for one
    assert shard.lent == {0, 1, 2} and not shard.opened
    later = threading.Thread(target=round_, args=(3, 4.0))
    later.start()
    later.join(0.2)
    assert later.is_alive() and shard.version == 3 and copy.value.eq(3).all()
    link.answer()
    mirrors.release(shard)  # buffers 1 and 2 given back: round 3's payload moves into one
    later.join(10)
    assert shard.version == 4 and shard.value_buffer == 1 and copy.value.eq(4).all()
    assert shard.lent == {0, 1} and set(shard.opened.values()) == {2}
    link.answer()
    mirrors.release(shard)
    assert shard.lent == {1} and set(shard.opened.values()) == {0, 2}
    round_(4, 5.0)  # the primary dies after its round's sum, during the next one
    assert copy.holding() == shard.value_buffer == 2
    region.buffers[0].fill_(float("nan"))
    assert copy.value.eq(5).all() and copy.version == 5
    lent = copy.value
    backup.replicator.mark_dead([0])  # the backup takes over: the value becomes its own
    assert copy.holding() is None and copy.value.eq(5).all()
    copy.push(Push(0, 5, torch.full((3,), 6.0)))
    assert copy.value.eq(6).all() and not any(b.data_ptr() == lent.data_ptr() for b in copy.pool)
    mirrors.close()
    backup.replicator.close()


def test_a_backup_that_cannot_map_the_primarys_memory_gets_copies_instead_of_loans(monkeypatch) -> None:
    """mirror.py: a same-host backup that cannot map its primary's arena (another PID or IPC
    namespace) is lent nothing; it takes the values through its own buffers, as with a server
    optimizer, and goes on as a live backup."""
    primary, backup = KVServer(0), KVServer(1)
    for server in (primary, backup):
        server.configure({"mode": "sync", "members": [0], "replication": 2, "servers": [["h", 1]] * 2})
    meta = {"key": "w", "start": 0, "stop": 3, "numel": 3, "shape": [3], "dtype": "float32", "chain": [0, 1]}
    shard, copy = primary.adopt(meta), backup.adopt(meta)
    shard.share(primary.arena().region(3, torch.float32, 3))
    hidden, opens = primary.arena().describe(), mirror.ArenaMap.open

    def open_unless_hidden(described: list) -> mirror.ArenaMap:
        if list(described) == list(hidden):
            raise OSError(f"no process {hidden[0]} here")
        return opens(described)

    monkeypatch.setattr(mirror.ArenaMap, "open", staticmethod(open_unless_hidden))
    mirrors, link = Mirrors(0), Loopback(backup)
    shard.on_applied = lambda s: mirrors.send(1, link, s, *s.replica(sender=0))
    for clock in range(3):
        shard.push(Push(0, clock, torch.full((3,), clock + 1.0)))
        assert "lent" not in link.sent[-1][0] and copy.value.eq(clock + 1).all()
        assert copy.holding() is None and shard.lent == frozenset()
        link.answer()
    assert mirrors._borrowers == {1: False} and "buffer" in link.sent[0][0]  # through its buffers
    assert 1 not in primary.replicator.dead
    mirrors.close()


def test_the_lent_slices_of_one_push_go_to_a_backup_in_one_frame_answered_per_slice() -> None:
    primary, backup = KVServer(0), KVServer(1)
    for server in (primary, backup):
        server.configure({"mode": "sync", "members": [0], "replication": 2, "servers": [["h", 1]] * 2})
    pairs = []
    for key in ("a", "b"):
        meta = {"key": key, "start": 0, "stop": 4, "numel": 4, "shape": [4], "dtype": "float32"}
        meta["chain"] = [0, 1]
        shard = primary.adopt(meta)
        shard.share(primary.arena().region(4, torch.float32, 3))
        pairs.append((shard, backup.adopt(meta)))
    primary.replicator.dead.add(1)  # its own forwards skip server 1: they go through `mirrors` here
    batch, mirrors = Batch(), Mirrors(0)
    for i, (shard, _) in enumerate(pairs):
        shard.push(Push(0, 0, torch.full((4,), i + 1.0)))
        parts = mirrors.defer(1, shard, shard.replica()[0], batch)
        assert shard.lent == {shard.value_buffer} and not parts.done()  # lent before it is sent
    ((metas, parts_sent),) = batch.frames.values()
    reply = backup._replicate(frame("replicate", {"sender": 0, "slices": metas}, []))
    assert len(reply["holds"]) == 2 and [h[2] for h in reply["holds"]] == [1, 1]
    whole = Future("replicate", None)
    whole._set(Reply(reply), None)
    for part in parts_sent:
        part.whole = whole
    for i, (shard, copy) in enumerate(pairs):
        mirrors.release(shard)
        assert copy.value.eq(i + 1).all() and copy.version == 1 and shard.lent == {1}
    mirrors.close()
    backup.replicator.close()


def test_a_push_in_several_frames_sends_its_lent_slices_to_a_backup_together() -> None:
    """outbox.py: a push frame that says more of its push follows holds back the slices it
    completed (lent already, not durable); the push's last frame sends them all in one frame; a
    slice held for a worker that never sends its last frame goes after HOLD_S."""
    primary, backup = KVServer(0), KVServer(1)
    for server in (primary, backup):
        server.configure({"mode": "sync", "members": [0], "replication": 2, "servers": [["h", 1]] * 2})
    link = Loopback(backup)
    primary.replicator._clients[1] = link  # type: ignore[assignment]
    shards = {}
    for key in ("a", "b", "c"):
        meta = {"key": key, "start": 0, "stop": 4, "numel": 4, "shape": [4], "dtype": "float32"}
        meta["chain"] = [0, 1]
        shards[key] = primary.adopt(meta)
        shards[key].share(primary.arena().region(4, torch.float32, 3))
        backup.adopt(meta)

    def push(key: str, clock: int, more: bool) -> None:
        meta = {"rank": 0, "keys": [key], "starts": [0], "stops": [4], "clocks": [clock]}
        meta |= {"more": True} if more else {}
        primary._push(frame("push", meta, [torch.ones(4)]), protocol.Push.from_meta(meta))

    def answered(count: int) -> None:
        deadline = time.monotonic() + 10
        while len(link.sent) < count and time.monotonic() < deadline:
            time.sleep(0.001)
        link.answer()

    push("a", 0, more=True)
    push("b", 0, more=True)
    assert link.sent == [] and shards["a"].version == 1 and shards["a"].lent == {1}
    push("c", 0, more=False)
    assert [[part["key"] for part in meta["slices"]] for meta, _ in link.sent] == [["a", "b", "c"]]
    answered(1)
    push("a", 1, more=True)  # the worker dies before its next frame
    answered(2)
    assert [part["key"] for part in link.sent[1][0]["slices"]] == ["a"]
    deadline = time.monotonic() + 10
    while shards["a"].durable < 2 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert [s.durable for s in shards.values()] == [2, 1, 1]
    primary.replicator.close()
    backup.replicator.close()


def test_a_worker_that_leaves_or_dies_part_way_through_a_push_holds_no_slice_back() -> None:
    server = KVServer(0)
    server.configure({"mode": "sync", "members": [0, 1, 2], "replication": 2, "servers": [["h", 1]] * 2})
    for rank in (0, 1, 2):
        server.arrivals.pushed(rank, more=True)
    server.arrivals.pushed(2, more=False)  # its last frame came
    server._leave(0)
    assert server.arrivals.more()  # worker 1 is still part way through its push
    server.set_members([0, 2], [])  # worker 1 died
    assert not server.arrivals.more()
    server.replicator.close()
