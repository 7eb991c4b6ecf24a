"""`paratrain launch --backend slurm`: one sbatch script whose single `srun` starts every role.

The script asks Slurm for W+S tasks and starts them all with one `srun`; each task finds its role
and rank in the cluster spec's Slurm convention (SLURM_PROCID, SLURM_NTASKS) with
PARATRAIN_NUM_SERVERS=S: S of the tasks are servers, the rest workers, and global rank 0 runs the
scheduler at MASTER_ADDR:MASTER_PORT+1 (see cluster/spec.py). MASTER_ADDR is the allocation's first
node, where the batch script itself runs, so the script picks MASTER_PORT there, at run time, as a
port free together with the next one.

The job secret is made inside the batch script when it runs and reaches the tasks through srun's
environment: it is never in the script's text (which Slurm keeps), on a command line or in a file.
`srun --kill-on-bad-exit=1` ends the step as soon as one task fails, and srun's own error line names
that task and its node. Each task runs the script under `bash -c`, which prefixes every line of its
output with `[role rank @node] ` (as the local launcher prefixes `[role rank] `); the table of roles
in that command is `server_ranks` of the cluster spec, the rule each task's spec_from_env applies.

Elastic jobs (`--elastic`, `--max-restarts N`; restarts.py): each task's command is then a small
supervisor loop (`supervised_task`) around the script. A worker task whose process dies starts it
again, with the same identity, up to N times (counted per task: the tasks share no state), and the
new process joins the running job; with no restarts left the task ends with code 0 and the job
goes on without that worker (the scheduler stops it below min_workers, and every task's output
then names the dead worker). Task 0 is not restarted, nor are servers: task 0 runs the scheduler
(cluster/spec.py), whose death ends the job. A node that fails takes its tasks' loops with it, and
srun ends the step: the loop restarts processes, not nodes. srun has nothing to restart a task with: its
--kill-on-bad-exit ends the step on a task's failure, --no-kill only keeps the allocation when a
node fails, and sbatch --requeue starts the whole batch job again; hence the loop.

The command returns once sbatch accepted the job (or failed to), printing the job id and the output
file; `--dry-run` prints the script instead of submitting it.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from paratrain.cluster.spec import EXIT_ABORTED, server_ranks
from paratrain.launch.api import LaunchConfig, thread_env
from paratrain.launch.engines.slurm import hetjob
from paratrain.launch.quoting import quote

SBATCH_TIMEOUT_S = 60.0

# Inherited values of these, from the shell that ran sbatch, would describe some other process (or
# would win over srun's convention in spec_from_env, which reads paratrain's and torchrun's first).
_FOREIGN_IDENTITY = (
    "PARATRAIN_ROLE",
    "PARATRAIN_RANK",
    "PARATRAIN_NUM_WORKERS",
    "PARATRAIN_SCHEDULER",
    "PARATRAIN_SECRET_FILE",
    "PARATRAIN_HOST",
    "PARATRAIN_LAUNCHER_PID",
    "PARATRAIN_SCHEDULER_FD",
    "DMLC_ROLE",
    "TF_CONFIG",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
)

# What the script sets itself; the same names in LaunchConfig.env are dropped (a secret there would be
# written into the script's text).
_SET_BY_SCRIPT = frozenset(
    {*_FOREIGN_IDENTITY, "PARATRAIN_NUM_SERVERS", "PARATRAIN_SECRET", "MASTER_ADDR", "MASTER_PORT"}
)

# sbatch --time: minutes, minutes:seconds, hours:minutes:seconds, days-hours[:minutes[:seconds]].
_TIME = re.compile(r"(\d+(:\d{1,2}){0,2}|\d+-\d+(:\d{1,2}){0,2}|UNLIMITED|INFINITE)")
_SBATCH_WORD = re.compile(r"[A-Za-z0-9_.,:@%+=/-]+")
_CONSTRAINT = re.compile(r"[A-Za-z0-9_.,:@%+=/&|*!\[\]()-]+")
_EXTRA = re.compile(r"--([a-z][a-z0-9-]*)(=(.*))?", re.S)
# The sbatch options the script writes itself, and where the user says each instead.
_OWN_OPTIONS = {
    "job-name": "the job's name",
    "output": "the job's output file",
    "ntasks": "-w and -s",
    "cpus-per-task": "--cpus-per-worker/--cpus-per-server",
    "gpus-per-task": "--gpus-per-worker",
    "nodes": "nodes",
    "partition": "partition",
    "time": "time",
    "account": "account",
    "qos": "qos",
    "constraint": "constraint",
    "mem-per-cpu": "resources.*.memory",
}
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# Run on the first node by the batch script: a port that is free there together with the next one
# (torch.distributed's store takes MASTER_PORT, paratrain's scheduler MASTER_PORT+1).
_FREE_PORT_PAIR = """\
import socket
for _ in range(100):
    with socket.socket() as first, socket.socket() as second:
        first.bind(("", 0))
        port = first.getsockname()[1]
        try:
            second.bind(("", port + 1))
        except OSError:
            continue
        print(port)
        break
