# ruff: noqa: E501  (the table of mistakes reads best one mistake a line)
"""The job spec without processes: every kind of mistake named by file, line and field with what is
allowed; the JSON Schema in docs/ is the models' own; what a spec gives the launcher (directories as
variables and UAI's arguments); its sbatch and Kubernetes forms, which validate; the Trainer's
defaults under the output directory; the job records and the per-process log files; checkpoint
readers that never see a half-written checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import torch
import yaml
from click.testing import CliRunner

from paratrain import checkpoint
from paratrain.launch import engines, job_cluster, jobs
from paratrain.launch.cli import main
from paratrain.launch.job_driver import LogFiles
from paratrain.launch.jobspec import (
    SpecError,
    json_schema,
    json_schema_text,
    launch_config,
    load_spec,
    memory_bytes,
    parse_spec,
)
from paratrain.train.jobdirs import job_defaults

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = ROOT / "docs" / "jobspec.schema.json"
EXAMPLE = ROOT / "examples" / "cifar10.yaml"
K8S_VERSION = "1.32"

BASE = """\
name: demo
entry:
  script: train.py
  args: [--lr, "0.1"]
workers: 2
servers: 1
strategy: dist_sync
resources:
  worker: {cpus: 2, gpus: 1, memory: 4Gi}
  server: {cpus: 1}
