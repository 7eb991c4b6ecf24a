"""The job spec's parts (jobspec.py holds the whole): what every process runs, what each role
reserves, and each engine's own settings. Each field here is one `paratrain launch` option too
(jobspec.LAUNCH_FIELDS says which), so that a spec and a command line say the same things."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema, model_validator

TEXT_MAX = 4096
"""Longest string field: a path, a name, an argument (Linux's PATH_MAX)."""
ITEMS_MAX = 1000
"""Most arguments in entry.args, and most variables in env."""
Text = Annotated[str, Field(max_length=TEXT_MAX)]

MEMORY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|K|M|G|T)?$")


def _number_as_text(value: Any) -> Any:
    """A script argument written as a YAML number (`--epochs, 3`), as the text the script gets."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return value


ScriptArg = Annotated[Text, BeforeValidator(_number_as_text), WithJsonSchema({"type": ["string", "number"]})]


class StrictModel(BaseModel):
    """Unknown fields are errors; values are not coerced across types (no "2" for 2)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, use_attribute_docstrings=True)


class Entry(StrictModel):
    """What every process runs: a script, or a module (`python -m`)."""

    script: str | None = Field(None, min_length=1, max_length=TEXT_MAX)
    """The Python script, relative to work_dir (or absolute); or give `module`."""
    module: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
    """A module to run as `python -m MODULE` from work_dir, instead of a script (launch's -m)."""
    args: list[ScriptArg] = Field([], max_length=ITEMS_MAX)
    """Its own arguments, passed unparsed, before any directory arguments (numbers as written)."""
    python: Text | None = None
    """The interpreter (on every host); default: the one running paratrain (on k8s: `python`)."""

    @model_validator(mode="after")
    def _script_or_module(self) -> Entry:
        if (self.script is None) == (self.module is None):
            given = "both" if self.script is not None else "neither"
            raise ValueError(f"give one of entry.script and entry.module, not {given}")
        return self


class RoleResources(StrictModel):
    """What one process of a role reserves (ray, slurm, k8s; the local backend shares this machine)."""

    cpus: Annotated[float, Field(gt=0)] = 1.0
    """CPU cores (may be fractional on ray and k8s); also the process's OMP_NUM_THREADS."""
    gpus: Annotated[int, Field(ge=0)] = 0
    """GPUs (workers only: no engine gives a server GPUs)."""
    memory: Annotated[str, Field(pattern=MEMORY.pattern, max_length=64)] | None = None
    """Memory, a Kubernetes quantity: bytes, or with a unit K, M, G, T, Ki, Mi, Gi, Ti (e.g. 4Gi)."""


class Resources(StrictModel):
    """Per role. The evaluator runs beside the job's driver and reserves nothing."""

    worker: RoleResources = RoleResources()
    server: RoleResources = RoleResources()


class Dashboard(StrictModel):
    """The live dashboard and Prometheus /metrics, served by the scheduler (launch's --dashboard*)."""

    enabled: bool = False
    """Serve it; the URL with its token is printed when the job starts."""
    host: str = Field("127.0.0.1", min_length=1, max_length=255)
    """The address it binds (loopback: reach it through an SSH tunnel)."""
    port: Annotated[int, Field(ge=0, le=65535)] = 0
    """Its port (0: a free one)."""
    linger_s: Annotated[float, Field(ge=0)] = 0.0
    """After a failed job, keep it up this many seconds to read what failed."""


class LocalSettings(StrictModel):
    """backend: local."""

    host: str = Field("127.0.0.1", min_length=1, max_length=255)
    """The address every process binds and advertises."""


class RaySettings(StrictModel):
    """backend: ray."""

    address: str = Field("auto", min_length=1, max_length=TEXT_MAX)
    """The Ray cluster: "auto" (the one `ray start` started on this machine) or host:port."""


_SBATCH_WORD = r"^[A-Za-z0-9_.,:@%+=/-]+$"


class SlurmSettings(StrictModel):
    """backend: slurm."""

    partition: str | None = Field(None, pattern=_SBATCH_WORD, max_length=TEXT_MAX)
    """sbatch --partition; default: the cluster's default partition."""
    time: str | None = Field(
        None, pattern=r"^(\d+(:\d{1,2}){0,2}|\d+-\d+(:\d{1,2}){0,2}|UNLIMITED|INFINITE)$", max_length=64
    )
    """sbatch --time: minutes, h:mm:ss, days-hours, ...; default: from timeout_s, else the partition's."""
    nodes: Annotated[int, Field(ge=1)] | None = None
    """sbatch --nodes; default: Slurm chooses."""
    account: str | None = Field(None, pattern=_SBATCH_WORD, max_length=TEXT_MAX)
    """sbatch --account: the account the job is charged to; default: the user's."""
    qos: str | None = Field(None, pattern=_SBATCH_WORD, max_length=TEXT_MAX)
    """sbatch --qos: the quality of service; default: the account's."""
    constraint: str | None = Field(None, pattern=r"^[A-Za-z0-9_.,:@%+=/&|*!\[\]()-]+$", max_length=TEXT_MAX)
    """sbatch --constraint: node features the job needs, e.g. `v100` or `intel&ib`."""
    extra_sbatch: list[Text] = Field([], max_length=100)
    """More sbatch options, one `--name=value` or `--flag` each (e.g. `--mail-type=END`)."""
    setup: list[Text] = Field([], max_length=100)
    """Shell commands run before the tasks start, whose exports every task gets (e.g. `module load
    cuda/12.4`, `source /shared/venv/bin/activate`); one command each."""


class K8sSettings(StrictModel):
    """backend: k8s."""

    image: str | None = Field(None, min_length=1, max_length=TEXT_MAX)
    """The container image every pod runs (holds the script and paratrain); needed to submit."""
    namespace: str = Field("default", pattern=r"^[a-z]([-a-z0-9]*[a-z0-9])?$", max_length=63)
    """The namespace every object is created in."""
    output_pvc: str | None = Field(None, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", max_length=253)
    """The PersistentVolumeClaim mounted read-write at output_dir in every pod (needed to submit)."""
    data_pvc: str | None = Field(None, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", max_length=253)
    """The PersistentVolumeClaim mounted read-only at data_dir in every pod (needed with data_dir)."""
    pod_overrides: dict[Literal["all", "scheduler", "server", "worker"], dict[str, Any]] = {}
    """Pod template fragments ({metadata: {labels, annotations}, spec: {...}}) merged into every
    role's pods (all) or one role's: nodeSelector, tolerations, serviceAccountName,
    imagePullSecrets, volumes; a container without a name is the role's own (resources, env)."""
    form: Literal["jobs", "jobset"] = "jobs"
    """jobs: one indexed Job per role; jobset: the same Jobs as one JobSet (jobset.x-k8s.io)."""
