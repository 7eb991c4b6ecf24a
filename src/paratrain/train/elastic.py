"""The elastic collective engine: all-reduce data parallel that outlives a worker (collective, and the
dense half of hybrid, when the job's elasticity is on).

After every optimizer step each member commits its state in memory (collective/elastic.py) and the
members agree, by one tiny all-reduce, on the newest membership generation any of them has heard of
from the scheduler; when it changed (a worker joined, or died between steps), they re-form together.
When a collective raises because a peer died, the survivors wait for the scheduler to drop it, roll
back to their commit and re-form. A re-formation makes a new process group over the members of the
current generation (cluster/rendezvous.py), the member with the newest commit broadcasts it to all,
and DDP is rebuilt on the new group.

Data: in the epoch where membership changes, survivors keep their shards (every one of them still
runs the same number of steps, which all-reduce needs), so the dead worker's unread share of that
epoch is not read, unless a replacement comes: it takes a shard left vacant in that epoch at the
survivors' position (or, if none is vacant, reads a copy of one). From the next epoch the data is
divided over the members (ShardedLoader.reshard). The batch in flight when the group broke is not
trained on. The members run in lockstep, so epochs need no meeting at the scheduler.

Not handled: a replacement in a hybrid job (refused: its embedding tables' rounds on the servers
would need joining too; the survivors of a hybrid job go on, untested). A replacement that registers
while the others are inside a checkpoint's barrier makes that barrier wait for it, and it waits for
them at its re-formation, until `meet_s` ends it (the replacement fails; a restart tries again).
"""

from __future__ import annotations

import gc
import logging
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from paratrain.collective import elastic as state
from paratrain.train.trainer import CollectiveEngine, LocalEngine, unwrap

if TYPE_CHECKING:
    from paratrain.cluster.rendezvous import Formation
    from paratrain.train.trainer import Trainer

logger = logging.getLogger(__name__)

REFORM_ATTEMPTS = 5
"""Re-formations tried in a row (each after the membership changed again) before giving up."""


def elastic_enabled(ctx: Any) -> bool:
    """Whether the job's JobConfig turned elasticity on (JobConfig.elastic)."""
    return getattr(getattr(ctx, "config", None), "elastic", None) is not None


def generation_of(ctx: Any) -> int:
    """The newest membership generation this worker has heard of from the scheduler (no round trip)."""
    membership = ctx.link.membership if ctx.link is not None else None
    return 0 if membership is None else membership.generation


