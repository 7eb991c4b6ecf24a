# ruff: noqa: E501  (the table of refused overrides reads best one a line)
"""The k8s engine's cluster options, without a cluster: pod overrides merged into every role's pods,
the dashboard behind a Service (with Prometheus's scrape annotations and its token in the Secret),
and the JobSet form; every object validated offline (kubernetes-validate's strict 1.32 schema; a
JobSet against the JobSet API's published models and each of its Jobs against the schema)."""

from __future__ import annotations

import base64
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from click.testing import CliRunner

from paratrain.launch.api import LaunchConfig
from paratrain.launch.cli import main
from paratrain.launch.engines.k8s.manifests import K8sOptions, build_manifests, pod_templates
from paratrain.metrics.dashboard import DashboardConfig, dashboard_token

K8S_VERSION = "1.32"
SECRET = bytes(range(32))
NAME = "paratrain-train-abc123"
OVERRIDES = {
    "all": {
        "metadata": {"labels": {"kueue.x-k8s.io/queue-name": "team-a"}, "annotations": {"team": "ml"}},
        "spec": {
            "serviceAccountName": "trainer",
            "imagePullSecrets": [{"name": "registry-creds"}],
            "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory"}}],
            "containers": [{"volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}]}],
        },
    },
    "worker": {
        "spec": {
            "nodeSelector": {"accelerator": "a100"},
            "containers": [
                {
                    "resources": {"limits": {"memory": "8Gi", "ephemeral-storage": "20Gi"}},
                    "env": [{"name": "NCCL_DEBUG", "value": "INFO"}],
                }
            ],
        }
    },
}


def make(**options) -> list[dict]:
    config = LaunchConfig(script="train.py", num_workers=2, num_servers=1, timeout_s=600)
    return build_manifests(config, K8sOptions(image="reg/train:1", **options), NAME, SECRET)


def validate_all(manifests: list[dict]) -> None:
    from kubeflow_trainer_api.models import JobsetV1alpha2JobSet

    for manifest in manifests:
        if manifest["kind"] != "JobSet":
            assert kubernetes_validate.validate(manifest, K8S_VERSION, strict=True) == K8S_VERSION
            continue
        # The JobSet API's models drop unknown fields (and fill in defaults): reading the JobSet
        # back must lose nothing of it.
        assert not lost(manifest, JobsetV1alpha2JobSet.from_dict(manifest).to_dict())
        for job in manifest["spec"]["replicatedJobs"]:
            as_job = {"apiVersion": "batch/v1", "kind": "Job", **job["template"]}
            as_job["metadata"] = {"name": f"{NAME}-{job['name']}", **as_job["metadata"]}
            assert kubernetes_validate.validate(as_job, K8S_VERSION, strict=True) == K8S_VERSION


def lost(given: object, read: object, path: str = "") -> list[str]:
    """Where `read` lacks or changed part of `given`."""
    if isinstance(given, dict) and isinstance(read, dict):
        return [p for key in given for p in lost(given[key], read.get(key), f"{path}.{key}")]
    if isinstance(given, list) and isinstance(read, list) and len(given) == len(read):
        return [p for i, (a, b) in enumerate(zip(given, read)) for p in lost(a, b, f"{path}[{i}]")]
    return [] if given == read else [path]


def test_the_jobset_check_finds_a_misspelt_field():
    (jobset,) = [m for m in make(form="jobset") if m["kind"] == "JobSet"]
    jobset["spec"]["failurePolicy"] = {"maxRestart": 0}
    from kubeflow_trainer_api.models import JobsetV1alpha2JobSet

    assert lost(jobset, JobsetV1alpha2JobSet.from_dict(jobset).to_dict()) == [
        ".spec.failurePolicy.maxRestart"
    ]


def pods_by_role(manifests: list[dict]) -> dict[str, dict]:
    return {t["metadata"]["labels"]["paratrain.io/role"]: t for t in pod_templates(manifests)}