else:
    raise SystemExit("paratrain: found no two free consecutive ports for MASTER_PORT")"""


@dataclass(frozen=True)
class SlurmOptions:
    """What the Slurm engine adds to a LaunchConfig: where and with what the job runs."""

    partition: str | None = None
    """sbatch --partition; None: the cluster's default partition."""
    time: str | None = None
    """sbatch --time (e.g. 30, 1:00:00, 2-0); None: from the job's timeout, else the partition's."""
    nodes: int | None = None
    """sbatch --nodes; None lets Slurm choose. Tasks are laid out in blocks over the nodes."""
    dry_run: bool = False
    """Print the sbatch script instead of submitting it."""
    cpus_per_worker: float = 1.0
    """CPUs for each worker task (Slurm gives every task of one srun the same: the larger of the
    two, rounded up)."""
    cpus_per_server: float = 1.0
    """CPUs for each server task."""
    gpus_per_worker: int = 0
    """GPUs for each worker task (srun --gpus-per-task binds each task to its own). With servers,
    the job is a heterogeneous one whose servers have none (hetjob.py)."""
    job_name: str | None = None
    """sbatch --job-name; None: paratrain-<script name>."""
    output: str | None = None
    """sbatch --output (%j is the job id); None: <job name>-%j.out in the current directory."""
    account: str | None = None
    """sbatch --account: whose allocation the job is charged to; None: the user's default."""
    qos: str | None = None
    """sbatch --qos; None: the account's default."""
    constraint: str | None = None
    """sbatch --constraint: node features the job needs (e.g. `v100`, `intel&ib`, `[rack1|rack2]`)."""
    extra_sbatch: tuple[str, ...] = ()
    """More sbatch options, one `--name=value` or `--flag` each (e.g. `--mail-type=END`,
    `--exclusive`), written as #SBATCH lines after paratrain's own."""
    mem_per_cpu: str | None = None
    """sbatch --mem-per-cpu (e.g. 2048M); None: the partition's default."""
    setup: tuple[str, ...] = ()
    """Shell commands the batch script runs before starting the tasks, which inherit what they
    export (e.g. `module load cuda/12.4`, `source /shared/venv/bin/activate`); one command each."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "extra_sbatch", tuple(self.extra_sbatch))
        object.__setattr__(self, "setup", tuple(self.setup))
        for name in ("partition", "job_name", "account", "qos", "mem_per_cpu"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and _SBATCH_WORD.fullmatch(value)):
                raise ValueError(f"{name} must be a word of letters, digits and _.,:@%+=/-, got {value!r}")
        if self.constraint is not None and not (
            isinstance(self.constraint, str) and _CONSTRAINT.fullmatch(self.constraint)
        ):
            raise ValueError(
                f"constraint must be node features joined by & | , * and [ ] ( ), got {self.constraint!r}"
            )
        for i, line in enumerate(self.extra_sbatch):
            extra_option(line, f"extra_sbatch[{i}]")
        for i, line in enumerate(self.setup):
            setup_command(line, f"setup[{i}]")
        if self.output is not None:
            quote(self.output, "sbatch", "output")  # raises about a path no #SBATCH line can carry
        if self.time is not None and not (isinstance(self.time, str) and _TIME.fullmatch(self.time)):
            raise ValueError(
                f"time must be sbatch's --time format (minutes, h:mm:ss, days-hours, ...), got {self.time!r}"
            )
        if self.nodes is not None and (not _is_int(self.nodes) or self.nodes < 1):
            raise ValueError(f"nodes must be an int >= 1 or None, got {self.nodes!r}")
        for name in ("cpus_per_worker", "cpus_per_server"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        if not _is_int(self.gpus_per_worker) or self.gpus_per_worker < 0:
            raise ValueError(f"gpus_per_worker must be an int >= 0, got {self.gpus_per_worker!r}")

    @property
    def cpus_per_task(self) -> int:
        return math.ceil(max(self.cpus_per_worker, self.cpus_per_server))


def extra_option(line: object, field: str) -> tuple[str, str | None]:
    """(name, value or None) of one extra sbatch option `--name=value` or `--flag`; ValueError
    naming `field` for anything else, or for an option the script writes itself."""
    match = _EXTRA.fullmatch(line) if isinstance(line, str) else None
    if match is None:
        raise ValueError(f"{field} must be one sbatch option, --name=value or --flag, got {line!r}")
    name, value = match[1], match[3]
    if name in _OWN_OPTIONS:
        raise ValueError(f"{field}: --{name} is written by paratrain: give {_OWN_OPTIONS[name]} instead")
    if value is not None:
        quote(value, "sbatch", field)  # raises about a value no #SBATCH line can carry
    return name, value


def setup_command(line: object, field: str) -> str:
    """One setup command, checked: a non-empty line (several commands are several items)."""
    if not isinstance(line, str) or not line.strip() or any(c in line for c in "\n\r\0"):
        raise ValueError(f"{field} must be one shell command on one line, got {line!r}")
    return line


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def job_name(config: LaunchConfig, options: SlurmOptions) -> str:
    if options.job_name is not None:
        return options.job_name
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", Path(config.script).stem) or "job"
    return f"paratrain-{stem}"


def output_path(config: LaunchConfig, options: SlurmOptions) -> str:
    """Where the job's output goes, absolute (%j stands for the job id)."""
    return os.path.abspath(options.output or f"{job_name(config, options)}-%j.out")


