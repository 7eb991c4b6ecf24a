"""The data layer: disjoint, equal, deterministic, resumable shards; split_and_load; the readers."""

from __future__ import annotations

import itertools
from collections import Counter, namedtuple
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset, WeightedRandomSampler

from paratrain.data import (
    CIFAR10,
    ShardedLoader,
    ShardSampler,
    digits,
    local_devices,
    merge,
    split_and_load,
    write_cifar10_binary,
)

SIZES = (10, 11, 97, 1000)
REPLICAS = (1, 2, 3, 4)


def shards(size: int, replicas: int, **kwargs) -> list[list[int]]:
    return [list(ShardSampler(size, replicas, rank, **kwargs)) for rank in range(replicas)]


def indices(size: int) -> TensorDataset:
    return TensorDataset(torch.arange(size))


def batches(loader) -> list[list[int]]:
    return [batch[0].tolist() for batch in loader]


# -- ShardSampler ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("shuffle", [True, False])
def test_drop_remainder_shards_are_disjoint_and_equal(shuffle):
    for size, replicas in itertools.product(SIZES, REPLICAS):
        parts = shards(size, replicas, shuffle=shuffle)
        assert [len(p) for p in parts] == [size // replicas] * replicas
        union = set().union(*parts)
        assert len(union) == sum(len(p) for p in parts) == size - size % replicas
        assert union <= set(range(size))


@pytest.mark.parametrize("shuffle", [True, False])
def test_without_drop_remainder_every_index_exactly_once(shuffle):
    for size, replicas in itertools.product(SIZES, REPLICAS):
        parts = shards(size, replicas, shuffle=shuffle, drop_remainder=False)
        assert sorted(itertools.chain(*parts)) == list(range(size))
        extra = size % replicas
        assert [len(p) for p in parts] == [size // replicas + (r < extra) for r in range(replicas)]
        assert [len(ShardSampler(size, replicas, r, drop_remainder=False)) for r in range(replicas)] == [
            len(p) for p in parts
        ]


def test_unshuffled_order_is_range_strided():
    assert shards(10, 3, shuffle=False) == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]
    assert shards(10, 3, shuffle=False, drop_remainder=False) == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]


def test_deterministic_across_instances_and_seeds_and_epochs_differ():
    assert shards(97, 3, seed=5) == shards(97, 3, seed=5)
    assert shards(97, 3, seed=5) != shards(97, 3, seed=6)
    sampler = ShardSampler(97, 3, 1)
    first = list(sampler)
    sampler.set_epoch(1)
    second = list(sampler)
    assert first != second
    again = ShardSampler(97, 3, 1)
    again.set_epoch(1)
    assert list(again) == second


def test_dropped_remainder_changes_between_epochs():
    dropped = set()  # 11 % 4 == 3 samples are left out of each epoch
    for epoch in range(20):
        used = set()
        for rank in range(4):
            s = ShardSampler(11, 4, rank)
            s.set_epoch(epoch)
            used |= set(s)
        dropped |= set(range(11)) - used
    assert len(dropped) > 3  # not always the same 3 samples left out


def test_empty_shards_when_fewer_samples_than_replicas():
    assert shards(3, 4) == [[], [], [], []]
    assert shards(0, 2, drop_remainder=False) == [[], []]
    assert sorted(itertools.chain(*shards(3, 4, drop_remainder=False))) == [0, 1, 2]


def test_position_resumes_the_shard_and_state_round_trips():
    sampler = ShardSampler(100, 3, 2, seed=7)
    sampler.set_epoch(4)
    full = list(sampler)
    sampler.position = 10
    assert list(sampler) == full[10:] and len(sampler) == len(full) - 10
    assert sampler.position == 10  # iterating does not move the position
    sampler.set_epoch(4)  # same epoch: keeps its place
    assert sampler.position == 10
    other = ShardSampler(100, 3, 2, seed=7)
    other.load_state_dict(sampler.state_dict())
    assert list(other) == full[10:] and other.epoch == 4
    sampler.set_epoch(5)
    assert sampler.position == 0


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"size": -1}, "size"),
        ({"num_replicas": 0}, "num_replicas"),
        ({"rank": 3}, "rank"),
        ({"rank": -1}, "rank"),
    ],
)
def test_sampler_rejects_bad_arguments(kwargs, field):
    args = {"size": 10, "num_replicas": 3, "rank": 0} | kwargs
    with pytest.raises(ValueError, match=field):
        ShardSampler(**args)