def test_pod_overrides_reach_every_role_and_one_role_and_validate():
    manifests = make(pod_overrides=OVERRIDES)
    validate_all(manifests)
    pods = pods_by_role(manifests)
    for role, template in pods.items():
        pod, (main, *sidecars) = template["spec"], template["spec"]["containers"]
        assert template["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
        assert template["metadata"]["labels"]["paratrain.io/role"] == role  # paratrain's kept
        assert pod["serviceAccountName"] == "trainer" and pod["restartPolicy"] == "Never"
        assert pod["imagePullSecrets"] == [{"name": "registry-creds"}]
        assert main["name"] == role and not sidecars  # merged into the role's own container
        assert {"name": "shm", "mountPath": "/dev/shm"} in main["volumeMounts"]
        assert main["command"][:2] == ["python", "-u"]
        names = [e["name"] for e in main["env"]]
        assert ("NCCL_DEBUG" in names) == (role == "worker")
        assert ("nodeSelector" in pod) == (role == "worker")
    for job in [m for m in manifests if m["kind"] == "Job"]:  # where Kueue reads the queue
        assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    limits = pods["worker"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {"cpu": "1", "memory": "8Gi", "ephemeral-storage": "20Gi"}


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"workers": {}}, "pod_overrides.workers: 'workers' is not one of all, scheduler, server, worker"),
        ({"all": {"spec": {"restartPolicy": "Always"}}}, "pod_overrides.all.spec.restartPolicy: set by paratrain"),
        ({"worker": {"spec": {"containers": [{"command": ["sh"]}]}}}, "containers[0].command: the role's own container's command is set by paratrain"),
        ({"all": {"metadata": {"labels": {"paratrain.io/job": "x"}}}}, "labels.paratrain.io/job: paratrain.io/ names are paratrain's own"),
        ({"server": {"spec": {"containers": [{"env": [{"name": "PARATRAIN_RANK", "value": "0"}]}]}}}, "PARATRAIN_RANK is set by paratrain for each pod"),
        ({"all": {"kind": "Pod"}}, "pod_overrides.all must be a pod template (metadata, spec)"),
    ],
)  # fmt: skip
def test_overrides_paratrain_needs_are_refused_naming_the_field(overrides, message):
    with pytest.raises(ValueError) as refused:
        K8sOptions(image="reg/train:1", pod_overrides=overrides)
    assert message in str(refused.value)


def test_the_dashboard_is_served_from_the_scheduler_pod_behind_a_service():
    manifests = make(dashboard=DashboardConfig(port=0))
    validate_all(manifests)
    (service,) = [m for m in manifests if m["metadata"]["name"] == f"{NAME}-dashboard"]
    assert service["spec"]["selector"] == {"paratrain.io/job": NAME, "paratrain.io/role": "scheduler"}
    assert service["spec"]["ports"] == [{"name": "dashboard", "port": 8265, "targetPort": 8265}]
    scrape = {"prometheus.io/scrape": "true", "prometheus.io/port": "8265", "prometheus.io/path": "/metrics"}
    assert service["metadata"]["annotations"] == scrape
    pods = pods_by_role(manifests)
    assert pods["scheduler"]["metadata"]["annotations"] == scrape
    env = [e["name"] for e in pods["scheduler"]["spec"]["containers"][0]["env"]]
    # $(PARATRAIN_HOST) expands only to a variable defined before it
    assert env.index("PARATRAIN_HOST") < env.index("PARATRAIN_DASHBOARD")
    assert {"name": "PARATRAIN_DASHBOARD", "value": "$(PARATRAIN_HOST):8265"} in pods["scheduler"]["spec"][
        "containers"
    ][0]["env"]
    for role in ("server", "worker"):
        assert "PARATRAIN_DASHBOARD" not in [e["name"] for e in pods[role]["spec"]["containers"][0]["env"]]
    (secret,) = [m for m in manifests if m["kind"] == "Secret"]
    assert base64.b64decode(secret["data"]["dashboard-token"]).decode() == dashboard_token(SECRET)