def sbatch_script(config: LaunchConfig, options: SlurmOptions, environ: dict[str, str] | None = None) -> str:
    """The batch script for `config`; `environ` (default os.environ) is what sbatch will export."""
    environ = dict(os.environ if environ is None else environ)
    tasks = config.num_workers + config.num_servers
    if options.nodes is not None and options.nodes > tasks:
        raise ValueError(f"nodes={options.nodes} is more than the job's {tasks} tasks (-w + -s)")
    for key in config.env:
        if not _ENV_NAME.fullmatch(key):
            raise ValueError(f"env key {key!r} is not a shell variable name")
    het = hetjob.heterogeneous(config, options)
    # A heterogeneous job's workers and servers each have their own CPUs (and threads: hetjob.py).
    cpus = math.ceil(options.cpus_per_worker) if het else options.cpus_per_task
    threads = thread_env(cpus, 1, {**environ, **config.env})
    server_threads = thread_env(math.ceil(options.cpus_per_server), 1, {**environ, **config.env})
    # The job's identity wins over the user's env, as under the local launcher.
    job_env = {k: v for k, v in config.job_env().items() if k not in _SET_BY_SCRIPT}
    exports = {**job_env, "PARATRAIN_NUM_SERVERS": str(config.num_servers), **threads}
    python = quote(config.python, "bash", "python")
    words = [quote(word, "bash", "script") for word in config.entry(absolute=True)]
    words += [quote(arg, "bash", f"args[{i}]") for i, arg in enumerate(config.args)]
    command = " ".join(words)
    lines = [
        "#!/bin/bash",
        f"# paratrain job: {config.num_workers} worker(s) and {config.num_servers} server(s) as one srun "
        f"of {tasks} tasks",
        *_directives(config, options),
        "set -eu",
        *_setup(options.setup),
        "",
        "# Identity comes from srun (SLURM_PROCID, SLURM_NTASKS) and PARATRAIN_NUM_SERVERS; values",
        "# inherited from the submitting shell would describe another process.",
        f"unset {' '.join(_FOREIGN_IDENTITY)}",
        *(f"export {key}={quote(value, 'bash', f'env[{key!r}]')}" for key, value in exports.items()),
        "export PYTHONUNBUFFERED=1",
        *_rendezvous(python),
        "echo "
        + quote(f"paratrain: {describe_tasks(config.num_workers, config.num_servers, het)}", "bash", "tasks"),
        "# Every line a task writes (stdout and stderr alike) starts with its role, rank and node.",
        *_task_command(config, options.gpus_per_worker, server_threads if het else None),
        _srun(config, options, het, f'bash -c "$PREFIX_OUTPUT" {python} -u {command}') + " && exit 0",
        "status=$?",
        'echo "paratrain: job failed: srun exited with code $status; its error line above names the'
        ' failed task and node" >&2',
        "exit $status",
        "",
    ]
    return "\n".join(lines)