output_dir: /shared/out
data_dir: /shared/data
"""


def _spec(text: str = BASE, **overrides):
    return parse_spec(text, "job.yaml", base=Path("/work"), overrides=overrides or None)


def _problems(text: str) -> list[str]:
    with pytest.raises(SpecError) as caught:
        _spec(text)
    return caught.value.problems


def _replace(line_no: int, new: str) -> str:
    lines = BASE.splitlines()
    lines[line_no - 1] = new
    return "\n".join(lines) + "\n"


# (what, the spec, "job.yaml:LINE: field: ...", a fragment saying what is allowed)
MISTAKES = [
    ("unknown field", _replace(5, "wokers: 2"), "job.yaml:5: wokers:", "did you mean 'workers'?"),
    ("unknown nested field", _replace(10, "  server: {cpus: 1, mem: 1Gi}"), "job.yaml:10: resources.server.mem:", "allowed here: cpus, gpus, memory"),
    ("negative count", _replace(6, "servers: -1"), "job.yaml:6: servers:", "greater than or equal to 0"),
    ("string for a number", _replace(5, 'workers: "2"'), "job.yaml:5: workers:", "valid integer (got '2')"),
    ("fractional GPUs", _replace(9, "  worker: {cpus: 2, gpus: 0.5}"), "job.yaml:9: resources.worker.gpus:", "valid integer"),
    ("zero CPUs", _replace(10, "  server: {cpus: 0}"), "job.yaml:10: resources.server.cpus:", "greater than 0"),
    ("bad memory", _replace(9, "  worker: {memory: 4GB}"), "job.yaml:9: resources.worker.memory:", "'4GB' is not allowed: Memory, a Kubernetes quantity"),
    ("unknown backend", BASE + "backend: kube\n", "job.yaml:13: backend:", "'local', 'ray', 'slurm' or 'k8s'"),
    ("unknown strategy", _replace(7, "strategy: dist_synk"), "job.yaml:7: strategy:", "dist_sync, dist_async"),
    ("ps without servers", _replace(6, "servers: 0"), "job.yaml:7: strategy:", "needs servers"),
    ("tensor groups that do not fit", _replace(7, "strategy: fsdp:tensor_parallel=4"), "job.yaml:7: strategy:", "does not divide the job's 2 worker"),
    ("bad name", _replace(1, "name: My_Job"), "job.yaml:1: name:", "lower-case letters, digits and '-'"),
    ("missing field", BASE.replace("output_dir: /shared/out\n", ""), "job.yaml:1: output_dir:", "is required"),
    ("missing script", _replace(3, "  python: python3"), "job.yaml:2: entry:", "give one of entry.script and entry.module, not neither"),
    ("script and module", _replace(3, "  script: train.py\n  module: pkg.train"), "job.yaml:2: entry:", "not both"),
    ("bad module", _replace(3, "  module: pkg/train"), "job.yaml:3: entry.module:", "'pkg/train' is not allowed"),
    ("unknown apiVersion", "apiVersion: paratrain.io/v2\n" + BASE, "job.yaml:1: apiVersion:", "'paratrain.io/v2' is not one this paratrain reads: should be 'paratrain.io/v1'"),
    ("unknown kind", "kind: Job\n" + BASE, "job.yaml:1: kind:", "'Job' is not one this paratrain reads: should be 'TrainingJob'"),
    ("losing every server", BASE + "server_losses: 1\n", "job.yaml:13: server_losses:", "1 must be below servers (1)"),
    ("restarts on k8s", BASE + "max_restarts: 2\nbackend: k8s\nk8s: {output_pvc: o, data_pvc: d}\n", "job.yaml:13: max_restarts:", "max_restarts works on the local, ray and slurm backends, not k8s"),
    ("bad dashboard port", BASE + "dashboard: {enabled: true, port: 70000}\n", "job.yaml:13: dashboard.port:", "less than or equal to 65535"),
    ("identity in env", BASE + "env:\n  A: x\n  PARATRAIN_RANK: '3'\n", "job.yaml:15: env.PARATRAIN_RANK:", "set by paratrain"),
    ("bad env name", BASE + "env:\n  1X: y\n", "job.yaml:14: env.1X:", "is not a variable name"),
    ("number for an env value", BASE + "env:\n  SEED: 3\n", "job.yaml:14: env.SEED:", "valid string"),
    ("duplicate field", BASE + "workers: 3\n", "job.yaml:13: workers:", "given twice"),
    ("not YAML", _replace(5, "workers: [2"), "job.yaml:6:", "not valid YAML"),
    ("not a mapping", "- a\n- b\n", "job.yaml:1:", "must be a mapping"),
    ("two evaluators", BASE + "evaluator: 2\n", "job.yaml:13: evaluator:", "less than or equal to 1"),
    ("evaluator on slurm", BASE + "evaluator: 1\nbackend: slurm\n", "job.yaml:13: evaluator:", "local and ray"),
    ("k8s without a claim", BASE + "backend: k8s\n", "job.yaml:1: k8s.output_pvc:", "is required with backend k8s"),
    ("k8s relative path", _replace(11, "output_dir: out") + "backend: k8s\nk8s: {output_pvc: o, data_pvc: d}\n", "job.yaml:11: output_dir:", "absolute path"),
    ("bad slurm time", BASE + "slurm: {time: 1h}\n", "job.yaml:13: slurm.time:", "h:mm:ss"),
    ("sbatch option paratrain writes", BASE + "backend: slurm\nslurm:\n  extra_sbatch: [--time=5]\n", "job.yaml:15: slurm.extra_sbatch.0:", "--time is written by paratrain: give time instead"),
    ("setup of two lines", BASE + "backend: slurm\nslurm:\n  setup: [\"a\\nb\"]\n", "job.yaml:15: slurm.setup.0:", "must be one shell command on one line"),
    ("k8s override of what paratrain sets", BASE + "backend: k8s\nk8s:\n  output_pvc: o\n  data_pvc: d\n  pod_overrides:\n    all:\n      spec: {restartPolicy: Always}\n", "job.yaml:19: k8s.pod_overrides.all.spec.restartPolicy:", "set by paratrain"),
    ("unknown k8s form", BASE + "k8s: {form: pytorchjob}\n", "job.yaml:13: k8s.form:", "Input should be 'jobs' or 'jobset'"),
    ("bad constraint", BASE + "slurm: {constraint: a b}\n", "job.yaml:13: slurm.constraint:", "'a b' is not allowed: sbatch --constraint"),
    ("zero timeout", BASE + "timeout_s: 0\n", "job.yaml:13: timeout_s:", "greater than 0"),
]  # fmt: skip


@pytest.mark.parametrize("text, where, allowed", [m[1:] for m in MISTAKES], ids=[m[0] for m in MISTAKES])
def test_every_mistake_names_line_field_and_what_is_allowed(text, where, allowed):
    problems = _problems(text)
    named = [p for p in problems if p.startswith(where)]
    assert named, problems
    assert allowed in named[0], named[0]


def test_a_strategy_is_checked_against_the_specs_own_workers():
    assert _spec(_replace(7, "strategy: fsdp:tensor_parallel=2")).strategy == "fsdp:tensor_parallel=2"


BOMB = "".join(
    f"l{n}: &l{n} [{', '.join([f'*l{n - 1}' if n else 'x'] * 9)}]\n" for n in range(6)
)  # 6 levels: 9**6 values once expanded (9 levels took 60 s and 6 GB to refuse)
TOO_LARGE = [
    ("aliases", BOMB + BASE, "job.yaml:2: YAML alias *l0 is not allowed in a job spec"),
    ("a merge", BASE + "resources:\n  worker: &w {cpus: 2}\n  server: {<<: *w}\n", "YAML alias *w"),
    (
        "a long argument",
        BASE.replace('"0.1"', "a" * 5000),
        "job.yaml:4: entry.args.1: String should have at most 4096",
    ),
    (
        "many arguments",
        BASE.replace('"0.1"', ", ".join(["a"] * 1000)),
        "job.yaml:4: entry.args: List should have at most 1000",
    ),
    ("a long variable", BASE + f"env: {{X: {'v' * 40000}}}\n", "env.X: String should have at most 32768"),
    (
        "a long script",
        BASE.replace("train.py", "t" * 5000),
        "job.yaml:3: entry.script: String should have at most 4096",
    ),
    (
        "a long output_dir",
        BASE.replace("/shared/out", "/o" * 3000),
        "output_dir: String should have at most 4096",
    ),
    ("a large file", BASE + "# " + "x" * (256 << 10) + "\n", "job.yaml: the job spec is over 262144 bytes"),
]


@pytest.mark.parametrize("what, text, message", TOO_LARGE, ids=[row[0] for row in TOO_LARGE])
def test_a_spec_too_large_or_with_aliases_is_refused_naming_what(what, text, message):
    with pytest.raises(SpecError) as refused:
        _spec(text)
    assert message in str(refused.value), str(refused.value)[:500]


def test_a_huge_spec_file_is_refused_without_reading_it_all(tmp_path):
    path = tmp_path / "job.yaml"
    with path.open("w") as file:
        file.write(BASE)
        file.truncate(50 << 20)  # 50 MB, mostly a hole
    with pytest.raises(SpecError, match="job.yaml: the job spec is over 262144 bytes"):
        load_spec(path)


def test_every_mistake_is_reported_at_once_in_line_order():
    text = BASE.replace("workers: 2", "workers: 0").replace("servers: 1", "servers: x") + "colour: red\n"
    problems = _problems(text)
    assert [p.split(":")[1] for p in problems] == ["5", "6", "13"], problems


def test_numeric_script_arguments_need_no_quotes():
    spec = _spec(BASE.replace('args: [--lr, "0.1"]', "args: [--lr, 0.1, --epochs, 3]"))
    assert spec.entry.args == ["--lr", "0.1", "--epochs", "3"]
    jsonschema.validate(yaml.safe_load(BASE.replace('"0.1"', "0.1")), json_schema())
    (problem,) = _problems(BASE.replace('"0.1"', "yes"))
    assert problem.startswith("job.yaml:4: entry.args.1:") and "valid string (got True)" in problem


def test_jobs_help_says_which_jobs_it_lists():
    from click.testing import CliRunner

    from paratrain.launch.cli import main

    shown = " ".join(CliRunner().invoke(main, ["jobs", "--help"]).output.split())
    assert "every job this user submitted on this machine, as noted in ~/.paratrain/jobs" in shown


def test_the_schema_in_docs_is_generated_from_the_models_and_accepts_the_example():
    assert SCHEMA.read_text() == json_schema_text(), (
        "regenerate: python -m paratrain.launch.jobspec > docs/..."
    )
    jsonschema.validate(yaml.safe_load(EXAMPLE.read_text()), json_schema())
    jsonschema.validate(yaml.safe_load(BASE), json_schema())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**yaml.safe_load(BASE), "wokers": 2}, json_schema())


def test_the_example_spec_is_valid_and_runs_the_example_with_two_workers_and_a_server():
    spec = load_spec(EXAMPLE)
    assert (spec.workers, spec.servers, spec.evaluator, spec.dir_args) == (2, 1, 1, True)
    assert Path(spec.work_dir) / spec.entry.script == ROOT / "examples" / "cifar10.py"


def test_directories_reach_every_process_as_variables_and_uai_arguments():
    spec = _spec(BASE + "dir_args: true\ncheckpoint_every: 50\nenv: {A: b}\n")
    config = launch_config(spec, "demo-1", "/shared/out/jobs/demo-1/logs")
    assert config.script == "/work/train.py" and (config.num_workers, config.num_servers) == (2, 1)
    assert config.args == (
        "--lr", "0.1",
        "--data_dir", "/shared/data", "--output_dir", "/shared/out", "--work_dir", "/work",
        "--log_dir", "/shared/out/jobs/demo-1/logs", "--num_gpus", "1",
    )  # fmt: skip
    assert config.job_env() == {
        "A": "b",
        "PARATRAIN_DATA_DIR": "/shared/data",
        "PARATRAIN_OUTPUT_DIR": "/shared/out",
        "PARATRAIN_WORK_DIR": "/work",
        "PARATRAIN_LOG_DIR": "/shared/out/jobs/demo-1/logs",
        "PARATRAIN_JOB_ID": "demo-1",
        "PARATRAIN_CHECKPOINT_EVERY": "50",
        "PARATRAIN_STRATEGY": "dist_sync",
    }
    relative = _spec(BASE.replace("/shared/out", "out"))
    assert relative.output_dir == "/work/out"
    assert launch_config(_spec(), "x", "/l").args == ("--lr", "0.1")  # no dir_args: the script's own


def test_the_trainer_defaults_to_folders_under_the_output_directory():
    env = {"PARATRAIN_OUTPUT_DIR": "/out", "PARATRAIN_CHECKPOINT_EVERY": "7"}
    assert job_defaults(None, None, None, env) == (Path("/out/checkpoints"), Path("/out/metrics"), 7)
    assert job_defaults("c", "m", 3, env) == (Path("c"), Path("m"), 3)
    assert job_defaults(None, None, None, {}) == (None, None, 0)
    with pytest.raises(ValueError, match="PARATRAIN_CHECKPOINT_EVERY='x'"):
        job_defaults(None, None, None, {"PARATRAIN_CHECKPOINT_EVERY": "x"})
    with pytest.raises(ValueError, match="evaluator .* must not train"):
        job_defaults(None, None, None, {"PARATRAIN_TASK": "evaluator", **env})


def test_memory_quantities():
    assert [memory_bytes(q) for q in ("512Mi", "4G", "1.5Gi", "100")] == [2**29, 4 * 10**9, 3 * 2**29, 100]


CLUSTERS = BASE + (
    "slurm: {partition: gpu, time: '1:00:00'}\n"
    "k8s: {image: reg/img:1, output_pvc: out-claim, data_pvc: data-claim}\n"
)


def test_the_slurm_form_holds_the_jobs_memory_folders_and_output(tmp_path):
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(CLUSTERS.replace("/work", str(tmp_path)))
    done = CliRunner().invoke(main, ["submit", "--dry-run", "--backend", "slurm", str(spec_file)])
    assert done.exit_code == 0, done.output
    script = done.stdout
    lines = [line[len("#SBATCH ") :] for line in script.splitlines() if line.startswith("#SBATCH ")]
    assert "hetjob" in lines  # a worker's GPU: the servers are a component without one
    directives = dict(line[2:].split("=", 1) for line in lines[: lines.index("hetjob")])
    assert directives["job-name"].startswith("demo-") and directives["partition"] == "gpu"
    assert directives["mem-per-cpu"] == "2048M"  # 4Gi over the task's 2 CPUs
    assert directives["output"] == f"/shared/out/jobs/{directives['job-name']}/logs/slurm-%j.out"
    assert "warning: " + str(spec_file) + ": data_dir: /shared/data is not a folder here" in done.stderr
    assert f"for folder in {tmp_path} /shared/data /shared/out; do" in script
    assert (
        "export PARATRAIN_OUTPUT_DIR=/shared/out" in script and f"-u {tmp_path}/train.py --lr 0.1" in script
    )
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


def test_the_k8s_form_mounts_the_claims_and_validates(tmp_path, monkeypatch):
    monkeypatch.setenv("PARATRAIN_HOME", str(tmp_path / "home"))
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(CLUSTERS)
    done = CliRunner().invoke(main, ["submit", "--dry-run", "--backend", "k8s", str(spec_file)])
    assert done.exit_code == 0, done.output
    manifests = list(yaml.safe_load_all(done.stdout))
    for manifest in manifests:
        assert kubernetes_validate.validate(manifest, K8S_VERSION, strict=True) == K8S_VERSION
    pods = {
        m["metadata"]["name"].rsplit("-", 1)[1]: m["spec"]["template"]["spec"]
        for m in manifests
        if m["kind"] == "Job"
    }
    assert set(pods) == {"scheduler", "server", "worker"}
    for pod in pods.values():
        claims = {v["name"]: v["persistentVolumeClaim"] for v in pod["volumes"]}
        assert claims == {
            "output": {"claimName": "out-claim"},
            "data": {"claimName": "data-claim", "readOnly": True},
        }
        mounts = {m["mountPath"]: m["readOnly"] for m in pod["containers"][0]["volumeMounts"]}
        assert mounts == {"/shared/out": False, "/shared/data": True}
    worker = pods["worker"]["containers"][0]
    assert worker["resources"]["limits"]["memory"] == "4Gi"
    assert worker["command"][2] == "train.py"  # in the image, from its working directory
    env = {e["name"]: e.get("value") for e in worker["env"]}
    assert env["PARATRAIN_DATA_DIR"] == "/shared/data" and env["PARATRAIN_OUTPUT_DIR"] == "/shared/out"
    assert env["PARATRAIN_LOG_DIR"].startswith("/shared/out/jobs/demo-")
    assert not (tmp_path / "home").exists()  # a dry run records nothing


def test_log_files_keep_each_process_apart_and_the_whole_in_order(tmp_path):
    (tmp_path / "logs").mkdir()
    logs = LogFiles(tmp_path)
    logs.write("[worker 1] a\n[server 0 @10.0.0.2] b\npara")
    logs.write("train: done\n[worker 1] c")
    logs.close()
    assert (tmp_path / "logs" / "worker-1.log").read_text() == "a\nc\n"
    assert (tmp_path / "logs" / "server-0.log").read_text() == "b\n"
    assert (tmp_path / "logs" / "launcher.log").read_text() == "paratrain: done\n"
    assert (tmp_path / "job.log").read_text().splitlines()[-1] == "[worker 1] c"


def test_job_records_are_found_by_id_listed_and_a_dead_driver_is_noticed(tmp_path, monkeypatch):
    monkeypatch.setenv("PARATRAIN_HOME", str(tmp_path / "home"))
    job_id = jobs.new_job_id("demo")
    folder = engines.get("local").job_folder(str(tmp_path / "out"), job_id)
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()
    record = jobs.JobRecord(id=job_id, name="demo", backend="local", folder=str(folder), state="running")
    record.driver_pid, record.driver_host = dead.pid, __import__("socket").gethostname()
    jobs.create_job(record, "name: demo\n")
    assert jobs.find_job(job_id) == folder  # from PARATRAIN_HOME's note
    assert jobs.find_job(job_id, str(tmp_path / "out")) == folder
    with pytest.raises(ValueError, match="no job 'nope'"):
        jobs.find_job("nope")
    [listed] = jobs.list_jobs(str(tmp_path / "out"))
    assert listed.state == "failed" and "died without recording" in listed.failure
    assert [r.id for r in jobs.list_jobs()] == [job_id]


def _commit(root: Path, step: int, value: float) -> None:
    folder = checkpoint.staging_dir(root, step)
    checkpoint.save_file(folder / "model.pt", {"model": {"w": torch.full((3,), value)}})
    checkpoint.commit(root, step, {"metrics": {"loss": value}}, keep=2)


def test_readers_see_the_newest_complete_checkpoint_never_the_one_being_written(tmp_path):
    root = tmp_path / "checkpoints"
    assert checkpoint.load_latest(tmp_path) is None
    _commit(root, 1, 1.0)
    _commit(root, 2, 2.0)
    staging = checkpoint.staging_dir(root, 3)  # the next, half-written
    checkpoint.save_file(staging / "model.pt", {"model": {"w": torch.full((3,), 3.0)}})
    (staging / ".worker-0.pt.tmp-1").write_bytes(b"half")
    found, state = checkpoint.load_latest(tmp_path)
    assert found.step == 2 and torch.equal(state["w"], torch.full((3,), 2.0))
    followed = checkpoint.follow(tmp_path, done_file=tmp_path / "done", poll_s=0.01)
    assert next(followed).step == 2
    _commit(root, 3, 3.0)  # prunes step 1
    (tmp_path / "done").touch()
    assert [c.step for c in followed] == [3]
    checkpoint.write_evaluation(checkpoint.load(root), {"accuracy": 0.5})
    assert json.loads((root / "step-00000003" / "evaluation.json").read_text())["accuracy"] == 0.5


def test_the_table_of_fields_in_docs_is_the_models_own():
    from paratrain.launch.jobspec import fields_markdown

    assert (ROOT / "docs" / "jobspec.md").read_text().endswith("## Fields\n\n" + fields_markdown())


def test_a_slurm_jobs_output_is_split_by_process_and_its_states_named():
    text = "paratrain: job 7\n[worker 1 @n1] a\n[server 0 @n2] b\n[worker 1 @n1] [worker 0 @x] c\n"
    assert job_cluster.slurm_lines(text, "worker", 1) == "a\n[worker 0 @x] c\n"
    assert job_cluster.slurm_lines(text, None, 0) == text
    assert job_cluster._SLURM_STATES["CANCELLED"] == "stopped"


def _fake_commands(folder: Path, answers: dict[str, str]) -> Path:
    """Scripts named like the cluster's commands: each notes its arguments and prints its answer."""
    folder.mkdir()
    for name, answer in answers.items():
        script = folder / name
        script.write_text(f"#!/bin/sh\necho \"{name} $*\" >> {folder}/calls\ncat <<'EOF'\n{answer}\nEOF\n")
        script.chmod(0o755)
    return folder


