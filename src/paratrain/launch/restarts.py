"""Restarting a dead worker of an elastic job: the rule the cluster engines apply.

With `--elastic` or `--max-restarts N` (LaunchConfig.elastic, max_restarts; the script sets
JobConfig.elastic), a worker that dies does not stop the job: the scheduler drops it from the
membership (and stops the job itself below min_workers, naming it). While restarts are left the
engine starts the same worker again, with the same identity; the new process registers with the
dead one's rank and joins the running job at the next epoch. Only workers are restarted: a dead
scheduler or server still ends the job, and so does a worker that exited with EXIT_ABORTED (the
scheduler aborted the job: nothing to go on with).

The local launcher (local.py) and the Ray engine (ray_supervise.py) apply `Restarts` with one budget
for the job, N restarts in all; the local launcher also spends it on replicated servers. The
Slurm engine's tasks share no state (no shared file system is assumed), so each worker task of its
script counts its own N (slurm.py, `supervised_task`).
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.cluster.spec import EXIT_ABORTED


@dataclass
class Restarts:
    """An elastic job's restart budget, as one engine's supervisor spends it."""

    max_restarts: int = 0
    """How many times in all a dead worker process is started again (> 0 implies `elastic`)."""
    elastic: bool = False
    """A worker's death does not stop the job (the scheduler's membership decides)."""
    used: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int):
            raise TypeError(f"max_restarts must be an int, got {self.max_restarts!r}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts!r}")

    @property
    def on(self) -> bool:
        """Whether a worker's death leaves the job going."""
        return self.elastic or self.max_restarts > 0

    def is_death(self, role: str, returncode: int | None, lost: bool = False) -> bool:
        """Whether this end of a process is a worker's death that an elastic job survives: a worker
        that failed or was lost with its node, not one the scheduler's abort stopped."""
        if not self.on or role != "worker":
            return False
        return lost or returncode not in (0, EXIT_ABORTED, None)

    def take(self, what: str, wanted: bool = True) -> tuple[bool, str]:
        """Spends a restart if one is left (and `wanted`: the job still needs the process). `what`
        says who died and how ("worker 1 (pid 7, host h) was killed by signal SIGKILL"); returns
        whether to start it again and the line to print."""
        again = wanted and self.used < self.max_restarts
        if again:
            self.used += 1
            said = f"restart {self.used} of {self.max_restarts}"
        else:
            spent = self.max_restarts and self.used >= self.max_restarts
            said = f"not restarted: all {self.max_restarts} used" if spent else "not restarted"
        return again, f"paratrain: {what}; the job goes on ({said})\n"
