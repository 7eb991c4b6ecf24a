"""`paratrain launch --backend slurm` on a real one-machine Slurm, and the script it writes.

The `slurm` fixture starts munged, slurmctld and slurmd from a temporary config (one node: this
machine under its own hostname; state, spool, logs and the munge key in a temporary directory;
ports chosen free) and stops them afterwards, checking that no process of that cluster is left. It
installs nothing: `scripts/setup_test.sh` installs Debian's slurm-wlm and munge when run as root. Where
they are missing the Slurm tests skip with that reason, except in CI (CI=true), where they fail.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest

from paratrain.launch.api import LaunchConfig
from paratrain.launch.engines.slurm.sbatch import (
    SlurmOptions,
    run_slurm_job,
    sbatch_script,
    supervised_task,
    task_roles,
)
from paratrain.testing import free_port

JOBS = Path(__file__).parent / "jobs"
COUNT = str(JOBS / "elastic_count.py")
PARATRAIN = str(Path(sys.executable).parent / "paratrain")
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "sinfo", "squeue", "scontrol", "scancel", "srun")
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
JOB_TIMEOUT_S = 150.0
NODE_CPUS = 8  # more than this machine has: slurmd takes the config's word (config_overrides)


# ---- the one-machine cluster --------------------------------------------------------------------


@dataclass
class SlurmCluster:
    root: Path
    conf: Path
    node: str
    env: dict[str, str]
    """os.environ plus SLURM_CONF: what a client command (and a job submitted with it) gets."""

    def run(self, *cmd: str, timeout_s: float = 30.0) -> str:
        done = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout_s)
        assert done.returncode == 0, f"{shlex.join(cmd)} exited {done.returncode}: {done.stderr}"
        return done.stdout

    def logs(self) -> str:
        tails = []
        for log in sorted((self.root / "log").glob("*.log")):
            lines = log.read_text(errors="replace").splitlines()[-15:]
            tails.append(f"--- {log.name}\n" + "\n".join(lines))
        return "\n".join(tails)

    def wait_for_job(self, job_id: str, timeout_s: float = JOB_TIMEOUT_S) -> str:
        """Polls scontrol until the job has ended; returns its final state (e.g. COMPLETED)."""
        deadline = time.monotonic() + timeout_s
        state = "unknown"
        while time.monotonic() < deadline:
            shown = self.run("scontrol", "show", "job", "-o", job_id)
            state = re.search(r"JobState=(\S+)", shown)[1]
            if state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
                return state
            time.sleep(0.5)
        raise AssertionError(f"Slurm job {job_id} still {state} after {timeout_s} s\n{self.logs()}")


def _missing() -> str | None:
    absent = [name for name in (*DAEMONS, *CLIENTS) if shutil.which(name) is None]
    if absent:
        return f"{', '.join(absent)} not installed: scripts/setup_test.sh installs them as root"
    if os.geteuid() != 0:
        return "slurmd must run as root to start tasks"
    return None


def _config(root: Path, node: str, cpus: int) -> str:
    return f"""\
ClusterName=paratrain-test
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.sock
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=test Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""


def _start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out)


def _wait(what: str, ready, timeout_s: float, logs) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() >= deadline:
            raise AssertionError(f"waited {timeout_s} s for {what}\n{logs()}")
        time.sleep(0.2)


def _idle(cluster: SlurmCluster) -> bool:
    return _node_state(cluster) == "idle"


def _node_state(cluster: SlurmCluster) -> str:
    done = subprocess.run(
        ["sinfo", "-h", "-n", cluster.node, "-o", "%T"], env=cluster.env, capture_output=True, text=True
    )
    return done.stdout.strip()


def _processes_of(conf: Path) -> list[int]:
    """Every process whose environment names this cluster's config: its daemons, step daemons,
    batch scripts and tasks (a job inherits SLURM_CONF from the sbatch that submitted it)."""
    marker = f"SLURM_CONF={conf}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue  # gone, or not ours to read
        if marker in environ.split(b"\0"):
            pids.append(int(entry.name))
    return pids


