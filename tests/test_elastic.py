"""Elastic workers (issue 15, item 1): the scheduler's membership, servers' rounds over the workers
that are left, the sampler over the current members, and the digits job losing (and regaining) a
worker (the one test that starts processes). The membership tests run the scheduler in this process
and talk to it over real sockets, with plain RPC clients standing in for nodes."""

from __future__ import annotations

import queue
import re
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from paratrain import version
from paratrain.cluster.barriers import Barriers
from paratrain.cluster.config import ElasticConfig, JobConfig
from paratrain.cluster.membership import Members
from paratrain.cluster.protocol import Register
from paratrain.cluster.scheduler import Scheduler
from paratrain.cluster.spec import ClusterSpec
from paratrain.errors import RegistrationError, RemoteError
from paratrain.kvstore.consistency import Sync
from paratrain.kvstore.server.rules import Push, Rules
from paratrain.kvstore.server.server import KVServer
from paratrain.kvstore.server.shard import ShardState
from paratrain.testing import free_port, run_job
from paratrain.transport.client import RpcClient

SECRET = b"elastic-test-secret-0123456789ab"
JOB = Path(__file__).parent / "jobs" / "elastic_digits.py"
EPOCHS, LR = 8, 5e-3  # the job's defaults


class FakeNode:
    """A node as the scheduler sees it: registers, keeps the notices it gets, can vanish."""

    def __init__(self, port: int, config: JobConfig) -> None:
        self.config = config
        self.notices: queue.SimpleQueue = queue.SimpleQueue()
        self.client = RpcClient(
            "127.0.0.1", port, SECRET, on_message=lambda h, _t: self.notices.put((h.op, h.meta))
        )

    def register(self, role: str, rank: int | None, timeout_s: float = 10.0):
        meta = {"role": role, "rank": rank, "host": "127.0.0.1", "port": 1, "pid": 1}
        meta |= {"version": version.__version__, "config": self.config.as_dict()}
        meta["config_digest"] = self.config.digest()
        return self.client.request("register", meta)

    def notice(self, op: str, timeout_s: float = 10.0) -> dict:
        while True:
            got, meta = self.notices.get(timeout=timeout_s)
            if got == op:
                return meta


@pytest.fixture
def job():
    """A running scheduler of 3 workers and 1 server (min 2 workers, at most 4) and its 4 nodes."""
    config = JobConfig(elastic=ElasticConfig(min_workers=2, max_workers=4))
    port = free_port()
    spec = ClusterSpec("scheduler", 0, 3, 1, "127.0.0.1", port, SECRET)
    scheduler = Scheduler(spec, config)
    thread = threading.Thread(target=scheduler.run, daemon=True)
    thread.start()
    nodes = [FakeNode(port, config) for _ in range(4)]
    replies = [nodes[0].register("server", 0)] + [n.register("worker", r) for r, n in enumerate(nodes[1:])]
    for reply in replies:
        reply.wait(10.0)
    yield scheduler, nodes, port, config
    scheduler.abort("test over")
    for node in nodes:
        node.client.close()
    thread.join(10.0)


def test_a_dead_worker_is_dropped_and_a_joiner_takes_its_rank(job):
    scheduler, nodes, port, config = job
    server, w0, w1, w2 = nodes
    first = w0.client.call("members", {}, timeout_s=10.0).meta
    assert first == {"generation": 0, "workers": [0, 1, 2], "joiners": []}
    barrier = w0.client.request("barrier", {"group": "workers", "name": "b"})
    w2.client.request("barrier", {"group": "workers", "name": "b"})
    w1.client.close()  # worker 1 dies: the barrier completes with 0 and 2, and every node hears of it
    assert sorted(rank for rank, _ in barrier.wait(10.0).meta["data"]) == [0, 2]
    for node in (server, w0, w2):
        assert node.notice("members") == {"generation": 1, "workers": [0, 2], "joiners": []}
    assert scheduler.outcome is None
    joiner = FakeNode(port, config)
    reply = joiner.register("worker", None).wait(10.0).meta
    assert (reply["rank"], reply["joined"]) == (1, True)
    assert reply["membership"] == {"generation": 2, "workers": [0, 1, 2], "joiners": [1]}
    assert server.notice("members")["generation"] == 2
    extra = FakeNode(port, config).register("worker", None).wait(10.0).meta
    assert extra["rank"] == 3  # below max_workers=4
    with pytest.raises(RemoteError, match="outside 0..3"):
        FakeNode(port, config).register("worker", 7).wait(10.0)
    states = {(r["role"], r["rank"], r["state"]) for r in scheduler.roles()}
    assert ("worker", 1, "lost") in states and ("worker", 1, "running") in states


