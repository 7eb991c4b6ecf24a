"""`paratrain launch --backend k8s`: one job as Kubernetes objects, applied with kubectl.

What one job becomes (every object labelled `paratrain.io/job=<name>`, so that one
`kubectl delete ... -l paratrain.io/job=<name>` removes all of it):

    Secret   <name>-secret      the job secret (hex) under key PARATRAIN_SECRET, base64 as `data`
    Service  <name>-scheduler   headless: its DNS name resolves to the scheduler pod's own IP
    Job      <name>-scheduler   indexed, 1 pod
    Job      <name>-server      indexed, S pods (absent when S = 0)
    Job      <name>-worker      indexed, W pods

Identity reaches each pod through paratrain's own variables (cluster/spec.py): the role as a
literal, the rank from the Job's completion index (downward API, the pod's
`batch.kubernetes.io/job-completion-index` annotation), PARATRAIN_HOST from `status.podIP` (every
process binds and advertises its own pod's address), PARATRAIN_SCHEDULER the Service's DNS name and
port, and PARATRAIN_SECRET from the Secret through `secretKeyRef`: the secret is never in a pod's
env as plain text, nor on a command line.

Servers and workers start with an init container that waits for the Service's name to resolve:
a headless Service publishes only ready pods, so that is when the scheduler container has started.
Without it, a pod that starts long before the scheduler's (an image pull on a slow node) would use
up its connect timeout (JobConfig.transport.connect_timeout_s, 60 s) before the scheduler exists.

Every Job has backoffLimit 0 and restartPolicy Never: paratrain has no rejoin, so a failed pod
fails its Job, and the scheduler aborts the others (they exit with EXIT_ABORTED) instead of Kubernetes
restarting one process into a job that has moved on.
"""

from __future__ import annotations

import base64
import logging
import math
import os
import re
import secrets
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import IO, Any

import yaml

from paratrain.launch.api import IDENTITY_VARS, THREAD_VARS, LaunchConfig, describe_threads, thread_env
from paratrain.launch.engines.k8s.extras import (
    TOKEN_KEY,
    apply_overrides,
    check_overrides,
    dashboard_env,
    dashboard_port,
    dashboard_service,
    jobset,
    override_labels,
    scrape_annotations,
)
from paratrain.launch.quoting import quote
from paratrain.metrics.dashboard import DashboardConfig, dashboard_token
from paratrain.metrics.observe import DASHBOARD_VAR

logger = logging.getLogger(__name__)

JOB_LABEL = "paratrain.io/job"
ROLE_LABEL = "paratrain.io/role"
SECRET_KEY = "PARATRAIN_SECRET"
INDEX_FIELD = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
GPU_RESOURCE = "nvidia.com/gpu"
FORMS = ("jobs", "jobset")

# What the scheduler pod reserves: it answers registrations, heartbeats and barriers, no tensors.
_SCHEDULER_CPU_REQUEST = "100m"
_SCHEDULER_CPUS = 1
# How long kubectl may take to answer, and how long we wait for it beyond that.
_KUBECTL_REQUEST_TIMEOUT_S = 30
_KUBECTL_WAIT_S = 90.0
# How long a server or worker pod waits for the scheduler pod to start (an image pull included).
SCHEDULER_WAIT_S = 600

# A DNS-1123 label (namespaces, Job and Secret names); a Service name must also start with a letter.
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
# The longest job name: a pod of Job "<name>-scheduler" is named "<name>-scheduler-<index>-<5 random
# characters>", its hostname "<name>-scheduler-<index>", and both must stay 63-character DNS labels
# (room left for indexes up to 99999).
MAX_NAME_LENGTH = 63 - len("-scheduler") - len("-99999") - len("-abcde")


# The init container's program: resolve the scheduler's Service name until it resolves or time runs out.
_WAIT_FOR_SCHEDULER = """\
import socket, sys, time
host, limit = sys.argv[1], float(sys.argv[2])
deadline = time.monotonic() + limit
while True:
    try:
        socket.getaddrinfo(host, None)
        break
    except OSError as exc:
        if time.monotonic() > deadline:
            sys.exit(f"paratrain: waited {limit:.0f} s for the scheduler pod behind {host} to start: {exc}")
        time.sleep(1)
"""


