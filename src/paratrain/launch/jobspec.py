"""The job spec: one YAML file that says what a job runs, where, with what, and where its data is.

    paratrain submit job.yaml            (or --dry-run to print what would run)

The spec is read with PyYAML and checked by the pydantic models below, which are also the source of
the JSON Schema in docs/jobspec.schema.json (`python -m paratrain.launch.jobspec > ...`) and of the
table of fields in docs/jobspec.md (`... --markdown`). A mistake
is reported as `job.yaml:LINE: field.path: what is wrong (what is allowed)`, every mistake at once;
a field the models do not know is an error, with the nearest known name suggested.

A spec is bounded before anything reads it deeply: at most MAX_SPEC_BYTES, no YAML aliases (a few
hundred bytes of nested aliases stand for billions of values), and every string, list and mapping
field with a size limit named in its error, so that what reaches a command line or a manifest fits.

A spec becomes the LaunchConfig every engine takes plus that engine's options (`launch_config`,
`engine_options`): there is one launcher, and the spec is only another way of asking it.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, Field, ValidationError, ValidationInfo, field_validator

from paratrain.launch import engines
from paratrain.launch.api import IDENTITY_VARS, LaunchConfig, check_strategy
from paratrain.launch.engines.api import LaunchArgs
from paratrain.launch.jobspec_settings import (
    ITEMS_MAX,
    MEMORY,
    TEXT_MAX,
    Dashboard,
    Entry,
    K8sSettings,
    LocalSettings,
    RaySettings,
    Resources,
    SlurmSettings,
    StrictModel,
    Text,
)
from paratrain.launch.observe_cli import observing_env
from paratrain.metrics.dashboard import DashboardConfig

MAX_SPEC_BYTES = 256 << 10
"""Largest job spec file read (a spec is a page of settings; its values all go on command lines)."""
ENV_VALUE_MAX = 32 << 10
"""Longest environment variable value."""
_MEMORY_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
_MEMORY_UNITS.update({"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40})
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Set for every process by the platform itself (see `directory_env`).
DIRECTORY_VARS = ("PARATRAIN_DATA_DIR", "PARATRAIN_OUTPUT_DIR", "PARATRAIN_WORK_DIR", "PARATRAIN_LOG_DIR")
PLATFORM_VARS = frozenset(
    {*DIRECTORY_VARS, "PARATRAIN_CHECKPOINT_EVERY", "PARATRAIN_JOB_ID", "PARATRAIN_TASK"}
)


API_VERSION = "paratrain.io/v1"
"""The job spec's version, written `apiVersion: paratrain.io/v1`."""
KIND = "TrainingJob"


def _engine_names(schema: dict[str, Any]) -> None:
    """The schema's `backend`: the engines registered when the schema is made."""
    schema["enum"] = list(engines.names())


