"""Jobs on simulated hosts: network namespaces with their own addresses on one bridge
(paratrain.testing_hosts). They need root and `ip netns`; CI has both, elsewhere they skip."""

from __future__ import annotations

from pathlib import Path

import pytest

from paratrain.testing import SimulatedHosts, hosts_unavailable, run_job

JOBS = Path(__file__).parent / "jobs"

pytestmark = pytest.mark.skipif(hosts_unavailable() is not None, reason=str(hosts_unavailable()))


@pytest.fixture
def four_hosts():
    with SimulatedHosts(4) as hosts:
        yield hosts


def test_dist_sync_with_two_servers_and_three_workers_on_four_hosts_is_exact(four_hosts):
    # Scheduler and server 0 on host 0, server 1 on host 1, workers on hosts 2, 3 and 0: every
    # byte between a worker and a server crosses the bridge (tcp: no same-host shortcut either).
    place = {"scheduler": [0], "server": [0, 1], "worker": [2, 3, 0]}
    outcome = run_job(
        JOBS / "kv_exact.py",
        workers=3,
        servers=2,
        args=["dist_sync", "3", "tcp"],
        hosts=four_hosts,
        place=place,
        timeout_s=100,
    )
    for rank in range(3):
        assert outcome.lines("worker", rank, "stdout")[-1] == "all exact"
    assert outcome.scheduler_address.startswith(four_hosts.address(0) + ":")