@dataclass(frozen=True)
class K8sOptions:
    """What a Kubernetes job needs besides the LaunchConfig."""

    image: str
    """The container image every pod runs; it holds the script and an interpreter with paratrain."""
    namespace: str = "default"
    """The namespace every object is created in."""
    dry_run: bool = False
    """Print the manifests as YAML instead of applying them."""
    cpus_per_worker: float = 1.0
    """CPUs each worker pod requests and is limited to (also its OMP_NUM_THREADS, rounded down)."""
    cpus_per_server: float = 1.0
    """CPUs each server pod requests and is limited to."""
    gpus_per_worker: int = 0
    """`nvidia.com/gpu` each worker pod is limited to (0: none)."""
    name: str | None = None
    """The job's name (a DNS label); None: paratrain-<script name>-<6 random hex digits>."""
    scheduler_port: int = 29400
    """The port the scheduler listens on in its pod (each pod has its own IP: any port will do)."""
    python: str = "python"
    """The interpreter that runs the script inside the image."""
    kubectl: str = "kubectl"
    """The kubectl command that applies the manifests."""
    pod_overrides: Mapping[str, Any] = field(default_factory=dict)
    """Pod template fragments merged into every role's pods (`all`) and one role's (`scheduler`,
    `server`, `worker`): node selectors, tolerations, service account, image pull secrets, labels,
    annotations, volumes, resources (extras.py says how they merge)."""
    form: str = "jobs"
    """"jobs": one indexed Job per role; "jobset": the same Jobs as one JobSet (jobset.x-k8s.io)."""
    dashboard: DashboardConfig | None = None
    """Serve the dashboard from the scheduler pod, behind the Service <name>-dashboard."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "pod_overrides", dict(self.pod_overrides))
        check_overrides(self.pod_overrides, IDENTITY_VARS, "pod_overrides")
        if self.form not in FORMS:
            raise ValueError(f"form must be one of {', '.join(FORMS)}, got {self.form!r}")
        if not isinstance(self.image, str) or not self.image.strip():
            raise ValueError(f"image must name a container image, got {self.image!r}")
        _check_label("namespace", self.namespace, 63)
        if self.name is not None:
            _check_label("name", self.name, MAX_NAME_LENGTH)
        for field_name in ("cpus_per_worker", "cpus_per_server"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{field_name} must be a number, got {value!r}")
            # Kubernetes counts CPU in millicores: a smaller share would round to nothing.
            if not (math.isfinite(value) and value >= 0.001):
                raise ValueError(f"{field_name} must be a finite number >= 0.001, got {value!r}")
        if isinstance(self.gpus_per_worker, bool) or not isinstance(self.gpus_per_worker, int):
            raise TypeError(f"gpus_per_worker must be an int, got {self.gpus_per_worker!r}")
        if self.gpus_per_worker < 0:
            raise ValueError(f"gpus_per_worker must be >= 0, got {self.gpus_per_worker}")
        if isinstance(self.scheduler_port, bool) or not isinstance(self.scheduler_port, int):
            raise TypeError(f"scheduler_port must be an int, got {self.scheduler_port!r}")
        if not 1 <= self.scheduler_port <= 65535:
            raise ValueError(f"scheduler_port must be in 1..65535, got {self.scheduler_port}")
        for field_name in ("python", "kubectl"):
            if not getattr(self, field_name):
                raise ValueError(f"{field_name} must be a command, got {getattr(self, field_name)!r}")


def _check_label(field_name: str, value: object, max_length: int) -> None:
    if not isinstance(value, str) or not _DNS_LABEL.match(value) or len(value) > max_length:
        raise ValueError(
            f"{field_name} must be a DNS label of at most {max_length} characters (lower-case letters, "
            f"digits and '-', starting with a letter, not ending with '-'), got {value!r}"
        )


def job_name(script: str) -> str:
    """paratrain-<the script's name, as a DNS label>-<6 random hex digits>: unique per launch."""
    stem = re.sub(r"[^a-z0-9]+", "-", PurePosixPath(script).stem.lower()).strip("-")[:20].strip("-")
    return "-".join(part for part in ("paratrain", stem, secrets.token_hex(3)) if part)


