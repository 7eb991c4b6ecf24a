"""The Ray engine: placement plans as data, the per-node process keeper without Ray, and real jobs
on a 2-node Ray cluster simulated on this machine (`ray.cluster_utils.Cluster`).

The cluster is started once for the module (Ray starts slowly on 2 cores) and the test process is
its driver, so jobs run in process through `run_ray`; one job goes through the CLI in a
subprocess driver and is stopped with SIGINT. After every job no child process, actor or
placement group is left, and after the module no Ray process (raylet, gcs_server, workers) is.
"""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import ray

from paratrain.launch.api import LaunchConfig
from paratrain.launch.engines.ray.driver import RayOptions, role_threads, run_ray
from paratrain.launch.engines.ray.placement import NodeInfo, RayJobError, node_labels, plan_groups
from paratrain.launch.engines.ray.process import RoleProcess
from paratrain.launch.engines.ray.supervise import Interrupts, RayChild, Supervisor, first_line
from paratrain.launch.report import Printer
from paratrain.launch.restarts import Restarts
from paratrain.testing import assert_all_gone

pytestmark = pytest.mark.timeout(240)

JOBS = Path(__file__).parent / "jobs"
ROLES = str(JOBS / "ray_roles.py")
COUNT = str(JOBS / "elastic_count.py")
PARATRAIN = str(Path(sys.executable).parent / "paratrain")
NODE_CPUS = 3
_LINE = re.compile(r"^\[(scheduler|server|worker) (\d+) @(\S+)\] (.*)$")
_RAY_PROGRAMS = ("raylet", "gcs_server", "plasma_store")


# -- plans and options, no cluster


def _config(workers: int = 2, servers: int = 2) -> LaunchConfig:
    return LaunchConfig(script="train.py", num_workers=workers, num_servers=servers)


def test_servers_are_strictly_spread_when_enough_nodes_can_hold_one():
    nodes = [{"CPU": 2.0}, {"CPU": 2.0}, {"CPU": 0.5}]
    servers, main = plan_groups(_config(workers=2, servers=2), RayOptions(), nodes)
    assert servers.strategy == "STRICT_SPREAD"
    assert servers.members == (("server", 0), ("server", 1))
    assert main.strategy == "SPREAD"
    assert main.members == (("scheduler", 0), ("worker", 0), ("worker", 1))
    assert main.bundles == ({"CPU": 0.5}, {"CPU": 1.0}, {"CPU": 1.0})


def test_more_servers_than_nodes_spread_as_best_ray_can():
    [servers, _] = plan_groups(_config(workers=1, servers=3), RayOptions(), [{"CPU": 8.0}, {"CPU": 8.0}])
    assert servers.strategy == "SPREAD" and len(servers.bundles) == 3


def test_a_collective_job_has_one_group_and_workers_reserve_their_gpus():
    options = RayOptions(cpus_per_worker=4, gpus_per_worker=1)
    [main] = plan_groups(_config(workers=2, servers=0), options, [{"CPU": 16.0, "GPU": 2.0}])
    assert main.bundles[1:] == ({"CPU": 4.0, "GPU": 1.0},) * 2


@pytest.mark.parametrize(
    "options, nodes, named",
    [
        (
            RayOptions(gpus_per_worker=1),
            [{"CPU": 8.0}],
            "no node of the Ray cluster can hold a worker (CPU 1 GPU 1)",
        ),
        (RayOptions(cpus_per_server=4), [{"CPU": 3.0}, {"CPU": 3.0}], "can hold a server (CPU 4)"),
        (RayOptions(), [{"CPU": 2.0}, {"CPU": 2.0}], "needs 4.5 CPU"),
    ],
)
def test_a_job_the_cluster_cannot_hold_fails_at_once_naming_what(options, nodes, named):
    with pytest.raises(RayJobError, match=re.escape(named)):
        plan_groups(_config(workers=2, servers=2), options, nodes)


def test_nodes_sharing_an_address_are_told_apart_by_their_id():
    a, b, c = (
        NodeInfo("10.0.0.1", "aaaaaaaa11"),
        NodeInfo("10.0.0.1", "bbbbbbbb22"),
        NodeInfo("10.0.0.2", "cc"),
    )
    assert node_labels([a, b, c, a]) == {
        "aaaaaaaa11": "10.0.0.1/aaaaaa",
        "bbbbbbbb22": "10.0.0.1/bbbbbb",
        "cc": "10.0.0.2",
    }


