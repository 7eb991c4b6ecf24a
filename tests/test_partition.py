"""Network partitions (issue 15, item 3): a host whose link goes down is dropped within the heartbeat
timeout and the job goes on without it (elastic workers, replicated servers); when the link comes
back, the process behind it, alive all along, is fenced: it exits saying it was dropped, and what
it sends late is refused. The decision logic is tested without processes first; one job on
simulated hosts (root and `ip netns`, as in CI) shows both cuts end to end."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from test_elastic import SECRET, FakeNode

from paratrain.cluster.config import ElasticConfig, JobConfig
from paratrain.cluster.fencing import DROPPED, dropped_message, dropped_notice
from paratrain.cluster.protocol import Dropped
from paratrain.cluster.scheduler import Scheduler
from paratrain.cluster.spec import ClusterSpec
from paratrain.kvstore.api import KVError
from paratrain.kvstore.server.fence import Fence
from paratrain.kvstore.server.server import KVServer
from paratrain.testing import SimulatedHosts, free_port, hosts_unavailable, run_job

JOB = Path(__file__).parent / "jobs" / "partition_count.py"


# -- without processes -----------------------------------------------------------------------------
def test_a_dropped_workers_connections_are_refused_and_a_replacement_of_its_rank_is_not():
    fence = Fence(0)
    old, other, replacement = object(), object(), object()
    fence.check_push(old, 2)
    fence.check_push(other, 1)
    fence.drop([2])
    with pytest.raises(KVError, match=re.escape(f"server 0 refuses this push: worker 2 {DROPPED}")):
        fence.check_push(old, 2)
    fence.check_push(other, 1)  # the others push on
    fence.check_push(replacement, 2)  # the rank's next worker connects anew
    fence.drop([1])
    with pytest.raises(KVError, match="worker 1"):
        fence.check_push(other, 1)
    fence.check_push(replacement, 2)


def test_copies_from_a_lost_server_are_refused_and_others_taken():
    fence = Fence(0)
    fence.check_replicate(1, dead=set())
    fence.check_replicate(None, dead={1})  # a copy that names no sender (an older peer): taken
    with pytest.raises(KVError, match=re.escape(f"server 0 refuses this copy: server 1 {DROPPED}")):
        fence.check_replicate(1, dead={1})


def test_a_dropped_node_says_its_role_rank_and_why():
    assert dropped_message("worker", 2) == f"worker 2 {DROPPED}"
    said = dropped_notice(Dropped("server", 1, "sent no heartbeat for 3.1 s"))
    assert said.startswith(f"server 1 {DROPPED} (sent no heartbeat for 3.1 s); ")
    assert "rather than rejoin" in said


class FakeRequest:
    """What KVServer.handle reads of a request, and the failure it answers."""

    def __init__(self, op: str, meta: dict, conn: object) -> None:
        self.op, self.meta, self.conn, self.tensors = op, meta, conn, []
        self.failed: list[str] = []

    def fail(self, message: str) -> None:
        self.failed.append(message)


def test_a_server_refuses_pushes_over_a_dropped_workers_connection_and_copies_from_a_lost_server():
    server = KVServer(rank=0)
    server.configure({"mode": "sync", "members": [0, 1, 2]})
    conns = {rank: object() for rank in range(3)}
    for rank, conn in conns.items():
        server.fence.check_push(conn, rank)  # what each worker's first push records
    server.set_members([0, 1], [])  # worker 2 dropped (it may be alive behind a partition)
    push = {"rank": 2, "keys": ["w"], "starts": [0], "stops": [2], "clocks": [0]}
    late = FakeRequest("push", push, conns[2])
    server.handle(late)
    refused = f"server 0: server 0 refuses this push: worker 2 {DROPPED}, and the rounds went on without it"
    assert len(late.failed) == 1 and late.failed[0].startswith(refused), late.failed  # then the docs link
    sparse = FakeRequest("sparse_push", {"rank": 2, "key": "emb", "clock": 0}, conns[2])
    server.handle(sparse)
    assert sparse.failed and f"worker 2 {DROPPED}" in sparse.failed[0], sparse.failed
    server.replicator.mark_dead([1])  # the scheduler lost server 1: a copy from it comes late
    copy = FakeRequest("replicate", {"sender": 1, "key": "w", "start": 0, "stop": 2}, object())
    server.handle(copy)
    assert copy.failed and f"server 1 {DROPPED}" in copy.failed[0], copy.failed
    server.close()


@pytest.fixture
def partitioned_job():
    """A running elastic scheduler (min 2 workers) with replication 2: 2 servers, 3 workers."""
    config = JobConfig(elastic=ElasticConfig(min_workers=2), replication=2)
    port = free_port()
    scheduler = Scheduler(ClusterSpec("scheduler", 0, 3, 2, "127.0.0.1", port, SECRET), config)
    thread = threading.Thread(target=scheduler.run, daemon=True)
    thread.start()
    nodes = {("server", r): FakeNode(port, config) for r in range(2)}
    nodes |= {("worker", r): FakeNode(port, config) for r in range(3)}
    for reply in [node.register(role, rank) for (role, rank), node in nodes.items()]:
        reply.wait(10.0)
    yield scheduler, nodes
    scheduler.abort("test over")
    for node in nodes.values():
        node.client.close()
    thread.join(10.0)


def node_of(scheduler: Scheduler, role: str, rank: int):
    return scheduler.members.nodes[role, rank]


def test_the_scheduler_tells_whom_it_went_on_without_and_says_it_again_at_each_later_heartbeat(
    partitioned_job,
):
    scheduler, nodes = partitioned_job
    # what the monitor does when worker 2's heartbeats stop (its connection stays open: cut off)
    scheduler._failed(node_of(scheduler, "worker", 2), "worker 2 sent no heartbeat for 3.0 s")
    cut = nodes["worker", 2]
    assert cut.notice("dropped") == {
        "role": "worker",
        "rank": 2,
        "reason": "worker 2 sent no heartbeat for 3.0 s",
    }
    cut.client.send("heartbeat", {})  # its link is back: it hears it again
    assert cut.notice("dropped")["rank"] == 2
    assert nodes["worker", 0].notice("members")["workers"] == [0, 1]
    # server 1's heartbeats stop: the job goes on (replication 2); every other node hears of it
    assert scheduler._survivable(node_of(scheduler, "server", 1), "sent no heartbeat for 3.1 s")
    lost = nodes["server", 1]
    assert lost.notice("dropped") == {
        "role": "server",
        "rank": 1,
        "reason": "server 1 (host 127.0.0.1, pid 1) sent no heartbeat for 3.1 s",
    }
    for key in (("server", 0), ("worker", 0), ("worker", 1)):
        assert nodes[key].notice("server_lost") == {"rank": 1, "reason": "sent no heartbeat for 3.1 s"}
    lost.client.send("heartbeat", {})
    assert lost.notice("dropped")["rank"] == 1
    assert scheduler.outcome is None


# -- on simulated hosts ----------------------------------------------------------------------------
def bring_back(hosts: SimulatedHosts) -> Callable[[str], None]:
    """A `watch` for run_job: as soon as the scheduler has dropped worker 2 (on host 3) or lost
    server 1 (on host 1), that host's link comes back, while the others still run."""
    dropped = {
        "dropped worker 2 (host": 3,
        "server 1 (host": 1,  # "... sent no heartbeat for 3.0 s; its backups serve its slices"
    }

    def watch(line: str) -> None:
        if not line.startswith("[scheduler 0]"):
            return
        for said, host in dropped.items():
            if said in line and "sent no heartbeat" in line:
                hosts.run(host, ["ip", "link", "set", "eth0", "up"])

    return watch


