"""What a cluster adds to the k8s engine's objects (manifests.py): the user's pod overrides, the
dashboard's Service, and the JobSet form.

Pod overrides are PodTemplateSpec fragments (`metadata.labels`, `metadata.annotations`, `spec`),
one for every role (`all`) and one per role (`scheduler`, `server`, `worker`), merged into each
role's pod in that order, as `kubectl patch` merges a strategic patch: mappings key by key, lists
of named items (containers, volumes, env, imagePullSecrets) item by name, other lists (tolerations)
appended. A container without a name is the role's own container (its resources, volumeMounts,
env). What paratrain sets for a job to run (the command, the restart policy, identity variables,
its labels) cannot be overridden: such a fragment is refused, naming the field. The fragments'
labels also go on the role's Job (and `all`'s on a JobSet), where queues such as Kueue read them.

The dashboard, when asked for, is served by the scheduler pod on its own IP (a Service cannot
reach a loopback address), at the port given (8265 when 0: a Service needs a fixed one), behind
the Service `<name>-dashboard`; its token is in the job's Secret under `dashboard-token`.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

ROLES = ("scheduler", "server", "worker")
OVERRIDE_KEYS = ("all", *ROLES)
DASHBOARD_PORT = 8265
"""The dashboard's port in the scheduler pod when none is given (Ray's, familiar to its users)."""
TOKEN_KEY = "dashboard-token"
JOBSET_API = "jobset.x-k8s.io/v1alpha2"

_OWNED_POD = ("restartPolicy",)
_OWNED_CONTAINER = ("command", "args", "image", "name")
_MAIN = "the role's own container"


def check_overrides(overrides: Mapping[str, Any], identity: frozenset[str], field: str) -> None:
    """ValueError naming the part of `overrides` (at `field`) that is not a fragment paratrain merges."""
    if not isinstance(overrides, Mapping):
        raise ValueError(f"{field} must be a mapping of role to pod template, got {overrides!r}")
    for role, fragment in overrides.items():
        where = f"{field}.{role}"
        if role not in OVERRIDE_KEYS:
            raise ValueError(f"{where}: {role!r} is not one of {', '.join(OVERRIDE_KEYS)}")
        if not isinstance(fragment, Mapping) or set(fragment) - {"metadata", "spec"}:
            raise ValueError(f"{where} must be a pod template (metadata, spec), got {fragment!r}")
        _check_metadata(fragment.get("metadata", {}), f"{where}.metadata")
        _check_pod(fragment.get("spec", {}), identity, f"{where}.spec")


def _check_metadata(metadata: Any, where: str) -> None:
    if not isinstance(metadata, Mapping) or set(metadata) - {"labels", "annotations"}:
        raise ValueError(f"{where} may hold labels and annotations only, got {metadata!r}")
    for kind in ("labels", "annotations"):
        values = metadata.get(kind, {})
        if not isinstance(values, Mapping):
            raise ValueError(f"{where}.{kind} must be a mapping, got {values!r}")
        for key, value in values.items():
            if not (isinstance(key, str) and isinstance(value, str)):
                raise ValueError(f"{where}.{kind}: {key!r}: {value!r} must be text to text")
            if key.startswith("paratrain.io/"):
                raise ValueError(f"{where}.{kind}.{key}: paratrain.io/ names are paratrain's own")


def _check_pod(pod: Any, identity: frozenset[str], where: str) -> None:
    if not isinstance(pod, Mapping):
        raise ValueError(f"{where} must be a pod spec mapping, got {pod!r}")
    for key in _OWNED_POD:
        if key in pod:
            raise ValueError(f"{where}.{key}: set by paratrain (a failed pod is not restarted)")
    for kind in ("containers", "initContainers"):
        containers = pod.get(kind, [])
        if not isinstance(containers, list) or not all(isinstance(c, Mapping) for c in containers):
            raise ValueError(f"{where}.{kind} must be a list of containers, got {containers!r}")
        for i, container in enumerate(containers):
            if kind == "containers" and "name" not in container:
                for key in _OWNED_CONTAINER:
                    if key in container:
                        raise ValueError(f"{where}.{kind}[{i}].{key}: {_MAIN}'s {key} is set by paratrain")
            for variable in container.get("env", []):
                name = variable.get("name") if isinstance(variable, Mapping) else None
                if name in identity:
                    raise ValueError(f"{where}.{kind}[{i}].env: {name} is set by paratrain for each pod")


def apply_overrides(pod_template: dict[str, Any], overrides: Mapping[str, Any], role: str) -> None:
    """Merges the `all` fragment, then the role's, into a Job's pod template, in place."""
    for key in ("all", role):
        fragment = overrides.get(key)
        if not fragment:
            continue
        fragment = copy.deepcopy(dict(fragment))
        spec = fragment.get("spec", {})
        main = pod_template["spec"]["containers"][0]["name"]
        spec["containers"] = [
            {**container, "name": container.get("name", main)} for container in spec.get("containers", [])
        ]
        _merge(pod_template, fragment)


def override_labels(overrides: Mapping[str, Any], *keys: str) -> dict[str, str]:
    """The labels the fragments of `keys` give pods, which their Jobs (and a JobSet) carry too: a
    queue such as Kueue's (`kueue.x-k8s.io/queue-name`) reads them from the workload, not its pods."""
    labels: dict[str, str] = {}
    for key in keys:
        labels.update(overrides.get(key, {}).get("metadata", {}).get("labels", {}))
    return labels


