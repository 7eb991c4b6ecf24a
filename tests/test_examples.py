"""The README's main job learns, distributed and alone."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from paratrain.testing import run_job

EXAMPLE = Path(__file__).parent.parent / "examples" / "ps_train.py"


def accuracy(line: str) -> float:
    return float(re.search(r"held-out accuracy ([0-9.]+)", line).group(1))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["dist_sync", "dist_async"])
def test_the_main_job_learns_on_a_parameter_server(kind):
    outcome = run_job(EXAMPLE, workers=2, servers=1, args=("--kind", kind, "--steps", "200"), timeout_s=200)
    finals = [outcome.lines("worker", rank, "stdout")[-1] for rank in (0, 1)]
    assert all(accuracy(line) >= 0.9 for line in finals), finals
    if kind == "dist_sync":  # every worker pulled the same weights after the last round
        assert accuracy(finals[0]) == accuracy(finals[1])


@pytest.mark.timeout(120)
def test_the_main_job_runs_alone():
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--steps", "200"], capture_output=True, text=True, timeout=100
    )
    assert done.returncode == 0, done.stderr
    assert accuracy(done.stdout.splitlines()[-1]) >= 0.9
