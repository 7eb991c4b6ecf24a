"""Submitted jobs on `slurm` and `k8s`: what the engines are given, and the cluster's word on a job.

The engines (slurm.py, k8s.py) write the sbatch script and the manifests; this module adds what a
job spec asks for beyond a launch: on Slurm, the memory per CPU and a check, on the first node, that
the job's folders are there (a shared file system); on Kubernetes, the output PersistentVolumeClaim
mounted read-write at output_dir and the data claim read-only at data_dir in every pod, the memory
per role, and the working directory. A submitted job is then asked about (state), followed (logs) and
stopped with the cluster's own commands: sacct/squeue and scancel, kubectl get/logs/delete.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import secrets
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from paratrain.errors import LaunchError
from paratrain.launch.quoting import quote

if TYPE_CHECKING:  # pydantic is imported only by the commands that read a spec
    from paratrain.launch.api import LaunchConfig
    from paratrain.launch.jobspec import JobSpec

_CLUSTER_TIMEOUT_S = 60.0
# Slurm's job states, as this platform names them.
_SLURM_STATES = {
    "PENDING": "pending",
    "CONFIGURING": "pending",
    "REQUEUED": "pending",
    "RUNNING": "running",
    "COMPLETING": "running",
    "COMPLETED": "succeeded",
    "CANCELLED": "stopped",
}


def run_command(cmd: list[str], stdin: str | None = None) -> str:
    """The stdout of `cmd`; LaunchError naming the command and its stderr when it fails."""
    if shutil.which(cmd[0]) is None:
        raise LaunchError(f"{cmd[0]} is not on PATH (the job's cluster is asked with it)")
    try:
        done = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=_CLUSTER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise LaunchError(f"{shlex.join(cmd)} did not answer within {_CLUSTER_TIMEOUT_S} s") from None
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip()
        raise LaunchError(f"{shlex.join(cmd)} exited with code {done.returncode}: {said}")
    return done.stdout


# ---- Slurm -------------------------------------------------------------------------------------


def slurm_options(spec: JobSpec, job_id: str, folder: Path, dry_run: bool) -> Any:
    """The options `paratrain launch` would make of the spec, with the job's name and output file."""
    from paratrain.launch import engines
    from paratrain.launch.jobspec import launch_args

    options = engines.get(spec.backend).options(launch_args(spec, dry_run))
    return dataclasses.replace(options, job_name=job_id, output=str(folder / "logs" / "slurm-%j.out"))


def slurm_script(spec: JobSpec, config: LaunchConfig, options: Any) -> str:
    """The engine's sbatch script, with the job's memory and its folders checked before srun."""
    from paratrain.launch.engines.slurm.sbatch import sbatch_script
    from paratrain.launch.jobspec import memory_bytes

    memory = [r.memory for r in (spec.resources.worker, spec.resources.server) if r.memory]
    if memory:
        per_cpu = max(memory_bytes(m) for m in memory) / options.cpus_per_task
        options = dataclasses.replace(options, mem_per_cpu=f"{math.ceil(per_cpu / 2**20)}M")
    lines = sbatch_script(config, options).splitlines()
    dirs = {"work_dir": spec.work_dir, "data_dir": spec.data_dir, "output_dir": spec.output_dir}
    folders = " ".join(quote(d, "bash", name) for name, d in dirs.items() if d)
    check = [
        "# The job's folders must be on a file system every node sees; this node, at least, must see them.",
        f"for folder in {folders}; do",
        '  [ -d "$folder" ] || { echo "paratrain: $folder is not on $(hostname): the job\'s folders must be'
        ' on a shared file system" >&2; exit 1; }',
        "done",
        f"cd {quote(spec.work_dir or '.', 'bash', 'work_dir')}",
    ]
    at = lines.index("set -eu") + 1
    return "\n".join(lines[:at] + check + lines[at:]) + "\n"


def sbatch(script: str) -> str:
    """Submits the script; the Slurm job id."""
    return run_command(["sbatch", "--parsable"], stdin=script).strip().split(";")[0]


def slurm_state(cluster_id: str) -> str | None:
    """pending, running, succeeded, failed or stopped, as squeue or sacct say; None when neither knows."""
    try:
        text = run_command(["squeue", "-h", "-j", cluster_id, "-o", "%T"]).strip()
    except LaunchError:
        text = ""  # squeue forgets a finished job (and refuses an id it forgot)
    if not text:
        try:
            text = run_command(["sacct", "-X", "-n", "-P", "-o", "State", "-j", cluster_id]).strip()
        except LaunchError:
            return None
    if not text:
        return None
    word = text.splitlines()[0].split()[0]
    return _SLURM_STATES.get(word, "failed")


def slurm_output(folder: Path, cluster_id: str) -> Path:
    return folder / "logs" / f"slurm-{cluster_id}.out"