def test_each_role_gets_its_cpus_as_threads_unless_the_user_chose():
    options = RayOptions(cpus_per_worker=3, cpus_per_server=1.5)
    threads, user_chose = role_threads(options, {})
    assert not user_chose
    assert {role: t["OMP_NUM_THREADS"] for role, t in threads.items()} == {
        "scheduler": "1",
        "server": "1",
        "worker": "3",
    }
    threads, user_chose = role_threads(options, {"OMP_NUM_THREADS": "2"})
    assert user_chose and all(t == {"OMP_NUM_THREADS": "2"} for t in threads.values())


@pytest.mark.parametrize(
    "field, value",
    [
        ("address", ""),
        ("cpus_per_worker", 0),
        ("cpus_per_server", -1),
        ("gpus_per_worker", -1),
        ("stop_grace_s", -1),
    ],
)
def test_options_reject_bad_values_naming_field_and_value(field, value):
    with pytest.raises(ValueError, match=f"{field}.*{value!r}"):
        RayOptions(**{field: value})


def test_a_ray_error_is_told_in_one_line_with_the_remote_exception():
    text = "The actor died in \x1b[36mray::A()\x1b[39m\n  Traceback\nModuleNotFoundError: No module named 'x'"
    said = "RuntimeError: The actor died in ray::A() ... ModuleNotFoundError: No module named 'x'"
    assert first_line(RuntimeError(text)) == said


class _Restarting(Supervisor):
    """The driver's supervisor with its restarts recorded instead of made (no Ray)."""

    def __init__(self, restarts: Restarts) -> None:
        super().__init__(Printer(io.StringIO(), io.StringIO()), Interrupts(), 1.0, 1.0, None, restarts)
        self.children = [RayChild(role, rank, actor=None) for role, rank in _ROLES]
        self.restarted: list[str] = []

    def restart(self, dead: RayChild) -> None:
        self.restarted.append(dead.label)
        child = RayChild(dead.role, dead.rank, actor=None)
        child.replacement = True
        self.children.append(child)

    def end(self, role: str, rank: int, returncode: int) -> bool:
        child = next(c for c in self.children if (c.role, c.rank) == (role, rank) and c.running)
        child.returncode, child.ended, child.exit_time = returncode, True, time.monotonic()
        return self._record(child)


_ROLES = [("scheduler", 0), ("server", 0), ("worker", 0), ("worker", 1)]


def test_an_elastic_jobs_dead_worker_is_started_again_while_restarts_last():
    job = _Restarting(Restarts(max_restarts=1))
    assert job.end("worker", 1, -signal.SIGKILL) and job.restarted == ["worker 1"]
    assert job.end("worker", 1, 3) and job.restarted == ["worker 1"]  # the replacement dies: none left
    said = job.printer.err.getvalue().splitlines()
    assert said[0].endswith("was killed by signal SIGKILL; the job goes on (restart 1 of 1)")
    assert said[1].endswith("exited with code 3; the job goes on (not restarted: all 1 used)")
    assert not job.end("worker", 0, 75)  # EXIT_ABORTED: the scheduler aborted the job (min_workers)

    job = _Restarting(Restarts(elastic=True))  # --elastic alone: the job goes on, nothing restarted
    assert job.end("worker", 0, -signal.SIGKILL) and job.restarted == []
    assert not job.end("server", 0, -signal.SIGKILL)  # servers are never restarted
    assert not _Restarting(Restarts()).end("worker", 1, -signal.SIGKILL)  # not elastic: stops the job


def test_a_replacement_that_never_joined_does_not_fail_a_finished_job():
    job = _Restarting(Restarts(max_restarts=2))
    job.end("worker", 1, -signal.SIGKILL)
    assert job.end("worker", 0, 0) and job.end("scheduler", 0, 0) and job.ending
    assert job.early == [] and job.end("worker", 1, 1)  # it found the scheduler gone
    assert job.restarted == ["worker 1"]


