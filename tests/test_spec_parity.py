# ruff: noqa: E501  (the table of examples reads best one parameter a line)
"""`paratrain launch` and the job spec are one vocabulary: every launch parameter has its spec field
and the other way round (read from click's parameters and the spec's models, so a new option
without its field fails here), and each, given on either side, makes the same job: the same
LaunchConfig and the same engine options on every engine (or both refuse it)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from pydantic import BaseModel

from paratrain.launch import engines
from paratrain.launch.cli import launch, main
from paratrain.launch.jobspec import (
    LAUNCH_FIELDS,
    PLATFORM_VARS,
    JobSpec,
    SpecError,
    launch_config,
    parse_spec,
)

LAUNCH_ONLY = {
    "nproc_per_node": "torchrun's spelling of --workers",
    "nnodes": "torchrun's; one machine",
    "node_rank": "torchrun's; one machine",
    "rdzv_endpoint": "torchrun's; the launcher picks the port",
    "dry_run": "`paratrain submit --dry-run` says it for a spec",
}
SPEC_ONLY = {
    "apiVersion": "the file's own version",
    "kind": "the file's own kind",
    "name": "a submitted job's name (a launch names the job after its script)",
    "evaluator": "an evaluator beside a submitted job's driver",
    "data_dir": "the job platform's folders (a launch runs where the shell is)",
    "output_dir": "the job platform's folders",
    "work_dir": "the job platform's folders",
    "dir_args": "the job platform's folders as script arguments",
    "checkpoint_every": "PARATRAIN_CHECKPOINT_EVERY (a launch takes it from the shell)",
    "env": "a launch passes on the shell's environment",
    "entry.python": "a launch runs under the interpreter that runs paratrain",
    "resources.worker.memory": "reserved by the job platform's sbatch and manifests",
    "resources.server.memory": "reserved by the job platform's sbatch and manifests",
    "resources.server.gpus": "no engine gives a server GPUs (resources.worker and .server are one model)",
    "k8s.output_pvc": "the job platform's output volume",
    "k8s.data_pvc": "the job platform's data volume",
}


def _leaf_fields(model: type[BaseModel], prefix: str = "") -> set[str]:
    found = set()
    for name, info in model.model_fields.items():
        kind = info.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            found |= _leaf_fields(kind, f"{prefix}{name}.")
        else:
            found.add(prefix + name)
    return found


def test_every_launch_parameter_has_its_spec_field_and_every_field_its_parameter():
    params = {param.name for param in launch.params}
    assert params - set(LAUNCH_ONLY) == set(LAUNCH_FIELDS), "a launch parameter without its spec field"
    fields = _leaf_fields(JobSpec)
    assert fields - set(SPEC_ONLY) == set(LAUNCH_FIELDS.values()), "a spec field without its parameter"
    assert set(LAUNCH_ONLY) <= params and set(SPEC_ONLY) <= fields  # no stale exemption


# Each parameter's example: its words on the command line (the script's words in place of the
# base job's script where they are the parameter), and the same as spec fields (a dotted path to a
# value). The base job is 2 workers and 2 servers (so that one server may be lost).
def _examples(tmp: Path) -> dict[str, tuple[list[str], dict[str, Any]]]:
    other, train = str(tmp / "other.py"), str(tmp / "train.py")
    pods = tmp / "pods.yaml"
    pods.write_text(yaml.safe_dump(POD_OVERRIDES))
    return {
        "workers": (["-w", "4"], {"workers": 4}),
        "servers": (["-s", "3"], {"servers": 3}),
        "strategy": (["--strategy", "dist_async"], {"strategy": "dist_async"}),
        "timeout_s": (["--timeout", "90"], {"timeout_s": 90.0}),
        "server_losses": (["--server-losses", "1"], {"server_losses": 1}),
        "elastic": (["--elastic"], {"elastic": True}),
        "max_restarts": (["--max-restarts", "2"], {"max_restarts": 2}),
        "module": (["-m", "pkg.train", "--lr", "0.5"], {"entry": {"module": "pkg.train", "args": ["--lr", "0.5"]}}),
        "script": ([other], {"entry": {"script": other}}),
        "script_args": ([train, "--lr", "0.5", "-w", "3"], {"entry": {"script": train, "args": ["--lr", "0.5", "-w", "3"]}}),
        "host": (["--host", "127.0.0.2"], {"local": {"host": "127.0.0.2"}}),
        "address": (["--address", "10.0.0.1:6379"], {"ray": {"address": "10.0.0.1:6379"}}),
        "partition": (["--partition", "gpu"], {"slurm": {"partition": "gpu"}}),
        "time_limit": (["--time", "1:00:00"], {"slurm": {"time": "1:00:00"}}),
        "nodes": (["--nodes", "2"], {"slurm": {"nodes": 2}}),
        "account": (["--account", "ml-team"], {"slurm": {"account": "ml-team"}}),
        "qos": (["--qos", "high"], {"slurm": {"qos": "high"}}),
        "constraint": (["--constraint", "v100&ib"], {"slurm": {"constraint": "v100&ib"}}),
        "extra_sbatch": (["--sbatch=--mail-type=END", "--sbatch", "--exclusive"], {"slurm": {"extra_sbatch": ["--mail-type=END", "--exclusive"]}}),
        "setup": (["--setup", "module load cuda", "--setup", "source /v/bin/activate"], {"slurm": {"setup": ["module load cuda", "source /v/bin/activate"]}}),
        "image": (["--image", "reg/other:2"], {"k8s": {"image": "reg/other:2"}}),
        "namespace": (["--namespace", "ml"], {"k8s": {"namespace": "ml"}}),
        "pod_overrides": (["--pod-overrides", str(pods)], {"k8s": {"pod_overrides": POD_OVERRIDES}}),
        "k8s_form": (["--k8s-form", "jobset"], {"k8s": {"form": "jobset"}}),
        "cpus_per_worker": (["--cpus-per-worker", "2.5"], {"resources": {"worker": {"cpus": 2.5}}}),
        "cpus_per_server": (["--cpus-per-server", "3"], {"resources": {"server": {"cpus": 3.0}}}),
        "gpus_per_worker": (["--gpus-per-worker", "1"], {"resources": {"worker": {"gpus": 1}}}),
        "dashboard_on": (["--dashboard"], {"dashboard": {"enabled": True}}),
        "dashboard_host": (["--dashboard", "--dashboard-host", "0.0.0.0"], {"dashboard": {"enabled": True, "host": "0.0.0.0"}}),
        "dashboard_port": (["--dashboard", "--dashboard-port", "8265"], {"dashboard": {"enabled": True, "port": 8265}}),
        "dashboard_linger": (["--dashboard", "--dashboard-linger", "30"], {"dashboard": {"enabled": True, "linger_s": 30.0}}),
        "trace_dir": (["--trace", str(tmp / "traces")], {"trace_dir": str(tmp / "traces")}),
    }  # fmt: skip


SCRIPT_PARAMS = ("module", "script", "script_args")
POD_OVERRIDES = {"worker": {"spec": {"nodeSelector": {"gpu": "a100"}}}}


def _merged(into: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    for key, value in fields.items():
        into[key] = _merged(dict(into.get(key, {})), value) if isinstance(value, dict) else value
    return into


def _from_launch(backend: str, words: list[str], monkeypatch) -> Any:
    """(LaunchConfig, options) that `paratrain launch` hands the engine, or "refused"."""
    engine = engines.get(backend)
    got: list[Any] = []
    monkeypatch.setattr(engine, "launch", lambda config, options: got.append((config, options)) or 0)
    done = CliRunner().invoke(main, ["launch", "--backend", backend, *words])
    if done.exit_code == 2:
        return "refused"
    assert done.exit_code == 0 and got, done.output
    return got[0]


def _from_spec(backend: str, fields: dict[str, Any], tmp: Path) -> Any:
    spec: dict[str, Any] = {
        "name": "demo",
        "entry": {"script": str(tmp / "train.py")},
        "workers": 2,
        "servers": 2,
        "output_dir": "/out",
        "backend": backend,
        "k8s": {"image": "reg/img:1", "output_pvc": "out"},
    }
    if "entry" in fields:
        del spec["entry"]
    spec = _merged(spec, fields)
    try:
        parsed = parse_spec(yaml.safe_dump(spec), "job.yaml", base=tmp)
    except SpecError:
        return "refused"
    engine = engines.get(backend)
    config = launch_config(parsed, "demo-1", "/out/logs")
    env = {k: v for k, v in config.env.items() if k not in PLATFORM_VARS}
    return dataclasses.replace(config, env=env), engine.job_options(parsed, "demo-1", tmp, dry_run=False)


def _comparable(made: Any) -> Any:
    if made == "refused":
        return made
    config, options = made
    named = {"job_name", "output", "name", "python", "dry_run"}  # a submitted job's own
    return config, {k: v for k, v in dataclasses.asdict(options).items() if k not in named}


@pytest.mark.parametrize("backend", ["local", "ray", "slurm", "k8s"])
def test_each_parameter_makes_the_same_job_from_the_command_line_and_from_a_spec(
    backend, tmp_path, monkeypatch
):
    monkeypatch.delenv("PARATRAIN_STRATEGY", raising=False)
    monkeypatch.chdir(tmp_path)
    for name in ("train.py", "other.py"):
        (tmp_path / name).write_text("")
    examples = _examples(tmp_path)
    assert set(examples) == set(LAUNCH_FIELDS) - {"backend"}, "give each launch parameter an example"
    base = ["-w", "2", "-s", "2", *(["--image", "reg/img:1"] if backend == "k8s" else [])]
    from_launch = _from_launch(backend, [*base, str(tmp_path / "train.py")], monkeypatch)
    assert _comparable(from_launch) == _comparable(_from_spec(backend, {}, tmp_path))
    refused = []
    for name, (words, fields) in examples.items():
        script = [] if name in SCRIPT_PARAMS else [str(tmp_path / "train.py")]
        from_launch = _from_launch(backend, [*base, *words, *script], monkeypatch)
        from_spec = _from_spec(backend, fields, tmp_path)
        assert _comparable(from_launch) == _comparable(from_spec), name
        if from_launch == "refused":
            refused.append(name)
    assert refused == (["elastic", "max_restarts"] if backend == "k8s" else [])
