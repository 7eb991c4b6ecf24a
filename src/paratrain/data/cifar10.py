"""CIFAR-10 from its binary distribution (cifar-10-batches-bin), and a writer of synthetic files in it.

Each record is 1 label byte then 3072 pixel bytes: 1024 red, 1024 green, 1024 blue, each a 32x32 image
in row-major order. Train is data_batch_1.bin .. data_batch_5.bin, test is test_batch.bin. Files are
read whole with numpy into one uint8 array; there is no Python object per record.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from paratrain.data.sampler import check_int

logger = logging.getLogger(__name__)

FOLDER = "cifar-10-batches-bin"
TRAIN_FILES = tuple(f"data_batch_{i}.bin" for i in range(1, 6))
TEST_FILES = ("test_batch.bin",)
NUM_CLASSES = 10
SHAPE = (3, 32, 32)
RECORD_BYTES = 1 + 3 * 32 * 32
# Per-channel mean and standard deviation of the 50,000 training images, scaled to [0, 1].
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)


class CIFAR10(Dataset):
    """The train or test split of CIFAR-10; items are (float32 3x32x32 tensor, int label).

    `data_dir` is the folder holding the .bin files or its parent holding `cifar-10-batches-bin/`.
    `.images` (uint8, N x 3 x 32 x 32) and `.labels` (int64, N) hold the whole split.
    """

    def __init__(self, data_dir: str | os.PathLike[str], train: bool = True, normalize: bool = True) -> None:
        self.folder = resolve_folder(data_dir)
        self.train = bool(train)
        self.normalize = bool(normalize)
        images, labels = read_records([self.folder / name for name in (TRAIN_FILES if train else TEST_FILES)])
        self.images = torch.from_numpy(images)
        self.labels = torch.from_numpy(labels)
        self._mean = torch.tensor(MEAN).view(3, 1, 1)
        self._std = torch.tensor(STD).view(3, 1, 1)
        logger.info("CIFAR-10 %s: %d images from %s", "train" if train else "test", len(labels), self.folder)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = self.images[index].float().div_(255.0)
        if self.normalize:
            image = image.sub_(self._mean).div_(self._std)
        return image, int(self.labels[index])


def resolve_folder(data_dir: str | os.PathLike[str]) -> Path:
    """`data_dir/cifar-10-batches-bin` if that folder exists, else `data_dir` itself."""
    data_dir = Path(data_dir)
    nested = data_dir / FOLDER
    return nested if nested.is_dir() else data_dir


def read_records(paths: list[Path]) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 images N x 3 x 32 x 32, int64 labels N) of the records in `paths`, checked."""
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        expected = ", ".join(p.name for p in paths)
        raise FileNotFoundError(
            f"CIFAR-10 files missing in {paths[0].parent}: {', '.join(missing)} (expected {expected}, "
            f"in data_dir or data_dir/{FOLDER})"
        )
    counts = [_record_count(p) for p in paths]
    images = np.empty((sum(counts), *SHAPE), dtype=np.uint8)
    labels = np.empty(sum(counts), dtype=np.int64)
    start = 0
    for path, count in zip(paths, counts):
        records = np.fromfile(path, dtype=np.uint8).reshape(count, RECORD_BYTES)
        bad = records[:, 0] >= NUM_CLASSES
        if bad.any():
            index = int(np.argmax(bad))
            raise ValueError(f"{path}: record {index} has label {records[index, 0]}, not below {NUM_CLASSES}")
        images[start : start + count] = records[:, 1:].reshape(count, *SHAPE)
        labels[start : start + count] = records[:, 0]
        start += count
    return images, labels


def _record_count(path: Path) -> int:
    size = path.stat().st_size
    if size % RECORD_BYTES:
        raise ValueError(
            f"{path}: {size} bytes is not a multiple of the {RECORD_BYTES}-byte record "
            "(truncated, or not CIFAR-10)"
        )
    return size // RECORD_BYTES


# -- synthetic data in the same format ---------------------------------------------------------------
# One colour and one stripe pattern (angle, cycles per image) per class, so a small CNN can learn them.
_TINTS = np.array(
    [
        [0.9, 0.2, 0.2],
        [0.2, 0.9, 0.2],
        [0.2, 0.2, 0.9],
        [0.9, 0.9, 0.2],
        [0.9, 0.2, 0.9],
        [0.2, 0.9, 0.9],
        [0.9, 0.6, 0.3],
        [0.5, 0.5, 0.5],
        [0.3, 0.5, 0.9],
        [0.6, 0.3, 0.6],
    ]
)
_ANGLES = np.arange(NUM_CLASSES) * math.pi / NUM_CLASSES
_CYCLES = np.array([2.0, 3.0, 4.0, 5.0, 2.5, 3.5, 4.5, 1.5, 6.0, 3.0])


def synthetic_images(labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """uint8 images (N x 3 x 32 x 32) for `labels`: the class's tint, its stripes at a random phase, noise."""
    y, x = np.mgrid[0:32, 0:32].astype(np.float64) / 32.0
    angle, cycles = _ANGLES[labels][:, None, None], _CYCLES[labels][:, None, None]
    phase = rng.uniform(0.0, 2 * math.pi, size=(len(labels), 1, 1))
    along = x * np.cos(angle) + y * np.sin(angle)
    stripes = np.sin(2 * math.pi * cycles * along + phase)  # N x 32 x 32
    tint = _TINTS[labels][:, :, None, None]  # N x 3 x 1 x 1
    pixels = 40 + 150 * tint + 50 * stripes[:, None] + rng.normal(0.0, 20.0, size=(len(labels), *SHAPE))
    return np.clip(np.rint(pixels), 0, 255).astype(np.uint8)


def write_records(path: Path, images: np.ndarray, labels: np.ndarray) -> None:
    """Write (label byte, 3072 pixel bytes) records to `path`."""
    records = np.empty((len(labels), RECORD_BYTES), dtype=np.uint8)
    records[:, 0] = labels
    records[:, 1:] = images.reshape(len(labels), -1)
    records.tofile(path)


def write_cifar10_binary(
    data_dir: str | os.PathLike[str],
    *,
    train_per_file: int = 100,
    test: int = 100,
    num_train_files: int = 5,
    seed: int = 0,
) -> Path:
    """Write synthetic CIFAR-10 files into `data_dir/cifar-10-batches-bin/` and return that folder.

    Deterministic from `seed`. CIFAR10 needs all five train files; fewer is for testing that error.
    """
    check_int("train_per_file", train_per_file, 0)
    check_int("test", test, 0)
    if check_int("num_train_files", num_train_files, 1) > len(TRAIN_FILES):
        raise ValueError(f"num_train_files must be <= {len(TRAIN_FILES)}, got {num_train_files}")
    folder = Path(data_dir) / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(check_int("seed", seed, 0))
    names = list(TRAIN_FILES[:num_train_files]) + list(TEST_FILES)
    counts = [train_per_file] * num_train_files + [test]
    for name, count in zip(names, counts):
        labels = rng.integers(0, NUM_CLASSES, size=count).astype(np.uint8)
        write_records(folder / name, synthetic_images(labels, rng), labels)
    logger.info("wrote synthetic CIFAR-10 (%d train, %d test) to %s", sum(counts) - test, test, folder)
    return folder
