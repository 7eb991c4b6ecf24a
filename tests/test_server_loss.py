"""A replicated server lost at any moment of the job's life (`--server-losses`): before it
registered, once the job started, during configure, init, set_optimizer, set_hyperparameters, a
round, a checkpoint and at the end. Each job (tests/jobs/server_loss.py) ends with every key and
the checkpoint exactly the uninterrupted run's (the single-process reference)."""

from __future__ import annotations

from pathlib import Path

import pytest

from paratrain.kvstore.server.faults import ENV_VAR, KillAt, kill_at
from paratrain.testing import run_job

JOBS = Path(__file__).parent / "jobs"


def test_the_kill_knob_names_one_server_and_a_moment() -> None:
    assert kill_at(1, {ENV_VAR: "1 init"}) == KillAt("init") and kill_at(0, {ENV_VAR: "1 init"}) is None
    assert kill_at(2, {ENV_VAR: "2 pushpull 3"}) == KillAt("pushpull", 3) and kill_at(0, {}) is None
    with pytest.raises(ValueError, match="is not 'RANK MOMENT"):
        kill_at(0, {ENV_VAR: "init 1"})
    with pytest.raises(ValueError, match="count 0 must be >= 1"):
        kill_at(0, {ENV_VAR: "0 init 0"})


# (server, moment): the server SIGKILLs itself there (kvstore/server/faults.py). Servers 0..2, each
# the primary of some slices and the backup of another's.
MOMENTS = [
    (None, None),  # the uninterrupted job
    (1, "start"),  # before it registered
    (2, "started"),  # registered, before any request
    (0, "configure"),
    (1, "init"),
    (2, "set_optimizer"),
    (0, "set_hyper"),
    (1, "pushpull 3"),  # mid-run
    (2, "get_state"),  # during the checkpoint
    (0, "leave"),  # at the end
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("server,moment", MOMENTS, ids=[m or "none" for _, m in MOMENTS])
def test_a_server_lost_at_any_moment_loses_nothing(tmp_path: Path, server: int | None, moment: str | None) -> None:
    env = {} if moment is None else {ENV_VAR: f"{server} {moment}"}
    outcome = run_job(
        JOBS / "server_loss.py", workers=2, servers=3, args=["6", str(tmp_path)], env=env, server_losses=1,
        timeout_s=90,
    )
    for rank in range(2):
        assert outcome.lines("worker", rank, "stdout") == ["exact ok"], outcome.stderr[-3000:]
    if moment is not None:
        assert f"server {server}" in outcome.stderr and "the job goes on" in outcome.stderr
