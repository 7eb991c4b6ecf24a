"""spec_from_env / spec_to_env: every accepted convention, round trips, and every rejected value."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from paratrain.cluster import spec as spec_module
from paratrain.cluster.spec import ClusterSpec, own_address, server_ranks, spec_from_env, spec_to_env

SECRET = bytes(range(16, 48))
SECRET_HEX = SECRET.hex()
WITH_SECRET = {"PARATRAIN_SECRET": SECRET_HEX}


def spec(*fields: object, **named: object) -> ClusterSpec:
    """ClusterSpec(role, rank, num_workers, num_servers, scheduler_host, scheduler_port, ...) with
    the test secret."""
    return ClusterSpec(*fields, **{"secret": SECRET, **named})  # type: ignore[arg-type]


def tf_config(task_type: object, index: object, with_chief: bool = True, **cluster: object) -> str:
    """A TF_CONFIG with a chief (unless with_chief=False), two workers and two ps tasks; or, if
    given, `cluster`."""
    if not cluster:
        cluster = {"worker": ["w0:2000", "w1:2001"], "ps": ["p0:3000", "[::1]:3001"]}
        if with_chief:
            cluster["chief"] = ["c0:1000"]
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})


# What the fake route lookup below answers: this host's address towards any peer.
ROUTED = "10.0.0.9"


@pytest.fixture(autouse=True)
def fake_route(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Where no variable names a process's address, spec_from_env asks the kernel for the route to
    the scheduler's host; here a fake answers, and records what it was asked."""
    asked: list[tuple[str, str]] = []

    def route(peer_host: str, name: str = "PARATRAIN_SCHEDULER") -> str:
        asked.append((peer_host, name))
        return ROUTED

    monkeypatch.setattr(spec_module, "own_address", route)
    return asked