def test_sampler_rejects_mismatched_state_and_bad_position():
    state = ShardSampler(10, 2, 0, seed=1).state_dict()
    for field, sampler in [
        ("size", ShardSampler(11, 2, 0, seed=1)),
        ("num_replicas", ShardSampler(10, 3, 0, seed=1)),
        ("seed", ShardSampler(10, 2, 0, seed=2)),
    ]:
        with pytest.raises(ValueError, match=field):
            sampler.load_state_dict(state)
    with pytest.raises(ValueError, match="position"):
        ShardSampler(10, 2, 0).position = 6
    with pytest.raises(ValueError, match="epoch"):
        ShardSampler(10, 2, 0).load_state_dict({"seed": 0, "size": 10, "num_replicas": 2})


# -- ShardedLoader ---------------------------------------------------------------------------------------
def test_loader_epochs_advance_and_cover_the_shard():
    loader = ShardedLoader(indices(97), 8, num_replicas=3, rank=1, seed=3)
    assert len(loader) == 4  # 32 samples: 8 + 8 + 8 + 8
    sampler = ShardSampler(97, 3, 1, seed=3)
    for epoch in range(3):
        assert loader.epoch == epoch
        got = batches(loader)
        sampler.set_epoch(epoch)
        assert list(itertools.chain(*got)) == list(sampler)
    assert loader.epoch == 3 and loader.batches_done == 0