def _srun(config: LaunchConfig, options: SlurmOptions, het: bool, command: str) -> str:
    """The one srun that starts every task (a part per component of a heterogeneous job)."""
    if het:
        parts = hetjob.srun_parts(config, options)
        return "srun --kill-on-bad-exit=1 " + " : ".join(f"{part} {command}" for part in parts)
    tasks = config.num_workers + config.num_servers
    gpus = f" --gpus-per-task={options.gpus_per_worker}" if options.gpus_per_worker else ""
    return (
        f"srun --kill-on-bad-exit=1 --ntasks={tasks} --cpus-per-task={options.cpus_per_task}{gpus} {command}"
    )


def _directives(config: LaunchConfig, options: SlurmOptions) -> list[str]:
    shared = {
        "partition": options.partition,
        "time": options.time or _minutes(config.timeout_s),
        "account": options.account,
        "qos": options.qos,
        "constraint": options.constraint,
        "mem-per-cpu": options.mem_per_cpu,
    }
    named = [
        sbatch_directive("job-name", job_name(config, options)),
        sbatch_directive("output", output_path(config, options)),
    ]
    if hetjob.heterogeneous(config, options):
        workers, servers = hetjob.components(shared, config, options)
        return [*named, *_values(workers), *_extra(options), "#SBATCH hetjob", *_values(servers)]
    values = {
        "ntasks": str(config.num_workers + config.num_servers),
        "cpus-per-task": str(options.cpus_per_task),
        "nodes": None if options.nodes is None else str(options.nodes),
        "gpus-per-task": str(options.gpus_per_worker) if options.gpus_per_worker else None,
        **shared,
    }
    return [*named, *_values(values), *_extra(options)]


def _values(values: dict[str, str | None]) -> list[str]:
    return [sbatch_directive(name, value) for name, value in values.items() if value is not None]


def _extra(options: SlurmOptions) -> list[str]:
    """The user's extra options (in a heterogeneous job, the first component's: the workers')."""
    lines = []
    for i, line in enumerate(options.extra_sbatch):
        name, value = extra_option(line, f"extra_sbatch[{i}]")
        lines.append(f"#SBATCH --{name}" if value is None else sbatch_directive(name, value))
    return lines


def _setup(commands: tuple[str, ...]) -> list[str]:
    """The user's setup commands, as written (they are the user's code): before anything that runs
    Python, so that a `module load` or a venv they activate gives the tasks their interpreter.
    `set -u` is off while they run: module systems and venv scripts read unset variables."""
    if not commands:
        return []
    return ["# Setup (slurm.setup / --setup): its exports reach every task.", "set +u", *commands, "set -u"]


def sbatch_directive(name: str, value: str) -> str:
    """One `#SBATCH --name=value` line, its value quoted for sbatch (quoting.py says why)."""
    return f"#SBATCH --{name}={quote(value, 'sbatch', name)}"


def _rendezvous(python: str) -> list[str]:
    """Lines that set MASTER_ADDR, MASTER_PORT and the secret, at run time, on the first node."""
    return [
        'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
        "# This script runs on that first node: a free port there, and the next one for the scheduler.",
        f"MASTER_PORT=$({python} - <<'EOF'",
        _FREE_PORT_PAIR,
        "EOF",
        ")",
        "export MASTER_ADDR MASTER_PORT",
        "# Made here, at run time: the secret is in no file, on no command line, not in this script.",
        f"PARATRAIN_SECRET=$({python} -c 'import secrets; print(secrets.token_hex(32))')",
        "export PARATRAIN_SECRET",
        'echo "paratrain: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST, scheduler at'
        ' $MASTER_ADDR:$((MASTER_PORT + 1))"',
    ]


def _minutes(timeout_s: float | None) -> str | None:
    return None if timeout_s is None else str(math.ceil(timeout_s / 60))