def _merge(into: dict[str, Any], patch: Mapping[str, Any]) -> None:
    for key, value in patch.items():
        have = into.get(key)
        if isinstance(have, dict) and isinstance(value, Mapping):
            _merge(have, value)
        elif isinstance(have, list) and isinstance(value, list):
            into[key] = _merge_list(have, value)
        else:
            into[key] = copy.deepcopy(value)


def _merge_list(have: list[Any], patch: list[Any]) -> list[Any]:
    """Named items merged by name (the rest appended), unnamed items appended."""
    merged = copy.deepcopy(have)
    by_name = {item["name"]: item for item in merged if isinstance(item, dict) and "name" in item}
    for item in patch:
        if isinstance(item, Mapping) and item.get("name") in by_name:
            _merge(by_name[item["name"]], item)
        else:
            merged.append(copy.deepcopy(item))
    return merged


# ---- the dashboard -----------------------------------------------------------------------------


def dashboard_port(port: int) -> int:
    return port or DASHBOARD_PORT


def dashboard_env(port: int) -> dict[str, str]:
    """PARATRAIN_DASHBOARD for the scheduler container: its own pod IP, which Kubernetes writes in
    from PARATRAIN_HOST (defined before it: `$(VAR)` expands earlier variables only)."""
    return {"name": "PARATRAIN_DASHBOARD", "value": f"$(PARATRAIN_HOST):{dashboard_port(port)}"}


def scrape_annotations(port: int) -> dict[str, str]:
    """The annotations Prometheus's usual kubernetes-pods and -services scrape jobs read."""
    return {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(dashboard_port(port)),
        "prometheus.io/path": "/metrics",
    }


def dashboard_service(metadata: dict[str, Any], selector: dict[str, str], port: int) -> dict[str, Any]:
    """The Service in front of the scheduler pod's dashboard (`kubectl port-forward svc/...`)."""
    metadata = {**metadata, "annotations": scrape_annotations(port)}
    number = dashboard_port(port)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata,
        "spec": {
            "selector": selector,
            "ports": [{"name": "dashboard", "port": number, "targetPort": number}],
        },
    }


# ---- JobSet --------------------------------------------------------------------------------------


def jobset(name: str, namespace: str, labels: dict[str, str], jobs: list[dict[str, Any]]) -> dict[str, Any]:
    """The role Jobs as one JobSet (jobset.x-k8s.io): one replicated Job per role, one replica
    each; no restart of the set (maxRestarts 0: a failed pod fails the job, as with plain Jobs)."""
    replicated = []
    for job in jobs:
        role = job["metadata"]["labels"]["paratrain.io/role"]
        template = {"metadata": {"labels": job["metadata"]["labels"]}, "spec": job["spec"]}
        replicated.append({"name": role, "replicas": 1, "template": template})
    return {
        "apiVersion": JOBSET_API,
        "kind": "JobSet",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {"failurePolicy": {"maxRestarts": 0}, "replicatedJobs": replicated},
    }