def _cancel_all(cluster: SlurmCluster) -> None:
    """Cancels every job of the cluster and waits until none is left (its processes gone)."""
    subprocess.run(["scancel", "--user=root"], env=cluster.env, capture_output=True, timeout=30)
    _wait("every job to end", partial(_no_jobs, cluster), STOP_TIMEOUT_S, cluster.logs)


def _no_jobs(cluster: SlurmCluster) -> bool:
    return not cluster.run("squeue", "-h", "-o", "%i").strip()


def _survivors(conf: Path) -> list[int]:
    """Processes of the cluster still there STOP_TIMEOUT_S after its daemons stopped (a step daemon
    may still be tidying up a moment after its job ended)."""
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while (left := _processes_of(conf)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in reversed(procs):  # slurmd, slurmctld, then munged, which they use to the end
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_TIMEOUT_S)


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    reason = _missing()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"the Slurm tests must run in CI: {reason}")
        pytest.skip(reason)
    # munged insists that every directory above its socket is searchable by all (pytest's are not).
    root = Path(tempfile.mkdtemp(prefix="paratrain-slurm-"))
    root.chmod(0o755)
    for sub in ("munge", "state", "spool", "log"):
        (root / sub).mkdir(mode=0o755)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    node = socket.gethostname().split(".")[0]
    conf = root / "slurm.conf"
    conf.write_text(_config(root, node, NODE_CPUS))
    cluster = SlurmCluster(root, conf, node, {**os.environ, "SLURM_CONF": str(conf)})
    munge = root / "munge"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(
            _start(
                ["munged", "-F", f"--key-file={key}", f"--socket={munge}/munge.sock",
                 f"--pid-file={munge}/munged.pid", f"--seed-file={munge}/seed",
                 f"--log-file={root}/log/munged.log"],
                cluster.env,
                root / "log" / "munged.out.log",
            )
        )  # fmt: skip
        _wait("munged's socket", (munge / "munge.sock").exists, START_TIMEOUT_S, cluster.logs)
        procs.append(_start(["slurmctld", "-D", "-f", str(conf)], cluster.env, root / "log" / "ctld.out.log"))
        procs.append(
            _start(["slurmd", "-D", "-N", node, "-f", str(conf)], cluster.env, root / "log" / "d.out.log")
        )
        _wait(f"node {node} to be idle", partial(_idle, cluster), START_TIMEOUT_S, cluster.logs)
        yield cluster
    finally:
        try:
            if len(procs) == len(DAEMONS) and all(proc.poll() is None for proc in procs):
                _cancel_all(cluster)
        finally:
            _stop(procs)
            left = _survivors(conf)
            for pid in left:
                os.kill(pid, signal.SIGKILL)
            shutil.rmtree(root, ignore_errors=True)
        assert not left, f"processes of the test Slurm cluster still running after it stopped: {left}"


# ---- a real job ----------------------------------------------------------------------------------