def task_roles(num_workers: int, num_servers: int, het: bool = False) -> list[tuple[str, int]]:
    """(role, rank) of each srun task by its number (SLURM_PROCID), as the cluster spec assigns
    them; in a heterogeneous job (`het`), the workers' component first."""
    if het:
        return hetjob.het_roles(num_workers, num_servers)
    servers = server_ranks(num_workers + num_servers, num_servers)
    roles, worker = [], 0
    for task in range(num_workers + num_servers):
        if task in servers:
            roles.append(("server", servers.index(task)))
        else:
            roles.append(("worker", worker))
            worker += 1
    return roles


def _prefix_output(num_workers: int, num_servers: int, het: bool = False) -> str:
    """The bash command each task runs: "$0" "$@" with every output line prefixed, its exit status
    kept. bash waits for the whole pipeline, so sed has flushed before the task ends."""
    labels = " ".join(f'"{role} {rank}"' for role, rank in task_roles(num_workers, num_servers, het))
    return (
        f'labels=({labels}); "$0" "$@" 2>&1 | sed -u "s|^|[${{labels[$SLURM_PROCID]}} @$SLURMD_NODENAME] |"; '
        'exit "${PIPESTATUS[0]}"'
    )


def _task_command(
    config: LaunchConfig, gpus_per_worker: int = 0, het_threads: dict[str, str] | None = None
) -> list[str]:
    """The lines that set PREFIX_OUTPUT, the command every srun task runs around the script; with
    `het_threads` (a heterogeneous job's servers' thread variables), each task's identity first."""
    workers, servers = config.num_workers, config.num_servers
    het = het_threads is not None
    binding = gpu_binding(workers, servers, gpus_per_worker, het)
    if het_threads is not None:
        binding = hetjob.identity(workers, servers, het_threads) + binding
    if not (config.elastic or config.max_restarts):
        prefix = binding + _prefix_output(workers, servers, het)
        return [f"PREFIX_OUTPUT={quote(prefix, 'bash', 'PREFIX_OUTPUT')}"]
    return [
        f"# Elastic: a worker task (but task 0, which runs the scheduler) starts a dead worker again, up to"
        f" {config.max_restarts} time(s).",
        "PREFIX_OUTPUT="
        + quote(
            binding + supervised_task(workers, servers, config.max_restarts, het), "bash", "PREFIX_OUTPUT"
        ),
    ]


def gpu_binding(num_workers: int, num_servers: int, gpus_per_worker: int, het: bool = False) -> str:
    """The start of each task's command with GPUs: srun --gpus-per-task binds every task to GPUs of
    its own, servers included in one plain srun (which gives all its tasks the same; a
    heterogeneous job gives servers none); a server task hides any GPUs it sees, so that no CUDA
    context of its takes their memory, and a worker task says it has its own."""
    if not gpus_per_worker:
        return ""
    roles = task_roles(num_workers, num_servers, het)
    servers = " ".join(str(task) for task, (role, _) in enumerate(roles) if role == "server")
    return (
        f'case " {servers} " in *" $SLURM_PROCID "*) export CUDA_VISIBLE_DEVICES=;; '
        f"*) export PARATRAIN_GPUS_PER_WORKER={gpus_per_worker};; esac; "
    )


def supervised_task(num_workers: int, num_servers: int, max_restarts: int, het: bool = False) -> str:
    """The bash command each task of an elastic job runs: "$0" "$@" with every output line
    prefixed (as _prefix_output), in a loop that starts a worker's process again when it died, up
    to max_restarts times, and says so on stderr. Its exit status: the process's, but 0 for a
    worker that died with no restarts left (the job goes on without it; the scheduler decides)."""
    roles = task_roles(num_workers, num_servers, het)
    labels = " ".join(f'"{role} {rank}"' for role, rank in roles)
    restartable = " ".join("1" if role == "worker" and task else "0" for task, (role, _) in enumerate(roles))
    spent = f"not restarted: all {max_restarts} used" if max_restarts else "not restarted"
    return (
        f"labels=({labels}); restartable=({restartable}); restarts=0; "
        'label=${labels[$SLURM_PROCID]}; tag="[$label @$SLURMD_NODENAME] "; '
        'while :; do "$0" "$@" 2>&1 | sed -u "s|^|$tag|"; status=${PIPESTATUS[0]}; '
        f'if [ "$status" = 0 ] || [ "$status" = {EXIT_ABORTED} ] || '
        '[ "${restartable[$SLURM_PROCID]}" != 1 ]; then exit "$status"; fi; '
        'if [ "$status" -gt 128 ]; then why="was killed by signal SIG$(kill -l "$status")"; '
        'else why="exited with code $status"; fi; '
        'said="paratrain: $label (host $SLURMD_NODENAME) $why; the job goes on"; '
        f'if [ "$restarts" -ge {max_restarts} ]; then '
        f'echo "$said ({spent})" >&2; exit 0; fi; '
        f'restarts=$((restarts + 1)); echo "$said (restart $restarts of {max_restarts})" >&2; done'
    )