def scheduler_address(name: str, options: K8sOptions) -> str:
    """PARATRAIN_SCHEDULER: the headless Service's DNS name within the cluster, and the port."""
    return f"{name}-scheduler.{options.namespace}.svc:{options.scheduler_port}"


def build_manifests(config: LaunchConfig, options: K8sOptions, name: str, secret: bytes) -> list[dict]:
    """Every object of the job, as plain dicts in the order they are applied."""
    # A JobSet's Jobs are named <name>-<role>-0: two more characters in every pod's name.
    _check_label("name", name, MAX_NAME_LENGTH - (2 if options.form == "jobset" else 0))
    manifests = [_secret(name, options, secret), _service(name, options)]
    if options.dashboard is not None:
        selector = {JOB_LABEL: name, ROLE_LABEL: "scheduler"}
        metadata = _metadata(f"{name}-dashboard", options, _labels(name, "scheduler"))
        manifests.append(dashboard_service(metadata, selector, options.dashboard.port))
    counts = {"scheduler": 1, "server": config.num_servers, "worker": config.num_workers}
    jobs = [_job(config, options, name, role, count) for role, count in counts.items() if count]
    overrides = options.pod_overrides
    for job in jobs:
        role = job["metadata"]["labels"][ROLE_LABEL]
        apply_overrides(job["spec"]["template"], overrides, role)
        job["metadata"]["labels"] = {**override_labels(overrides, "all", role), **job["metadata"]["labels"]}
    if options.form == "jobset":
        labels = {**override_labels(overrides, "all"), **_labels(name)}
        return [*manifests, jobset(name, options.namespace, labels, jobs)]
    return manifests + jobs


def pod_templates(manifests: list[dict]) -> list[dict]:
    """Every role's pod template among the job's objects, whichever form they take."""
    templates = []
    for manifest in manifests:
        if manifest["kind"] == "Job":
            templates.append(manifest["spec"]["template"])
        elif manifest["kind"] == "JobSet":
            templates += [job["template"]["spec"]["template"] for job in manifest["spec"]["replicatedJobs"]]
    return templates


def manifests_yaml(manifests: list[dict]) -> str:
    """The manifests as one multi-document YAML text, as `kubectl apply -f -` reads it."""
    return yaml.dump_all(manifests, Dumper=_Dumper, sort_keys=False, default_flow_style=False)


class _Dumper(yaml.SafeDumper):
    """SafeDumper that writes a multi-line string as a literal block (the init container's program
    stays readable)."""


def _represent_str(dumper: yaml.SafeDumper, text: str) -> yaml.Node:
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_Dumper.add_representer(str, _represent_str)


def role_threads(config: LaunchConfig, options: K8sOptions, role: str) -> tuple[dict[str, str], int]:
    """OMP_NUM_THREADS/MKL_NUM_THREADS for one role's pods (empty when the user chose), and the
    cores that share is of: the pod's CPU limit, rounded down, at least 1. One process per pod."""
    cores = max(1, math.floor(_role_cpus(options, role)))
    return thread_env(cores, 1, _user_env(config)), cores


def _role_cpus(options: K8sOptions, role: str) -> float:
    return {"scheduler": _SCHEDULER_CPUS, "server": options.cpus_per_server}.get(
        role, options.cpus_per_worker
    )


def _user_env(config: LaunchConfig) -> dict[str, str]:
    """The variables every pod gets besides identity and threads: the job's env and strategy, and a
    thread count the user set where they launched (a pod inherits nothing from that shell, so a
    choice made there is carried over rather than silently overridden)."""
    chosen = {name: os.environ[name] for name in THREAD_VARS if os.environ.get(name)}
    env = {**chosen, **config.job_env()}
    # The scheduler pod alone serves the dashboard, on its own address (`_container`).
    return {key: value for key, value in env.items() if key not in IDENTITY_VARS | {DASHBOARD_VAR}}