def slurm_lines(text: str, role: str | None, rank: int) -> str:
    """The lines of one process in the job's output (each is prefixed `[role rank @node] `)."""
    if role is None:
        return text
    prefix = re.compile(rf"^\[{re.escape(role)} {rank} @\S+\] ")
    return "".join(prefix.sub("", line, count=1) for line in text.splitlines(True) if prefix.match(line))


# ---- Kubernetes --------------------------------------------------------------------------------


def k8s_options(spec: JobSpec, job_id: str, dry_run: bool) -> Any:
    """The options `paratrain launch` would make of the spec, with the job's name and interpreter."""
    from paratrain.launch import engines
    from paratrain.launch.jobspec import launch_args

    # A dry run of a spec without an image shows IMAGE where it goes (submit_problems refuses it).
    options = engines.get(spec.backend).options(launch_args(spec, dry_run=True))
    return dataclasses.replace(options, dry_run=dry_run, name=job_id, python=spec.entry.python or "python")


def k8s_manifests(spec: JobSpec, config: LaunchConfig, options: Any) -> list[dict]:
    """The engine's manifests, with the job's volumes, memory and working directory in every pod."""
    from paratrain.launch.engines.k8s.manifests import build_manifests, pod_templates

    manifests = build_manifests(config, options, options.name, secrets.token_bytes(32))
    for template in pod_templates(manifests):
        _add_to_pod(spec, template["spec"])
    return manifests


def _add_to_pod(spec: JobSpec, pod: dict) -> None:
    volumes, mounts = [], []
    claims = [("output", spec.k8s.output_pvc, spec.output_dir, False)]
    if spec.data_dir is not None:
        claims.append(("data", spec.k8s.data_pvc, spec.data_dir, True))
    for name, claim, path, read_only in claims:
        if claim is None:
            continue  # a dry run of a spec that will not submit as it is
        source: dict[str, Any] = {"claimName": claim}
        if read_only:
            source["readOnly"] = True
        volumes.append({"name": name, "persistentVolumeClaim": source})
        mounts.append({"name": name, "mountPath": path, "readOnly": read_only})
    if volumes:  # beside any the pod overrides added
        pod["volumes"] = [*pod.get("volumes", []), *volumes]
    container = pod["containers"][0]
    if mounts:
        container["volumeMounts"] = [*container.get("volumeMounts", []), *mounts]
    if spec.work_dir is not None:
        container["workingDir"] = spec.work_dir
    role = container["name"]
    memory = {"server": spec.resources.server.memory, "worker": spec.resources.worker.memory}.get(role)
    if memory is not None:
        container["resources"]["requests"]["memory"] = memory
        container["resources"]["limits"]["memory"] = memory


def k8s_apply(options: Any, text: str) -> None:
    from paratrain.launch.engines.k8s.manifests import _apply

    error = _apply(options, text)
    if error is not None:
        raise LaunchError(error)


def _selector(cluster_id: str) -> list[str]:
    name, namespace, *_ = cluster_id.split("/")
    return ["-n", namespace, "-l", f"paratrain.io/job={name}"]


def k8s_state(cluster_id: str) -> str | None:
    """The job's state from its worker Job's conditions (every Job's, for failures)."""
    text = run_command(["kubectl", "get", "jobs", *_selector(cluster_id), "-o", "json"])
    jobs = json.loads(text).get("items", [])
    if not jobs:
        return None
    conditions = {
        (job["metadata"]["labels"].get("paratrain.io/role"), c["type"])
        for job in jobs
        for c in job.get("status", {}).get("conditions", [])
        if c.get("status") == "True"
    }
    if any(kind == "Failed" for _, kind in conditions):
        return "failed"
    if ("worker", "Complete") in conditions:
        return "succeeded"
    return "running" if any(job.get("status", {}).get("active") for job in jobs) else "pending"


def k8s_logs_command(cluster_id: str, role: str | None, rank: int, follow: bool) -> list[str]:
    name, namespace, *_ = cluster_id.split("/")
    selector = f"paratrain.io/job={name}"
    if role is not None:
        selector += f",paratrain.io/role={role},batch.kubernetes.io/job-completion-index={rank}"
    cmd = ["kubectl", "logs", "-n", namespace, "-l", selector, "--prefix", "--max-log-requests", "64"]
    return cmd + (["-f"] if follow else [])


def k8s_delete(cluster_id: str) -> None:
    """Deletes the job's objects (`<name>/<namespace>[/jobset]`: the form its Jobs were made in)."""
    kinds = "jobset,service,secret" if cluster_id.endswith("/jobset") else "job,service,secret"
    run_command(["kubectl", "delete", kinds, "--wait=false", *_selector(cluster_id)])


def write_text(out: IO[str], text: str) -> None:
    out.write(text)
    out.flush()