PARATRAIN = {
    "PARATRAIN_ROLE": "worker",
    "PARATRAIN_RANK": "2",
    "PARATRAIN_NUM_WORKERS": "3",
    "PARATRAIN_NUM_SERVERS": "2",
    "PARATRAIN_SCHEDULER": "10.0.0.1:5000",
}
DMLC = {
    "DMLC_ROLE": "worker",
    "DMLC_WORKER_ID": "1",
    "DMLC_NUM_WORKER": "2",
    "DMLC_NUM_SERVER": "1",
    "DMLC_PS_ROOT_URI": "10.0.0.1",
    "DMLC_PS_ROOT_PORT": "9000",
}
MASTER = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
TORCHRUN = {"RANK": "1", "WORLD_SIZE": "4", **MASTER}
SLURM = {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", **MASTER}
OMPI = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4", "PARATRAIN_SCHEDULER": "h:7000"}
PMI = {"PMI_RANK": "1", "PMI_SIZE": "4", **MASTER}
IPV6_SERVER = {
    "PARATRAIN_ROLE": "server",
    "PARATRAIN_RANK": "",  # empty counts as unset
    "PARATRAIN_HOST": "::1",
    "PARATRAIN_SCHEDULER": "[::1]:5000",
    "PARATRAIN_LAUNCHER_PID": "4242",
    "PARATRAIN_SCHEDULER_FD": "3",
}

# Under torchrun, Slurm and MPI: 4 workers, no servers, the scheduler at MASTER_PORT+1.
WORKERS = (4, 0, "10.0.0.1", 29501)
ACCEPTED = {
    "paratrain worker": (PARATRAIN, spec("worker", 2, 3, 2, "10.0.0.1", 5000, host=ROUTED)),
    "paratrain server IPv6": (
        {**PARATRAIN, **IPV6_SERVER},
        spec("server", None, 3, 2, "::1", 5000, host="::1", launcher_pid=4242, scheduler_fd=3),
    ),
    "paratrain scheduler": (
        {**PARATRAIN, "PARATRAIN_ROLE": "scheduler", "PARATRAIN_RANK": "0"},
        spec("scheduler", 0, 3, 2, "10.0.0.1", 5000, host="10.0.0.1"),
    ),
    "dmlc worker": (
        {**DMLC, "DMLC_NODE_HOST": "10.0.0.7"},
        spec("worker", 1, 2, 1, "10.0.0.1", 9000, host="10.0.0.7", source="dmlc"),
    ),
    "dmlc server without id": (
        {**DMLC, "DMLC_ROLE": "server"},
        spec("server", None, 2, 1, "10.0.0.1", 9000, host=ROUTED, source="dmlc"),
    ),
    "dmlc scheduler": (
        {**DMLC, "DMLC_ROLE": "scheduler", "PARATRAIN_HOST": "10.0.0.1"},
        spec("scheduler", 0, 2, 1, "10.0.0.1", 9000, host="10.0.0.1", source="dmlc"),
    ),
    "tf chief": (
        {"TF_CONFIG": tf_config("chief", 0)},
        spec("worker", 0, 3, 2, "c0", 1000, host="c0", source="tf_config", embedded_scheduler=True),
    ),
    "tf worker after a chief": (
        {"TF_CONFIG": tf_config("worker", 1)},
        spec("worker", 2, 3, 2, "c0", 1000, host="w1", source="tf_config"),
    ),
    "tf worker 0 without a chief": (
        {"TF_CONFIG": tf_config("worker", 0, with_chief=False)},
        spec("worker", 0, 2, 2, "w0", 2000, host="w0", source="tf_config", embedded_scheduler=True),
    ),
    "tf ps IPv6, index as text": (
        {"TF_CONFIG": tf_config("ps", "1")},
        spec("server", 1, 3, 2, "c0", 1000, host="::1", source="tf_config"),
    ),
    "torchrun": (TORCHRUN, spec("worker", 1, *WORKERS, host=ROUTED, source="torchrun")),
    "torchrun rank 0": (
        {**TORCHRUN, "RANK": "0", "PARATRAIN_HOST": "10.0.0.1"},
        spec("worker", 0, *WORKERS, host="10.0.0.1", source="torchrun", embedded_scheduler=True),
    ),
    "slurm": (SLURM, spec("worker", 1, *WORKERS, host=ROUTED, source="slurm")),
    "open mpi": (OMPI, spec("worker", 1, 4, 0, "h", 7000, host=ROUTED, source="mpi")),
    "mpich": (PMI, spec("worker", 1, *WORKERS, host=ROUTED, source="mpi")),
    # 4 processes with 2 servers: global ranks 1 and 3 serve, 0 and 2 are workers 0 and 1.
    "torchrun server": (
        {**TORCHRUN, "PARATRAIN_NUM_SERVERS": "2"},
        spec("server", 0, 2, 2, "10.0.0.1", 29501, host=ROUTED, source="torchrun"),
    ),
    "torchrun rank 0 with servers": (
        {**TORCHRUN, "RANK": "0", "PARATRAIN_NUM_SERVERS": "2"},
        spec("worker", 0, 2, 2, "10.0.0.1", 29501, host=ROUTED, source="torchrun", embedded_scheduler=True),
    ),
    "slurm worker after a server": (
        {**SLURM, "SLURM_PROCID": "2", "PARATRAIN_NUM_SERVERS": "2"},
        spec("worker", 1, 2, 2, "10.0.0.1", 29501, host=ROUTED, source="slurm"),
    ),
    # 3 processes, 2 servers: ranks 0 and 2 serve, and rank 0 also runs the scheduler.
    "mpich rank 0 serves and schedules": (
        {**PMI, "PMI_RANK": "0", "PMI_SIZE": "3", "PARATRAIN_NUM_SERVERS": "2"},
        spec("server", 0, 1, 2, "10.0.0.1", 29501, host=ROUTED, source="mpi", embedded_scheduler=True),
    ),
    "slurm without MASTER_ADDR": (
        {
            "SLURM_PROCID": "1",
            "SLURM_NTASKS": "4",
            "SLURM_JOB_ID": "1234",
            "SLURM_STEP_NODELIST": "node[03-05,07],gpu1",
            "SLURM_JOB_NODELIST": "other",
        },
        spec("worker", 1, 4, 0, "node03", 21235, host=ROUTED, source="slurm"),
    ),
}


@pytest.mark.parametrize(("env", "expected"), ACCEPTED.values(), ids=ACCEPTED.keys())
def test_each_convention_gives_its_spec(env: dict[str, str], expected: ClusterSpec) -> None:
    assert spec_from_env({**env, **WITH_SECRET}) == expected


@pytest.mark.parametrize(
    ("env", "source"),
    [
        ({**PARATRAIN, **DMLC, **TORCHRUN}, "paratrain"),
        ({**DMLC, "TF_CONFIG": tf_config("ps", 0), **TORCHRUN}, "dmlc"),
        ({"TF_CONFIG": tf_config("ps", 0), **TORCHRUN}, "tf_config"),
        ({**SLURM, **TORCHRUN}, "torchrun"),  # torchrun inside an srun allocation
        ({**PMI, **SLURM}, "slurm"),  # srun --mpi=pmi2
        ({**PMI, **OMPI}, "mpi"),
    ],
)
def test_first_convention_in_order_wins(env: dict[str, str], source: str) -> None:
    result = spec_from_env({**env, **WITH_SECRET})
    assert result is not None and result.source == source


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"PATH": "/usr/bin", "HOME": "/root", **WITH_SECRET},
        {"RANK": "0"},  # half a marker is no convention
        {"PARATRAIN_ROLE": ""},  # empty counts as unset
    ],
)
def test_no_convention_gives_none(env: dict[str, str]) -> None:
    assert spec_from_env(env) is None


