"""Criteo-format click logs: the reader, and a generator of synthetic logs in the same format.

A line is tab-separated: the label (0 or 1), 13 integer features, 26 categorical features written as
8 hex digits (hashes); any feature may be empty. `read_criteo` turns a file into tensors: labels,
dense features as log(1 + max(x, 0)) (0 where missing), and one int64 id per categorical feature
that also encodes its column (`category_id`), so that all 26 columns can share one sparse table.

`write_synthetic_criteo` writes such a file: the categorical values of each column follow a power
law (value of rank k drawn with probability proportional to k ** -exponent, `zipf_ranks`) and are
written as hashes of (column, rank); the click probability is a logistic function of hidden
per-value weights and of the integer features, so a model can learn it.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import torch
from torch.utils.data import TensorDataset

from paratrain.system import atomic_write

logger = logging.getLogger(__name__)

NUM_DENSE, NUM_CATEGORICAL = 13, 26
_MASK64 = (1 << 64) - 1


def category_id(column: int, value: int | None) -> int:
    """The id of a categorical value (32-bit hash, None where missing) in column 0..25."""
    return ((column + 1) << 33) | (0 if value is None else value + 1)


def read_criteo(path: str | os.PathLike[str], limit: int | None = None) -> TensorDataset:
    """(labels float32 [n], dense float32 [n, 13], ids int64 [n, 26]) of the first `limit` lines."""
    labels: list[float] = []
    dense: list[list[float]] = []
    ids: list[list[int]] = []
    with open(path, encoding="ascii") as f:
        for number, line in enumerate(f, 1):
            if limit is not None and len(labels) >= limit:
                break
            fields = line.rstrip("\r\n").split("\t")
            if len(fields) != 1 + NUM_DENSE + NUM_CATEGORICAL:
                raise ValueError(f"{path}:{number}: {len(fields)} tab-separated fields, expected 40")
            try:
                labels.append(float(fields[0]))
                dense.append([float(x) if x else 0.0 for x in fields[1 : 1 + NUM_DENSE]])
                ids.append(
                    [category_id(c, int(x, 16) if x else None) for c, x in enumerate(fields[1 + NUM_DENSE :])]
                )
            except ValueError as exc:
                raise ValueError(f"{path}:{number}: {exc}") from None
    dense_t = torch.tensor(dense, dtype=torch.float32).reshape(-1, NUM_DENSE)
    logger.debug("criteo %s: %d lines", path, len(labels))
    return TensorDataset(
        torch.tensor(labels, dtype=torch.float32),
        torch.log1p(dense_t.clamp_(min=0)),
        torch.tensor(ids, dtype=torch.int64).reshape(-1, NUM_CATEGORICAL),
    )


def zipf_ranks(n: int, vocab: int, exponent: float, generator: torch.Generator) -> torch.Tensor:
    """n ranks in [1, vocab], rank k with probability proportional to k ** -exponent (int64)."""
    if vocab < 1 or exponent <= 0:
        raise ValueError(f"zipf_ranks: vocab={vocab!r} must be >= 1 and exponent={exponent!r} > 0")
    weights = torch.arange(1, vocab + 1, dtype=torch.float64).pow_(-exponent)
    cdf = weights.cumsum_(0)
    cdf /= cdf[-1].clone()
    u = torch.rand(n, generator=generator, dtype=torch.float64)
    return torch.searchsorted(cdf, u).clamp_(max=vocab - 1) + 1


def _mix(values: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer (uint64): the generator's hashes and hidden weights."""
    z = values.astype(np.uint64)
    z ^= z >> np.uint64(30)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return z


def _value_hashes(column: int, ranks: np.ndarray, seed: int) -> np.ndarray:
    base = np.uint64((column * 0x9E3779B97F4A7C15 + seed * 0xD1B54A32D192ED03 + 1) & _MASK64)
    return _mix(ranks.astype(np.uint64) + base)


def write_synthetic_criteo(
    path: str | os.PathLike[str],
    rows: int,
    *,
    seed: int = 0,
    model_seed: int = 0,
    vocab: int = 20_000,
    exponent: float = 1.1,
    missing: float = 0.05,
    signal: float = 1.0,
) -> None:
    """Write `rows` lines in Criteo's format. `seed` draws the lines; `model_seed` fixes the hidden
    click model and the values' hashes (a train file and a held-out file share it and differ in
    `seed`). Column c's values come from about vocab / (1 + c % 5) values, by a power law with
    `exponent`; `missing` is the chance that a feature is empty; `signal` scales the click model's
    logits (0: labels are noise)."""
    if rows < 0 or not 0 <= missing < 1:
        raise ValueError(
            f"write_synthetic_criteo: rows={rows!r} must be >= 0 and missing={missing!r} in [0, 1)"
        )
    g = torch.Generator().manual_seed(seed)
    logit = torch.full((rows,), -1.0, dtype=torch.float64)
    cat_text = []
    for c in range(NUM_CATEGORICAL):
        ranks = zipf_ranks(rows, max(1, vocab // (1 + c % 5)), exponent, g).numpy()
        hashes = _value_hashes(c, ranks, model_seed)
        # a hidden weight per value in [-1, 1), from its hash; columns count less as c grows
        weight = (hashes >> np.uint64(11)).astype(np.float64) * 2.0**-52 - 1.0
        logit += torch.from_numpy(weight) * signal * 1.5 / (1 + c / 8)
        text = np.char.zfill(np.char.mod("%x", (hashes & np.uint64(0xFFFFFFFF)).astype(np.int64)), 8)
        drop = torch.rand(rows, generator=g).numpy() < missing
        cat_text.append(np.where(drop, "", text))
    counts = torch.poisson(torch.full((rows, NUM_DENSE), 3.0), generator=g)
    logit += signal * 0.3 * (counts[:, 0] - 3.0).double() - signal * 0.2 * (counts[:, 1] - 3.0).double()
    labels = (torch.rand(rows, generator=g, dtype=torch.float64) < torch.sigmoid(logit)).int().numpy()
    dense_missing = (torch.rand(rows, NUM_DENSE, generator=g) < missing).numpy()
    dense_text = np.where(dense_missing, "", counts.int().numpy().astype(str))
    columns = [labels.astype(str), *dense_text.T, *cat_text]
    lines = ["\t".join(fields) for fields in zip(*columns, strict=True)]
    atomic_write(path, "\n".join(lines) + ("\n" if lines else ""))