def _submit(cluster: SlurmCluster, cwd: Path, *args: str) -> tuple[str, Path]:
    cmd = [PARATRAIN, "launch", "--backend", "slurm", *args]
    done = subprocess.run(cmd, env=cluster.env, cwd=cwd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    job_id = re.search(r"submitted Slurm job (\d+)", done.stdout)[1]
    output = Path(re.search(r"output in (\S+)", done.stdout)[1])
    return job_id, output


@pytest.mark.timeout(240)
def test_a_kvstore_job_runs_under_sbatch_and_srun_with_exact_values(slurm, tmp_path):
    job_id, output = _submit(
        slurm, tmp_path, "-w", "2", "-s", "1", "--time", "5", str(JOBS / "kv_exact.py"), "dist_sync", "2"
    )
    assert output == tmp_path / f"paratrain-kv_exact-{job_id}.out"

    state = slurm.wait_for_job(job_id)
    text = output.read_text()
    assert state == "COMPLETED", f"job {job_id} ended {state}:\n{text}\n{slurm.logs()}"
    for rank in (0, 1):  # every line carries its role, rank and node
        for line in ("round 1 exact", "push-ahead exact", "optimizer round 1 exact", "all exact"):
            assert f"[worker {rank} @{slurm.node}] {line}\n" in text, (rank, line, text)
    assert "paratrain: srun task 0: worker 0, 1: worker 1, 2: server 0" in text


def test_a_failed_task_stops_the_step_and_the_output_names_it(slurm, tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(
        "import os, sys, time\n"
        "if os.environ['SLURM_PROCID'] == '1':\n"
        "    sys.exit('worker 1 gives up')\n"
        "time.sleep(600)  # stopped by srun --kill-on-bad-exit, not by the time limit\n"
    )
    job_id, output = _submit(slurm, tmp_path, "-w", "2", "-s", "0", "--time", "5", str(script))
    state = slurm.wait_for_job(job_id)
    text = output.read_text()
    assert state == "FAILED", f"job {job_id} ended {state}:\n{text}"
    assert f"[worker 1 @{slurm.node}] worker 1 gives up\n" in text
    assert re.search(rf"srun: error: {slurm.node}: task 1: Exited with exit code 1", text), text
    assert "paratrain: job failed: srun exited with code" in text


@pytest.mark.timeout(240)
def test_an_elastic_jobs_killed_worker_task_starts_it_again_and_it_joins(slurm, tmp_path):
    """--max-restarts 1: worker 1 (task 1) SIGKILLs itself in epoch 1; its task's loop starts it
    again, the new process joins at epoch 2, and the weight counts every round exactly once."""
    args = ("-w", "2", "-s", "1", "--max-restarts", "1", "--time", "5", COUNT, "--kill", "1:1")
    job_id, output = _submit(slurm, tmp_path, *args)
    state = slurm.wait_for_job(job_id)
    text = output.read_text()
    assert state == "COMPLETED", f"job {job_id} ended {state}:\n{text}\n{slurm.logs()}"
    node = slurm.node
    assert f"[worker 0 @{node}] worker 0: weight 18 steps 18 epochs [0, 1, 2] joined False\n" in text, text
    assert f"[worker 1 @{node}] worker 1: weight 18 steps 6 epochs [2] joined True\n" in text, text
    said = f"paratrain: worker 1 (host {node}) was killed by signal SIGKILL; the job goes on (restart 1 of 1)"
    assert said in text


def test_setup_commands_run_before_the_tasks_and_extra_options_reach_sbatch(slurm, tmp_path):
    script = tmp_path / "show.py"
    script.write_text("import os\nprint('setup gave', os.environ['FROM_SETUP'])\n")
    args = ("--setup", "FROM_SETUP=$(echo ok)", "--setup", "export FROM_SETUP", "--sbatch=--comment=ptest")
    job_id, output = _submit(slurm, tmp_path, "-w", "1", "-s", "0", "--time", "5", *args, str(script))
    state = slurm.wait_for_job(job_id)
    text = output.read_text()
    assert state == "COMPLETED", f"job {job_id} ended {state}:\n{text}"
    assert f"[worker 0 @{slurm.node}] setup gave ok\n" in text
    assert "Comment=ptest" in slurm.run("scontrol", "show", "job", job_id)


# ---- the script, without Slurm --------------------------------------------------------------------


def test_cluster_options_become_directives_and_setup_runs_first():
    options = SlurmOptions(
        account="ml",
        qos="high",
        constraint="v100&ib",
        extra_sbatch=("--mail-type=END", "--exclusive", "--comment=it's $(x)"),
        setup=("module load cuda/12.4", "source /shared/venv/bin/activate"),
    )
    script = sbatch_script(LaunchConfig(script="train.py", num_workers=2, num_servers=1), options)
    lines = script.splitlines()
    directives = [line for line in lines if line.startswith("#SBATCH")]
    assert directives[-6:] == [
        "#SBATCH --account=ml",
        "#SBATCH --qos=high",
        "#SBATCH --constraint='v100&ib'",
        "#SBATCH --mail-type=END",
        "#SBATCH --exclusive",
        "#SBATCH --comment='it'\"'\"'s $(x)'",
    ]
    setup = lines.index("module load cuda/12.4")
    assert lines[setup - 1] == "set +u" and lines[setup + 2] == "set -u"
    assert setup < min(i for i, line in enumerate(lines) if "python" in line.split("#")[0])
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("extra_sbatch", ("--partition=gpu",), "extra_sbatch[0]: --partition is written by paratrain"),
        ("extra_sbatch", ("mail-type=END",), "must be one sbatch option, --name=value or --flag"),
        ("extra_sbatch", ("--comment=a\nb",), "extra_sbatch[0] holds a line break"),
        ("setup", ("module load a\nrm -rf x",), "setup[0] must be one shell command on one line, got"),
        ("constraint", "v100 ib", "constraint must be node features joined by & | , * and [ ] ( )"),
        ("account", "a b", "account must be a word of letters, digits and _.,:@%+=/-, got 'a b'"),
        ("qos", "x\n#SBATCH --uid=0", "qos must be a word"),
    ],
)  # fmt: skip
def test_cluster_options_refuse_what_sbatch_cannot_carry_naming_field_and_value(field, value, message):
    with pytest.raises(ValueError) as refused:
        SlurmOptions(**{field: value})
    assert message in str(refused.value)


