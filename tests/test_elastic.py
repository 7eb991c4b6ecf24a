"""Elastic workers (issue 15, item 1): the scheduler's membership, servers' rounds over the workers
that are left, the sampler over the current members, and the digits job losing (and regaining) a
worker. The membership tests run the scheduler in this process and talk to it over real sockets
with plain RPC clients standing in for nodes; no process is started."""

from __future__ import annotations

import queue
import threading

import pytest

from paratrain import version
from paratrain.cluster.config import ElasticConfig, JobConfig
from paratrain.cluster.scheduler import Scheduler
from paratrain.cluster.spec import ClusterSpec
from paratrain.errors import RemoteError
from paratrain.testing import free_port
from paratrain.transport.rpc import RpcClient

SECRET = b"elastic-test-secret-0123456789ab"


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
