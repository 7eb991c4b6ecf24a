"""The Kubernetes engine, without a cluster: the manifests validate against the Kubernetes schema
offline, the secret is only in the Secret, and the env each pod would get (fieldRefs and
secretKeyRefs resolved as the kubelet resolves them) makes every role and rank exactly once.
Kubeflow's TFJob is checked the same way, from the TF_CONFIG its operator gives each replica.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from paratrain.cluster.spec import spec_from_env
from paratrain.launch.api import LaunchConfig
from paratrain.launch.engines.k8s.manifests import (
    INDEX_FIELD,
    JOB_LABEL,
    ROLE_LABEL,
    K8sOptions,
    build_manifests,
    job_name,
    manifests_yaml,
    run_k8s_job,
)
from paratrain.testing import assert_all_gone, free_port

# A version kubernetes-validate ships schemas for (and the kubectl installed here speaks).
K8S_VERSION = "1.32"
SECRET = bytes(range(32))
NAME = "paratrain-train-abc123"
TFJOB = Path(__file__).resolve().parent.parent / "docs" / "examples" / "tfjob.yaml"  # the docs' TFJob
PARATRAIN = str(Path(sys.executable).parent / "paratrain")
JOBS_DIR = Path(__file__).resolve().parent / "jobs"

JOBS = [  # (workers, servers, options): the shapes a job takes
    (3, 2, {}),
    (1, 1, {"namespace": "ml", "cpus_per_worker": 2.5, "gpus_per_worker": 1}),
    (4, 0, {"cpus_per_worker": 0.5}),  # collective: no server Job
    (2, 3, {"cpus_per_server": 4, "scheduler_port": 7000}),
]


def make(workers: int, servers: int, **options) -> tuple[LaunchConfig, K8sOptions, list[dict]]:
    config = LaunchConfig(
        script="train.py", args=("--lr", "0.1"), num_workers=workers, num_servers=servers, timeout_s=3600
    )
    opts = K8sOptions(image="registry.local/train:1", **options)
    return config, opts, build_manifests(config, opts, NAME, SECRET)


def of_kind(manifests: list[dict], kind: str) -> list[dict]:
    return [m for m in manifests if m["kind"] == kind]


# ---- what the kubelet would do ------------------------------------------------------------------

_REF = re.compile(r"\$\$|\$\(([-._a-zA-Z0-9]+)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: $$ is a literal $, $(VAR) a variable defined before it (an
    undefined one is left as written)."""
    return _REF.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def secret_value(secrets: dict[str, dict], name: str, key: str) -> str:
    secret = secrets[name]
    if key in secret.get("stringData", {}):
        return secret["stringData"][key]
    return base64.b64decode(secret["data"][key]).decode()


def pod_env(
    container: dict, annotations: dict[str, str], pod_ip: str, secrets: dict[str, dict]
) -> dict[str, str]:
    """The environment a container starts with, each entry resolved in order as Kubernetes does."""
    env: dict[str, str] = {}
    for entry in container.get("env", []):
        name = entry["name"]
        if "value" in entry:
            env[name] = expand(entry["value"], env)
            continue
        source = entry["valueFrom"]
        if "fieldRef" in source:
            path = source["fieldRef"]["fieldPath"]
            match = re.fullmatch(r"metadata\.annotations\['([^']+)'\]", path)
            if path == "status.podIP":
                env[name] = pod_ip
            elif match:
                env[name] = annotations[match.group(1)]
            else:
                raise AssertionError(f"fieldRef {path!r} is not resolved by this test")
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            env[name] = secret_value(secrets, ref["name"], ref["key"])
        else:
            raise AssertionError(f"env {name}: valueFrom {source!r} is not resolved by this test")
    return env


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def job_pods(manifests: list[dict], net: str = "10.0") -> list[tuple[dict, dict, dict[str, str], str]]:
    """(Job, container, env, pod IP) of every pod every Job starts, one per completion index; pod
    IPs are <net>.<the Job's position>.<index + 1>."""
    secrets = {m["metadata"]["name"]: m for m in of_kind(manifests, "Secret")}
    pods = []
    for j, job in enumerate(of_kind(manifests, "Job")):
        spec = job["spec"]
        assert spec["completionMode"] == "Indexed"
        assert spec["completions"] == spec["parallelism"]
        (container,) = spec["template"]["spec"]["containers"]
        for index in range(spec["completions"]):
            pod_ip = f"{net}.{j}.{index + 1}"
            annotations = {"batch.kubernetes.io/job-completion-index": str(index)}
            pods.append((job, container, pod_env(container, annotations, pod_ip, secrets), pod_ip))
    return pods


