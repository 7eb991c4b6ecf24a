"""A resumed run ends where the uninterrupted run does, bit for bit, under every kind of strategy.

For each strategy one uninterrupted run checkpoints every step (tests/jobs/train_resume.py: 3 epochs
of 5 steps, a network with dropout and one without). Then one chain of runs continues from its
checkpoints: from a copy of its mid-epoch checkpoint (step 7) to an epoch's last step (10), where
the launcher is interrupted with SIGINT; from there to a step of the last epoch (12); from there to
the end. Each run trains exactly the steps left, and the last prints the uninterrupted run's
parameter digests: every resume restored the RNG, the loader's place and the optimizer exactly.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from paratrain import checkpoint
from paratrain.testing import assert_all_gone, run_job

JOB = Path(__file__).parent / "jobs" / "train_resume.py"
PARATRAIN = str(Path(sys.executable).parent / "paratrain")
ENV = {"OMP_NUM_THREADS": "1"}  # the same sums in every run
MID_EPOCH, EPOCH_END, LAST_EPOCH, STEPS = 7, 10, 12, 15

# strategy, servers (None: one process, no launcher)
STRATEGIES = [("alone", None), ("dist_sync", 1), ("collective", 0), ("hybrid", 1)]


def _run(strategy: str, servers: int | None, *args: str) -> list[str]:
    """worker 0's output lines (alone: the process's); checks that a resumed run says so once."""
    if servers is None:
        done = subprocess.run(
            [sys.executable, str(JOB), strategy, *args],
            env={**os.environ, **ENV},
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert done.returncode == 0, done.stderr
        _check_resume_notice(done.stderr, args, "")
        return done.stdout.splitlines()
    outcome = run_job(JOB, workers=2, servers=servers, args=(strategy, *args), env=ENV, timeout_s=240)
    _check_resume_notice(outcome.stderr, args, "[worker 0] ")
    return outcome.lines("worker", 0, "stdout")


def _check_resume_notice(stderr: str, args: tuple[str, ...], prefix: str) -> None:
    """One line (worker 0's, with the launcher's prefix once) names the checkpoint and its step."""
    said = [line for line in stderr.splitlines() if "resumed from checkpoint" in line]
    if "straight" in args[0]:
        assert said == [], said
        return
    assert len(said) == 1 and said[0].startswith(prefix) and said[0].count("[worker") == (1 if prefix else 0)
    assert re.search(r"resumed from checkpoint \S+/step-\d{8} at step \d+ \(epoch \d, batch \d\)", said[0])


def _interrupt(strategy: str, servers: int | None, ckpt: Path, at: int) -> None:
    """Run from `ckpt` until worker 0 has taken step `at`, then SIGINT to the launcher (alone: to
    the process)."""
    args = [strategy, str(ckpt), f"wait={at}"]
    launch = [PARATRAIN, "launch", "-w", "2", "-s", str(servers)] if servers is not None else [sys.executable]
    proc = subprocess.Popen(
        [*launch, str(JOB), *args],
        env={**os.environ, **ENV},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    pids = []
    try:
        for line in proc.stdout:
            found = re.search(r"waiting at step (\d+) \(pid (\d+)\)", line)
            if found:
                assert int(found[1]) == at, line
                pids.append(int(found[2]))
                if servers is None or line.startswith("[worker 0]"):
                    break
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert pids, err
    assert proc.returncode != 0, err
    if servers is not None:
        assert proc.returncode == 130 and "interrupted by SIGINT" in err, err
    assert_all_gone(pids)


@pytest.mark.parametrize(("strategy", "servers"), STRATEGIES, ids=[s for s, _ in STRATEGIES])
def test_resumes_end_where_the_uninterrupted_run_ends(tmp_path, strategy, servers):
    straight = _run(strategy, servers, str(tmp_path / "straight"))
    assert f"trained steps 0..{STEPS}" in straight, straight
    digests = next(line for line in straight if line.startswith("digests"))

    chain = tmp_path / "chain"
    chain.mkdir()
    mid = checkpoint.latest(tmp_path / "straight").path.with_name(f"step-{MID_EPOCH:08d}")
    shutil.copytree(mid, chain / mid.name)
    _interrupt(strategy, servers, chain, at=EPOCH_END)  # resumes mid-epoch
    assert checkpoint.latest(chain).step == EPOCH_END
    lines = _run(strategy, servers, str(chain), f"stop={LAST_EPOCH}")  # resumes at an epoch's end
    assert f"trained steps {EPOCH_END}..{LAST_EPOCH}" in lines, lines
    lines = _run(strategy, servers, str(chain))  # resumes in the last epoch
    assert f"trained steps {LAST_EPOCH}..{STEPS}" in lines, lines
    assert digests in lines, (digests, lines)
