"""Jobs that several test files check, run once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from paratrain.testing import JobOutcome, run_job

EXAMPLES = Path(__file__).parent.parent / "examples"

DIGITS_SYNC_ARGS = ("--strategy", "dist_sync", "--epochs", "6")
DIGITS_SYNC_ENV = {"OMP_NUM_THREADS": "1"}
"""One torch thread per process: the sums and the steps are the same on every run (0.958 after 6
epochs, measured), wherever the processes run (test_hosts runs the same job on three hosts)."""


@pytest.fixture(scope="session")
def digits_dist_sync() -> JobOutcome:
    """The README's main job (2 workers, 1 server, dist_sync) on this machine: test_examples checks
    that it learns, test_hosts that three hosts reach the same accuracy."""
    digits = EXAMPLES / "digits.py"
    return run_job(digits, workers=2, servers=1, args=DIGITS_SYNC_ARGS, env=DIGITS_SYNC_ENV, timeout_s=280)