# ---- the manifests ------------------------------------------------------------------------------


@pytest.mark.parametrize("workers,servers,options", JOBS)
def test_manifests_validate_against_the_kubernetes_schema(workers, servers, options):
    _, _, manifests = make(workers, servers, **options)
    assert [m["kind"] for m in manifests] == ["Secret", "Service", "Job"] + ["Job"] * (1 + (servers > 0))
    for manifest in manifests:
        # strict: an unknown (misspelt) field fails too
        assert kubernetes_validate.validate(manifest, K8S_VERSION, strict=True) == K8S_VERSION
    # and as the YAML text kubectl is given
    for manifest in yaml.safe_load_all(manifests_yaml(manifests)):
        kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)


def test_a_broken_manifest_fails_validation():
    """The validation above can fail: a misspelt field and a wrong type are caught."""
    _, _, manifests = make(2, 1)
    job = of_kind(manifests, "Job")[0]
    job["spec"]["completion"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, K8S_VERSION, strict=True)
    del job["spec"]["completion"]
    job["spec"]["template"]["spec"]["containers"][0]["env"][0]["value"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, K8S_VERSION, strict=True)


@pytest.mark.parametrize("workers,servers,options", JOBS)
def test_the_secret_is_only_in_the_secret_object(workers, servers, options):
    _, _, manifests = make(workers, servers, **options)
    text = manifests_yaml(manifests)
    encoded = base64.b64encode(SECRET.hex().encode()).decode()
    assert SECRET.hex() not in text  # base64 under `data`, never the hex itself
    (secret,) = of_kind(manifests, "Secret")
    assert secret["data"] == {"PARATRAIN_SECRET": encoded}
    assert "stringData" not in secret
    for manifest in manifests:
        if manifest is secret:
            continue
        dumped = yaml.safe_dump(manifest)
        for form in (SECRET.hex(), encoded, base64.b64encode(SECRET).decode(), SECRET.hex().upper()):
            assert form not in dumped, f"{manifest['kind']} {manifest['metadata']['name']} holds the secret"
    for _job, container, _, _ in job_pods(manifests):
        (entry,) = [e for e in container["env"] if e["name"] == "PARATRAIN_SECRET"]
        assert entry == {
            "name": "PARATRAIN_SECRET",
            "valueFrom": {"secretKeyRef": {"name": secret["metadata"]["name"], "key": "PARATRAIN_SECRET"}},
        }
        assert not any("SECRET" in part for part in container["command"])


@pytest.mark.parametrize("workers,servers,options", JOBS)
def test_every_pod_resolves_to_one_role_and_rank(workers, servers, options):
    config, opts, manifests = make(workers, servers, **options)
    (service,) = of_kind(manifests, "Service")
    svc_name, namespace = service["metadata"]["name"], service["metadata"]["namespace"]
    (port,) = service["spec"]["ports"]
    seen = []
    for job, container, env, pod_ip in job_pods(manifests):
        spec = spec_from_env(env)
        assert spec is not None and spec.source == "paratrain"
        assert job["metadata"]["labels"][ROLE_LABEL] == spec.role == container["name"]
        assert (spec.num_workers, spec.num_servers) == (workers, servers)
        assert (spec.scheduler_host, spec.scheduler_port) == (f"{svc_name}.{namespace}.svc", port["port"])
        assert spec.host == pod_ip and spec.secret == SECRET
        seen.append((spec.role, spec.rank))
    expected = [("scheduler", 0)] + [("server", r) for r in range(servers)]
    expected += [("worker", r) for r in range(workers)]
    assert sorted(seen) == sorted(expected) and len(seen) == len(set(seen))


