"""The job platform end to end on the local backend, through the `paratrain` commands.

The commands run in this process (click's runner), but for the follower of a running job's log;
every job is driven by a process of its own, as `paratrain submit` starts it. Two submitted jobs:
examples/cifar10.yaml's (2 workers, 1 server, an evaluator) on CIFAR-10 binary files the test
writes, followed to its end; and a job that checkpoints, stages its next checkpoint halfway and
waits, which is listed, followed, read from another process, and stopped. Afterwards no process of
either job is left.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner, Result

from paratrain.data import write_cifar10_binary
from paratrain.launch import jobs
from paratrain.launch.cli import main
from paratrain.testing import assert_all_gone

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parent.parent
PARATRAIN = str(Path(sys.executable).parent / "paratrain")
JOB = str(ROOT / "tests" / "jobs" / "platform_job.py")
WAIT_S = 180.0


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARATRAIN_")}
    env["PARATRAIN_HOME"] = str(tmp_path / "home")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    return env


def _paratrain(tmp_path: Path, *args: str, check: bool = True) -> Result:
    """`paratrain ARGS` in this process (the driver it starts is a process of its own)."""
    done = CliRunner().invoke(main, list(args), env={"PARATRAIN_HOME": str(tmp_path / "home")})
    if check:
        assert done.exit_code == 0, f"paratrain {' '.join(args)}: {done.output}"
    return done


def _submitted_id(output: str) -> str:
    line = next(line for line in output.splitlines() if line.startswith("paratrain: submitted job "))
    return line.split()[3]


def _wait_for(what: str, check, timeout_s: float = WAIT_S):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"waited {timeout_s} s for {what}")


@pytest.mark.jobs  # `paratrain submit` starts the job's driver
def test_the_cifar10_example_runs_as_a_job_with_an_evaluator(tmp_path):
    write_cifar10_binary(tmp_path / "data", train_per_file=26, test=40)  # 4 steps of 2 x 16
    spec = yaml.safe_load((ROOT / "examples" / "cifar10.yaml").read_text())
    spec["entry"]["script"] = str(ROOT / "examples" / "cifar10.py")
    spec["entry"]["args"] = ["--epochs", "1", "--batch-size", "16", "--width", "4"]
    spec.update(data_dir=str(tmp_path / "data"), output_dir=str(tmp_path / "out"), checkpoint_every=2)
    spec_file = tmp_path / "cifar10.yaml"
    spec_file.write_text(yaml.safe_dump(spec))

    dry = _paratrain(tmp_path, "submit", "--dry-run", str(spec_file)).stdout
    assert f"PARATRAIN_DATA_DIR={tmp_path / 'data'}" in dry and "--data_dir" in dry
    assert not (tmp_path / "out").exists()  # a dry run starts and writes nothing

    done = _paratrain(tmp_path, "submit", "--follow", str(spec_file), check=False)
    assert done.exit_code == 0, done.output
    job_id = _submitted_id(done.stdout)
    assert "[evaluator 0] evaluator: step 4: test accuracy" in done.stdout  # the last one
    record = jobs.read_record(tmp_path / "out" / "jobs" / job_id)
    assert (record.state, record.exit_code, record.workers, record.servers) == ("succeeded", 0, 2, 1)
    listed = _paratrain(tmp_path, "jobs", str(tmp_path / "out")).stdout
    assert f"{job_id}  succeeded  local    2w 1s 1e" in listed
    for rank in range(2):
        worker = _paratrain(tmp_path, "logs", job_id, "--role", "worker", "--rank", str(rank)).stdout
        assert f"worker {rank}: test accuracy" in worker and "on 40 images, 4 steps" in worker
    launcher = _paratrain(tmp_path, "logs", job_id, "--role", "launcher").stdout
    assert "job finished: 2 worker(s) succeeded" in launcher
    table = _paratrain(tmp_path, "checkpoints", str(tmp_path / "out")).stdout.splitlines()
    assert [row.split()[0] for row in table] == ["STEP", "2", "4"]
    assert "loss=" in table[2] and "accuracy=" in table[2]
    assert (tmp_path / "out" / "metrics").is_dir()  # the Trainer's metrics, under the output dir


def test_a_job_is_listed_followed_read_while_checkpointing_and_stopped(tmp_path):
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(
        f"name: stopme\nentry: {{script: {JOB}}}\nworkers: 2\nservers: 1\nevaluator: 1\n"
        f"output_dir: out\ncheckpoint_every: 2\nenv: {{OMP_NUM_THREADS: '1'}}\n"
    )
    job_id = _submitted_id(_paratrain(tmp_path, "submit", str(spec_file)).stdout)
    folder = tmp_path / "out" / "jobs" / job_id
    follower = subprocess.Popen(
        [PARATRAIN, "logs", job_id, "--role", "worker", "--rank", "1", "-f"],
        env=_env(tmp_path),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        lines = []
        for line in follower.stdout:  # followed as the worker writes
            lines.append(line.strip())
            if line.strip() == "staged":
                break
        assert lines[-1] == "staged", lines
        weights = json.loads(next(line for line in lines if line.startswith("weights "))[8:])
        evaluation = folder.parent.parent / "checkpoints" / "step-00000004" / "evaluation.json"
        _wait_for("the evaluator to score step 4", evaluation.is_file)

        # Another process reads the newest complete checkpoint while step 5 is half-written.
        read = (
            "import json, sys; from paratrain.checkpoint import load_latest; "
            "found, state = load_latest(sys.argv[1]); "
            "loss = found.meta['metrics']['loss']; "
            "print(json.dumps([found.step, loss, state['weight'].flatten().tolist()]))"
        )
        reader = subprocess.run(
            [sys.executable, "-c", read, str(tmp_path / "out")],
            env=_env(tmp_path),
            capture_output=True,
            text=True,
            timeout=WAIT_S,
        )
        step, loss, read_weights = json.loads(reader.stdout)
        assert step == 4 and read_weights == weights, reader.stderr
        assert torch.allclose(torch.tensor(read_weights), _reference_weights(), atol=1e-6)
        assert loss > 0

        table = _paratrain(tmp_path, "checkpoints", str(tmp_path / "out")).stdout.splitlines()
        assert [row.split()[0] for row in table] == ["STEP", "2", "4"]  # not the staged step 5
        assert "mse=" in table[2]
        assert f"{job_id}  running  local" in _paratrain(tmp_path, "jobs").stdout

        pids = _job_pids(folder)
        assert len(pids) == 4, pids
        assert "job " + job_id + " stopped" in _paratrain(tmp_path, "stop", job_id).stdout
        assert follower.wait(timeout=30) == 0  # following ends with the job
    finally:
        if follower.poll() is None:
            follower.kill()
    record = jobs.read_record(folder)
    assert record.state == "stopped" and record.exit_code == 143  # SIGTERM, as `paratrain stop` sends
    assert "interrupted by SIGTERM" in record.failure and record.ended >= record.started > 0
    assert_all_gone(pids + record.extra["pids"], wait_s=10)
    assert "already stopped" in _paratrain(tmp_path, "stop", job_id).stdout


def _reference_weights() -> torch.Tensor:
    """The job's 4 synchronous steps, in one process: both workers push the same gradient."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(32, 4, generator=generator)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(4):
        optimizer.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        optimizer.step()
    return model.weight.detach().flatten()


def _job_pids(folder: Path) -> list[int]:
    """The driver, the evaluator and the workers (which print their pids)."""
    record = jobs.read_record(folder)
    pids = [record.driver_pid, record.extra["evaluator_pid"]]
    for log in (folder / "logs").glob("*.log"):
        pids += [int(line.split()[1]) for line in log.read_text().splitlines() if line.startswith("pid ")]
    return pids