def test_a_joiner_asking_for_a_live_rank_waits_until_it_is_dropped(job):
    scheduler, nodes, port, config = job
    waiting = FakeNode(port, config).register("worker", 2)
    with pytest.raises(TimeoutError):
        waiting.wait(0.5)
    nodes[3].client.close()
    assert waiting.wait(10.0).meta["rank"] == 2


def test_the_job_stops_below_min_workers_naming_the_dead_worker(job):
    scheduler, nodes, _port, _config = job
    nodes[2].client.close()
    assert nodes[0].notice("members")["workers"] == [0, 2]
    nodes[3].client.close()
    reason = nodes[0].notice("abort")["reason"]
    assert "worker 2" in reason and "fewer than min_workers=2" in reason, reason
    assert scheduler.failures[0]["rank"] == 2


def _registration(role: str, rank: int | None, config: JobConfig) -> tuple[Any, Register]:
    """What Members reads of a registration: its connection and message."""
    return object(), Register(role, "h", 1, version.__version__, config.digest(), rank=rank, port=1)


class _Waiter:
    """What Barriers keeps of a request."""

    def __init__(self, rank: int) -> None:
        self.rank = rank


def test_members_give_free_ranks_and_refuse_duplicates_and_strangers():
    config = JobConfig(elastic=ElasticConfig(min_workers=1, max_workers=3))
    members = Members(ClusterSpec("scheduler", 0, 2, 1, "127.0.0.1", 1, SECRET), config)
    first = members.admit(*_registration("worker", None, config))
    assert (first.rank, members.admit(*_registration("worker", None, config)).rank) == (0, 1)
    assert members.missing() == ["server 0"]
    with pytest.raises(RegistrationError, match="worker 1 is already registered"):
        members.admit(*_registration("worker", 1, config))
    with pytest.raises(RegistrationError, match="different JobConfig"):
        members.admit(*_registration("worker", None, JobConfig()))
    assert members.free_rank(None) == 2 and members.free_rank(1) is None
    with pytest.raises(RegistrationError, match=r"rank 3 is outside 0\.\.2"):
        members.free_rank(3)
    members.drop(first)
    assert members.free_rank(None) == 0 and members.snapshot().workers == (1,)
    assert first.state(job_started=True) == "lost"


def test_a_barrier_completes_with_the_workers_left_and_replies_in_rank_order():
    config = JobConfig()
    members = Members(ClusterSpec("scheduler", 0, 3, 1, "127.0.0.1", 1, SECRET), config)
    nodes = [members.admit(*_registration("worker", r, config)) for r in (2, 0, 1)]
    barriers = Barriers()
    for node in nodes[:2]:
        barriers.arrive(("workers", "b"), _Waiter(node.rank), node, node.rank * 10)  # type: ignore[arg-type]
    assert barriers.complete(3) == [] and len(barriers.waiting()) == 2
    members.drop(nodes[2])  # worker 1 dies before it arrives: the barrier no longer waits for it
    barriers.forget(nodes[2])
    released = barriers.complete(len(members.live_workers()))
    replies: list = []
    Barriers.release(released, lambda waiter, data: replies.append((waiter.rank, data)))
    assert replies == [(2, [[0, 0], [2, 20]]), (0, [[0, 0], [2, 20]])]
    assert barriers.waiting() == []
    barriers.arrive(("all", "c"), _Waiter(2), nodes[0], None)  # type: ignore[arg-type]
    members.drop(nodes[0])  # worker 2 dies in a barrier: what it brought is taken back
    barriers.forget(nodes[0])
    assert barriers.waiting() == [] and barriers.complete(1) == []