@pytest.mark.parametrize("workers,servers,options", JOBS)
def test_the_service_reaches_the_scheduler_pod_alone(workers, servers, options):
    _, opts, manifests = make(workers, servers, **options)
    (service,) = of_kind(manifests, "Service")
    assert service["spec"]["clusterIP"] == "None"  # headless: the name resolves to the pod's own IP
    selector = service["spec"]["selector"]
    chosen = [
        job
        for job in of_kind(manifests, "Job")
        if selects(selector, job["spec"]["template"]["metadata"]["labels"])
    ]
    assert [job["metadata"]["name"] for job in chosen] == [f"{NAME}-scheduler"]
    assert chosen[0]["spec"]["completions"] == 1
    (container,) = chosen[0]["spec"]["template"]["spec"]["containers"]
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] == container["ports"][0]["containerPort"] == opts.scheduler_port


def test_every_object_carries_the_job_label():
    _, _, manifests = make(3, 2)
    for manifest in manifests:
        assert manifest["metadata"]["labels"][JOB_LABEL] == NAME
        assert manifest["metadata"]["namespace"] == "default"
    for job in of_kind(manifests, "Job"):
        assert job["spec"]["template"]["metadata"]["labels"][JOB_LABEL] == NAME
        assert job["spec"]["backoffLimit"] == 0 and job["spec"]["activeDeadlineSeconds"] == 3600
        assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"