def _labels(name: str, role: str | None = None) -> dict[str, str]:
    labels = {"app.kubernetes.io/name": "paratrain", "app.kubernetes.io/managed-by": "paratrain"}
    labels[JOB_LABEL] = name
    if role is not None:
        labels[ROLE_LABEL] = role
    return labels


def _metadata(name: str, options: K8sOptions, labels: dict[str, str]) -> dict[str, Any]:
    return {"name": name, "namespace": options.namespace, "labels": labels}


def _secret(name: str, options: K8sOptions, secret: bytes) -> dict[str, Any]:
    # `data` (base64) rather than `stringData`, so that the hex itself appears nowhere in the text.
    data = {SECRET_KEY: _base64(secret.hex())}
    if options.dashboard is not None:  # for `kubectl port-forward` users and a scrape config
        data[TOKEN_KEY] = _base64(dashboard_token(secret))
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(f"{name}-secret", options, _labels(name)),
        "type": "Opaque",
        "data": data,
    }


def _base64(text: str) -> str:
    return base64.b64encode(text.encode("ascii")).decode("ascii")


def _service(name: str, options: K8sOptions) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(f"{name}-scheduler", options, _labels(name, "scheduler")),
        "spec": {
            "clusterIP": "None",
            "selector": {JOB_LABEL: name, ROLE_LABEL: "scheduler"},
            "ports": [
                {"name": "scheduler", "port": options.scheduler_port, "targetPort": options.scheduler_port}
            ],
        },
    }


def _job(config: LaunchConfig, options: K8sOptions, name: str, role: str, count: int) -> dict[str, Any]:
    pod: dict[str, Any] = {
        "restartPolicy": "Never",
        # Service links would add a variable per Service in the namespace; the env is ours alone.
        "enableServiceLinks": False,
        "containers": [_container(config, options, name, role)],
    }
    if role != "scheduler":
        pod["initContainers"] = [_wait_container(options, name)]
        # Spread each role over the nodes where the cluster can (never refusing to schedule).
        pod["topologySpreadConstraints"] = [
            {
                "maxSkew": 1,
                "topologyKey": "kubernetes.io/hostname",
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": {JOB_LABEL: name, ROLE_LABEL: role}},
            }
        ]
    spec: dict[str, Any] = {
        "completionMode": "Indexed",
        "completions": count,
        "parallelism": count,
        "backoffLimit": 0,
    }
    if config.timeout_s is not None:
        spec["activeDeadlineSeconds"] = math.ceil(config.timeout_s)
    spec["template"] = {"metadata": {"labels": _labels(name, role)}, "spec": pod}
    if role == "scheduler" and options.dashboard is not None:
        spec["template"]["metadata"]["annotations"] = scrape_annotations(options.dashboard.port)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _metadata(f"{name}-{role}", options, _labels(name, role)),
        "spec": spec,
    }


def _container(config: LaunchConfig, options: K8sOptions, name: str, role: str) -> dict[str, Any]:
    threads, _ = role_threads(config, options, role)
    chosen = {**threads, **_user_env(config), **device_env(options, role)}
    env = [_literal(key, value) for key, value in chosen.items()]
    env += _identity_env(config, options, name, role)
    env.append(_literal("PYTHONUNBUFFERED", "1"))  # output reaches `kubectl logs` line by line
    container: dict[str, Any] = {
        "name": role,
        "image": options.image,
        "command": _command(options, config),
        "env": env,
        "resources": _resources(options, role),
    }
    if role == "scheduler":
        container["ports"] = [{"name": "scheduler", "containerPort": options.scheduler_port}]
        if options.dashboard is not None:
            env.append(dashboard_env(options.dashboard.port))
            port = dashboard_port(options.dashboard.port)
            container["ports"].append({"name": "dashboard", "containerPort": port})
    return container


