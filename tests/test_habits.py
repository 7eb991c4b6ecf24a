"""A torchrun user's habits at `paratrain launch`: each spelling does what they expect, or says
plainly what to use (the Slurm dry run shows what would start, with no process started)."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from paratrain.launch.cli import main
from paratrain.train.strategy import Strategy

SRC = Path(__file__).resolve().parent.parent / "src"


def dry_run(tmp_path: Path, caplog: pytest.LogCaptureFixture, *args: str) -> tuple[int, int, list[str]]:
    """(workers, servers) of the job `paratrain launch ARGS train.py` would submit, and what it said."""
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('never run')\n")
    with caplog.at_level(logging.INFO, logger="paratrain.launch.cli"):
        done = CliRunner().invoke(main, ["launch", "--backend", "slurm", "--dry-run", *args, str(script)])
    assert done.exit_code == 0, done.output
    tasks = int(re.search(r"^#SBATCH --ntasks=(\d+)$", done.output, re.M)[1])
    servers = int(re.search(r"^export PARATRAIN_NUM_SERVERS=(\d+)$", done.output, re.M)[1])
    said = [r.getMessage() for r in caplog.records if r.name == "paratrain.launch.cli"]
    return tasks - servers, servers, said


@pytest.mark.parametrize(
    "args, workers, servers, said",
    [
        (["-w", "4"], 4, 1, "4 workers, 1 server, strategy dist_sync (the default with servers; -s 0 for"),
        (["-w", "4", "--strategy", "ddp"], 4, 0, "4 workers, 0 servers, strategy ddp (it uses none; -s N"),
        (["--strategy", "dist_async"], 2, 1, "2 workers, 1 server, strategy dist_async (the default for it"),
        (
            ["--nproc-per-node", "4", "-s", "0"],
            4,
            0,
            "4 workers, 0 servers, strategy collective (the default",
        ),
        (
            ["--nproc_per_node=3", "--nnodes=1", "--node-rank=0", "--strategy=ddp"],
            3,
            0,
            "3 workers, 0 servers",
        ),
        (["-w", "3", "-s", "2", "--strategy", "dist_sync"], 3, 2, None),  # all given: nothing to say
    ],
)
def test_what_a_launch_chose_is_said_first(tmp_path, caplog, monkeypatch, args, workers, servers, said):
    monkeypatch.delenv("PARATRAIN_STRATEGY", raising=False)
    got_workers, got_servers, lines = dry_run(tmp_path, caplog, *args)
    assert (got_workers, got_servers) == (workers, servers)
    if said is None:
        assert lines == []
    else:
        assert lines[0].startswith(said), lines


def test_ddp_is_torch_s_name_for_collective():
    assert Strategy.parse("ddp:accumulation_steps=2") == Strategy(
        architecture="collective", accumulation_steps=2
    )


@pytest.mark.parametrize(
    "args, says",
    [
        (
            ["--nnodes", "2", "--nproc-per-node", "4"],
            "--nnodes 2: paratrain launch starts every process itself",
        ),
        (["--node-rank", "1"], "--backend slurm --nodes N"),
        (["-w", "2", "--nproc-per-node", "4"], "-w 2 and --nproc-per-node 4 disagree"),
    ],
)
def test_torchrun_options_that_ask_for_more_machines_say_what_to_use(tmp_path, args, says):
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('never run')\n")
    done = CliRunner().invoke(main, ["launch", *args, str(script)])
    assert done.exit_code == 2 and says in done.output, done.output


def test_m_runs_a_module_and_what_follows_it_is_the_module_s(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="paratrain.launch.cli"):
        done = CliRunner().invoke(
            main, ["launch", "--backend", "slurm", "--dry-run", "-s", "0", "-m", "pkg.train", "-w", "4", "x"]
        )
    assert done.exit_code == 0, done.output
    (srun,) = [line for line in done.output.splitlines() if line.startswith("srun ")]
    assert srun.endswith(" -u -m pkg.train -w 4 x && exit 0")
    assert "--ntasks=2 " in srun  # -w 4 went to the module, not the launcher


def test_a_launch_without_script_or_module_says_both():
    done = CliRunner().invoke(main, ["launch", "-w", "2"])
    assert done.exit_code == 2 and "Missing argument 'SCRIPT' (or -m MODULE)" in done.output


REPORT = """
import sys
import paratrain
from paratrain.train.strategy import resolve_strategy
ctx = paratrain.init()
print("job", ctx.num_servers, resolve_strategy(None, ctx.num_servers).architecture, *sys.argv[1:])
"""


def test_python_m_paratrain_launches_a_ddp_module_without_servers(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "train.py").write_text(REPORT)
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    env.pop("PARATRAIN_STRATEGY", None)
    launch = ["launch", "-w", "2", "--strategy", "ddp", "--timeout", "120", "-m", "pkg.train", "-w", "4"]
    done = subprocess.run(
        [sys.executable, "-m", "paratrain", *launch],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    first = done.stderr.splitlines()[0]
    assert first == "paratrain: 2 workers, 0 servers, strategy ddp (it uses none; -s N to add servers)"
    assert sorted(re.findall(r"^\[worker \d\] job .*$", done.stdout, re.M)) == [
        "[worker 0] job 0 collective -w 4",
        "[worker 1] job 0 collective -w 4",
    ]


# ---- -o json, for the scripts platform teams write ----------------------------------------------


def test_jobs_checkpoints_and_logs_print_json(tmp_path, monkeypatch):
    import torch

    from paratrain import checkpoint
    from paratrain.launch import engines, jobs
    from paratrain.launch.job_driver import LogFiles

    monkeypatch.setenv("PARATRAIN_HOME", str(tmp_path / "home"))
    out = tmp_path / "out"
    folder = engines.get("local").job_folder(str(out), "demo-1")
    record = jobs.JobRecord(id="demo-1", name="demo", backend="local", folder=str(folder), state="succeeded")
    record.workers, record.servers, record.exit_code = 2, 1, 0
    jobs.create_job(record, "name: demo\n")
    (folder / "logs").mkdir(exist_ok=True)
    logs = LogFiles(folder)
    logs.write("[worker 1] loss 0.5\n[server 0 @10.0.0.2] serving\nparatrain: done\n")
    logs.close()
    root = out / "checkpoints"
    staging = checkpoint.staging_dir(root, 7)
    checkpoint.save_file(staging / "model.pt", {"model": {"w": torch.zeros(3)}})
    checkpoint.commit(root, 7, {"metrics": {"loss": 0.25}}, keep=2)

    listed = json.loads(CliRunner().invoke(main, ["jobs", str(out), "-o", "json"]).output)
    assert [(r["id"], r["state"], r["workers"], r["servers"], r["exit_code"]) for r in listed] == [
        ("demo-1", "succeeded", 2, 1, 0)
    ]
    (found,) = json.loads(CliRunner().invoke(main, ["checkpoints", str(out), "-o", "json"]).output)
    assert (found["step"], found["metrics"], found["bytes"] > 0) == (7, {"loss": 0.25}, True)
    done = CliRunner().invoke(main, ["logs", "demo-1", "--output-dir", str(out), "-o", "json"])
    assert [json.loads(line) for line in done.output.splitlines()] == [
        {"role": "worker", "rank": 1, "line": "loss 0.5"},
        {"role": "server", "rank": 0, "line": "serving", "host": "10.0.0.2"},
        {"role": "launcher", "rank": 0, "line": "paratrain: done"},
    ]
    done = CliRunner().invoke(
        main, ["logs", "demo-1", "--output-dir", str(out), "--role", "worker", "--rank", "1", "-o", "json"]
    )
    assert json.loads(done.output) == {"role": "worker", "rank": 1, "line": "loss 0.5"}