def describe_tasks(num_workers: int, num_servers: int, het: bool = False) -> str:
    roles = task_roles(num_workers, num_servers, het)
    return "srun task " + ", ".join(f"{task}: {role} {rank}" for task, (role, rank) in enumerate(roles))


def run_slurm_job(
    config: LaunchConfig, options: SlurmOptions, out: IO[str] | None = None, err: IO[str] | None = None
) -> int:
    """Submits the job with sbatch (or prints its script); the exit status: 0 if submitted."""
    out, err = out or sys.stdout, err or sys.stderr
    try:
        script = sbatch_script(config, options)
    except ValueError as exc:
        print(f"paratrain: {exc}", file=err)
        return 2
    _describe(config, options, err)
    if options.dry_run:
        out.write(script)
        return 0
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        print(
            "paratrain: sbatch is not on PATH: --backend slurm submits with sbatch from a Slurm login "
            "node (--dry-run prints the script)",
            file=err,
        )
        return 1
    try:
        done = subprocess.run(
            [sbatch, "--parsable"],
            input=script,
            capture_output=True,
            text=True,
            timeout=SBATCH_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        print(f"paratrain: sbatch got no answer from slurmctld within {SBATCH_TIMEOUT_S} s", file=err)
        return 1
    if done.returncode != 0:
        print(f"paratrain: sbatch refused the job (exit {done.returncode}): {done.stderr.strip()}", file=err)
        return 1
    job_id = done.stdout.strip().split(";")[0]
    output = output_path(config, options).replace("%j", job_id)
    print(f"paratrain: submitted Slurm job {job_id} ({job_name(config, options)})", file=out)
    print(f"paratrain: output in {output}", file=out)
    print(f"paratrain: follow it with squeue -j {job_id}; stop it with scancel {job_id}", file=out)
    return 0


def _describe(config: LaunchConfig, options: SlurmOptions, err: IO[str]) -> None:
    cpus = options.cpus_per_task
    lines = [
        f"{config.num_workers} worker(s) and {config.num_servers} server(s) as one srun of "
        f"{config.num_workers + config.num_servers} tasks, {cpus} CPU(s) each",
    ]
    if options.cpus_per_worker != options.cpus_per_server:
        lines.append(
            f"one srun gives every task the same CPUs: --cpus-per-task={cpus}, the larger of "
            f"--cpus-per-worker={options.cpus_per_worker} and --cpus-per-server={options.cpus_per_server}"
        )
    if hetjob.heterogeneous(config, options):
        lines = [
            f"{config.num_workers} worker(s) with {options.gpus_per_worker} GPU(s) each and "
            f"{config.num_servers} server(s) with none, as a heterogeneous job (one srun, two components)"
        ]
    elif options.gpus_per_worker and config.num_servers:
        lines.append(
            f"one srun gives every task the same GPUs: servers are allotted {options.gpus_per_worker} each "
            "too, and see none (CUDA_VISIBLE_DEVICES empty)"
        )
    if config.elastic or config.max_restarts:
        lines.append(
            f"elastic: a worker task starts its dead process again up to {config.max_restarts} time(s); "
            "not task 0, which runs the scheduler, nor servers"
        )
    if thread_env(cpus, 1, {**os.environ, **config.env}) and hetjob.heterogeneous(config, options):
        worker, server = math.ceil(options.cpus_per_worker), math.ceil(options.cpus_per_server)
        each = f"{worker} on workers, {server} on servers"
        lines.append(f"threads per process: OMP_NUM_THREADS={each} (their CPUs; set it to choose)")
    elif thread_env(cpus, 1, {**os.environ, **config.env}):
        lines.append(f"threads per process: OMP_NUM_THREADS={cpus} (--cpus-per-task; set it to choose)")
    else:
        lines.append("threads per process: as set by the user (OMP_NUM_THREADS/MKL_NUM_THREADS)")
    for line in lines:
        print(f"paratrain: {line}", file=err)