def test_the_jobset_form_holds_the_same_pods_as_the_jobs_form():
    jobs, jobset = make(pod_overrides=OVERRIDES), make(pod_overrides=OVERRIDES, form="jobset")
    validate_all(jobset)
    assert [m["kind"] for m in jobset] == ["Secret", "Service", "JobSet"]
    (whole,) = [m for m in jobset if m["kind"] == "JobSet"]
    assert whole["spec"]["failurePolicy"] == {"maxRestarts": 0}
    assert whole["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert [job["name"] for job in whole["spec"]["replicatedJobs"]] == ["scheduler", "server", "worker"]
    assert pod_templates(jobset) == pod_templates(jobs)
    with pytest.raises(ValueError, match="form must be one of jobs, jobset, got 'pytorchjob'"):
        K8sOptions(image="reg/train:1", form="pytorchjob")


def test_the_command_line_reads_the_overrides_file_and_prints_a_jobset(tmp_path: Path):
    overrides = tmp_path / "pods.yaml"
    overrides.write_text(yaml.safe_dump(OVERRIDES))
    args = ["launch", "--backend", "k8s", "--dry-run", "--image", "reg/train:1", "-w", "2", "-s", "1"]
    args += ["--pod-overrides", str(overrides), "--k8s-form", "jobset", "--dashboard", "train.py"]
    done = CliRunner().invoke(main, args)
    assert done.exit_code == 0, done.output
    manifests = list(yaml.safe_load_all(done.stdout))
    assert [m["kind"] for m in manifests] == ["Secret", "Service", "Service", "JobSet"]
    assert pods_by_role(manifests)["worker"]["spec"]["nodeSelector"] == {"accelerator": "a100"}
    overrides.write_text("- not a mapping\n")
    done = CliRunner().invoke(main, args)
    assert done.exit_code == 2 and "must hold a mapping of role to pod template" in done.output


DASHBOARD_PROBE = """\
import sys, urllib.error, urllib.request
import paratrain
ctx = paratrain.init()
if ctx.role == "worker" and ctx.rank == 0:
    url, token = sys.argv[1], sys.argv[2]
    try:
        urllib.request.urlopen(url, timeout=30)
    except urllib.error.HTTPError as exc:
        print("without the token:", exc.code)
    request = urllib.request.Request(url, headers={"Authorization": "Bearer " + token})
    text = urllib.request.urlopen(request, timeout=30).read().decode()
    print("with the token:", "paratrain_" in text)
ctx.barrier(name="probed")
"""


@pytest.mark.jobs
@pytest.mark.timeout(300)
def test_a_jobsets_pods_run_and_the_scheduler_pod_serves_the_dashboard(tmp_path):
    """Every pod of the JobSet form, started as Kubernetes would start it (tests/test_k8s.py's
    kubelet), runs the job; worker 0 reads /metrics from the scheduler pod's address at the
    dashboard's port with the Secret's token, and is refused without it."""
    from test_k8s import ROLE_LABEL, expand, job_pods, mount_namespace_unavailable, run_pods

    from paratrain.testing import free_port

    if mount_namespace_unavailable():
        pytest.skip(mount_namespace_unavailable())
    script = tmp_path / "probe.py"
    script.write_text(DASHBOARD_PROBE)
    port = free_port()
    url = f"http://127.77.0.1:{port}/metrics"  # the scheduler pod's address (job_pods numbers them)
    config = LaunchConfig(script=str(script), args=(url, "TOKEN"), num_workers=2, num_servers=1)
    options = K8sOptions(
        image="i", python=sys.executable, scheduler_port=free_port(), form="jobset",
        dashboard=DashboardConfig(port=port),
    )  # fmt: skip
    manifests = build_manifests(config, options, NAME, SECRET)
    validate_all(manifests)
    (secret,) = [m for m in manifests if m["kind"] == "Secret"]
    token = base64.b64decode(secret["data"]["dashboard-token"]).decode()
    (jobset,) = [m for m in manifests if m["kind"] == "JobSet"]
    as_jobs = [  # what the JobSet controller makes of it: one Job per replicated job
        {"kind": "Job", "metadata": {"name": f"{NAME}-{job['name']}-0", **job["template"]["metadata"]},
         "spec": job["template"]["spec"]}
        for job in jobset["spec"]["replicatedJobs"]
    ]  # fmt: skip
    services = [m for m in manifests if m["kind"] == "Service"]
    manifests = [m for m in manifests if m["kind"] != "JobSet"] + as_jobs
    pods, names = [], {}
    for job, container, env, ip in job_pods(manifests, net="127.77"):
        if job["metadata"]["labels"][ROLE_LABEL] == "scheduler":
            assert env["PARATRAIN_DASHBOARD"] == f"{ip}:{port}"  # its own address, not loopback
            for service in services:
                names[f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc"] = ip
        inits = job["spec"]["template"]["spec"].get("initContainers", [])
        init_commands = [[expand(part, env) for part in init["command"]] for init in inits]
        command = [expand(part, env).replace("TOKEN", token) for part in container["command"]]
        pods.append((f"{container['name']}-{env['PARATRAIN_RANK']}", init_commands, command, env))
    logs = run_pods(tmp_path, names, pods)
    assert "without the token: 401" in logs["worker-0"] and "with the token: True" in logs["worker-0"]
