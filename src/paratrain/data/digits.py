"""The 8x8 handwritten digits of scikit-learn (1,797 images) as a small, offline image data set.

The train and test splits are disjoint, stratified by label, and fixed by `seed`; together they hold
every sample. scikit-learn is imported on first use only, so `import paratrain.data` stays light.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch.utils.data import TensorDataset

from paratrain.data.sampler import check_int
from paratrain.errors import MissingExtraError

logger = logging.getLogger(__name__)


def digits(train: bool = True, *, test_fraction: float = 0.25, seed: int = 0) -> TensorDataset:
    """(float32 1x8x8 images in [0, 1], int64 labels) of the train or test split."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as exc:
        raise MissingExtraError("scikit-learn", "examples", "paratrain.data.digits") from exc

    data = load_digits()
    indices = np.arange(len(data.target))
    train_idx, test_idx = train_test_split(
        indices, test_size=test_fraction, random_state=check_int("seed", seed, 0), stratify=data.target
    )
    chosen = np.sort(train_idx if train else test_idx)
    images = torch.from_numpy(data.images[chosen].astype(np.float32) / 16.0).unsqueeze(1)
    labels = torch.from_numpy(data.target[chosen].astype(np.int64))
    logger.debug("digits %s: %d samples", "train" if train else "test", len(labels))
    return TensorDataset(images, labels)