ROUND_TRIP = [
    spec("worker", None, 1, 0, "127.0.0.1", 1),
    spec("server", 3, 2, 4, "::1", 65535, host="::1", launcher_pid=99, scheduler_fd=0),
    spec("scheduler", 0, 8, 2, "sched.example", 5000, host="10.1.2.3", launcher_pid=1),
]


@pytest.mark.parametrize("original", ROUND_TRIP, ids=lambda s: s.role)
def test_spec_to_env_round_trips(original: ClusterSpec) -> None:
    env = spec_to_env(original)
    assert env["PARATRAIN_SECRET"] == SECRET_HEX
    assert all(name.startswith("PARATRAIN_") for name in env)
    assert spec_from_env(env) == original


def test_spec_to_env_omits_what_is_none() -> None:
    env = spec_to_env(ROUND_TRIP[0])
    assert not {"PARATRAIN_RANK", "PARATRAIN_LAUNCHER_PID", "PARATRAIN_SCHEDULER_FD"} & set(env)


def test_spec_to_env_writes_other_sources_as_paratrain() -> None:
    from_torchrun = spec_from_env({**TORCHRUN, **WITH_SECRET})
    assert from_torchrun is not None
    expected = dataclasses.replace(from_torchrun, source="paratrain")
    assert spec_from_env(spec_to_env(from_torchrun)) == expected


def test_spec_to_env_refuses_an_embedded_scheduler() -> None:
    worker0 = spec_from_env({**TORCHRUN, "RANK": "0", **WITH_SECRET})
    assert worker0 is not None
    with pytest.raises(ValueError, match="embedded_scheduler"):
        spec_to_env(worker0)


