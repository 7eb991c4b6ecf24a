"""Sharded state in a checkpoint folder: torch.distributed.checkpoint (DCP), read without running code.

Every rank writes its shards of a state dict (DTensors, or plain tensors) into one folder of the
staging checkpoint (`save`); any number of ranks, or one process, reads it back into a state dict of
any other layout (`load`): DCP's planner maps the saved chunks onto the shards the reader asks for.
The folder is staged and committed with the rest of the checkpoint (store.py), so it is as atomic.

`save_async` is DCP's `async_save`: the state is copied to CPU memory at the call (training may
change it at once), then a thread writes the copy; the checkpoint is committed only once the write
is complete (the Trainer asks `finished`), so a process killed during the write leaves the previous
checkpoint the latest. The thread's collectives (the save plans, the coordinator's metadata) run on
a process group of their own, which must have a CPU backend (Gloo): sharing training's group from
two threads would interleave their collectives.

No code on load. DCP's FileSystemReader unpickles the folder's `.metadata` with plain `pickle.load`
and the default load planner reads non-tensor entries (an optimizer's param_groups) with
`torch.load(weights_only=False)`: either runs whatever a crafted file names. Here the metadata goes
through an unpickler that rebuilds only DCP's own metadata classes and torch's size, dtype and layout
(`_SafeUnpickler`), and non-tensor entries load with `weights_only=True` (`_SafeLoadPlanner`); tensor
entries already load with `weights_only=True` in DCP itself.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from paratrain.errors import CheckpointError

FOLDER = "sharded"
"""The folder of a Trainer checkpoint that holds a sharded save (train/fsdp.py, serve/weights.py)."""
METADATA = ".metadata"
"""The file DCP writes last, on the coordinating rank: its presence marks a complete sharded save."""

_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # torch's layouts pickle as a lookup by name
    ("pathlib", "PosixPath"),  # the checkpoint id DCP records
    ("pathlib", "WindowsPath"),
    ("collections", "OrderedDict"),
}


class _SafeUnpickler(pickle.Unpickler):
    """Rebuilds DCP's metadata and nothing else: any other global (a function a crafted file would
    call) is refused before it is looked up."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in checkpoint metadata")


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader with the metadata read by `_SafeUnpickler` (see the module docstring)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        rank = kwargs.get("rank")
        path = self._get_metadata_path(rank)
        with self.fs.create_stream(path, "rb") as stream:
            try:
                metadata = _SafeUnpickler(stream).load()
            except Exception as error:
                raise CheckpointError(
                    f"sharded checkpoint metadata {path} is corrupt or not plain data: {error}"
                ) from error
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise CheckpointError(f"sharded checkpoint metadata {path} holds a {type(metadata).__name__}")
        storage = getattr(metadata, "storage_meta", None) or dcp_metadata.StorageMeta()
        storage.load_id = self.load_id
        metadata.storage_meta = storage
        return metadata


class _SafeLoadPlanner(DefaultLoadPlanner):
    """The default planner, reading non-tensor entries with `weights_only=True` (its own load_bytes,
    with torch's weights_only unpickler in place of the unrestricted one)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except Exception as error:
            fqn = read_item.dest_index.fqn
            raise CheckpointError(f"sharded checkpoint entry {fqn!r} is corrupt or not plain data: {error}")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


@contextlib.contextmanager
def _alone_is_meant() -> Iterator[None]:
    """DCP warns that it assumes one process when no process group is up; here that is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def is_sharded(folder: str | os.PathLike[str]) -> bool:
    """Whether `folder` holds a complete sharded save."""
    return (Path(folder) / METADATA).is_file()


def save(folder: str | os.PathLike[str], state: dict[str, Any]) -> None:
    """Every rank of the default process group (or a lone process) writes its shards of `state`."""
    writer = dcp.FileSystemWriter(Path(folder), sync_files=True)
    with _alone_is_meant():
        dcp.save(state, storage_writer=writer, no_dist=not dist.is_initialized())


def save_async(
    folder: str | os.PathLike[str], state: dict[str, Any], group: dist.ProcessGroup | None = None
) -> Future:
    """`save` in the background (see the module docstring); `group`: the write's own process group.
    Pass the future to `finished` before committing the checkpoint."""
    writer = dcp.FileSystemWriter(Path(folder), sync_files=True)
    with _alone_is_meant():
        written = dcp.async_save(
            state, storage_writer=writer, process_group=group, no_dist=not dist.is_initialized()
        )
    return cast(Future, written)


def finished(written: Future, folder: str | os.PathLike[str]) -> None:
    """Wait for a `save_async` of `folder`; its failure (every rank's, gathered by DCP) becomes a
    CheckpointError. On the coordinating rank (0) it returns once every rank's part is written."""
    try:
        written.result()
    except CheckpointException as error:
        raise CheckpointError(f"the sharded checkpoint in {folder} was not written: {error}") from error


def load(folder: str | os.PathLike[str], state: dict[str, Any]) -> None:
    """Fill `state` (its tensors, in place, in any layout) from the sharded save in `folder`."""
    if not is_sharded(folder):
        raise CheckpointError(f"{folder} holds no sharded checkpoint (no {METADATA})")
    try:
        with _alone_is_meant():
            dcp.load(
                state,
                storage_reader=SafeReader(Path(folder)),
                planner=_SafeLoadPlanner(),
                no_dist=not dist.is_initialized(),
            )
    except CheckpointException as error:  # DCP gathers every rank's failure into one
        raise CheckpointError(f"cannot load the sharded checkpoint in {folder}: {error}") from error


def load_tensors(folder: str | os.PathLike[str], prefix: str) -> dict[str, torch.Tensor]:
    """Every tensor saved under the top-level key `prefix` ("model") of the sharded save in
    `folder`, whole, in one process: for export, where no model is at hand to say the layout."""
    if not is_sharded(folder):
        raise CheckpointError(f"{folder} holds no sharded checkpoint (no {METADATA})")
    saved = SafeReader(Path(folder)).read_metadata().state_dict_metadata
    start = prefix + "."
    tensors = {
        key[len(start) :]: torch.empty(entry.size, dtype=entry.properties.dtype)
        for key, entry in saved.items()
        if key.startswith(start) and isinstance(entry, dcp_metadata.TensorStorageMetadata)
    }
    if not tensors:
        raise CheckpointError(f"the sharded checkpoint in {folder} holds no {prefix!r} tensors")
    load(folder, {prefix: tensors})
    return tensors