@pytest.mark.parametrize("drop_last", [False, True])
def test_equal_batch_counts_across_ranks(drop_last):
    for size, replicas in itertools.product(SIZES, REPLICAS):
        counts = []
        for rank in range(replicas):
            loader = ShardedLoader(indices(size), 4, num_replicas=replicas, rank=rank, drop_last=drop_last)
            counts.append(len(batches(loader)))
            assert counts[-1] == len(loader)
        assert len(set(counts)) == 1, (size, replicas, counts)


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("k", [0, 1, 3, 5])
def test_resume_mid_epoch_in_a_new_loader(drop_last, k):
    def make():
        return ShardedLoader(indices(97), 6, num_replicas=2, rank=1, seed=11, drop_last=drop_last)

    reference = make()
    epochs = [batches(reference) for _ in range(2)]
    assert len(epochs[0]) == (48 // 6 if drop_last else 8)
    interrupted = make()
    for i, _ in enumerate(interrupted):
        if i + 1 == k:
            break
    state = interrupted.state_dict() if k else make().state_dict()
    assert state["batches"] == k and state["epoch"] == 0
    resumed = make()
    resumed.load_state_dict(state)
    assert resumed.batches_done == k
    assert batches(resumed) == epochs[0][k:]
    assert batches(resumed) == epochs[1]


def test_break_keeps_the_position_in_the_same_loader():
    loader = ShardedLoader(indices(50), 5, num_replicas=2, rank=0, seed=1)
    reference = batches(ShardedLoader(indices(50), 5, num_replicas=2, rank=0, seed=1))
    seen = []
    for batch in loader:
        seen.append(batch[0].tolist())
        if len(seen) == 2:
            break
    assert loader.batches_done == 2 and loader.epoch == 0
    seen += batches(loader)
    assert seen == reference and loader.epoch == 1


def test_break_after_the_last_batch_moves_to_the_next_epoch():
    def make():
        return ShardedLoader(indices(40), 10, num_replicas=2, rank=1, seed=2)

    reference = make()
    epochs = [batches(reference) for _ in range(2)]
    loader = make()
    for i, _ in enumerate(loader):
        if i == 1:
            break  # the epoch's last batch
    assert loader.state_dict()["batches"] == 2
    resumed = make()
    resumed.load_state_dict(loader.state_dict())
    assert batches(loader) == epochs[1]
    assert batches(resumed) == epochs[1]


def test_a_state_saved_after_an_epochs_last_batch_resumes_at_the_next_epoch():
    """A checkpoint on an epoch's last step: the Trainer's epochs count that epoch as done."""
    loader = ShardedLoader(indices(40), 10, num_replicas=2, rank=0)
    for i, _ in enumerate(loader):
        if i == len(loader) - 1:
            break
    resumed = ShardedLoader(indices(40), 10, num_replicas=2, rank=0)
    resumed.load_state_dict(loader.state_dict())
    assert (resumed.epoch, resumed.batches_done) == (1, 0)


def test_iterating_draws_nothing_from_torchs_global_rng():
    """A model's dropout masks follow the global RNG; a resumed run's first iter(loader) would
    otherwise shift them by one draw."""
    loader = ShardedLoader(indices(20), 4, seed=3)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    next(iter(loader))
    batches(loader)
    batches(loader)
    assert torch.equal(torch.get_rng_state(), before)


def test_from_loader_shuffles_by_the_loaders_generator():
    def order(seed: int | None) -> list[list[int]]:
        generator = None if seed is None else torch.Generator().manual_seed(seed)
        loader = DataLoader(indices(40), batch_size=5, shuffle=True, generator=generator)
        return batches(ShardedLoader.from_loader(loader, 2, 0))

    assert order(7) == order(7)
    assert order(7) != order(8) and order(7) != order(None)


def test_loader_rejects_bad_state_and_arguments():
    loader = ShardedLoader(indices(20), 4)
    with pytest.raises(ValueError, match="batch_size"):
        loader.load_state_dict(ShardedLoader(indices(20), 5).state_dict())
    with pytest.raises(ValueError, match="num_replicas"):
        loader.load_state_dict(ShardedLoader(indices(20), 4, num_replicas=2).state_dict())
    with pytest.raises(ValueError, match="batches"):
        loader.load_state_dict(loader.state_dict() | {"batches": 6})
    with pytest.raises(TypeError, match="sampler"):
        ShardedLoader(indices(20), 4, sampler=None)
    with pytest.raises(ValueError, match="batch_size"):
        ShardedLoader(indices(20), 0)


def test_an_older_iterator_is_retired():
    loader = ShardedLoader(indices(20), 2)
    old = iter(loader)
    next(old)
    batches(loader)
    with pytest.raises(RuntimeError, match="retired"):
        next(old)


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(10))


def pairs(samples):
    return {"x": torch.stack([s[0] for s in samples]), "n": len(samples)}


def test_from_loader_keeps_batch_size_collate_and_shuffle():
    dataset = indices(30)
    plain = ShardedLoader.from_loader(DataLoader(dataset, batch_size=4, collate_fn=pairs), 3, 2)
    assert plain.batch_size == 4 and not plain.sampler.shuffle and plain.sampler.rank == 2
    assert plain.dataloader.collate_fn is pairs
    first = next(iter(plain))
    assert first["n"] == 4 and first["x"].tolist() == [2, 5, 8, 11]
    shuffled = ShardedLoader.from_loader(
        DataLoader(dataset, batch_size=3, shuffle=True, drop_last=True), 2, 0
    )
    assert shuffled.sampler.shuffle and shuffled.drop_last and len(shuffled) == 5


def test_from_loader_rejects_what_cannot_be_resharded():
    with pytest.raises(ValueError, match="IterableDataset"):
        ShardedLoader.from_loader(DataLoader(Stream(), batch_size=2), 2, 0)
    weighted = WeightedRandomSampler([1.0] * 10, 10)
    with pytest.raises(ValueError, match="WeightedRandomSampler"):
        ShardedLoader.from_loader(DataLoader(indices(10), batch_size=2, sampler=weighted), 2, 0)
    batch_sampler = [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="batch_sampler"):
        ShardedLoader.from_loader(DataLoader(indices(10), batch_sampler=batch_sampler), 2, 0)
    with pytest.raises(ValueError, match="IterableDataset"):
        ShardedLoader(Stream(), 2)