AS_SERVER = {**PARATRAIN, "PARATRAIN_ROLE": "server"}
AS_DMLC_SERVER = {**DMLC, "DMLC_ROLE": "server"}
NO_WORKERS = {"ps": ["p:1"]}
# (base env, variable, bad value, what the message must contain when not "VARIABLE...value")
REJECTED = [
    (PARATRAIN, "PARATRAIN_ROLE", "boss", None),
    (PARATRAIN, "PARATRAIN_RANK", "x", "PARATRAIN_RANK='x' is not an integer"),
    (PARATRAIN, "PARATRAIN_RANK", "3", "PARATRAIN_RANK=3 is out of range for 3 workers (0..2)"),
    (PARATRAIN, "PARATRAIN_RANK", "-1", None),
    (AS_SERVER, "PARATRAIN_RANK", "2", "PARATRAIN_RANK=2 is out of range for 2 servers (0..1)"),
    ({**PARATRAIN, "PARATRAIN_ROLE": "scheduler"}, "PARATRAIN_RANK", "1", None),
    (AS_SERVER, "PARATRAIN_NUM_SERVERS", "0", None),
    (PARATRAIN, "PARATRAIN_NUM_WORKERS", "0", None),
    (PARATRAIN, "PARATRAIN_NUM_WORKERS", "", "PARATRAIN_NUM_WORKERS is not set"),
    (PARATRAIN, "PARATRAIN_NUM_SERVERS", "-2", None),
    (
        PARATRAIN,
        "PARATRAIN_SCHEDULER",
        "localhost",
        "PARATRAIN_SCHEDULER='localhost' is not host:port",
    ),
    (PARATRAIN, "PARATRAIN_SCHEDULER", "::1:5000", None),
    (PARATRAIN, "PARATRAIN_SCHEDULER", "h:0", None),
    (PARATRAIN, "PARATRAIN_SCHEDULER", "h:65536", None),
    (PARATRAIN, "PARATRAIN_SCHEDULER", "h:http", None),
    (PARATRAIN, "PARATRAIN_LAUNCHER_PID", "0", None),
    (PARATRAIN, "PARATRAIN_SCHEDULER_FD", "fd3", None),
    (DMLC, "DMLC_ROLE", "boss", "DMLC_ROLE='boss' is not one of scheduler, server, worker"),
    (DMLC, "DMLC_PS_ROOT_PORT", "70000", None),
    (DMLC, "DMLC_PS_ROOT_URI", "", "DMLC_PS_ROOT_URI is not set"),
    (DMLC, "DMLC_WORKER_ID", "2", None),
    (DMLC, "DMLC_NUM_SERVER", "-1", None),
    (AS_DMLC_SERVER, "DMLC_SERVER_ID", "1", None),
    (AS_DMLC_SERVER, "DMLC_NUM_SERVER", "0", None),
    ({}, "TF_CONFIG", "{cluster", None),
    ({}, "TF_CONFIG", "[1]", None),
    ({}, "TF_CONFIG", tf_config("evaluator", 0), "TF_CONFIG task.type='evaluator'"),
    ({}, "TF_CONFIG", tf_config("worker", 2), "TF_CONFIG task.index=2 is out of range"),
    ({}, "TF_CONFIG", tf_config("chief", 1), "TF_CONFIG task.index=1"),
    ({}, "TF_CONFIG", tf_config("ps", -1), "TF_CONFIG task.index=-1"),
    ({}, "TF_CONFIG", tf_config("ps", "one"), "TF_CONFIG task.index='one'"),
    ({}, "TF_CONFIG", tf_config("ps", None), "TF_CONFIG task.index is not set"),
    ({}, "TF_CONFIG", tf_config("ps", 0, worker=["w0"]), "TF_CONFIG cluster.worker[0]='w0'"),
    ({}, "TF_CONFIG", tf_config("ps", 0, ps="p:1"), "TF_CONFIG cluster.ps='p:1'"),
    ({}, "TF_CONFIG", tf_config("chief", 0, chief=["a:1", "b:2"]), "TF_CONFIG cluster.chief has 2"),
    ({}, "TF_CONFIG", tf_config("ps", 0, **NO_WORKERS), "TF_CONFIG cluster has no chief or worker"),
    (TORCHRUN, "RANK", "4", "RANK=4 must be in 0..3"),
    (TORCHRUN, "PARATRAIN_NUM_SERVERS", "4", "PARATRAIN_NUM_SERVERS=4 leaves no worker among WORLD_SIZE=4"),
    (TORCHRUN, "PARATRAIN_NUM_SERVERS", "-1", None),
    (SLURM, "MASTER_ADDR", "", "nor SLURM_STEP_NODELIST or SLURM_JOB_NODELIST"),
    (TORCHRUN, "RANK", "zero", None),
    (TORCHRUN, "WORLD_SIZE", "0", None),
    (TORCHRUN, "MASTER_ADDR", "", "MASTER_ADDR is not set"),
    (TORCHRUN, "MASTER_PORT", "0", None),
    (TORCHRUN, "MASTER_PORT", "65535", None),
    (SLURM, "SLURM_PROCID", "9", None),
    (SLURM, "SLURM_NTASKS", "-1", None),
    (SLURM, "PARATRAIN_SCHEDULER", "nope", None),
    (OMPI, "OMPI_COMM_WORLD_RANK", "x", None),
    (PMI, "PMI_SIZE", "0", None),
    (PMI, "MASTER_PORT", "", "MASTER_PORT is not set"),
]