class SpecError(ValueError):
    """A job spec that cannot run; `problems` holds one `file:line: field: message` per mistake."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


def _check_env_name(key: str) -> str:
    if not _ENV_NAME.match(key):
        raise ValueError(f"{key!r} is not a variable name (letters, digits and _, not first a digit)")
    if key in IDENTITY_VARS or key in PLATFORM_VARS:
        raise ValueError(f"{key} is set by paratrain for each process; it cannot be given here")
    return key


class JobSpec(StrictModel):
    """One training job. Paths are relative to the spec file's folder unless absolute."""

    apiVersion: str = API_VERSION
    """The spec's version; a file without it is read as paratrain.io/v1."""
    kind: str = KIND
    """What the file describes; a file without it is a TrainingJob."""
    name: str = Field(pattern=r"^[a-z][a-z0-9-]*$", max_length=20)
    """The job's name: lower-case letters, digits and '-', starting with a letter, at most 20."""
    entry: Entry
    """The script every process runs and its arguments."""
    workers: Annotated[int, Field(ge=1)] = 2
    """Worker processes."""
    servers: Annotated[int, Field(ge=0)] = 1
    """Server processes (0: a collective job)."""
    server_losses: Annotated[int, Field(ge=0)] = 0
    """Servers that may die without failing the job, for replicated servers (JobConfig.replication - 1
    in the script; local backend)."""
    evaluator: Annotated[int, Field(ge=0, le=1)] = 0
    """1: an evaluator process that scores each new checkpoint (local and ray backends)."""
    strategy: Text | None = None
    """The Trainer's strategy (dist_sync, dist_async, collective, ...); default: dist_sync with servers,
    collective without."""
    resources: Resources = Resources()
    """What each process of each role reserves."""
    backend: Annotated[str, Field(json_schema_extra=_engine_names)] = engines.DEFAULT
    """Where the processes run: one of the registered launch engines (local, ray, slurm, k8s)."""
    ray: RaySettings = RaySettings()
    slurm: SlurmSettings = SlurmSettings()
    k8s: K8sSettings = K8sSettings()
    data_dir: str | None = Field(None, min_length=1, max_length=TEXT_MAX)
    """The input data, given to every process (read-only on k8s)."""
    output_dir: str = Field(min_length=1, max_length=TEXT_MAX)
    """Checkpoints, metrics and the job's own records (OUTPUT_DIR/jobs/<id>/); shared by every role."""
    work_dir: str | None = Field(None, min_length=1, max_length=TEXT_MAX)
    """The folder processes start in, and the script's base; default: the spec file's folder."""
    dir_args: bool = False
    """UAI Train's convention: append --data_dir, --output_dir, --work_dir, --log_dir and --num_gpus to
    the script's arguments (the directories also reach every process as PARATRAIN_*_DIR variables)."""
    checkpoint_every: Annotated[int, Field(ge=0)] = 0
    """The Trainer checkpoints every this many steps into OUTPUT_DIR/checkpoints (0: only when the script
    asks)."""
    env: dict[
        Annotated[str, Field(max_length=256), AfterValidator(_check_env_name)],
        Annotated[str, Field(max_length=ENV_VALUE_MAX)],
    ] = Field({}, max_length=ITEMS_MAX)
    """Extra environment variables for every process."""
    timeout_s: Annotated[float, Field(gt=0)] | None = None
    """Stop the whole job after this many seconds; default: no limit."""
    elastic: bool = False
    """A worker that dies does not stop the job (the script sets JobConfig.elastic; the scheduler drops
    it and stops the job below min_workers). local, ray and slurm backends."""
    max_restarts: Annotated[int, Field(ge=0)] = 0
    """Start a dead worker process again, up to this many times (per worker task on slurm; implies
    elastic); the new process joins the running job."""
    dashboard: Dashboard = Dashboard()
    """The live dashboard and Prometheus /metrics."""
    trace_dir: str | None = Field(None, min_length=1, max_length=TEXT_MAX)
    """Every process writes a Chrome-trace timeline into this folder (`paratrain trace merge`)."""
    local: LocalSettings = LocalSettings()

    @field_validator("apiVersion", "kind")
    @classmethod
    def _version(cls, value: str, info: ValidationInfo) -> str:
        known = {"apiVersion": API_VERSION, "kind": KIND}[info.field_name or ""]
        if value != known:
            raise ValueError(f"{value!r} is not one this paratrain reads: should be {known!r}")
        return value

    @field_validator("server_losses")
    @classmethod
    def _server_losses(cls, value: int, info: ValidationInfo) -> int:
        servers = info.data.get("servers", 1)
        if value and value >= servers:
            raise ValueError(f"{value} must be below servers ({servers}): one server must be left")
        return value

    @field_validator("backend")
    @classmethod
    def _backend(cls, value: str) -> str:
        known = [repr(name) for name in engines.names()]
        if value not in engines.names():
            near = difflib.get_close_matches(value, engines.names(), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            one_of = f"{', '.join(known[:-1])} or {known[-1]}" if len(known) > 1 else known[0]
            raise ValueError(f"{value!r} is not a launch engine{hint}: should be {one_of}")
        return value

    @field_validator("strategy")
    @classmethod
    def _strategy(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None:
            try:
                check_strategy(value, info.data.get("servers", 1), info.data.get("workers", 1))
            except ValueError as exc:  # without the launcher's "strategy=...: " (the field is named)
                raise ValueError(re.sub(r"^strategy=\S+: ", "", str(exc))) from None
        return value


# ---- reading ------------------------------------------------------------------------------------


def load_spec(path: str | os.PathLike[str], overrides: Mapping[str, Any] | None = None) -> JobSpec:
    """The spec in `path`, checked; paths in it resolved against its folder. `overrides` (e.g.
    {"backend": "k8s"}) replace top-level fields before checking. Raises SpecError."""
    path = Path(path)
    try:
        with path.open("rb") as file:
            data = file.read(MAX_SPEC_BYTES + 1)  # not all of a file that is far too large
        text = data.decode()
    except OSError as exc:
        raise SpecError([f"{path}: cannot read the job spec: {exc.strerror}"]) from None
    except UnicodeDecodeError as exc:
        raise SpecError(
            [f"{path}: the job spec is not UTF-8 text: {exc.reason} at byte {exc.start}"]
        ) from None
    return parse_spec(text, str(path), base=path.resolve().parent, overrides=overrides)


def parse_spec(
    text: str, source: str = "<spec>", base: Path | None = None, overrides: Mapping[str, Any] | None = None
) -> JobSpec:
    """The spec in YAML `text` (named `source` in messages); relative paths resolve against `base`."""
    data, lines = _read_yaml(text, source)
    if not isinstance(data, dict):
        raise SpecError([f"{source}:1: the job spec must be a mapping of fields, got {_kind(data)}"])
    data = {**data, **(overrides or {})}
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as exc:
        problems = sorted((_problem(error, lines) for error in exc.errors()), key=lambda p: p[0])
        raise SpecError([f"{source}:{line}: {text}" for line, text in problems]) from None
    found = [
        f"{source}:{_line(loc, lines)}: {'.'.join(loc)}: {msg}"
        for loc, msg in engines.get(spec.backend).spec_problems(spec)
    ]
    if found:
        raise SpecError(found)
    return _resolved(spec, base or Path.cwd())


def _read_yaml(text: str, source: str) -> tuple[Any, dict[tuple, int]]:
    """The YAML's data and the line of every field and list item (by path); too large a text,
    aliases and duplicate keys refused."""
    size = len(text.encode())
    if size > MAX_SPEC_BYTES:
        raise SpecError(
            [f"{source}: the job spec is over {MAX_SPEC_BYTES} bytes (a spec is settings, not data)"]
        )
    try:
        _refuse_aliases(text, source)
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else 1
        raise SpecError(
            [f"{source}:{line}: not valid YAML: {getattr(exc, 'problem', None) or exc}"]
        ) from None
    lines: dict[tuple, int] = {(): 1}
    problems: list[str] = []
    if node is not None:
        _walk(node, (), lines, problems, source)
    if problems:
        raise SpecError(problems)
    return data, lines


def _refuse_aliases(text: str, source: str) -> None:
    """Aliases (`*name`, and merges `<<: *name`) are refused before anything expands them: nested,
    a few hundred bytes of them stand for billions of values."""
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.AliasEvent):
            line = event.start_mark.line + 1 if event.start_mark is not None else 1
            alias = f"YAML alias *{event.anchor}"
            raise SpecError([f"{source}:{line}: {alias} is not allowed in a job spec: write the value out"])


def _walk(node: yaml.Node, path: tuple, lines: dict[tuple, int], problems: list[str], source: str) -> None:
    lines[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key, value in node.value:
            name = key.value
            if name in seen:
                where = ".".join(str(part) for part in (*path, name))
                problems.append(f"{source}:{key.start_mark.line + 1}: {where}: given twice")
            seen.add(name)
            _walk(value, (*path, name), lines, problems, source)
            where_key = (*path, name)
            lines[where_key] = key.start_mark.line + 1
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _walk(item, (*path, index), lines, problems, source)


def _line(loc: tuple, lines: dict[tuple, int]) -> int:
    """The line of the deepest part of `loc` that is in the file."""
    for end in range(len(loc), -1, -1):
        if tuple(loc[:end]) in lines:
            return lines[tuple(loc[:end])]
    return 1


def _problem(error: Mapping[str, Any], lines: dict[tuple, int]) -> tuple[int, str]:
    """(line, "field: message") of one pydantic error."""
    loc = tuple(part for part in error["loc"] if part != "[key]")
    field = ".".join(str(part) for part in loc) or "(top level)"
    kind, value = error["type"], error.get("input")
    if kind == "extra_forbidden":
        message = _unknown_field(loc)
    elif kind == "missing":
        message = f"is required: {_doc(loc)}"
    elif kind == "value_error":
        message = str(error["ctx"]["error"])
    elif kind == "string_pattern_mismatch":
        message = f"{_shown(value)} is not allowed: {_doc(loc)}"
    else:
        message = f"{error['msg']} (got {_shown(value)})"
        doc = _doc(loc)
        if doc and kind.startswith(("literal", "string_too_long")):
            message += f"; {doc}"
    return _line(loc, lines), f"{field}: {message}"


def _unknown_field(loc: tuple) -> str:
    model = _model_at(loc[:-1])
    known = sorted(model.model_fields) if model is not None else []
    near = difflib.get_close_matches(str(loc[-1]), known, n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    return f"unknown field{hint}; allowed here: {', '.join(known)}"


def _model_at(loc: tuple) -> type[BaseModel] | None:
    model: Any = JobSpec
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return None
        model = field.annotation
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return None
    return model


def _doc(loc: tuple) -> str:
    model = _model_at(loc[:-1])
    field = model.model_fields.get(loc[-1]) if model is not None and loc else None
    return " ".join((field.description or "").split()) if field is not None else ""


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _kind(value: Any) -> str:
    return "nothing" if value is None else f"a {type(value).__name__}"


def _resolved(spec: JobSpec, base: Path) -> JobSpec:
    """Paths made absolute against `base` (on k8s, data_dir and output_dir are paths inside the pods)."""
    if not engines.get(spec.backend).paths_here:  # paths in the pods, as written
        return spec
    changes: dict[str, Any] = {
        "work_dir": _absolute(spec.work_dir, base) if spec.work_dir else str(base),
        "output_dir": _absolute(spec.output_dir, base),
    }
    for name in ("data_dir", "trace_dir"):
        if getattr(spec, name) is not None:
            changes[name] = _absolute(getattr(spec, name), base)
    return spec.model_copy(update=changes)


def _absolute(path: str, base: Path) -> str:
    return os.path.normpath(os.path.join(base, os.path.expanduser(path)))


# ---- what the launcher is given -----------------------------------------------------------------


def script_path(spec: JobSpec) -> str:
    """The entry script, absolute against work_dir (on k8s: against its working directory); or the
    entry module's name."""
    script = spec.entry.script
    if script is None:
        assert spec.entry.module is not None  # Entry holds one of the two
        return spec.entry.module
    if spec.work_dir is None or os.path.isabs(script):
        return script
    return os.path.join(spec.work_dir, script)


def directories(spec: JobSpec, log_dir: str) -> dict[str, str]:
    """The job's directories by name: data (when given), output, work and log."""
    dirs = {
        "data_dir": spec.data_dir,
        "output_dir": spec.output_dir,
        "work_dir": spec.work_dir,
        "log_dir": log_dir,
    }
    return {name: value for name, value in dirs.items() if value is not None}


def directory_env(spec: JobSpec, job_id: str, log_dir: str) -> dict[str, str]:
    """What every process gets besides its identity: PARATRAIN_*_DIR, the checkpoint interval, the job id."""
    env = {f"PARATRAIN_{name.upper()}": value for name, value in directories(spec, log_dir).items()}
    env["PARATRAIN_JOB_ID"] = job_id
    if spec.checkpoint_every:
        env["PARATRAIN_CHECKPOINT_EVERY"] = str(spec.checkpoint_every)
    return env


def script_args(spec: JobSpec, log_dir: str) -> tuple[str, ...]:
    """The script's arguments, with UAI's --data_dir ... --num_gpus appended when dir_args is set."""
    args = list(spec.entry.args)
    if spec.dir_args:
        for name, value in directories(spec, log_dir).items():
            args += [f"--{name}", value]
        args += ["--num_gpus", str(spec.resources.worker.gpus)]
    return tuple(args)


def launch_config(spec: JobSpec, job_id: str, log_dir: str) -> LaunchConfig:
    """The LaunchConfig every engine takes: what `paratrain launch` makes of the same settings."""
    kwargs: dict[str, Any] = {}
    if spec.entry.python is not None:
        kwargs["python"] = spec.entry.python
    local = engines.get(spec.backend).binds_dashboard
    observing = observing_env(spec.trace_dir, dashboard_config(spec), local)
    return LaunchConfig(
        script=script_path(spec),
        args=script_args(spec, log_dir),
        num_workers=spec.workers,
        num_servers=spec.servers,
        strategy=spec.strategy,
        env={**spec.env, **observing, **directory_env(spec, job_id, log_dir)},
        timeout_s=spec.timeout_s,
        server_losses=spec.server_losses,
        elastic=spec.elastic,
        max_restarts=spec.max_restarts,
        module=spec.entry.module is not None,
        **kwargs,
    )


def dashboard_config(spec: JobSpec) -> DashboardConfig | None:
    board = spec.dashboard
    if not board.enabled:
        return None
    return DashboardConfig(host=board.host, port=board.port, linger_s=board.linger_s)


def launch_args(spec: JobSpec, dry_run: bool) -> LaunchArgs:
    """The engine options `paratrain launch` would be given for this spec (LAUNCH_FIELDS)."""
    return LaunchArgs(
        host=spec.local.host,
        dashboard=dashboard_config(spec),
        address=spec.ray.address,
        partition=spec.slurm.partition,
        time_limit=spec.slurm.time,
        nodes=spec.slurm.nodes,
        account=spec.slurm.account,
        qos=spec.slurm.qos,
        constraint=spec.slurm.constraint,
        extra_sbatch=tuple(spec.slurm.extra_sbatch),
        setup=tuple(spec.slurm.setup),
        image=spec.k8s.image,
        namespace=spec.k8s.namespace,
        pod_overrides={str(role): part for role, part in spec.k8s.pod_overrides.items()},
        k8s_form=spec.k8s.form,
        cpus_per_worker=spec.resources.worker.cpus,
        cpus_per_server=spec.resources.server.cpus,
        gpus_per_worker=spec.resources.worker.gpus,
        dry_run=dry_run,
    )


LAUNCH_FIELDS = {
    "backend": "backend",
    "workers": "workers",
    "servers": "servers",
    "strategy": "strategy",
    "timeout_s": "timeout_s",
    "server_losses": "server_losses",
    "elastic": "elastic",
    "max_restarts": "max_restarts",
    "module": "entry.module",
    "script": "entry.script",
    "script_args": "entry.args",
    "host": "local.host",
    "address": "ray.address",
    "partition": "slurm.partition",
    "time_limit": "slurm.time",
    "nodes": "slurm.nodes",
    "account": "slurm.account",
    "qos": "slurm.qos",
    "constraint": "slurm.constraint",
    "extra_sbatch": "slurm.extra_sbatch",
    "setup": "slurm.setup",
    "image": "k8s.image",
    "namespace": "k8s.namespace",
    "pod_overrides": "k8s.pod_overrides",
    "k8s_form": "k8s.form",
    "cpus_per_worker": "resources.worker.cpus",
    "cpus_per_server": "resources.server.cpus",
    "gpus_per_worker": "resources.worker.gpus",
    "dashboard_on": "dashboard.enabled",
    "dashboard_host": "dashboard.host",
    "dashboard_port": "dashboard.port",
    "dashboard_linger": "dashboard.linger_s",
    "trace_dir": "trace_dir",
}
"""Each `paratrain launch` parameter and the spec field that says the same (tests/test_jobspec.py
walks both and fails on one without the other)."""


def memory_bytes(quantity: str) -> int:
    """A memory quantity (see RoleResources.memory) in bytes."""
    match = MEMORY.match(quantity)
    if match is None:
        raise ValueError(f"memory {quantity!r} is not a quantity such as 512Mi or 4G")
    unit = match[2] or ""
    return int(float(quantity[: len(quantity) - len(unit)]) * _MEMORY_UNITS[unit])


def json_schema() -> dict[str, Any]:
    """The JSON Schema of a job spec, from the same models that check it."""
    schema = JobSpec.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "paratrain job spec"
    return schema


def json_schema_text() -> str:
    return json.dumps(json_schema(), indent=2, sort_keys=True) + "\n"


def fields_markdown() -> str:
    """Every field of a spec as a Markdown table (docs/jobspec.md), from the models' docstrings."""
    rows = ["| field | type | default | meaning |", "| --- | --- | --- | --- |"]
    rows += _field_rows(JobSpec, "")
    return "\n".join(rows) + "\n"


def _field_rows(model: type[BaseModel], prefix: str) -> list[str]:
    rows = []
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            doc = " ".join((info.description or annotation.__doc__ or "").split())
            rows.append(f"| `{prefix}{name}` | mapping | | {doc} |")
            rows += _field_rows(annotation, f"{prefix}{name}.")
            continue
        default = "required" if info.is_required() else f"`{json.dumps(info.get_default())}`"
        doc = " ".join((info.description or "").split()).replace("|", "/")
        rows.append(f"| `{prefix}{name}` | {_type_name(annotation)} | {default} | {doc} |")
    return rows


def _type_name(annotation: Any) -> str:
    """A field's type in words: int, str or null, one of 'a', 'b', list of str, ..."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Annotated:
        return _type_name(args[0])
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in args)
    if origin in (list, dict):
        return f"{origin.__name__} of {', '.join(_type_name(a) for a in args)}"
    return getattr(annotation, "__name__", str(annotation))


if __name__ == "__main__":
    import sys

    print(fields_markdown() if sys.argv[1:] == ["--markdown"] else json_schema_text(), end="")
