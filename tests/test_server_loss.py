"""A replicated server lost at any moment of the job's life (`--server-losses`): before it
registered, once the job started, during init, set_optimizer, set_hyperparameters, a checkpoint
and at the end. Each job (tests/jobs/server_loss.py) ends with every key and
the checkpoint exactly the uninterrupted run's (the single-process reference)."""

from __future__ import annotations

from pathlib import Path

import pytest

from paratrain import version
from paratrain.cluster.config import JobConfig
from paratrain.cluster.membership import Members
from paratrain.cluster.protocol import Register
from paratrain.cluster.spec import ClusterSpec
from paratrain.errors import KVStoreError, RemoteError, TransportError
from paratrain.kvstore.server.faults import ENV_VAR, KillAt, kill_at
from paratrain.kvstore.worker.failover import Servers, Spared, Unreachable
from paratrain.testing import run_job
from paratrain.transport.client import Future, Reply

JOBS = Path(__file__).parent / "jobs"


def test_the_kill_knob_names_one_server_and_a_moment() -> None:
    assert kill_at(1, {ENV_VAR: "1 init"}) == KillAt("init") and kill_at(0, {ENV_VAR: "1 init"}) is None
    assert kill_at(2, {ENV_VAR: "2 pushpull 3"}) == KillAt("pushpull", 3) and kill_at(0, {}) is None
    with pytest.raises(ValueError, match="is not 'RANK MOMENT"):
        kill_at(0, {ENV_VAR: "init 1"})
    with pytest.raises(ValueError, match="count 0 must be >= 1"):
        kill_at(0, {ENV_VAR: "0 init 0"})


class Answering:
    """A server's client whose requests are answered by hand: `fail` loses the connection."""

    def __init__(self) -> None:
        self.futures: list[Future] = []

    def submit(self, op: str, meta: dict, tensors: object = (), out: object = None) -> Future:
        self.futures.append(Future(op, None))
        return self.futures[-1]


def test_a_call_to_every_server_goes_on_without_one_lost_while_every_slice_keeps_a_copy() -> None:
    """set_optimizer, set_hyper, init, a checkpoint's get_state: the server lost during the call is
    left out (its slices' copies got the same call); a server's own refusal is still an error; and
    once some slice has no live copy left, the call fails saying so."""
    clients = [Answering() for _ in range(3)]
    servers = Servers(clients, 2)  # type: ignore[arg-type]
    sent = [servers.submit(s, "set_optimizer", {}) for s in range(3)]
    assert all(isinstance(future, Spared) for future in sent)
    clients[0].futures[0]._set(Reply({"ok": 0}), None)
    clients[1].futures[0]._set(None, TransportError("server 1 closed the connection"))
    clients[2].futures[0]._set(None, RemoteError("server 2: no such optimizer"))
    assert sent[0].wait(1).meta == {"ok": 0} and not sent[0].lost
    assert sent[1].wait(1).meta == {} and sent[1].lost and servers.dead_list() == [1]
    with pytest.raises(RemoteError, match="no such optimizer"):
        sent[2].wait(1)
    again = servers.submit(2, "get_state", {})
    clients[2].futures[1]._set(None, TransportError("server 2 closed the connection"))
    with pytest.raises(KVStoreError, match=r"every server holding server 1's slices is dead \(\[1, 2\]\)"):
        again.wait(1)
    plain = Servers([Answering()], 1)  # type: ignore[list-item]
    assert isinstance(plain.submit(0, "init", {}), Future)  # unreplicated: a loss is the call's error


def test_a_server_lost_before_it_registered_is_nowhere_and_not_waited_for() -> None:
    config = JobConfig(replication=2)
    members = Members(ClusterSpec("scheduler", 0, 1, 3, "127.0.0.1", 1, b"s" * 32), config)
    for role, rank in (("server", 0), ("server", 2), ("worker", 0)):
        register = Register(role, "h", 1, version.__version__, config.digest(), rank=rank, port=7 + rank)
        members.admit(object(), register)  # type: ignore[arg-type]
    assert members.missing() == ["server 1"] and members.missing({1}) == []
    assert members.roster().servers == [["h", 7], ["", 0], ["h", 9]]
    unreachable = Unreachable("server 1", "killed before it registered")
    with pytest.raises(TransportError, match="server 1 was lost before it could be reached: killed"):
        unreachable.submit("init", {}).wait(1)
    with pytest.raises(TransportError, match="lost before it could be reached"):
        unreachable.request("leave", {})


# (server, moment): the server SIGKILLs itself there (kvstore/server/faults.py). Servers 0..2, each
# the primary of some slices and the backup of another's. A configure, join or stats call is sent as
# set_optimizer is; the uninterrupted run is the reference each job replays. Mid-round deaths are
# test_replication.py's (a server killed at a random round of the counting job).
MOMENTS = [
    (1, "start"),  # before it registered
    (2, "started"),  # registered, before any request
    (1, "init"),
    (2, "set_optimizer"),
    (0, "set_hyper"),
    (2, "get_state"),  # during the checkpoint
    (0, "leave"),  # at the end
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("server,moment", MOMENTS, ids=[moment for _, moment in MOMENTS])
def test_a_server_lost_at_any_moment_loses_nothing(tmp_path: Path, server: int, moment: str) -> None:
    outcome = run_job(
        JOBS / "server_loss.py",
        workers=2,
        servers=3,
        args=["4", str(tmp_path)],
        env={ENV_VAR: f"{server} {moment}"},
        server_losses=1,
        timeout_s=90,
    )
    for rank in range(2):
        assert outcome.lines("worker", rank, "stdout") == ["exact ok"], outcome.stderr[-3000:]
    assert f"server {server} was killed by signal SIGKILL; the job goes on" in outcome.stderr


@pytest.mark.timeout(300)
def test_without_copies_a_server_lost_before_it_registered_ends_the_job_at_once(tmp_path: Path) -> None:
    """replication=1: the launcher goes on (--server-losses 1), but the scheduler ends the job at
    once, naming the server and why, not after its start timeout."""
    outcome = run_job(
        JOBS / "server_loss.py",
        workers=2,
        servers=3,
        args=["4", str(tmp_path), "1"],
        env={ENV_VAR: "1 start"},
        server_losses=1,
        timeout_s=90,
        expect="failure",
    )
    assert (
        "server 1 was killed by signal SIGKILL before it registered; the job cannot go on without it "
        "(replication=1)" in outcome.report
    ), outcome.report
    assert "did not register" not in outcome.stderr