def test_resources_and_threads_per_role(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    _, _, manifests = make(2, 1, cpus_per_worker=2.5, cpus_per_server=4, gpus_per_worker=2)
    got = {}
    for _job, container, env, _ in job_pods(manifests):
        got[container["name"]] = (container["resources"], env["OMP_NUM_THREADS"], env["MKL_NUM_THREADS"])
    assert got["worker"] == (
        {"requests": {"cpu": "2500m"}, "limits": {"cpu": "2500m", "nvidia.com/gpu": 2}},
        "2",
        "2",
    )
    assert got["server"] == ({"requests": {"cpu": "4"}, "limits": {"cpu": "4"}}, "4", "4")
    assert got["scheduler"][1] == "1"
    # a fraction of a core still gets one thread
    _, _, manifests = make(2, 1, cpus_per_worker=0.25)
    worker = [env for job, c, env, _ in job_pods(manifests) if c["name"] == "worker"][0]
    assert worker["OMP_NUM_THREADS"] == "1"


def test_threads_the_user_chose_are_kept(monkeypatch):
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # set where the job was launched: carried to the pods
    _, _, manifests = make(2, 1, cpus_per_worker=8)
    for _, _, env, _ in job_pods(manifests):
        assert env["OMP_NUM_THREADS"] == "3" and "MKL_NUM_THREADS" not in env
    monkeypatch.delenv("OMP_NUM_THREADS")
    config = LaunchConfig(script="train.py", num_workers=2, num_servers=1, env={"MKL_NUM_THREADS": "5"})
    manifests = build_manifests(config, K8sOptions(image="i", cpus_per_worker=8), NAME, SECRET)
    for _, _, env, _ in job_pods(manifests):
        assert env["MKL_NUM_THREADS"] == "5" and "OMP_NUM_THREADS" not in env


def test_the_command_and_env_reach_the_pod_as_given():
    """Kubernetes expands $(VAR) in commands and env values: the user's text must come through as is."""
    args = ("--out", "$(HOME)/x", "$$", "a b")
    config = LaunchConfig(
        script="dir/train.py",
        args=args,
        num_workers=1,
        num_servers=1,
        strategy="dist_async",
        env={"NOTE": "$(PARATRAIN_ROLE) costs $5"},
    )
    manifests = build_manifests(config, K8sOptions(image="i", python="python3"), NAME, SECRET)
    for _, container, env, _ in job_pods(manifests):
        assert [expand(part, env) for part in container["command"]] == [
            "python3",
            "-u",
            "dir/train.py",
            *args,
        ]
        assert env["NOTE"] == "$(PARATRAIN_ROLE) costs $5"
        assert env["PARATRAIN_STRATEGY"] == "dist_async"
        assert env["PARATRAIN_RANK"] == str(int(env["PARATRAIN_RANK"]))


def test_identity_in_the_users_env_is_ignored():
    env = {"PARATRAIN_ROLE": "server", "PARATRAIN_SECRET_FILE": "/s", "PARATRAIN_HOST": "1.2.3.4", "X": "1"}
    config = LaunchConfig(script="train.py", num_workers=2, num_servers=1, env=env)
    manifests = build_manifests(config, K8sOptions(image="i"), NAME, SECRET)
    for _, container, env, pod_ip in job_pods(manifests):
        names = [entry["name"] for entry in container["env"]]
        assert len(names) == len(set(names)) and "PARATRAIN_SECRET_FILE" not in names
        assert env["X"] == "1" and env["PARATRAIN_HOST"] == pod_ip
        assert env["PARATRAIN_ROLE"] == container["name"]


def test_the_rank_comes_from_the_completion_index():
    _, _, manifests = make(2, 2)
    for _, container, _, _ in job_pods(manifests):
        (entry,) = [e for e in container["env"] if e["name"] == "PARATRAIN_RANK"]
        assert entry["valueFrom"] == {"fieldRef": {"fieldPath": INDEX_FIELD}}
        (entry,) = [e for e in container["env"] if e["name"] == "PARATRAIN_HOST"]
        assert entry["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}


def test_servers_and_workers_wait_for_the_scheduler_name(tmp_path):
    """The init container's program resolves the Service name; past its limit it fails naming it."""
    _, _, manifests = make(2, 1)
    for job in of_kind(manifests, "Job"):
        init = job["spec"]["template"]["spec"].get("initContainers", [])
        if job["metadata"]["labels"][ROLE_LABEL] == "scheduler":
            assert init == []
            continue
        (wait,) = init
        assert wait["command"][3] == f"{NAME}-scheduler.default.svc"
    program = wait["command"][2]
    done = subprocess.run([sys.executable, "-c", program, "localhost", "5"], capture_output=True, timeout=60)
    assert done.returncode == 0
    done = subprocess.run(
        [sys.executable, "-c", program, "no-such-name.invalid", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and "scheduler pod behind no-such-name.invalid" in done.stderr


def mount_namespace_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root: each pod's process gets the Service's DNS name in a mount namespace of its own"
    if shutil.which("unshare") is None:
        return "needs unshare (util-linux)"
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True)
    if probe.returncode != 0:
        return f"unshare --mount does not work here: {probe.stderr.decode().strip()}"
    return None


def run_pods(tmp_path: Path, names: dict[str, str], pods: list[tuple[str, list, list, dict]]) -> dict:
    """Runs each pod's init commands, then all their commands at once, each process in a mount
    namespace of its own whose /etc/hosts maps `names` (DNS name -> address) as cluster DNS would.
    pods: (label, init commands, command, env). Returns {label: output}; asserts every one exited 0."""
    hosts = tmp_path / "hosts"
    hosts.write_text(
        Path("/etc/hosts").read_text() + "".join(f"\n{ip} {name}" for name, ip in names.items()) + "\n"
    )
    wrap = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
            'mount --bind "$0" /etc/hosts && exec "$@"', str(hosts)]  # fmt: skip
    # what the image would provide: the interpreter's paths (paratrain installed)
    base = {name: os.environ[name] for name in ("PATH", "PYTHONPATH", "HOME") if name in os.environ}
    procs = {}
    try:
        for label, inits, command, env in pods:
            for init in inits:
                done = subprocess.run(wrap + init, capture_output=True, text=True, timeout=60)
                assert done.returncode == 0, done.stderr
            with open(tmp_path / f"{label}.log", "w") as log:
                procs[label] = subprocess.Popen(wrap + command, env={**base, **env}, stdout=log, stderr=log)
        for proc in procs.values():
            proc.wait(timeout=240)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    logs = {label: (tmp_path / f"{label}.log").read_text() for label in procs}
    assert {label: proc.returncode for label, proc in procs.items()} == dict.fromkeys(procs, 0), logs
    assert_all_gone([proc.pid for proc in procs.values()])
    return logs


KV_EXACT = [sys.executable, "-u", str(JOBS_DIR / "kv_exact.py"), "dist_sync", "1", "tcp"]
needs_mount_namespace = pytest.mark.skipif(
    mount_namespace_unavailable() is not None, reason=str(mount_namespace_unavailable())
)


@needs_mount_namespace
@pytest.mark.timeout(300)
def test_the_pods_run_the_job(tmp_path):
    """Every pod's process started with exactly the env and command Kubernetes would give it: the
    job runs and its values are exact. Pods get addresses 127.77.<job>.<index + 1> (all on this
    machine's loopback), and the Service's DNS name resolves to the scheduler pod's address."""
    config = LaunchConfig(script=KV_EXACT[2], args=KV_EXACT[3:], num_workers=2, num_servers=1)
    # a free port: these pods share this machine's network namespace, unlike real ones
    options = K8sOptions(image="i", python=sys.executable, scheduler_port=free_port())
    manifests = build_manifests(config, options, NAME, SECRET)
    (service,) = of_kind(manifests, "Service")
    pods, names = [], {}
    for job, container, env, ip in job_pods(manifests, net="127.77"):
        if job["metadata"]["labels"][ROLE_LABEL] == "scheduler":
            names[f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc"] = ip
        inits = job["spec"]["template"]["spec"].get("initContainers", [])
        init_commands = [[expand(part, env) for part in init["command"]] for init in inits]
        command = [expand(part, env) for part in container["command"]]
        pods.append((f"{container['name']}-{env['PARATRAIN_RANK']}", init_commands, command, env))
    logs = run_pods(tmp_path, names, pods)
    assert sorted(logs) == ["scheduler-0", "server-0", "worker-0", "worker-1"]
    assert "all exact" in logs["worker-0"] and "all exact" in logs["worker-1"]


# ---- options and names ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value",
    [
        ("image", ""),
        ("namespace", "ML"),
        ("namespace", "a_b"),
        ("name", "x" * 42),
        ("name", "9lives"),
        ("cpus_per_worker", 0.0),
        ("cpus_per_server", float("inf")),
        ("gpus_per_worker", -1),
        ("scheduler_port", 70000),
        ("python", ""),
    ],
)
def test_bad_options_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        K8sOptions(**{"image": "i", field: value})


def test_job_names_are_dns_labels_and_unique():
    names = {job_name("examples/My_Train.Script.py") for _ in range(20)}
    assert len(names) == 20
    for name in names:
        assert re.fullmatch(r"paratrain-my-train-script-[0-9a-f]{6}", name)
        K8sOptions(image="i", name=name)  # accepted as a name
    assert re.fullmatch(r"paratrain-[0-9a-f]{6}", job_name("___.py"))
    K8sOptions(image="i", name=job_name("a" * 200 + ".py"))
    K8sOptions(image="i", name="x" * 41)
    # the longest name still gives pod names and hostnames that are 63-character DNS labels
    config = LaunchConfig(script="t.py", num_workers=99999, num_servers=1)
    for job in of_kind(build_manifests(config, K8sOptions(image="i"), "x" * 41, SECRET), "Job"):
        pod = f"{job['metadata']['name']}-{job['spec']['completions'] - 1}-abcde"
        assert len(pod) <= 63 and re.fullmatch(r"[a-z][-a-z0-9]*[a-z0-9]", pod)


# ---- running ------------------------------------------------------------------------------------


def test_dry_run_prints_the_manifests():
    config = LaunchConfig(script="train.py", num_workers=2, num_servers=1)
    out = io.StringIO()
    assert run_k8s_job(config, K8sOptions(image="i", dry_run=True), out=out) == 0
    manifests = list(yaml.safe_load_all(out.getvalue()))
    assert [m["kind"] for m in manifests] == ["Secret", "Service", "Job", "Job", "Job"]
    pods = job_pods(manifests)
    assert sorted((env["PARATRAIN_ROLE"], env["PARATRAIN_RANK"]) for _, _, env, _ in pods) == [
        ("scheduler", "0"),
        ("server", "0"),
        ("worker", "0"),
        ("worker", "1"),
    ]


def test_cli_dry_run():
    """The real command: its stdout is the manifests alone (the log goes to stderr)."""
    cmd = [PARATRAIN, "launch", "--backend", "k8s", "--dry-run", "--image", "registry.local/t:1",
           "-w", "3", "-s", "2", "--cpus-per-worker", "2", "train.py", "--epochs", "3"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    manifests = list(yaml.safe_load_all(done.stdout))
    for manifest in manifests:
        kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)
    roles = sorted(
        (env["PARATRAIN_ROLE"], int(env["PARATRAIN_RANK"])) for _, _, env, _ in job_pods(manifests)
    )
    assert roles == [
        ("scheduler", 0),
        ("server", 0),
        ("server", 1),
        ("worker", 0),
        ("worker", 1),
        ("worker", 2),
    ]
    assert "workers: threads per process: OMP_NUM_THREADS=2 (2 cores per worker pod" in done.stderr


def fake_kubectl(tmp_path: Path, rc: int) -> Path:
    script = tmp_path / "kubectl"
    script.write_text(
        f'#!/bin/sh\necho "$@" >> "{tmp_path}/args"\ncat > "{tmp_path}/stdin"\n'
        f'[ {rc} = 0 ] || echo "error: something broke" >&2\nexit {rc}\n'
    )
    script.chmod(0o755)
    return script


def test_apply_gives_kubectl_the_manifests(tmp_path, caplog):
    config = LaunchConfig(script="train.py", num_workers=2, num_servers=1)
    options = K8sOptions(image="i", namespace="ml", name=NAME, kubectl=str(fake_kubectl(tmp_path, 0)))
    with caplog.at_level(logging.INFO):
        assert run_k8s_job(config, options) == 0
    assert (tmp_path / "args").read_text().split()[:3] == [
        "apply",
        "--server-side",
        "--field-manager=paratrain",
    ]
    assert (tmp_path / "args").read_text().split()[-2:] == ["-f", "-"]
    applied = list(yaml.safe_load_all((tmp_path / "stdin").read_text()))
    assert [m["metadata"]["name"] for m in applied] == [
        f"{NAME}-secret",
        f"{NAME}-scheduler",
        f"{NAME}-scheduler",
        f"{NAME}-server",
        f"{NAME}-worker",
    ]
    assert f"kubectl delete job,service,secret -n ml -l {JOB_LABEL}={NAME}" in caplog.text


def test_apply_failure_is_reported(tmp_path, caplog):
    config = LaunchConfig(script="train.py", num_workers=2, num_servers=1)
    options = K8sOptions(image="i", name=NAME, kubectl=str(fake_kubectl(tmp_path, 3)))
    assert run_k8s_job(config, options) == 1
    assert "kubectl apply failed (exit 3)" in caplog.text and "error: something broke" in caplog.text
    assert f"-l {JOB_LABEL}={NAME}" in caplog.text
    caplog.clear()
    options = K8sOptions(image="i", kubectl=str(tmp_path / "missing-kubectl"))
    assert run_k8s_job(config, options) == 1
    assert "missing-kubectl' was not found" in caplog.text and "--dry-run" in caplog.text


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_apply_without_a_cluster_says_so(tmp_path, caplog, monkeypatch):
    """The real kubectl, pointed at a port where no cluster listens."""
    port = free_port()
    kubeconfig = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "none", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
        "users": [{"name": "me", "user": {}}],
        "contexts": [{"name": "nowhere", "context": {"cluster": "none", "user": "me"}}],
        "current-context": "nowhere",
    }
    (tmp_path / "config").write_text(json.dumps(kubeconfig))
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "config"))
    config = LaunchConfig(script="train.py", num_workers=2, num_servers=1)
    assert run_k8s_job(config, K8sOptions(image="i", name=NAME)) == 1
    assert "kubectl apply failed (exit 1)" in caplog.text
    assert f"127.0.0.1:{port}" in caplog.text and "refused" in caplog.text
    assert "kubectl's current context is 'nowhere'" in caplog.text
    caplog.clear()
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    assert run_k8s_job(config, K8sOptions(image="i", name=NAME)) == 1
    assert "kubectl has no current context" in caplog.text