def test_elastic_config_names_bad_values():
    with pytest.raises(ValueError, match="min_workers=0"):
        ElasticConfig(min_workers=0)
    with pytest.raises(ValueError, match="max_workers=1"):
        ElasticConfig(min_workers=2, max_workers=1)
    with pytest.raises(TypeError, match="JobConfig.elastic"):
        JobConfig(elastic=3)  # type: ignore[arg-type]


def test_the_sampler_divides_the_data_over_the_members_from_the_next_epoch():
    from paratrain.data.sampler import ShardSampler

    four = [ShardSampler(103, 4, r, seed=5, elastic=True) for r in range(4)]
    for sampler in four:
        sampler.position = 7  # mid-epoch 0: worker 3 dies now
    survivors = four[:3]
    for index, sampler in enumerate(survivors):
        sampler.reshard(3, index)
        assert (sampler.num_replicas, sampler.rank) == (4, index)  # not within the epoch
        sampler.set_epoch(1)
        assert (sampler.num_replicas, sampler.rank) == (3, index)
    shards = [set(s.shard().tolist()) for s in survivors]
    assert sum(map(len, shards)) == 103 - 103 % 3 and len(set.union(*shards)) == 103 - 103 % 3
    assert shards[0] == set(ShardSampler(103, 3, 0, seed=5).shard(1).tolist())
    fresh = ShardSampler(103, 4, 3, elastic=True, seed=5)  # a joiner, before its first epoch
    fresh.reshard(3, 2)
    assert fresh.num_replicas == 3


def test_a_sampler_state_loads_across_a_membership_change_at_an_epoch_boundary():
    from paratrain.data import ShardedLoader
    from paratrain.data.sampler import ShardSampler

    saved = ShardSampler(50, 4, 1, seed=2, elastic=True)
    saved.set_epoch(3)
    saved.position = 5
    now = ShardSampler(50, 3, 2, seed=2, elastic=True)
    now.load_state_dict(saved.state_dict())
    assert (now.epoch, now.position, now.num_replicas) == (4, 0, 3)
    saved.position = 0
    now.load_state_dict(saved.state_dict())
    assert (now.epoch, now.position) == (3, 0)
    with pytest.raises(ValueError, match="num_replicas"):  # only where asked for
        ShardSampler(50, 3, 2, seed=2).load_state_dict(saved.state_dict())
    with pytest.raises(ValueError, match="seed"):
        now.load_state_dict(saved.state_dict() | {"seed": 9})
    data = list(range(40))
    before = ShardedLoader(data, 4, num_replicas=2, rank=0, elastic=True)
    next(iter(before))
    after = ShardedLoader(data, 4, num_replicas=3, rank=1, elastic=True)
    after.load_state_dict(before.state_dict())
    assert (after.epoch, after.batches_done) == (1, 0)
    assert sorted(x for batch in after for x in batch.tolist()) == sorted(after.sampler.shard(1).tolist())


def admitted(state: ShardState, rank: int, clock: int, grad: list[float]) -> None:
    """A push as the server takes it: a joiner's clock shifted (ShardState.admit), then checked."""
    p = state.admit(Push(rank, clock, torch.tensor(grad)))
    state.check(p)
    state.push(p)