def test_launch_config_names_a_bad_max_restarts():
    with pytest.raises(ValueError, match="max_restarts.*-1"):
        LaunchConfig(script="train.py", max_restarts=-1)


# -- the process keeper, without Ray


def test_the_keeper_streams_output_then_the_exit_and_signals_the_group():
    keeper = RoleProcess()
    code = "import sys, time; print('out'); print('err', file=sys.stderr, flush=True); sys.exit(4)"
    keeper.start([None, "-c", code], {"PYTHONUNBUFFERED": "1"})
    lines, returncode = _drain_keeper(keeper)
    assert sorted(lines) == [(1, "out"), (2, "err")] and returncode == 4

    keeper = RoleProcess()
    pid = keeper.start([None, "-c", "print('up', flush=True); import time; time.sleep(60)"], {})
    assert keeper.poll(30)["lines"] == [(1, "up")]
    keeper.signal(signal.SIGTERM)
    assert _drain_keeper(keeper)[1] == -signal.SIGTERM
    assert_all_gone([pid])


def test_a_keeper_starts_another_process_only_after_the_last_one_exited():
    """An elastic job's replacement runs on the dead worker's actor when only the process died."""
    keeper = RoleProcess()
    keeper.start([None, "-c", "import time; print('first', flush=True); time.sleep(60)"], {})
    assert keeper.poll(30)["lines"] == [(1, "first")]
    with pytest.raises(RuntimeError, match="still runs"):
        keeper.start([None, "-c", "pass"], {})
    keeper.signal(signal.SIGKILL)
    assert _drain_keeper(keeper)[1] == -signal.SIGKILL
    keeper.start([None, "-c", "print('second')"], {"PYTHONUNBUFFERED": "1"})
    assert _drain_keeper(keeper) == ([(1, "second")], 0)


def test_the_keepers_child_gets_the_node_env_less_paratrain_variables_and_the_listener(monkeypatch):
    monkeypatch.setenv("PARATRAIN_ROLE", "stale")
    keeper = RoleProcess()
    port = keeper.listen("127.0.0.1")
    code = (
        "import os, socket; fd = int(os.environ['PARATRAIN_SCHEDULER_FD']);"
        "launcher = os.environ['PARATRAIN_LAUNCHER_PID'] == str(os.getppid());"
        "port = socket.socket(fileno=fd).getsockname()[1];"
        "print(os.environ.get('PARATRAIN_ROLE'), os.environ['X'], launcher, port)"
    )
    keeper.start([None, "-c", code], {"X": "1"})
    lines, returncode = _drain_keeper(keeper)
    assert lines == [(1, f"None 1 True {port}")] and returncode == 0


def test_a_keepers_child_dies_with_the_thread_that_started_it():
    """What happens to a child when its actor dies: PR_SET_PDEATHSIG from the exec wrapper."""
    script = (  # the child has become the target (it printed) before its starter is killed
        "import time\n"
        "from paratrain.launch.engines.ray.process import RoleProcess\n"
        "target = 'import time; print(1, flush=True); time.sleep(60)'\n"
        "k = RoleProcess(); pid = k.start([None, '-c', target], {})\n"
        "assert k.poll(30)['lines'] == [(1, '1')]\n"
        "print(pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    proc.kill()
    proc.wait()
    assert_all_gone([child], wait_s=10)


def _drain_keeper(keeper: RoleProcess) -> tuple[list[tuple[int, str]], int]:
    lines = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        reply = keeper.poll(1.0)
        lines += [tuple(line) for line in reply["lines"]]
        if reply["returncode"] is not None:
            return lines, reply["returncode"]
    raise AssertionError(f"the keeper's child did not exit within 30 s; lines so far {lines}")


# -- real jobs on a 2-node cluster


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no report to send from a test cluster
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": NODE_CPUS, "num_gpus": 1, "include_dashboard": False},
    )
    try:
        # GPUs as Ray counts them: no device needed. Not add_node's own 30 s wait: 2 busy cores
        # have taken longer.
        cluster.add_node(wait=False, num_cpus=NODE_CPUS, num_gpus=1)
        cluster.wait_for_nodes(timeout=120)
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster
    finally:
        ours = _descendants(os.getpid())
        ray.shutdown()
        cluster.shutdown()
        assert_all_gone(ours, wait_s=30)
        left = [pid for pid, name in _processes() if name in _RAY_PROGRAMS]
        assert not left, f"Ray processes left after the cluster was shut down: pids {left}"