def test_dry_run_prints_a_script_whose_single_srun_starts_every_role(tmp_path):
    cmd = [
        PARATRAIN, "launch", "--backend", "slurm", "--dry-run", "-w", "3", "-s", "2",
        "--partition", "gpu", "--time", "1:30:00", "--nodes", "2",
        "--cpus-per-worker", "2", "--cpus-per-server", "1", "--gpus-per-worker", "1",
        str(JOBS / "kv_exact.py"), "dist_async", "--flag",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    done = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    script = done.stdout
    directives = [line[len("#SBATCH ") :] for line in script.splitlines() if line.startswith("#SBATCH ")]
    shared = ["--partition=gpu", "--time=1:30:00"]
    assert directives == [
        "--job-name=paratrain-kv_exact",
        f"--output={tmp_path}/paratrain-kv_exact-%j.out",
        "--ntasks=3", "--cpus-per-task=2", "--gpus-per-task=1", "--nodes=2", *shared,
        "hetjob",  # servers in a component of their own: their CPUs, no GPU
        "--ntasks=2", "--cpus-per-task=1", *shared,
    ]  # fmt: skip
    sruns = [line for line in script.splitlines() if line.startswith("srun ")]
    assert len(sruns) == 1
    workers, servers = sruns[0].split(" : ")
    assert workers.startswith(
        "srun --kill-on-bad-exit=1 --het-group=0 --ntasks=3 --cpus-per-task=2 --gpus-per-task=1 "
    )
    assert servers.startswith("--het-group=1 --ntasks=2 --cpus-per-task=1 bash -c ")
    assert 'labels=("worker 0" "worker 1" "worker 2" "server 0" "server 1"); ' in script
    assert f"-u {JOBS / 'kv_exact.py'} dist_async --flag" in workers and servers.endswith("&& exit 0")
    for export in (
        "PARATRAIN_NUM_SERVERS=2",
        "OMP_NUM_THREADS=2",
        "MASTER_ADDR MASTER_PORT",
        "PARATRAIN_SECRET",
    ):
        assert re.search(rf"^export {export}$", script, re.M), export
    assert 'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)' in script
    assert "2 server(s) with none, as a heterogeneous job" in done.stderr
    assert "OMP_NUM_THREADS=2" in done.stderr
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


@pytest.mark.parametrize("workers, servers", [(3, 2), (2, 2), (4, 1)])
def test_each_task_of_a_heterogeneous_job_is_the_role_and_rank_of_one_srun(workers, servers):
    """The command every task of a heterogeneous job runs, without Slurm: task numbers go workers
    first, and each task's cluster spec is the role and rank it would have in one plain srun."""
    config = LaunchConfig(script="train.py", num_workers=workers, num_servers=servers)
    options = SlurmOptions(gpus_per_worker=1, cpus_per_worker=4, cpus_per_server=2)
    script = sbatch_script(config, options, environ={})
    assert "\nexport OMP_NUM_THREADS=4\n" in script  # the workers'; a server task exports its own
    (line,) = [line for line in script.splitlines() if line.startswith("PREFIX_OUTPUT=")]
    report = (
        "from paratrain.cluster.spec import spec_from_env; s = spec_from_env(); "
        "import os; print(s.role, s.rank, s.num_workers, s.num_servers, "
        "repr(os.environ.get('CUDA_VISIBLE_DEVICES')), os.environ['OMP_NUM_THREADS'])"
    )
    seen = []
    for task in range(workers + servers):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PARATRAIN_", "SLURM_"))}
        env.update(SLURM_PROCID=str(task), SLURMD_NODENAME="n1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
        env.update(PARATRAIN_NUM_SERVERS=str(servers), PARATRAIN_SECRET="ab" * 32, CUDA_VISIBLE_DEVICES="0")
        env["OMP_NUM_THREADS"] = "4"
        done = subprocess.run(
            ["bash", "-c", f'{line}\nbash -c "$PREFIX_OUTPUT" "$@"', "bash", sys.executable, "-c", report],
            env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        seen.append(done.stdout.strip())
    one_srun = [
        f"[{role} {rank} @n1] {role} {rank} {workers} {servers} {'' if role == 'server' else '0'!r} "
        + ("2" if role == "server" else "4")
        for role, rank in task_roles(workers, servers, het=True)
    ]
    assert seen == one_srun
    assert task_roles(workers, servers, het=True)[0] == ("worker", 0)  # task 0 runs the scheduler


def test_more_servers_than_workers_stay_one_srun():
    config = LaunchConfig(script="train.py", num_workers=1, num_servers=2)
    assert "hetjob" not in sbatch_script(config, SlurmOptions(gpus_per_worker=1))


@pytest.mark.parametrize(
    "task, deaths, code, notes",
    [
        (1, 1, 0, ["restart 1 of 2"]),  # a worker: started again, then it finishes
        (1, 3, 0, ["restart 1 of 2", "restart 2 of 2", "not restarted: all 2 used"]),  # goes on without it
        (0, 1, 128 + signal.SIGKILL, []),  # task 0 runs the scheduler: its death ends the job
        (2, 1, 128 + signal.SIGKILL, []),  # a server is not restarted
    ],
)
def test_an_elastic_task_starts_a_dead_worker_again_while_restarts_last(tmp_path, task, deaths, code, notes):
    """The loop every task of an elastic job runs, without Slurm: the script dies `deaths` times."""
    count = tmp_path / "count"
    script = (
        "import os, signal, sys\n"
        f"runs = int(open({str(count)!r}).read()) if os.path.exists({str(count)!r}) else 0\n"
        f"open({str(count)!r}, 'w').write(str(runs + 1))\n"
        "print('run', runs, flush=True)\n"
        f"if runs < {deaths}:\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    env = {**os.environ, "SLURM_PROCID": str(task), "SLURMD_NODENAME": "n1"}
    command = ["bash", "-c", supervised_task(2, 1, 2), sys.executable, "-c", script]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == code, done.stderr
    label = task_roles(2, 1)[task]
    runs = 1 + len([note for note in notes if note.startswith("restart")])
    assert done.stdout.splitlines() == [f"[{label[0]} {label[1]} @n1] run {n}" for n in range(runs)]
    said = f"paratrain: {label[0]} {label[1]} (host n1) was killed by signal SIGKILL; the job goes on"
    assert done.stderr.splitlines() == [f"{said} ({note})" for note in notes]


def test_the_secret_is_made_at_run_time_and_never_written_down():
    given = {"PARATRAIN_SECRET": "cd" * 32}
    config = LaunchConfig(script="train.py", num_workers=2, num_servers=1, strategy="dist_async", env=given)
    environ = {"PARATRAIN_SECRET": "ab" * 32, "PARATRAIN_ROLE": "worker", "RANK": "3"}
    script = sbatch_script(config, SlurmOptions(), environ)
    assert "\nexport PARATRAIN_STRATEGY=dist_async\n" in script
    assert "ab" * 32 not in script and "cd" * 32 not in script  # neither inherited nor given secrets
    (assignment,) = [line for line in script.splitlines() if line.startswith("PARATRAIN_SECRET=")]
    assert assignment.endswith("-c 'import secrets; print(secrets.token_hex(32))')")
    # ... and run, it gives every task one fresh secret through the environment: run the script's
    # secret line in bash, as the batch script would.
    lines = f"{assignment}\nexport PARATRAIN_SECRET\nenv"
    probe = subprocess.run(["bash", "-c", lines], capture_output=True, text=True, timeout=30)
    (secret,) = re.findall(r"^PARATRAIN_SECRET=([0-9a-f]{64})$", probe.stdout, re.M)
    assert secret != "ab" * 32
    # identity inherited from the submitting shell is dropped before srun reads the convention
    unset = next(line for line in script.splitlines() if line.startswith("unset "))
    assert {"PARATRAIN_ROLE", "RANK", "PARATRAIN_SECRET_FILE", "PARATRAIN_SCHEDULER"} <= set(unset.split())


def test_user_threads_are_kept_and_the_job_timeout_becomes_the_time_limit():
    config = LaunchConfig(script="train.py", num_workers=1, num_servers=1, timeout_s=90)
    script = sbatch_script(config, SlurmOptions(cpus_per_worker=4), {"OMP_NUM_THREADS": "3"})
    assert "OMP_NUM_THREADS" not in script and "#SBATCH --time=2\n" in script


@pytest.mark.parametrize(
    "workers, servers, expected",
    [
        (2, 1, ["w0", "w1", "s0"]),
        (3, 2, ["w0", "s0", "w1", "w2", "s1"]),
        (4, 4, ["w0", "s0", "w1", "s1", "w2", "s2", "w3", "s3"]),
        (2, 0, ["w0", "w1"]),
    ],
)
def test_task_roles_spread_servers_to_the_ends_of_equal_blocks(workers, servers, expected):
    assert [f"{role[0]}{rank}" for role, rank in task_roles(workers, servers)] == expected


@pytest.mark.parametrize(
    "field, value",
    [
        ("partition", "a b"),
        ("partition", "x\n#SBATCH --uid=0"),
        ("time", "soon"),
        ("nodes", 0),
        ("nodes", True),
        ("cpus_per_worker", 0),
        ("cpus_per_server", -1.0),
        ("gpus_per_worker", -1),
        ("job_name", ""),
    ],
)
def test_options_reject_bad_values_naming_field_and_value(field, value):
    with pytest.raises(ValueError, match=rf"{field} .*{re.escape(repr(value))}"):
        SlurmOptions(**{field: value})


def test_more_nodes_than_tasks_is_refused_before_anything_is_submitted(capsys):
    config = LaunchConfig(script="train.py", num_workers=1, num_servers=1)
    assert run_slurm_job(config, SlurmOptions(nodes=3)) == 2
    assert "nodes=3 is more than the job's 2 tasks" in capsys.readouterr().err


@pytest.mark.parametrize("elastic", [False, True])
def test_each_task_sees_its_own_gpus_and_a_server_none(tmp_path, elastic):
    """The command every task runs, without Slurm: srun has bound each task to its GPUs."""
    config = LaunchConfig(script="train.py", num_workers=2, num_servers=1, max_restarts=int(elastic))
    script = sbatch_script(config, SlurmOptions(gpus_per_worker=2))
    (line,) = [line for line in script.splitlines() if line.startswith("PREFIX_OUTPUT=")]
    names = "'CUDA_VISIBLE_DEVICES', 'PARATRAIN_GPUS_PER_WORKER'"
    report = f"import os; print(*(os.environ.get(name) for name in ({names})))"
    seen = []
    for task in range(3):
        env = {
            **os.environ,
            "SLURM_PROCID": str(task),
            "SLURMD_NODENAME": "n1",
            "CUDA_VISIBLE_DEVICES": "6,7",
        }
        env.pop("PARATRAIN_GPUS_PER_WORKER", None)
        shell = f'{line}\nbash -c "$PREFIX_OUTPUT" "$@"'
        done = subprocess.run(
            ["bash", "-c", shell, "bash", sys.executable, "-c", report],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        seen.append(done.stdout.strip())
    assert seen == ["[worker 0 @n1] 6,7 2", "[worker 1 @n1] 6,7 2", "[server 0 @n1]  None"]
