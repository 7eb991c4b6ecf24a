"""The words of fencing: what a process that the job went on without says, wherever it learns it.

With elasticity (JobConfig.elastic) or replication (JobConfig.replication) the scheduler drops a
node it stopped hearing from, and the job goes on. Behind a partition that node is alive: the
scheduler tells it so (`dropped`, scheduler.py) and servers refuse its late pushes and copies
(kvstore/server/fence.py). Both say the same phrase, so that the node's exit names the cause
whichever of them reaches it first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from paratrain.cluster.protocol import Dropped

DROPPED = "was dropped from the job after a partition"


def dropped_message(role: str, rank: int, why: str = "") -> str:
    """`worker 2 was dropped from the job after a partition (<why>)`."""
    return f"{role} {rank} {DROPPED}" + (f" ({why})" if why else "")


def dropped_notice(notice: Dropped) -> str:
    """What a node says as it exits on the scheduler's `dropped {role, rank, reason}` notice."""
    why = dropped_message(notice.role, notice.rank, notice.reason)
    return f"{why}; the job went on without it, so it exits rather than rejoin as itself"
