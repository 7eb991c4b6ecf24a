"""A sync round's sum of pushes, folded in push by push as they arrive (SparseTable's rounds).

Summing a round's pushes once the last one came would put that work on the round's critical path,
while every worker waits for that round. Folding each push in on arrival leaves only the last one's
add and the optimizer step for the round's end: the others are added while the other workers still
compute.

The sum stays the same, to the bit, as the sum in rank order (`kernels.combine` of the pushes sorted
by rank). A row's gradients are added in the order the pushes are folded in, and float addition is
commutative but not associative: the two lowest ranks may be folded in either order (0 + a + b equals
0 + b + a), every later rank only once all lower ranks are in (`may_fold`). A push that comes too
early waits, stored with the round's pushes (SparseTable.rounds), until the ranks below it are in.

The sum is of the rows' slots when folded. It is used only while no row was evicted since the
round's first fold, and, if a folded push named rows that were absent then, none was created since
(`RoundSum.valid`): else the round is summed from its stored pushes, in rank order.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np
import torch

from paratrain.kvstore import kernels

__all__ = ["RoundSum", "fold_order_holds", "may_fold"]


def may_fold(rank: int, folded: Collection[int], order: Sequence[int]) -> bool:
    """Whether `rank`'s push may be added now to a sum that holds `folded`, for a round whose pushes
    are summed in `order` (ascending ranks): the first two in either order, then in order."""
    position = order.index(rank)
    return position < 2 or all(r in folded for r in order[:position])


def fold_order_holds(folded: Sequence[int], order: Sequence[int]) -> bool:
    """Whether a sum of `folded` (in that order), with the rest of `order` added in order, equals
    the sum of `order` in order."""
    head = list(order[: len(folded)])
    if sorted(folded) == sorted(head):
        return len(folded) < 3 or list(folded[2:]) == head[2:]
    return len(folded) == 1 and len(order) > 1 and folded[0] == order[1]  # b first, then a: a + b


class RoundSum:
    """One round's sum so far: the unique slots (first-fold order) and one gradient row each, in
    buffers kept from round to round (fresh ones cost a page fault per 4 KiB)."""

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self.round = -1  # the round being summed; -1: none
        self.ranks: list[int] = []  # folded in, in order
        self.count = self.size = self.dropped = 0
        self.stamp = (0, 0)  # the table's (evictions, rows created) at the round's first fold
        self.absent = False  # a folded push named rows absent then (their gradients were dropped)
        self.keys, self.where, self.unique, self.summed = kernels.combine_buffers(0, dim)

    def start(self, round_: int, rows: int, stamp: tuple[int, int]) -> None:
        """Begin round `round_`'s sum, expecting about `rows` gradient rows in all."""
        self.round, self.ranks, self.count, self.dropped = round_, [], 0, 0
        self.stamp, self.absent = stamp, False
        if len(self.unique) < rows:
            self._buffers(rows + rows // 4)
        self.size = kernels.combine_start(self.keys, len(self.unique))

    def _buffers(self, rows: int) -> None:
        self.keys, self.where, self.unique, self.summed = kernels.combine_buffers(rows, self.dim)

    def add(self, rank: int, slots: np.ndarray, grads: torch.Tensor) -> None:
        """Fold in `rank`'s push: its rows' slots (-1: absent, dropped) and gradients."""
        held = int(np.count_nonzero(slots >= 0))
        self.dropped += len(slots) - held
        self.absent |= held < len(slots)
        if 2 * (self.count + held) > self.size or self.count + held > len(self.unique):
            self._grow(self.count + held)
        rows = grads.contiguous().numpy()
        self.count = kernels.combine(
            slots, rows, self.keys, self.size, self.where, self.unique, self.summed, self.count
        )
        self.ranks.append(rank)

    def _grow(self, rows: int) -> None:
        """Larger buffers, the sum so far moved over: each slot once, so 0 + x copies x exactly
        (a sum from 0.0 is never -0.0)."""
        unique, summed, count = self.unique, self.summed, self.count
        self._buffers(2 * rows)
        self.size = kernels.combine_start(self.keys, len(self.unique))
        self.count = kernels.combine(
            unique[:count], summed[:count], self.keys, self.size, self.where, self.unique, self.summed, 0
        )

    def valid(self, stamp: tuple[int, int]) -> bool:
        """Whether the folded slots still hold their rows: no row evicted since the first fold and,
        where a folded push dropped absent rows, none created since."""
        evictions, created = stamp
        return evictions == self.stamp[0] and (not self.absent or created == self.stamp[1])

    def take(self) -> tuple[np.ndarray, torch.Tensor]:
        """The round's unique slots and their summed gradients (views of the buffers: used before
        the next round's first fold); the sum is closed."""
        self.round = -1
        return self.unique[: self.count], torch.from_numpy(self.summed[: self.count])

    def drop(self) -> None:
        self.round = -1