@pytest.mark.parametrize("backend", ["slurm", "k8s"])
def test_a_cluster_job_is_submitted_asked_about_and_stopped_with_the_clusters_commands(
    backend, tmp_path, monkeypatch
):
    k8s_jobs = {"items": [{"metadata": {"labels": {"paratrain.io/role": "worker"}}, "status": {"active": 2}}]}
    bin_dir = _fake_commands(
        tmp_path / "bin",
        {"sbatch": "4242", "squeue": "RUNNING", "scancel": "", "kubectl": json.dumps(k8s_jobs)},
    )
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("PARATRAIN_HOME", str(tmp_path / "home"))
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(CLUSTERS.replace("/shared", str(tmp_path)).replace("/work", str(tmp_path)))
    (tmp_path / "data").mkdir()
    (tmp_path / "train.py").write_text("")
    runner = CliRunner()
    done = runner.invoke(main, ["submit", "--backend", backend, str(spec_file)])
    assert done.exit_code == 0, done.output
    job_id = done.stdout.split()[3]
    listed = runner.invoke(main, ["jobs"]).stdout
    assert f"{job_id}  running  {backend}" in listed
    assert runner.invoke(main, ["stop", job_id]).stdout.strip() == f"paratrain: job {job_id} stopped"
    calls = (bin_dir / "calls").read_text()
    if backend == "slurm":
        assert "sbatch --parsable" in calls and "squeue -h -j 4242" in calls and "scancel 4242" in calls
    else:
        assert "kubectl apply --server-side" in calls
        assert (
            f"kubectl delete job,service,secret --wait=false -n default -l paratrain.io/job={job_id}" in calls
        )