def _identity_env(config: LaunchConfig, options: K8sOptions, name: str, role: str) -> list[dict]:
    """paratrain's identity variables (cluster/spec.py), each from where Kubernetes knows it."""
    return [
        _literal("PARATRAIN_ROLE", role),
        {"name": "PARATRAIN_RANK", "valueFrom": {"fieldRef": {"fieldPath": INDEX_FIELD}}},
        _literal("PARATRAIN_NUM_WORKERS", str(config.num_workers)),
        _literal("PARATRAIN_NUM_SERVERS", str(config.num_servers)),
        _literal("PARATRAIN_SCHEDULER", scheduler_address(name, options)),
        {"name": "PARATRAIN_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {
            "name": "PARATRAIN_SECRET",
            "valueFrom": {"secretKeyRef": {"name": f"{name}-secret", "key": SECRET_KEY}},
        },
    ]


def device_env(options: K8sOptions, role: str) -> dict[str, str]:
    """A worker's place on its pod's host as torchrun names it (one worker per pod) and its GPUs
    (the pod's nvidia.com/gpu limit: the device plugin shows it those alone); the scheduler and
    servers see no GPU of a node they share with workers."""
    env = {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"} if role == "worker" else {}
    if options.gpus_per_worker:
        gpus = {"PARATRAIN_GPUS_PER_WORKER": str(options.gpus_per_worker)}
        env.update(gpus if role == "worker" else {"CUDA_VISIBLE_DEVICES": ""})
    return env


def _literal(key: str, value: str) -> dict[str, str]:
    return {"name": key, "value": quote(value, "k8s", f"env[{key!r}]")}


def _command(options: K8sOptions, config: LaunchConfig) -> list[str]:
    words = [quote(options.python, "k8s", "python"), "-u"]
    words += [quote(word, "k8s", "script") for word in config.entry()]
    return words + [quote(arg, "k8s", f"args[{i}]") for i, arg in enumerate(config.args)]


def _resources(options: K8sOptions, role: str) -> dict[str, Any]:
    if role == "scheduler":
        return {"requests": {"cpu": _SCHEDULER_CPU_REQUEST}, "limits": {"cpu": str(_SCHEDULER_CPUS)}}
    cpu = _cpu_quantity(_role_cpus(options, role))
    limits: dict[str, Any] = {"cpu": cpu}
    if role == "worker" and options.gpus_per_worker:
        limits[GPU_RESOURCE] = options.gpus_per_worker  # extended resources: requests follow limits
    return {"requests": {"cpu": cpu}, "limits": limits}


def _cpu_quantity(cpus: float) -> str:
    """A Kubernetes CPU quantity: whole cores as "2", anything else in millicores ("1500m")."""
    millis = round(cpus * 1000)
    return str(millis // 1000) if millis % 1000 == 0 else f"{millis}m"


def _wait_container(options: K8sOptions, name: str) -> dict[str, Any]:
    host = f"{name}-scheduler.{options.namespace}.svc"
    return {
        "name": "wait-for-scheduler",
        "image": options.image,
        "command": [
            quote(options.python, "k8s", "python"),
            "-c",
            quote(_WAIT_FOR_SCHEDULER, "k8s", "the init container's program"),
            host,
            str(SCHEDULER_WAIT_S),
        ],
        "resources": {"requests": {"cpu": "10m"}, "limits": {"cpu": "100m"}},
    }


# ---- running ----------------------------------------------------------------------------------


def run_k8s_job(config: LaunchConfig, options: K8sOptions, out: IO[str] | None = None) -> int:
    """`paratrain launch --backend k8s`: prints the manifests (dry run) or applies them with
    kubectl. Returns 0 when printed or applied, 1 when kubectl failed (with a message saying why
    and how to clean up). It does not wait for the job: the job runs on in the cluster."""
    out = out or sys.stdout
    name = options.name or job_name(config.script)
    manifests = build_manifests(config, options, name, secrets.token_bytes(32))
    logger.info("%s", _describe(config, options, name))
    text = manifests_yaml(manifests)
    if options.dry_run:
        out.write(text)
        out.flush()
        return 0
    error = _apply(options, text)
    if error is not None:
        logger.error("%s\n%s", error, _cleanup_hint(options, name))
        return 1
    logger.info("applied %s in namespace %s\n%s", name, options.namespace, _follow_hint(options, name))
    return 0


def _describe(config: LaunchConfig, options: K8sOptions, name: str) -> str:
    lines = [
        f"job {name}: {' '.join([options.python, '-u', config.script, *config.args])}",
        f"  image {options.image}, namespace {options.namespace}, {config.num_workers} worker(s), "
        f"{config.num_servers} server(s), scheduler at {scheduler_address(name, options)}",
    ]
    for role in ("server", "worker"):
        if role == "server" and not config.num_servers:
            continue
        chosen, cores = role_threads(config, options, role)
        lines.append(f"  {role}s: {describe_threads(chosen, cores, 1, where=f'{role} pod')}")
    return "\n".join(lines)


def _apply(options: K8sOptions, text: str) -> str | None:
    """Runs `kubectl apply -f -` on the manifests; None when it succeeded, else what went wrong.

    Server-side apply: a client-side apply would copy every object, the Secret's data included,
    into a last-applied-configuration annotation readable by anyone who may read the object.
    """
    cmd = [
        options.kubectl,
        "apply",
        "--server-side",
        "--field-manager=paratrain",
        f"--request-timeout={_KUBECTL_REQUEST_TIMEOUT_S}s",
        "-f",
        "-",
    ]
    try:
        done = subprocess.run(cmd, input=text, capture_output=True, text=True, timeout=_KUBECTL_WAIT_S)
    except FileNotFoundError:
        return (
            f"kubectl apply failed: {options.kubectl!r} was not found. Install kubectl and configure it "
            f"for your cluster, or print the manifests with --dry-run and apply them elsewhere"
        )
    except subprocess.TimeoutExpired:
        return f"kubectl apply failed: {options.kubectl} did not answer within {_KUBECTL_WAIT_S} s"
    if done.returncode == 0:
        if done.stdout.strip():
            logger.info("%s", done.stdout.strip())
        return None
    said = "\n".join(f"    {line}" for line in (done.stderr or done.stdout).strip().splitlines())
    return (
        f"kubectl apply failed (exit {done.returncode}) in namespace {options.namespace}; "
        f"kubectl said:\n{said or '    (nothing)'}\n  {_cluster_hint(options)}"
    )


def _cluster_hint(options: K8sOptions) -> str:
    """Which cluster kubectl talks to, the first thing to check when apply fails."""
    try:
        done = subprocess.run(
            [options.kubectl, "config", "current-context"],
            capture_output=True,
            text=True,
            timeout=_KUBECTL_WAIT_S,
        )
    except (OSError, subprocess.TimeoutExpired):
        done = None
    if done is not None and done.returncode == 0 and done.stdout.strip():
        where = f"kubectl's current context is {done.stdout.strip()!r}"
    else:
        where = "kubectl has no current context (no cluster configured in its kubeconfig)"
    return (
        f"Is kubectl configured for a reachable cluster? {where}; `kubectl cluster-info` shows which "
        f"cluster it reaches. `paratrain launch --backend k8s --dry-run ...` prints the manifests."
    )


def _cleanup_hint(options: K8sOptions, name: str) -> str:
    return (
        f"  Objects applied before the failure, if any, are removed with:\n"
        f"    {_delete_command(options, name)}"
    )


def _delete_command(options: K8sOptions, name: str) -> str:
    kinds = "jobset,service,secret" if options.form == "jobset" else "job,service,secret"
    return f"kubectl delete {kinds} -n {options.namespace} -l {JOB_LABEL}={name}"


def _follow_hint(options: K8sOptions, name: str) -> str:
    selector = f"-n {options.namespace} -l {JOB_LABEL}={name}"
    return (
        f"  status:  kubectl get jobs,pods {selector}\n"
        f"  output:  kubectl logs -f --prefix --max-log-requests 64 {selector},{ROLE_LABEL}=worker\n"
        f"  remove:  {_delete_command(options, name)}"
    )