@pytest.mark.parametrize(
    ("base", "name", "value", "message"),
    REJECTED,
    ids=[f"{name}={value[:20]}" for _, name, value, _ in REJECTED],
)
def test_bad_values_raise_naming_variable_and_value(
    base: dict[str, str], name: str, value: str, message: str | None
) -> None:
    pattern = f"{re.escape(name)}.*{re.escape(value)}" if message is None else re.escape(message)
    with pytest.raises(ValueError, match=pattern):
        spec_from_env({**base, **WITH_SECRET, name: value})


@pytest.mark.parametrize(
    ("secret_env", "message"),
    [
        ({}, "PARATRAIN_SECRET is not set.*at least 16 bytes as hex"),
        ({"PARATRAIN_SECRET": SECRET_HEX[:-1]}, "PARATRAIN_SECRET is not a hex string"),
        ({"PARATRAIN_SECRET": "zz" + SECRET_HEX}, "PARATRAIN_SECRET is not a hex string"),
        ({"PARATRAIN_SECRET": SECRET_HEX[:30]}, "PARATRAIN_SECRET is 15 bytes.*at least 16"),
        (
            {**WITH_SECRET, "PARATRAIN_SECRET_FILE": "/x"},
            "PARATRAIN_SECRET and PARATRAIN_SECRET_FILE are both set",
        ),
        ({"PARATRAIN_SECRET_FILE": "/nonexistent/s"}, "PARATRAIN_SECRET_FILE='/nonexistent/s'"),
    ],
)
def test_bad_secret_raises_without_showing_it(secret_env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message) as raised:
        spec_from_env({**PARATRAIN, **secret_env})
    assert SECRET_HEX[:30] not in str(raised.value)


def test_secret_file(tmp_path) -> None:
    path = tmp_path / "secret"
    path.write_text(f"  {SECRET_HEX}\n")
    env = {**PARATRAIN, "PARATRAIN_SECRET_FILE": str(path)}
    result = spec_from_env(env)
    assert result is not None and result.secret == SECRET

    path.write_text(SECRET_HEX[:16])
    with pytest.raises(ValueError, match=re.escape(f"PARATRAIN_SECRET_FILE='{path}' is 8 bytes")) as raised:
        spec_from_env(env)
    assert SECRET_HEX[:16] not in str(raised.value)


def test_secret_not_in_repr() -> None:
    text = repr(spec_from_env({**PARATRAIN, **WITH_SECRET}))
    assert "secret" not in text and SECRET_HEX not in text and repr(SECRET) not in text


