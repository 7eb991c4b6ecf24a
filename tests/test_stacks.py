"""A stuck job's stacks (cluster/stacks.py, launch/stacks_cli.py): a worker stuck in the user's code
is named with that line when a wait passes wait_warning_s, and `paratrain stacks` shows it too."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from paratrain.cluster import stacks
from paratrain.launch import jobs
from paratrain.launch.cli import main
from paratrain.launch.stacks_cli import _catches_sigusr1, job_processes
from paratrain.testing import assert_all_gone

JOB = Path(__file__).resolve().parent / "jobs" / "stuck_worker.py"
STUCK_LINE = next(i for i, line in enumerate(JOB.read_text().splitlines(), 1) if "# stuck here" in line)
WAIT_S = 120.0


def _paratrain(tmp_path: Path, *args: str):
    done = CliRunner().invoke(main, list(args), env={"PARATRAIN_HOME": str(tmp_path / "home")})
    assert done.exit_code == 0, f"paratrain {' '.join(args)}: {done.output}"
    return done.output


def _wait_for(what: str, check):
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"waited {WAIT_S} s for {what}")


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else ""


def test_user_frames_are_the_callers_not_paratrains():
    frames = stacks.user_frames()
    assert (
        frames
        and frames[0].startswith(f"{__file__}:")
        and frames[0].endswith("in test_user_frames_are_the_callers_not_paratrains")
    )


def test_a_long_waits_diagnosis_names_the_awaited_workers_and_asks_with_them():
    from types import SimpleNamespace

    from paratrain.cluster.protocol import StacksWanted
    from paratrain.kvstore.worker.checks import explain_wait

    waits = [{"round": 3, "key": "w", "missing": [2, 1]}, {"round": 3, "key": "b", "missing": [1]}]
    reply = SimpleNamespace(meta={"waits": waits})
    client = SimpleNamespace(name="server 0", request=lambda op, query: SimpleNamespace(wait=lambda s: reply))
    found = explain_wait([(client, "waiting", {})], timeout_s=1.0)
    assert found.awaited == (1, 2) and "round 3 of key 'w' on server 0 waits for worker(s) 2, 1" in str(found)
    asked: list = []
    stacks.set_asker(lambda why, awaited: asked.append(StacksWanted(why, list(awaited))))
    try:
        stacks.ask(f"pull has waited 1 s: {found}", found.awaited)
    finally:
        stacks.set_asker(None)
    assert StacksWanted.from_meta(asked[0].wire()[1]).awaited == [1, 2]


def test_this_process_is_not_signalled_without_a_handler(tmp_path):
    # A process of a job that has not reached paratrain.init yet would be ended by SIGUSR1.
    proc = tmp_path / "123"
    proc.mkdir()
    (proc / "environ").write_bytes(b"PARATRAIN_LAUNCHER_PID=7\0PARATRAIN_ROLE=worker\0PARATRAIN_RANK=1\0")
    (proc / "status").write_text("Name:\tpython\nSigCgt:\t0000000000000000\n")
    assert not _catches_sigusr1(proc) and job_processes(7, tmp_path) == []
    (proc / "status").write_text(f"Name:\tpython\nSigCgt:\t{1 << (signal.SIGUSR1 - 1):016x}\n")
    assert [(p.role, p.rank, p.pid) for p in job_processes(7, tmp_path)] == [("worker", 1, 123)]


@pytest.mark.jobs  # `paratrain submit` starts the job's driver
@pytest.mark.timeout(300)
def test_a_stuck_worker_is_named_at_its_line_and_paratrain_stacks_shows_it(tmp_path):
    spec = tmp_path / "job.yaml"
    spec.write_text(
        f"name: stuck\nentry: {{script: {JOB}}}\nworkers: 2\nservers: 1\noutput_dir: out\n"
        "env: {OMP_NUM_THREADS: '1'}\n"
    )
    output = _paratrain(tmp_path, "submit", str(spec))
    job_id = re.search(r"submitted job (\S+)", output)[1]
    folder = tmp_path / "out" / "jobs" / job_id
    where = f"{JOB}:{STUCK_LINE} in stuck"
    pids: list[int] = []
    try:
        # The scheduler's warning (the launcher's output) names worker 1 at that line ...
        said = _wait_for(
            "the scheduler to name worker 1's line",
            lambda: [
                ln for ln in _text(folder / "job.log").splitlines() if "main thread at" in ln and where in ln
            ],
        )
        assert said[0].startswith("[scheduler 0] ") and "worker 1 (host" in said[0]
        assert "(the worker the others wait for)" in said[0], said  # marked among the reports
        log = _text(folder / "job.log")
        assert "asks every process for its stacks (it waits for worker(s) 1)" in log
        others = [ln for ln in log.splitlines() if "main thread at" in ln and "worker 0 (host" in ln]
        assert all("wait for)" not in ln for ln in others), others
        # ... every process wrote its threads' stacks to its log (faulthandler's format) ...
        for name in ("worker-0", "worker-1", "server-0", "scheduler-0"):
            _wait_for(f"{name}'s stacks", lambda n=name: "Thread 0x" in _text(folder / "logs" / f"{n}.log"))
        assert f'File "{JOB}", line {STUCK_LINE} in stuck' in _text(folder / "logs" / "worker-1.log")
        # ... and `paratrain stacks` shows it on demand.
        pids = [p.pid for p in job_processes(jobs.read_record(folder).driver_pid)]
        shown = _paratrain(tmp_path, "stacks", job_id)
        assert "==== worker 1 (pid" in shown and "==== scheduler 0 (pid" in shown, shown
        worker_1 = shown.split("==== worker 1")[1]
        assert f'File "{JOB}", line {STUCK_LINE} in stuck' in worker_1, shown
    finally:
        record = jobs.read_record(folder)
        if record.driver_pid is not None:
            CliRunner().invoke(main, ["stop", job_id], env={"PARATRAIN_HOME": str(tmp_path / "home")})
            assert_all_gone([record.driver_pid, *pids], wait_s=30)