# ---- Kubeflow's TFJob -----------------------------------------------------------------------------


def tfjob_tf_config(
    name: str, namespace: str, replicas: dict[str, int], rtype: str, index: int, port: int = 2222
) -> str:
    """TF_CONFIG as Kubeflow's training operator writes it for one replica (genTFConfigJSONStr):
    each replica type lower-cased, each replica at <job>-<type>-<i>.<namespace>.svc:2222 (its
    headless Service and the default port), evaluators left out of the cluster."""
    cluster = {
        kind.lower(): [f"{name}-{kind.lower()}-{i}.{namespace}.svc:{port}" for i in range(count)]
        for kind, count in replicas.items()
        if kind != "Evaluator"
    }
    task = {"type": rtype.lower(), "index": index}
    return json.dumps({"cluster": cluster, "task": task, "environment": "cloud"})


def tfjob_pods(tfjob: dict, secrets: dict[str, dict], net: str = "10.1", port: int = 2222):
    """(replica type, index, env, pod IP) for every replica of a TFJob, with the env its pod gets:
    the template's, resolved, plus the TF_CONFIG the operator adds to the `tensorflow` container.
    Pod IPs are <net>.<the replica type's position>.<index + 1>."""
    name, namespace = tfjob["metadata"]["name"], tfjob["metadata"].get("namespace", "default")
    specs = tfjob["spec"]["tfReplicaSpecs"]
    replicas = {kind: spec["replicas"] for kind, spec in specs.items()}
    for t, (kind, spec) in enumerate(specs.items()):
        (container,) = [c for c in spec["template"]["spec"]["containers"] if c["name"] == "tensorflow"]
        for index in range(spec["replicas"]):
            pod_ip = f"{net}.{t}.{index + 1}"
            env = pod_env(container, {}, pod_ip, secrets)
            env["TF_CONFIG"] = tfjob_tf_config(name, namespace, replicas, kind, index, port)
            yield kind, index, env, pod_ip


