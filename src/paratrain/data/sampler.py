"""Which samples each worker reads: a deterministic, resumable, disjoint shard of a map-style data set.

Every rank computes the same epoch order (a permutation seeded by (seed, epoch), or range order without
shuffling) and takes every `num_replicas`-th entry starting at its rank. Nothing is padded, so no sample
is read twice in an epoch and metrics are not skewed by duplicates. `position` is where this rank's
shard resumes; iterating does not move it, because the consumer (ShardedLoader) knows what was really
consumed while a DataLoader's workers prefetch ahead.

Elastic jobs (the membership changes while the job runs): `reshard(num_replicas, rank)` divides the
data over the current members from the next epoch on (at once where this rank's epoch has not
started). Within an epoch the division never changes, so a worker that dies mid-epoch leaves the rest
of its share unread in that epoch: those samples are not handed to the survivors (that would need
every survivor to agree on who read what), and from the next epoch the survivors divide the whole
data set again, so nothing is lost for more than the rest of one epoch. A state saved under another
number of replicas loads (with `elastic=True`) at the start of the next epoch of the saved one (or at
that epoch's start if it had not begun): a position only means something under the division it was
counted in.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch

logger = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1
_IDENTITY = ("seed", "size", "num_replicas")


def epoch_seed(seed: int, epoch: int) -> int:
    """A 64-bit generator seed mixed from (seed, epoch) (splitmix64), so (0, 1) and (1, 0) differ."""
    z = (seed * 0x9E3779B97F4A7C15 + epoch * 0xD1B54A32D192ED03 + 0x94D049BB133111EB) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def check_int(name: str, value: Any, minimum: int | None = None) -> int:
    """`value` as an int at least `minimum`; TypeError / ValueError naming `name` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


class ShardSampler(torch.utils.data.Sampler[int]):
    """This rank's disjoint part of `range(size)`, one epoch at a time.

    Remainder rule, with R = num_replicas:

    - drop_remainder=True (training): the last `size % R` entries of the epoch's order are left out of
      that epoch (with shuffling, different samples each epoch), and rank r takes `order[r::R]` of the
      rest. Every rank gets exactly `size // R` samples, so every rank runs the same number of steps;
      no sample is used twice. If `size < R` every shard is empty.
    - drop_remainder=False (evaluation): every sample exactly once per epoch; ranks below `size % R`
      get one sample more than the others.

    `set_epoch` to a new epoch restarts at position 0; setting the current epoch again keeps the
    position, so a resumed loop that calls `set_epoch(epoch)` at its top does not lose its place.
    """

    def __init__(
        self,
        size: int,
        num_replicas: int = 1,
        rank: int = 0,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_remainder: bool = True,
        elastic: bool = False,
    ) -> None:
        """`elastic`: a state saved with another num_replicas loads at an epoch boundary (see the
        module docstring) instead of being refused."""
        self.size = check_int("size", size, 0)
        self.num_replicas = check_int("num_replicas", num_replicas, 1)
        self.rank = check_int("rank", rank, 0)
        if rank >= num_replicas:
            raise ValueError(f"rank must be < num_replicas ({num_replicas}), got {rank}")
        self.seed = check_int("seed", seed)
        self.shuffle = bool(shuffle)
        self.drop_remainder = bool(drop_remainder)
        self.elastic = bool(elastic)
        self._epoch = 0
        self._position = 0
        self._next: tuple[int, int] | None = None
        """(num_replicas, rank) from the next epoch on (reshard)."""

    # -- what this rank reads ----------------------------------------------------------------------
    @property
    def num_samples(self) -> int:
        """Samples in this rank's shard in a whole epoch (the same in every epoch)."""
        base, extra = divmod(self.size, self.num_replicas)
        if self.drop_remainder:
            return base
        return base + (1 if self.rank < extra else 0)

    def epoch_order(self, epoch: int | None = None) -> torch.Tensor:
        """The order of all `size` indices in `epoch` (default: the current one), the same on every rank."""
        epoch = self._epoch if epoch is None else check_int("epoch", epoch, 0)
        if not self.shuffle:
            return torch.arange(self.size)
        generator = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
        return torch.randperm(self.size, generator=generator)

    def shard(self, epoch: int | None = None) -> torch.Tensor:
        """This rank's indices in `epoch` (default: the current one), from the start of the epoch."""
        order = self.epoch_order(epoch)
        if self.drop_remainder:
            order = order[: self.size - self.size % self.num_replicas]
        return order[self.rank :: self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(self.shard()[self._position :].tolist())

    def __len__(self) -> int:
        return self.num_samples - self._position

    # -- where this rank is ------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Make `epoch` current; a different epoch than the current one starts at position 0 (with
        the division a `reshard` asked for)."""
        check_int("epoch", epoch, 0)
        if epoch != self._epoch:
            self._epoch = epoch
            self._position = 0
            if self._next is not None:
                self.num_replicas, self.rank = self._next
                self._next = None

    def reshard(self, num_replicas: int, rank: int) -> None:
        """Divide the data over `num_replicas` (this one being `rank`) from the next epoch on, or at
        once if this rank has read nothing of the current epoch yet."""
        check_int("num_replicas", num_replicas, 1)
        check_int("rank", rank, 0)
        if rank >= num_replicas:
            raise ValueError(f"rank must be < num_replicas ({num_replicas}), got {rank}")
        if self._position == 0:
            self.num_replicas, self.rank, self._next = num_replicas, rank, None
        else:
            self._next = (num_replicas, rank)

    @property
    def position(self) -> int:
        """Samples of this rank's shard already consumed in the current epoch; iteration starts here."""
        return self._position

    @position.setter
    def position(self, position: int) -> None:
        check_int("position", position, 0)
        if position > self.num_samples:
            raise ValueError(f"position must be <= {self.num_samples} (this rank's shard), got {position}")
        self._position = position

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self._epoch,
            "position": self._position,
            "seed": self.seed,
            "size": self.size,
            "num_replicas": self.num_replicas,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at `state`'s epoch and position; the data set, replica count and seed must match
        (an elastic sampler takes another replica count: see the module docstring)."""
        replicas = state.get("num_replicas")
        regrouped = self.elastic and replicas != self.num_replicas
        own = self.state_dict() | ({"num_replicas": replicas} if regrouped else {})
        check_identity(state, own, _IDENTITY)
        require_keys(state, ("epoch", "position"))
        epoch = check_int("epoch", state["epoch"], 0)
        position = check_int("position", state["position"], 0)
        if regrouped:
            epoch, position = (epoch + 1 if position else epoch), 0
            logger.info(
                "saved with %s replicas, now %d: rank %d resumes at the start of epoch %d",
                replicas,
                self.num_replicas,
                self.rank,
                epoch,
            )
        self._epoch = epoch
        self._next = None
        self.position = position
        logger.debug("rank %d resumes at epoch %d, sample %d", self.rank, epoch, position)


def require_keys(state: Mapping[str, Any], names: tuple[str, ...]) -> None:
    """ValueError naming the first of `names` missing from `state`."""
    for name in names:
        if name not in state:
            raise ValueError(f"state has no {name!r} (keys: {sorted(state)})")


def check_identity(state: Mapping[str, Any], own: Mapping[str, Any], fields: tuple[str, ...]) -> None:
    """ValueError naming the first of `fields` missing from `state` or different from `own`."""
    require_keys(state, fields)
    for name in fields:
        if state[name] != own[name]:
            raise ValueError(f"state has {name}={state[name]!r}, but this one has {name}={own[name]!r}")