@pytest.mark.skipif(hosts_unavailable() is not None, reason=str(hosts_unavailable()))
@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_worker_and_a_server_cut_off_are_dropped_the_job_finishes_exact_and_both_are_fenced(mode, tmp_path):
    # Scheduler and server 0 on host 0, server 1 alone on host 1, workers 0, 1, 2 on hosts 2, 0, 3.
    # Worker 2 cuts its link before round 3 (it has 3 acknowledged pushes, none in flight), server 1
    # as worker 0 reaches round 3 (with pushes in flight): one heartbeat timeout (3 s) names both.
    # Each link comes back once the scheduler named its host's process. In sync, the rounds go on
    # with the pushes they got; in async, server 1 may come back with pushes in its buffers that it
    # applies and tries to copy to server 0, which refuses them (fence.py).
    place = {"scheduler": [0], "server": [0, 1], "worker": [2, 0, 3]}
    with SimulatedHosts(4) as hosts:
        outcome = run_job(
            JOB,
            workers=3,
            servers=2,
            args=[
                "14",
                str(tmp_path),
                "--worker",
                "2:3",
                "--server",
                "1:3",
                "--timeout",
                "3",
                "--mode",
                mode,
            ],
            hosts=hosts,
            place=place,
            elastic=True,
            server_losses=1,
            timeout_s=180,
            watch=bring_back(hosts),
        )
    # the survivors went on to the end, and every key holds exactly the acknowledged pushes
    for rank in (0, 1):
        assert outcome.lines("worker", rank, "stdout")[-1].endswith("count ok 31"), outcome.report
    # each cut-off host's process was named by its missing heartbeats (not by a TCP timeout)
    scheduler = "\n".join(outcome.lines("scheduler", 0, "stderr"))
    for said in (
        r"dropped worker 2 \(host 10.77.0.4, pid \d+\) from the membership: .* sent no heartbeat for",
        r"server 1 \(host 10.77.0.2, pid \d+\) sent no heartbeat for [\d.]+ s; its backups serve",
    ):
        assert re.search(said, scheduler), (said, scheduler)
    # and each, alive all along, exited once its link was back, saying why
    for role, rank in (("worker", 2), ("server", 1)):
        said = "\n".join(outcome.lines(role, rank, "stderr"))
        assert f"{role} {rank} {DROPPED}" in said, (role, rank, said)