class ElasticCollectiveEngine(CollectiveEngine):
    """See the module docstring. Made by the Trainer once its optimizer, loader and steps are set."""

    regroups_itself = True

    def __init__(self, model: nn.Module, trainer: Trainer) -> None:
        LocalEngine.__init__(self, model)
        from paratrain import collective

        self.ctx, self.strategy = trainer.ctx, trainer.strategy
        if self.ctx.joined and self.strategy.architecture == "hybrid":
            raise ValueError(
                "Strategy.architecture='hybrid': a worker cannot join a running elastic hybrid job yet "
                "(its tables' rounds on the servers are not joined mid-epoch); the job goes on without it"
            )
        self.module = unwrap(model)
        self.backend = collective.backend_for(model)
        heartbeat_s = self.ctx.config.heartbeat_timeout_s
        self.timeout_s = max(60.0, 4 * heartbeat_s)
        """How long a collective waits for a peer before raising. A dead process closes its
        connections at once; this bounds the wait on a peer cut off without a word (a lost host),
        and a step may not be slower than this."""
        self.meet_s = max(self.timeout_s, self.ctx.config.start_timeout_s)
        """How long a re-formation waits at its barrier: a replacement is a process still starting."""
        self.drop_s = 2 * heartbeat_s + 5.0
        """How long to wait, after a collective failed, for the scheduler to drop the dead peer."""
        self.local_sgd = None
        self.formation: Formation | None = None
        self.formations = 0
        self.pending_layout: tuple[int, int] | None = None
        """(num_replicas, rank) of this worker's data from the next epoch."""
        self.last = self._commit(trainer)
        self._form(trainer)

    # -- the trainer's hooks -----------------------------------------------------------------------
    def step(self, optimizer: torch.optim.Optimizer, local_step: Any) -> Any:
        return local_step()  # local SGD averages in after_step, where a failure can be recovered

    def after_step(self, trainer: Trainer) -> None:
        """Commit this step, then re-form if any member heard of a new membership."""
        try:
            if self.local_sgd is not None:
                self.local_sgd.after_step()
            self.last = self._commit(trainer)
            seen = torch.tensor([generation_of(self.ctx)], dtype=torch.int64)
            dist.all_reduce(seen, op=dist.ReduceOp.MAX)
        except Exception as error:
            if not self.recover(trainer, error):
                raise
            return
        assert self.formation is not None
        if int(seen.item()) > self.formation.generation:
            logger.info("membership changed (generation %d): re-forming", int(seen.item()))
            self._form(trainer)

    def before_epoch(self, trainer: Trainer) -> None:
        """From this epoch on, divide the data over the current members."""
        loader = trainer.loader
        if self.pending_layout is None or loader is None:
            return
        replicas, rank = self.pending_layout
        self.pending_layout = None
        sampler = loader.sampler
        if (sampler.num_replicas, sampler.rank) != (replicas, rank):
            logger.info(
                "data divided over %d member(s) from epoch %d: shard %d", replicas, loader.epoch, rank
            )
            loader.reshard(replicas, rank)  # at an epoch's start: at once

    def recover(self, trainer: Trainer, error: BaseException) -> bool:
        """After a collective raised `error`: if a member died (the scheduler's membership changed),
        roll back to the last commit, re-form and return True; otherwise False (re-raise it)."""
        if not state.is_peer_failure(error) or self.formation is None:
            return False
        if not self._await_change(self.formation.generation):
            return False
        logger.warning("the all-reduce group broke (%s); re-forming from step %d", error, self.last.steps)
        self._form(trainer)
        return True

    # -- re-formation ------------------------------------------------------------------------------
    def _commit(self, trainer: Trainer) -> state.Commit:
        loader = trainer.loader.state_dict() if trainer.loader is not None else None
        return state.commit(self.module, trainer.optimizer, trainer.steps, {"loader": loader})

    def _await_change(self, generation: int) -> bool:
        """Wait for the scheduler to announce a generation newer than `generation`."""
        assert self.ctx.link is not None  # an elastic job has a scheduler
        try:
            self.ctx.link.wait_members(generation, self.drop_s)
        except TimeoutError:
            return False
        return True

    def _form(self, trainer: Trainer) -> None:
        from paratrain.cluster.rendezvous import reform_torch_distributed

        for attempt in range(1, REFORM_ATTEMPTS + 1):
            generation = generation_of(self.ctx)
            mine = {"steps": self.last.steps, "formations": self.formations, "shard": _shard(trainer)}
            try:
                self._drop_model(trainer)
                formation = reform_torch_distributed(
                    self.ctx, generation, self.backend, self.timeout_s, mine, self.meet_s
                )
                self._sync(trainer, formation)
                self._wrap()
            except TimeoutError:
                # Members that read different generations wait at different barriers; those that
                # read the older one go to the newer one. An unchanged generation is a real hang.
                if attempt == REFORM_ATTEMPTS or generation_of(self.ctx) == generation:
                    raise
                logger.warning("re-forming generation %d timed out; the membership moved on", generation)
                continue
            except Exception as error:
                if attempt == REFORM_ATTEMPTS or not state.is_peer_failure(error):
                    raise
                logger.warning("re-forming generation %d failed (%s); trying again", generation, error)
                self._await_change(generation)
                continue
            self.formation, self.formations = formation, self.formations + 1
            trainer.replicas = formation.world_size
            if getattr(trainer, "model", self.model) is not self.model:
                trainer._bind_model()  # a later re-formation: the Trainer already had a model
            return

    def _sync(self, trainer: Trainer, formation: Formation) -> None:
        """Everyone takes the newest commit (the lowest worker rank's among equals)."""
        source = max(formation.members, key=lambda w: (formation.data[w]["steps"], -w))
        tree = state.broadcast_state(self.last.as_tree(), formation.members.index(source))
        self.last = state.Commit.from_tree(tree)
        state.restore(self.last, self.module, trainer.optimizer)
        trainer.steps = self.last.steps
        trainer._micro = 0
        trainer.optimizer.zero_grad()
        joiners = [w for w in formation.members if formation.data[w]["formations"] == 0]
        if len(joiners) < formation.world_size and self.formations == 0:
            self._take_vacant_shard(trainer, formation, joiners, source)
        if len(joiners) < formation.world_size:  # not the job's start: the data is re-divided
            self.pending_layout = (formation.world_size, formation.rank)

    def _take_vacant_shard(
        self, trainer: Trainer, formation: Formation, joiners: list[int], source: int
    ) -> None:
        """A replacement reads a shard that no veteran reads in this epoch, from where they are."""
        loader, position = trainer.loader, self.last.extra.get("loader")
        if loader is None or position is None:
            return
        replicas = formation.data[source]["shard"][0]
        taken = {formation.data[w]["shard"][1] for w in formation.members if w not in joiners}
        vacant = [r for r in range(replicas) if r not in taken]
        index = joiners.index(self.ctx.rank)
        shard = vacant[index] if index < len(vacant) else index % replicas
        loader.reshard(replicas, shard)  # nothing read yet: at once
        loader.load_state_dict(position)
        logger.warning(
            "joined at epoch %d, batch %d, reading shard %d of %d%s",
            position["epoch"],
            position["batches"],
            shard,
            replicas,
            "" if index < len(vacant) else " (a copy: no shard is vacant)",
        )

    def _drop_model(self, trainer: Trainer) -> None:
        """Release the DDP of the old group (its reducer's hooks go with it)."""
        self.model = self.module
        if getattr(trainer, "model", None) is not None:
            trainer.model = self.module
        gc.collect()

    def _wrap(self) -> None:
        from paratrain import collective

        if self.strategy.local_sgd_period:
            self.local_sgd = collective.LocalSGD(self.module, self.strategy.local_sgd_period)
        elif any(p.requires_grad for p in self.module.parameters()):
            # No buffer broadcast in forward: a collective there would fail in the user's own call,
            # out of the Trainer's reach. Buffers are equal after every re-formation instead.
            self.model = collective.wrap_ddp(
                self.module,
                bucket_mb=self.strategy.bucket_mb,
                compression=self.strategy.compression_config,
                sync_buffers=False,
            )


def _shard(trainer: Trainer) -> list[int] | None:
    loader = trainer.loader
    return None if loader is None else [loader.sampler.num_replicas, loader.sampler.rank]