def test_a_round_completes_with_the_workers_left_and_a_joiner_counts_from_its_join():
    server = KVServer()
    server.configure({"mode": "sync", "members": [0, 1, 2], "average": True})
    state = ShardState("w", 0, 2, 2, [2], "float32", torch.zeros(2), server.rules)
    server._shards["w", 0, 2] = state
    admitted(state, 0, 0, [2.0, 4.0])
    admitted(state, 1, 0, [4.0, 8.0])
    assert state.version == 0  # waits for worker 2
    server.set_members([0, 1], [])  # worker 2 died: the round is the mean of the two pushes
    assert state.version == 1 and state.value.tolist() == [3.0, 6.0]
    admitted(state, 0, 1, [1.0, 1.0])
    server.set_members([0, 1, 2], [2])  # a new worker 2 joined the job: not in rounds yet
    admitted(state, 1, 1, [3.0, 3.0])
    assert state.version == 2 and state.value.tolist() == [2.0, 2.0]
    server._join(2)  # at an epoch's start: every round from version 2 on waits for it
    admitted(state, 0, 2, [1.0, 1.0])
    admitted(state, 1, 2, [1.0, 1.0])
    assert state.version == 2 and state.waiting(3)["missing"] == [2]
    admitted(state, 2, 0, [4.0, 4.0])  # its clock 0 is round 2
    assert state.version == 3 and state.value.tolist() == [2.0, 2.0]
    assert state.pull_version(2, 1) == 3 and state.pull_version(0, 3) == 3
    server.set_members([0, 1], [])  # the joiner died too: its shift goes, rounds go on without it
    assert state.offsets == {} and state.waits_for() == {0, 1}


def test_a_joiner_with_a_dead_workers_rank_skips_the_rounds_its_predecessor_pushed():
    rules = Rules(Sync(), frozenset({0, 1}))
    state = ShardState("w", 0, 2, 2, [2], "float32", torch.zeros(2), rules)
    admitted(state, 1, 0, [1.0, 1.0])  # worker 1's last push, then it dies
    rules.members, rules.joiners = frozenset({0}), frozenset({1})  # ... and a new worker 1 joins
    admitted(state, 1, 0, [5.0, 5.0])  # its first push: round 0 already has worker 1's
    admitted(state, 0, 0, [1.0, 1.0])
    assert state.version == 1 and state.value.tolist() == [2.0, 2.0]
    assert state.offsets == {1: 1} and 1 in state.rounds[1].pushed


def digits_reference(workers: int = 4) -> float:
    """The test accuracy of the job without failures, in this process (digits_cnn.py)."""
    sys.path.insert(0, str(JOB.parent))
    try:
        from digits_cnn import make_model, sync_reference_accuracy  # tests/jobs/: the job's model
    finally:
        sys.path.remove(str(JOB.parent))
    return sync_reference_accuracy(make_model(), LR, EPOCHS, workers)


@pytest.mark.timeout(420)
def test_the_digits_job_loses_a_worker_and_a_restarted_one_joins_without_losing_accuracy():
    # Worker 2 is SIGKILLed mid-epoch 1 and restarted (--max-restarts 1): its replacement joins at
    # epoch 3 (the others wait for it to register there). Worker 3 is SIGKILLed mid-epoch 4 and
    # not restarted (no restarts left). One job shows both a drop and a join.
    args = ["--kill", "2:1", "--kill", "3:4", "--join-by", "3"]
    outcome = run_job(JOB, workers=4, servers=1, args=args, max_restarts=1, timeout_s=400, exit_grace_s=60)
    results = {}
    for rank in (0, 1, 2):
        line = next(t for t in outcome.lines("worker", rank, "stdout") if "test accuracy" in t)
        found = re.search(r"test accuracy ([0-9.]+) epochs \[([0-9, ]*)\] joined (\w+)", line)
        results[rank] = (float(found[1]), found[2], found[3])
    assert results[2][1:] == ("3, 4, 5, 6, 7", "True"), results  # the replacement's epochs
    assert results[0][1:] == (", ".join(map(str, range(EPOCHS))), "False"), results
    assert "worker 2" in outcome.stderr and "(restart 1 of 1)" in outcome.stderr
    assert "worker 3" in outcome.stderr and "(not restarted: all 1 used)" in outcome.stderr
    reference = digits_reference()
    for accuracy, _, _ in results.values():
        assert abs(accuracy - reference) <= 0.01, (results, reference)