def test_scheduler_address_brackets_ipv6() -> None:
    assert spec("worker", None, 1, 0, "::1", 80).scheduler_address == "[::1]:80"
    assert spec("worker", None, 1, 0, "h", 80).scheduler_address == "h:80"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"role": "boss"}, "role='boss'"),
        ({"num_workers": 0}, "num_workers=0"),
        ({"num_servers": -1}, "num_servers=-1"),
        ({"rank": 2}, "rank=2 is out of range for 2 workers"),
        ({"role": "server", "num_servers": 0}, "num_servers=0"),
        ({"scheduler_port": 0}, "scheduler_port=0"),
        ({"source": "yarn"}, "source='yarn'"),
        ({"rank": None, "embedded_scheduler": True}, "embedded_scheduler=True"),
        ({"role": "scheduler", "embedded_scheduler": True}, "embedded_scheduler=True"),
        ({"secret": b"short"}, "secret is 5 bytes"),
    ],
)
def test_cluster_spec_validates_its_fields(fields: dict[str, object], message: str) -> None:
    valid = dict(role="worker", rank=0, num_workers=2, num_servers=1)
    with pytest.raises(ValueError, match=re.escape(message)):
        spec(**{**valid, "scheduler_host": "h", "scheduler_port": 1, **fields})


@pytest.mark.parametrize(
    ("world_size", "num_servers", "expected"),
    [
        (4, 1, [3]),
        (4, 2, [1, 3]),
        (8, 2, [3, 7]),
        (8, 4, [1, 3, 5, 7]),
        (3, 1, [2]),
        (5, 2, [1, 4]),
        (2, 1, [1]),
    ],
)
def test_servers_are_the_last_rank_of_equal_blocks(
    world_size: int, num_servers: int, expected: list[int]
) -> None:
    assert server_ranks(world_size, num_servers) == expected


@pytest.mark.parametrize(("nnodes", "nproc", "servers"), [(2, 4, 2), (2, 2, 1), (3, 2, 3), (4, 3, 2)])
def test_torchrun_ranks_give_every_role_and_rank_once_with_servers_spread_over_nodes(
    nnodes: int, nproc: int, servers: int
) -> None:
    """What every process of `torchrun --nnodes N --nproc_per_node K` reads, with S servers."""
    places = []
    for global_rank in range(nnodes * nproc):
        env = {**TORCHRUN, "RANK": str(global_rank), "WORLD_SIZE": str(nnodes * nproc)}
        got = spec_from_env({**env, "PARATRAIN_NUM_SERVERS": str(servers), **WITH_SECRET})
        assert got is not None and got.embedded_scheduler == (global_rank == 0)
        places.append((got.role, got.rank, global_rank // nproc))
    roles = sorted((role, rank) for role, rank, _ in places)
    workers = nnodes * nproc - servers
    assert roles == sorted([("server", r) for r in range(servers)] + [("worker", r) for r in range(workers)])
    server_nodes = [node for role, _, node in places if role == "server"]
    assert (
        max(server_nodes.count(n) for n in range(nnodes)) - min(server_nodes.count(n) for n in range(nnodes))
        <= 1
    )
    assert places[0][:2] == ("worker", 0)


def test_own_address_asks_the_route_and_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.undo()  # the real lookup
    assert own_address("127.0.0.1") == "127.0.0.1"
    with pytest.raises(ValueError, match="MASTER_ADDR='no-such-host.invalid'.*set PARATRAIN_HOST"):
        own_address("no-such-host.invalid", "MASTER_ADDR")


def test_a_process_asks_for_its_route_only_when_nothing_names_its_address(fake_route) -> None:
    spec_from_env({**TORCHRUN, **WITH_SECRET, "PARATRAIN_HOST": "10.0.0.5"})
    assert fake_route == []
    spec_from_env({**TORCHRUN, **WITH_SECRET})
    assert fake_route == [("10.0.0.1", "MASTER_ADDR")]