# -- split_and_load / merge ------------------------------------------------------------------------------
def test_split_and_load_sizes_and_content():
    for rows, count in itertools.product((10, 11), (1, 2, 3, 4, 10)):
        x = torch.arange(rows * 2).view(rows, 2)
        parts = split_and_load(x, ["cpu"] * count)
        sizes = [len(p) for p in parts]
        assert len(parts) == count and max(sizes) - min(sizes) <= 1 and sum(sizes) == rows
        assert torch.equal(torch.cat(parts), x) and torch.equal(merge(parts), x)
        assert all(p.device == torch.device("cpu") for p in parts)
    x = torch.arange(22).view(11, 2)
    columns = split_and_load(x, ["cpu", "cpu"], dim=1)
    assert [c.tolist() for c in columns] == [x[:, :1].tolist(), x[:, 1:].tolist()]


def test_split_and_load_keeps_nesting_and_leaves():
    Pair = namedtuple("Pair", "a b")
    batch = {
        "x": torch.arange(5),
        "y": (torch.ones(5, 2), [torch.zeros(5), "tag"]),
        "p": Pair(torch.arange(5), 7),
    }
    batch["scale"] = torch.tensor(2.0)
    parts = split_and_load(batch, [torch.device("cpu")] * 2)
    assert parts[0]["x"].tolist() == [0, 1, 2] and parts[1]["x"].tolist() == [3, 4]
    assert parts[1]["y"][0].shape == (2, 2) and parts[1]["y"][1][1] == "tag"
    assert isinstance(parts[0]["p"], Pair) and parts[0]["p"].b == 7 and parts[1]["p"].a.tolist() == [3, 4]
    assert all(p["scale"].item() == 2.0 for p in parts)
    merged = merge(parts)
    assert torch.equal(merged["x"], batch["x"]) and torch.equal(merged["y"][0], batch["y"][0])
    assert merged["y"][1][1] == "tag" and merged["p"].a.tolist() == list(range(5))
    assert merged["scale"].tolist() == [2.0, 2.0]  # one 0-dim value per part, stacked


def test_split_and_load_errors():
    with pytest.raises(ValueError, match="devices is empty"):
        split_and_load(torch.ones(4), [])
    with pytest.raises(ValueError, match="fewer than the 3 devices"):
        split_and_load((torch.ones(2), torch.ones(2)), ["cpu"] * 3)
    with pytest.raises(ValueError, match="differ in size"):
        split_and_load((torch.ones(4), torch.ones(5)), ["cpu"] * 2)
    with pytest.raises(ValueError, match="no tensor"):
        split_and_load(["a", "b"], ["cpu"])
    with pytest.raises(ValueError, match="empty"):
        merge([])


