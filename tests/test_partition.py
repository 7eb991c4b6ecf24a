"""Network partitions (issue 15, item 3): a host whose link goes down is dropped within the heartbeat
timeout and the job goes on without it (elastic workers, replicated servers); when the link comes
back, the process behind it, alive all along, is fenced: it exits saying it was dropped, and what
it sends late is refused. The decision logic is tested without processes first; one job on
simulated hosts (root and `ip netns`, as in CI) shows both cuts end to end."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from paratrain.cluster.fencing import DROPPED, dropped_message, dropped_notice
from paratrain.kvstore.api import KVError
from paratrain.kvstore.server.fence import Fence
from paratrain.testing import SimulatedHosts, hosts_unavailable, run_job

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
    said = dropped_notice({"role": "server", "rank": 1, "reason": "sent no heartbeat for 3.1 s"})
    assert said.startswith(f"server 1 {DROPPED} (sent no heartbeat for 3.1 s); ")
    assert "rather than rejoin" in said


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
def test_a_worker_and_a_server_cut_off_are_dropped_the_job_finishes_exact_and_both_are_fenced(tmp_path):
    # Scheduler and server 0 on host 0, server 1 alone on host 1, workers 0, 1, 2 on hosts 2, 0, 3.
    # Worker 2 cuts its link before round 3 (it has 3 acknowledged pushes, none in flight), server 1
    # once worker 0 reached round 8 (with pushes in flight). Each link comes back once the scheduler
    # named its host's process; the heartbeat timeout is 3 s.
    place = {"scheduler": [0], "server": [0, 1], "worker": [2, 0, 3]}
    with SimulatedHosts(4) as hosts:
        outcome = run_job(
            JOB,
            workers=3,
            servers=2,
            args=["14", str(tmp_path), "--worker", "2:3", "--server", "1:8", "--timeout", "3"],
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
