"""One rank's batches of a sharded data set, counted so that training can resume at an epoch and step.

ShardedLoader wraps a torch DataLoader over a ShardSampler. It counts the batches it has yielded in the
current epoch; the next iteration starts after the last one yielded (also after a `break`, or in a new
process after `load_state_dict`), and an iteration that runs to the end of the epoch moves on to the
next epoch, so `for epoch in range(E): for batch in loader:` needs no `set_epoch`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from paratrain.data.sampler import ShardSampler, check_identity, check_int, epoch_seed, require_keys
from paratrain.data.split import to_device

logger = logging.getLogger(__name__)

# Arguments that ShardedLoader decides itself; passing them through would fight the sharding.
_OWN_ARGUMENTS = ("sampler", "batch_sampler", "shuffle", "batch_size", "drop_last", "generator")
# DataLoader settings that from_loader carries over when this torch version has them.
_CARRIED = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)


class ShardedLoader:
    """Batches of this rank's shard of `dataset`; every rank has the same `len` when drop_remainder.

    Only one iteration may be live at a time: starting a new one retires the previous iterator (using
    it afterwards raises RuntimeError), so the count of consumed batches is never ambiguous.
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        *,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        drop_remainder: bool = True,
        elastic: bool = False,
        **dataloader_kwargs: Any,
    ) -> None:
        self.batch_size = check_int("batch_size", batch_size, 1)
        self.drop_last = bool(drop_last)
        _check_dataset(dataset)
        clashes = sorted(set(dataloader_kwargs) & set(_OWN_ARGUMENTS))
        if clashes:
            raise TypeError(f"ShardedLoader sets {', '.join(clashes)} itself; do not pass them")
        self.dataset = dataset
        self.sampler = ShardSampler(
            len(dataset),  # type: ignore[arg-type]
            num_replicas,
            rank,
            shuffle=shuffle,
            seed=seed,
            drop_remainder=drop_remainder,
            elastic=elastic,
        )
        # Every iter(DataLoader) draws the base seed of its worker processes from `generator`, or
        # from torch's global RNG without one. That draw would shift the global RNG (a model's
        # dropout masks) by one at every epoch's start and again at a resume's first iteration, so a
        # resumed run would not continue the uninterrupted one. Seeded per (seed, epoch, rank), the
        # loader's own generator also gives every epoch the same worker seeds in both runs.
        self._generator = torch.Generator()
        self.dataloader = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=self.sampler,
            drop_last=drop_last,
            generator=self._generator,
            **dataloader_kwargs,
        )
        self._batches = 0
        self._generation = 0
        self.wait_s = 0.0
        """Seconds the loop has waited on the DataLoader for batches (and moving them to the device)
        since the Trainer last took them (`take_wait_s`): a step's data phase."""
        self.device: Any = None
        """Where batches go before they are yielded (a torch.device; None: where the DataLoader
        made them). The Trainer sets its device here."""
        logger.debug(
            "rank %d/%d: %d samples, %d batches of %d per epoch",
            rank,
            num_replicas,
            self.sampler.num_samples,
            len(self),
            batch_size,
        )

    @classmethod
    def from_loader(
        cls,
        loader: DataLoader,
        num_replicas: int,
        rank: int,
        seed: int = 0,
        *,
        drop_remainder: bool = True,
        elastic: bool = False,
    ) -> ShardedLoader:
        """The same data set, batch size, collate_fn, workers etc. as `loader`, sharded for `rank`.

        Shuffles iff `loader` used a RandomSampler. A `generator=` of `loader` seeds the shuffle and
        the worker processes: its initial_seed() is mixed into `seed` (its current state is not
        read, so a resumed run shuffles as the first did). Raises ValueError for what cannot be
        resharded: an IterableDataset, a custom batch_sampler, or a sampler other than
        Sequential/RandomSampler.
        """
        if isinstance(loader.dataset, IterableDataset):
            raise ValueError("cannot shard an IterableDataset by index; shard it in its __iter__ instead")
        if loader.batch_size is None or type(loader.batch_sampler) is not BatchSampler:
            raise ValueError(
                f"cannot reshard a DataLoader with a custom batch_sampler "
                f"({type(loader.batch_sampler).__name__}); give it batch_size instead"
            )
        shuffle = _shuffles(loader.sampler, len(loader.dataset))  # type: ignore[arg-type]
        kwargs = {name: getattr(loader, name) for name in _CARRIED if hasattr(loader, name)}
        if kwargs.get("num_workers", 0) > 0:
            kwargs["prefetch_factor"] = loader.prefetch_factor
        if loader.generator is not None:
            seed = epoch_seed(seed, loader.generator.initial_seed())
        return cls(
            loader.dataset,
            loader.batch_size,
            num_replicas=num_replicas,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=loader.drop_last,
            drop_remainder=drop_remainder,
            elastic=elastic,
            **kwargs,
        )

    # -- iteration ---------------------------------------------------------------------------------
    def __len__(self) -> int:
        """Batches per epoch for this rank."""
        samples = self.sampler.num_samples
        return samples // self.batch_size if self.drop_last else math.ceil(samples / self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        if self._batches >= len(self) > 0:
            self._next_epoch()  # the last iteration yielded every batch but was not run to its end
        self._generation += 1
        return self._iterate(self._generation)

    def _iterate(self, generation: int) -> Iterator[Any]:
        self.sampler.position = min(self._batches * self.batch_size, self.sampler.num_samples)
        self._generator.manual_seed(epoch_seed(epoch_seed(self.sampler.seed, self.epoch), self.sampler.rank))
        batches = iter(self.dataloader)
        while True:
            began = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                break
            if generation != self._generation:
                raise RuntimeError("this ShardedLoader iterator was retired by a newer iter(loader)")
            self._batches += 1
            if self.device is not None:
                batch = to_device(batch, self.device)
            self.wait_s += time.perf_counter() - began
            yield batch
        if generation == self._generation:
            self._next_epoch()

    def take_wait_s(self) -> float:
        """The seconds waited on batches since the last call."""
        wait, self.wait_s = self.wait_s, 0.0
        return wait

    def _next_epoch(self) -> None:
        self.sampler.set_epoch(self.sampler.epoch + 1)
        self._batches = 0

    # -- where this rank is ------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    @property
    def batches_done(self) -> int:
        """Batches yielded in the current epoch."""
        return self._batches

    def reshard(self, num_replicas: int, rank: int) -> None:
        """Divide the data over `num_replicas` members from the next epoch on, or at once where this
        epoch's first batch has not been yielded (ShardSampler.reshard; elastic jobs)."""
        if self._batches == 0:
            self.sampler.position = 0
        self.sampler.reshard(num_replicas, rank)

    def set_epoch(self, epoch: int) -> None:
        """Make `epoch` current; a different epoch than the current one starts at its first batch."""
        if check_int("epoch", epoch, 0) != self.epoch:
            self.sampler.set_epoch(epoch)
            self._batches = 0

    def state_dict(self) -> dict[str, int]:
        sampler = self.sampler.state_dict()
        return {
            "epoch": self.epoch,
            "batches": self._batches,
            "batch_size": self.batch_size,
            "seed": sampler["seed"],
            "size": sampler["size"],
            "num_replicas": sampler["num_replicas"],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue after `state`'s batch; the data set, replica count, seed and batch size must match."""
        identity = ("seed", "size", "num_replicas") + (("batch_size",) if "batch_size" in state else ())
        own = self.state_dict()
        if self.sampler.elastic and "num_replicas" in state:
            own["num_replicas"] = state["num_replicas"]  # another division: from an epoch's start
        check_identity(state, own, identity)
        require_keys(state, ("epoch", "batches"))
        epoch = check_int("epoch", state["epoch"], 0)
        batches = check_int("batches", state["batches"], 0)
        if state["num_replicas"] != self.sampler.num_replicas:
            epoch, batches = (epoch + 1 if batches else epoch), 0
        if batches > len(self):
            raise ValueError(f"batches must be <= {len(self)} (batches per epoch), got {batches}")
        if batches == len(self) > 0:
            # Saved after an epoch's last batch, before its loop ended (a checkpoint on the epoch's
            # last step): resume at the next epoch, so that `epoch` (and Trainer.epochs) count the
            # finished one as done.
            epoch, batches = epoch + 1, 0
        self.sampler.set_epoch(epoch)
        self._batches = batches
        self._generation += 1
        logger.debug("rank %d resumes at epoch %d, batch %d", self.sampler.rank, epoch, batches)


def _check_dataset(dataset: Any) -> None:
    if isinstance(dataset, IterableDataset):
        raise ValueError("cannot shard an IterableDataset by index; shard it in its __iter__ instead")
    try:
        len(dataset)
    except TypeError:
        raise TypeError(f"dataset must have a length to be sharded, got {type(dataset).__name__}")


def _shuffles(sampler: Any, size: int) -> bool:
    """Whether a DataLoader's sampler shuffles; ValueError for one that cannot be resharded."""
    if type(sampler) is SequentialSampler:
        return False
    if type(sampler) is RandomSampler:
        if sampler.replacement or sampler.num_samples != size:
            raise ValueError(
                "cannot reshard a RandomSampler that draws with replacement or a different number "
                f"of samples (replacement={sampler.replacement}, num_samples={sampler.num_samples})"
            )
        return True
    raise ValueError(
        f"cannot reshard a DataLoader with a custom sampler ({type(sampler).__name__}); "
        "use a plain or shuffled DataLoader, or build a ShardedLoader"
    )