class _Output(io.StringIO):
    """A stream that files each prefixed line by (role, rank) and can act on a line as it comes."""

    def __init__(self, on_line=None) -> None:
        super().__init__()
        self.by_child: dict[tuple[str, int], list[str]] = {}
        self.nodes: dict[tuple[str, int], str] = {}
        self._on_line = on_line
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            for line in text.splitlines():
                match = _LINE.match(line)
                if match:
                    key = (match[1], int(match[2]))
                    self.nodes[key] = match[3]
                    self.by_child.setdefault(key, []).append(match[4])
                    if self._on_line is not None:
                        self._on_line(key, match[4])
            return super().write(text)


def _run(args, workers=2, servers=2, on_line=None, launch=None, **options):
    config = LaunchConfig(
        script=str(args[0]), args=tuple(args[1:]), num_workers=workers, num_servers=servers, **(launch or {})
    )
    out, err = _Output(on_line), _Output()
    result = run_ray(config, RayOptions(address="auto", **options), out=out, err=err)
    assert_all_gone(result.pids, wait_s=15)
    _assert_nothing_left_on_ray()
    return result, out, err


def _assert_nothing_left_on_ray(wait_s: float = 15.0) -> None:
    deadline = time.monotonic() + wait_s
    while True:
        actors = ray._private.state.actors(actor_state_name="ALIVE")
        groups = [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
        if not actors and not groups:
            return
        if time.monotonic() > deadline:
            raise AssertionError(
                f"left on Ray after the job: actors {list(actors)}, placement groups {groups}"
            )
        time.sleep(0.2)


def test_an_exact_kvstore_job_runs_on_two_nodes_with_a_server_on_each(cluster):
    result, out, err = _run([ROLES, "exact"], workers=2, servers=2)
    assert result.exit_code == 0, err.getvalue()
    for rank in range(2):
        assert out.by_child[("worker", rank)][-2:] == ["all exact", "done"]
    places = [
        next(line for line in out.by_child[("worker", r)] if line.startswith("place ")) for r in range(2)
    ]
    worker_nodes = [result.nodes[f"worker {rank}"] for rank in range(2)]
    together = worker_nodes[0] == worker_nodes[1]
    assert places == (["place 0 2", "place 1 2"] if together else ["place 0 1", "place 0 1"]), worker_nodes
    server_nodes = {result.nodes[f"server {rank}"] for rank in range(2)}
    alive = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    assert len(server_nodes) == 2, result.nodes  # STRICT_SPREAD: one server on each node
    assert {label.rsplit("/", 1)[-1] for label in server_nodes} == {node_id[:6] for node_id in alive}
    assert "job finished: 2 worker(s) succeeded" in err.getvalue()


def test_a_job_the_cluster_cannot_hold_starts_nothing_and_says_why(cluster):
    result, _, err = _run([ROLES, "ok"], workers=2, servers=1, cpus_per_worker=NODE_CPUS + 1)  # 3 per node
    assert result.exit_code == 1 and result.children == []
    said = "could not start the job on Ray: no node of the Ray cluster can hold a worker (CPU 4)"
    assert said in err.getvalue()


def test_a_failing_worker_stops_the_job_and_is_named_with_its_node(cluster):
    """Also: each process's threads are its CPUs, and each worker sees the GPU it reserved."""
    result, out, err = _run([ROLES, "raise"], workers=2, servers=1, cpus_per_worker=2, gpus_per_worker=1)
    assert result.exit_code == 1
    failure = result.failure
    assert (failure.role, failure.rank, failure.returncode) == ("worker", 1, 1), err.getvalue()
    assert failure.host == out.nodes[("worker", 1)]
    assert "RuntimeError: worker 1 fails on purpose" in failure.stderr_tail
    first = err.getvalue().splitlines()[-len(result.report.splitlines())]
    assert first.startswith(
        f"paratrain: job failed: worker 1 (pid {failure.pid}, host {failure.host}) exited with code 1"
    )
    threads = {key: lines[0].split()[-1] for key, lines in out.by_child.items()}
    assert threads == {("scheduler", 0): "1", ("server", 0): "1", ("worker", 0): "2", ("worker", 1): "2"}
    # Each worker reserved a GPU and each node has one: one worker per node, each told its GPU.
    assert [out.by_child[("worker", rank)][0].split()[5] for rank in range(2)] == ["'0'", "'0'"]
    assert out.nodes[("worker", 0)] != out.nodes[("worker", 1)]


def test_a_killed_process_is_reported_and_every_process_is_gone(cluster):
    pids: dict[int, int] = {}

    def kill_worker_1_once_it_is_ready(key, line):
        if key == ("worker", 1) and line.startswith("ready"):
            pids[1] = int(line.split()[1])
            os.kill(pids[1], signal.SIGKILL)

    result, out, err = _run([ROLES, "hang"], workers=2, servers=1, on_line=kill_worker_1_once_it_is_ready)
    assert result.exit_code == 1, err.getvalue()
    failure = result.failure
    assert (failure.role, failure.rank, failure.signal) == ("worker", 1, "SIGKILL")
    assert failure.host == out.nodes[("worker", 1)]
    assert f"worker 1 (pid {pids[1]}, host {failure.host}) was killed by signal SIGKILL" in result.report


def test_the_job_timeout_stops_every_process(cluster):
    """Whatever the processes had reached when the timeout came, they are stopped and it is said."""
    config = LaunchConfig(script=ROLES, args=("hang",), num_workers=1, num_servers=1, timeout_s=3.0)
    out, err = _Output(), _Output()
    result = run_ray(config, RayOptions(), out=out, err=err)
    assert result.exit_code == 1
    failure = result.failure
    assert (failure.role, failure.rank) == ("worker", 0)
    assert failure.reason == "was still running when the job timed out after 3.0 s"
    assert_all_gone(result.pids, wait_s=15)
    _assert_nothing_left_on_ray()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_the_cli_runs_on_ray_and_stopping_the_driver_stops_every_process_on_every_node(cluster, signum):
    """SIGINT (Ctrl-C): the driver stops every process itself. SIGKILL: Ray kills the actors of
    a driver that died, and each child dies with its actor."""
    cmd = [PARATRAIN, "launch", "--backend", "ray", "--address", cluster.address, "-w", "2", "-s", "2"]
    proc = subprocess.Popen(
        [*cmd, ROLES, "hang"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )

    # Ctrl-C comes once every worker is ready (every role serving); the driver dies as soon as
    # every process has started (what Ray must clean up is there by then).
    def started(ready, pids):
        return ready == 2 if signum == signal.SIGINT else len(pids) == 5

    pids, nodes, ready = [], set(), 0
    try:
        for line in proc.stdout:
            match = _LINE.match(line.rstrip("\n"))
            if not match:
                continue
            if match[4].startswith("pid "):
                pids.append(int(match[4].split()[1]))
                nodes.add(match[3])
            ready += match[4].startswith("ready")
            if started(ready, pids):
                break
        assert started(ready, pids), proc.stderr.read()
        proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert len(pids) == 5 and len(nodes) == 2, (pids, nodes)
    assert "threads per process: OMP_NUM_THREADS = its CPUs" in stderr
    if signum == signal.SIGINT:
        assert proc.returncode == 130, stderr
        assert "interrupted by SIGINT; stopped every process of the job" in stderr
    else:
        assert proc.returncode == -signal.SIGKILL
    assert_all_gone(pids, wait_s=30)
    _assert_nothing_left_on_ray(wait_s=30)


def _processes() -> list[tuple[int, str]]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                found.append((int(entry.name), (entry / "comm").read_text().strip()))
            except OSError:
                pass
    return found


def _descendants(root: int) -> list[int]:
    parents = {}
    for pid, _ in _processes():
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            parents[pid] = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            pass
    found, frontier = [], [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent]
        found += children
        frontier += children
    return found


def test_a_submitted_job_runs_on_ray_with_its_folders_checked_on_every_node(cluster, tmp_path, monkeypatch):
    """The job platform's driver (job_driver.drive, as `paratrain submit` runs it) on the cluster:
    the job's folders are seen on both nodes, each process's output lands in its own log."""
    from paratrain.launch import engines, jobs
    from paratrain.launch.engines.ray import missing_on_ray_nodes
    from paratrain.launch.job_driver import drive
    from paratrain.launch.jobspec import parse_spec

    monkeypatch.setenv("PARATRAIN_HOME", str(tmp_path / "home"))
    (tmp_path / "data").mkdir()
    text = (
        f"name: onray\nentry: {{script: {ROLES}, args: [ok]}}\nworkers: 2\nservers: 1\nbackend: ray\n"
        f"ray: {{address: {cluster.address}}}\n"
        f"data_dir: {tmp_path / 'data'}\noutput_dir: {tmp_path / 'out'}\n"
    )
    spec = parse_spec(text, "job.yaml", base=tmp_path)
    job_id = jobs.new_job_id(spec.name)
    record = jobs.open_job(spec, job_id, engines.get("ray").job_folder(spec.output_dir, job_id))
    assert drive(Path(record.folder)) == 0
    record = jobs.read_record(record.folder)
    assert record.state == "succeeded" and record.exit_code == 0, record.failure
    for rank in range(2):
        log = (Path(record.folder) / "logs" / f"worker-{rank}.log").read_text()
        assert log.startswith("pid ") and "threads 1" in log.splitlines()[0]
    assert "[server 0 @" in (Path(record.folder) / "job.log").read_text()
    assert_all_gone(record.extra["pids"], wait_s=15)
    _assert_nothing_left_on_ray()
    assert missing_on_ray_nodes([str(tmp_path / "data")]) == ""
    missing = missing_on_ray_nodes([str(tmp_path / "nowhere")])
    assert missing.count(f"has no {tmp_path / 'nowhere'}") == 2  # each node says so


def test_an_elastic_jobs_worker_lost_with_its_actor_is_restarted_on_a_new_one_and_joins(cluster):
    """--max-restarts 1: worker 1 SIGKILLs its actor in epoch 1 and dies with it, which is how a
    lost node looks to the driver; a new actor in the same bundle starts a replacement, which joins
    at epoch 2, and the weight counts every round exactly once (elastic_count.py). (A process that
    dies under a live actor is started again by that actor: the keeper's test above.)"""
    args = [COUNT, "--kill", "1:1:parent"]
    result, out, err = _run(args, workers=2, servers=1, launch={"max_restarts": 1})
    assert result.exit_code == 0, err.getvalue()
    said = {rank: out.by_child[("worker", rank)][-1] for rank in (0, 1)}
    assert said[0] == "worker 0: weight 18 steps 18 epochs [0, 1, 2] joined False", said
    assert said[1] == "worker 1: weight 18 steps 6 epochs [2] joined True", said
    first, second = [c for c in result.children if (c.role, c.rank) == ("worker", 1)]
    assert (first.returncode, second.returncode) == (None, 0)  # lost with its actor, then finished
    [note] = [line for line in err.getvalue().splitlines() if "the job goes on" in line]
    assert f"worker 1 (pid {first.pid}, host " in note and "was lost: its Ray actor died" in note
    assert note.endswith("the job goes on (restart 1 of 1)")


def test_a_dead_node_stops_the_job_and_is_named(cluster):
    """Last in the module: it takes the cluster's second node away for good."""
    [other] = cluster.worker_nodes
    victim = other.node_id[:6]
    ready: set[int] = set()

    def remove_the_node_once_every_worker_is_ready(key, line):
        if line.startswith("ready"):
            ready.add(key[1])
            if ready == {0, 1}:
                cluster.remove_node(other)

    # stop_grace_s: the others exit aborted at once, Ray tells of the lost actors a little later
    on_line = remove_the_node_once_every_worker_is_ready
    result, out, err = _run([ROLES, "hang"], workers=2, servers=2, on_line=on_line, stop_grace_s=15)
    assert result.exit_code == 1, err.getvalue()
    failure = result.failure
    assert failure.host.endswith(f"/{victim}"), result.report
    assert f"was lost with its node {failure.host} (Ray node {victim}" in result.report