def test_local_devices():
    devices = local_devices()
    if torch.cuda.is_available():
        assert devices == [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    else:
        assert devices == [torch.device("cpu")]


# -- CIFAR-10 --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cifar_dir(tmp_path_factory) -> Path:
    return write_cifar10_binary(tmp_path_factory.mktemp("cifar"), train_per_file=30, test=20, seed=3)


def raw_records(folder: Path, names: list[str]) -> np.ndarray:
    return np.concatenate([np.fromfile(folder / n, dtype=np.uint8).reshape(-1, 3073) for n in names])


def test_cifar_round_trip(cifar_dir):
    train = CIFAR10(cifar_dir.parent, train=True, normalize=False)
    test = CIFAR10(cifar_dir, train=False)
    assert len(train) == 150 and len(test) == 20
    records = raw_records(cifar_dir, [f"data_batch_{i}.bin" for i in range(1, 6)])
    assert train.labels.dtype == torch.int64 and train.labels.tolist() == records[:, 0].tolist()
    assert train.images.dtype == torch.uint8 and train.images.shape == (150, 3, 32, 32)
    assert np.array_equal(train.images.numpy().reshape(150, -1), records[:, 1:])
    red = records[7, 1:1025].reshape(32, 32)  # channel-major: the first 1024 pixel bytes are red
    assert np.array_equal(train.images[7, 0].numpy(), red)
    image, label = train[7]
    assert image.dtype == torch.float32 and label == records[7, 0] and isinstance(label, int)
    assert torch.allclose(image, torch.from_numpy(records[7, 1:].reshape(3, 32, 32)).float() / 255)
    normalized, _ = test[0]
    expected = (
        test.images[0].float() / 255 - torch.tensor([0.4914, 0.4822, 0.4465]).view(3, 1, 1)
    ) / torch.tensor([0.2470, 0.2435, 0.2616]).view(3, 1, 1)
    assert torch.allclose(normalized, expected, atol=1e-5)
    assert test.labels.tolist() == raw_records(cifar_dir, ["test_batch.bin"])[:, 0].tolist()


def test_cifar_writer_is_deterministic_and_class_dependent(tmp_path, cifar_dir):
    again = write_cifar10_binary(tmp_path, train_per_file=30, test=20, seed=3)
    assert (again / "test_batch.bin").read_bytes() == (cifar_dir / "test_batch.bin").read_bytes()
    other = write_cifar10_binary(tmp_path / "o", train_per_file=30, test=20, seed=4)
    assert (other / "test_batch.bin").read_bytes() != (cifar_dir / "test_batch.bin").read_bytes()
    train = CIFAR10(cifar_dir, normalize=False)
    means = train.images.float().mean(dim=(2, 3))  # per-image channel means
    class_means = torch.stack(
        [means[train.labels == c].mean(0) for c in range(10) if (train.labels == c).any()]
    )
    assert torch.cdist(class_means, class_means).add(torch.eye(len(class_means)) * 1e3).min() > 10


def test_cifar_errors(tmp_path):
    folder = write_cifar10_binary(tmp_path / "short", train_per_file=3, test=2, num_train_files=4)
    with pytest.raises(FileNotFoundError, match="data_batch_5.bin"):
        CIFAR10(folder)
    CIFAR10(folder, train=False)  # the test split is complete
    with pytest.raises(FileNotFoundError, match="test_batch.bin"):
        CIFAR10(tmp_path / "nowhere", train=False)

    truncated = write_cifar10_binary(tmp_path / "truncated", train_per_file=3, test=2)
    data = (truncated / "data_batch_2.bin").read_bytes()
    (truncated / "data_batch_2.bin").write_bytes(data[:-5])
    with pytest.raises(ValueError, match="data_batch_2.bin"):
        CIFAR10(truncated)

    bad = write_cifar10_binary(tmp_path / "bad", train_per_file=3, test=2)
    data = bytearray((bad / "test_batch.bin").read_bytes())
    data[3073] = 10  # the second record's label
    (bad / "test_batch.bin").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"test_batch.bin.*label 10"):
        CIFAR10(bad, train=False)


# -- digits ----------------------------------------------------------------------------------------------
def test_digits_shapes_and_disjoint_split():
    train, test = digits(), digits(train=False)
    assert len(train) + len(test) == 1797 and len(test) == 450
    images, labels = train.tensors
    assert images.shape == (len(train), 1, 8, 8) and images.dtype == torch.float32
    assert labels.dtype == torch.int64 and images.min() >= 0.0 and images.max() <= 1.0 and images.max() > 0.9
    from sklearn.datasets import load_digits

    def rows(images, labels):
        return Counter(tuple(x.flatten().tolist()) + (int(y),) for x, y in zip(images, labels))

    full = load_digits()
    everything = rows(torch.from_numpy(full.images / 16.0).float(), full.target)
    assert rows(*train.tensors) + rows(*test.tensors) == everything  # disjoint, and together all
    assert torch.equal(digits().tensors[1], labels)
    assert not torch.equal(digits(seed=1).tensors[1], labels)
    assert sorted(set(test.tensors[1].tolist())) == list(range(10))
    with pytest.raises(ValueError, match="test_fraction"):
        digits(test_fraction=1.0)