def secret_object(name: str, namespace: str = "default") -> dict:
    encoded = base64.b64encode(SECRET.hex().encode()).decode()
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": namespace},
            "data": {"PARATRAIN_SECRET": encoded}}  # fmt: skip


def tfjob(replicas: dict[str, int]) -> dict:
    template = {
        "spec": {
            "containers": [
                {
                    "name": "tensorflow",
                    "image": "i",
                    "env": [
                        {
                            "name": "PARATRAIN_SECRET",
                            "valueFrom": {"secretKeyRef": {"name": "s", "key": "PARATRAIN_SECRET"}},
                        },
                        {"name": "PARATRAIN_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                    ],  # fmt: skip
                }
            ]
        }
    }
    specs = {kind: {"replicas": count, "template": template} for kind, count in replicas.items()}
    return {"kind": "TFJob", "metadata": {"name": "tj", "namespace": "ml"}, "spec": {"tfReplicaSpecs": specs}}


def check_tfjob_ranks(job: dict, secrets: dict[str, dict]) -> None:
    specs = job["spec"]["tfReplicaSpecs"]
    chief = specs.get("Chief", {}).get("replicas", 0)
    workers = chief + specs.get("Worker", {}).get("replicas", 0)
    servers = specs.get("PS", {}).get("replicas", 0)
    first = f"{job['metadata']['name']}-{'chief' if chief else 'worker'}-0.{job['metadata']['namespace']}.svc"
    seen = []
    for kind, _index, env, pod_ip in tfjob_pods(job, secrets):
        spec = spec_from_env(env)
        assert spec is not None and spec.source == "tf_config"
        assert (spec.num_workers, spec.num_servers) == (workers, servers)
        assert (spec.scheduler_host, spec.scheduler_port) == (first, 2222)
        assert spec.host == pod_ip and spec.secret == SECRET
        # worker 0 (the chief when there is one) runs the scheduler, nobody else
        assert spec.embedded_scheduler == (spec.role == "worker" and spec.rank == 0)
        assert spec.role == ("server" if kind == "PS" else "worker")
        if kind == "Chief":
            assert spec.rank == 0
        seen.append((spec.role, spec.rank))
    expected = [("server", r) for r in range(servers)] + [("worker", r) for r in range(workers)]
    assert sorted(seen) == expected


@pytest.mark.parametrize(
    "replicas",
    [
        {"Chief": 1, "Worker": 3, "PS": 2},
        {"Worker": 2, "PS": 1},
        {"PS": 3, "Worker": 4, "Chief": 1},
        {"Chief": 1, "Worker": 2},  # collective: no ps
        {"Chief": 1, "Worker": 2, "PS": 1, "Evaluator": 1},  # the evaluator is not in the cluster
    ],
)
def test_tfjob_replicas_resolve_to_every_role_and_rank_once(replicas):
    job = tfjob(replicas)
    secrets = {"s": secret_object("s", "ml")}
    if "Evaluator" in replicas:
        # an evaluator is in no cluster list: paratrain refuses it rather than guess a role
        env = next(env for kind, _, env, _ in tfjob_pods(job, secrets) if kind == "Evaluator")
        with pytest.raises(ValueError, match="task.type='evaluator'"):
            spec_from_env(env)
        del job["spec"]["tfReplicaSpecs"]["Evaluator"]
    check_tfjob_ranks(job, secrets)


def readme_tfjob() -> dict:
    (job,) = [doc for doc in yaml.safe_load_all(TFJOB.read_text()) if doc.get("kind") == "TFJob"]
    return job


def test_the_readme_tfjob_works():
    """The docs' TFJob: each replica's pod template validates, takes the secret from a Secret and
    its host from the pod IP, and its replicas resolve to every role and rank once."""
    job = readme_tfjob()
    secrets = {}
    for spec in job["spec"]["tfReplicaSpecs"].values():
        assert spec["restartPolicy"] == "Never"
        template = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": "t"},
            "template": spec["template"],
        }
        kubernetes_validate.validate(template, K8S_VERSION, strict=True)
        for container in spec["template"]["spec"]["containers"]:
            for entry in container.get("env", []):
                assert "SECRET" not in entry["name"] or "value" not in entry
                ref = entry.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    secrets[ref["name"]] = secret_object(ref["name"], job["metadata"]["namespace"])
    assert secrets, "the docs' TFJob takes no secret from a Secret"
    check_tfjob_ranks(job, secrets)
    assert all(env["PARATRAIN_HOST"] == ip for _, _, env, ip in tfjob_pods(job, secrets))


@needs_mount_namespace
@pytest.mark.timeout(300)
def test_tfjob_replicas_run_the_job(tmp_path):
    """Each TFJob replica's process started with the env its pod would get (TF_CONFIG as the
    operator writes it): the chief runs the scheduler, the ps replica serves, the values are exact.
    Each replica's DNS name (the operator's headless Service per replica) resolves to its address."""
    job = tfjob({"Chief": 1, "Worker": 1, "PS": 1})
    secrets = {"s": secret_object("s", "ml")}
    pods, names = [], {}
    # a free port where the operator's default is 2222: these pods share this machine's network
    for kind, index, env, ip in tfjob_pods(job, secrets, net="127.78", port=free_port()):
        names[f"tj-{kind.lower()}-{index}.ml.svc"] = ip
        pods.append((f"{kind.lower()}-{index}", [], KV_EXACT, env))
    logs = run_pods(tmp_path, names, pods)
    assert "all exact" in logs["chief-0"] and "all exact" in logs["worker-0"]


@pytest.mark.parametrize("gpus", [0, 2])
def test_each_worker_pod_is_alone_on_its_host_with_its_gpus_and_servers_see_none(gpus):
    _, _, manifests = make(2, 1, gpus_per_worker=gpus)
    for _, container, env, _ in job_pods(manifests):
        spec = spec_from_env(env)
        if container["name"] == "worker":
            assert (spec.local_rank, spec.local_world_size) == (0, 1)
            assert spec.gpus_per_worker == (gpus or None)
            assert container["resources"]["limits"].get("nvidia.com/gpu") == (gpus or None)
            assert "CUDA_VISIBLE_DEVICES" not in env  # the device plugin shows the pod its own
        else:
            assert spec.gpus_per_worker is None and "nvidia.com/gpu" not in container["resources"]["limits"]
            assert env.get("CUDA_VISIBLE_DEVICES") == ("" if gpus else None)
