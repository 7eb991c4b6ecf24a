"""The kvstore's state file: every key's whole value and optimizer state, independent of how many
servers held it. Tensors and plain data only, so loading runs no code (`weights_only=True`); written
as every checkpoint file is (checkpoint.save_file): to a hidden temporary file, fsynced, renamed, so
a reader never sees half a file and a kill mid-write leaves only debris that `commit` removes."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from paratrain.checkpoint import save_file
from paratrain.errors import KVStoreError
from paratrain.transport.tensors import dtype_name

STATE_FORMAT = "paratrain.kvstore/1"

# One key's entry: (key, whole value, optimizer state tensors by name).
Entry = tuple[Any, torch.Tensor, dict[str, torch.Tensor]]
# One sparse table's entry (embedding.TableClient.gather): key, dim, config, step, and tensors by id:
# "ids", "values", "ages" (steps since each row was last seen) and "state" (optimizer state by name).
TableEntry = dict[str, Any]


def write_state(
    path: str | os.PathLike[str], entries: list[Entry], optimizer: list, tables: Sequence[TableEntry] = ()
) -> None:
    state = {
        "format": STATE_FORMAT,
        "keys": [{"key": k, "shape": list(v.shape), "dtype": dtype_name(v.dtype)} for k, v, _ in entries],
        "values": {n: v for n, (_, v, _) in enumerate(entries)},
        "state": {n: s for n, (_, _, s) in enumerate(entries) if s},
        "optimizer": optimizer,
    }
    if tables:
        state["tables"] = list(tables)
    _write(path, state)


def _write(path: str | os.PathLike[str], state: dict) -> None:
    save_file(path, state)


def read_state(path: str | os.PathLike[str]) -> list[Entry]:
    state = torch.load(path, weights_only=True)  # tensors and plain data only: no code runs
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise KVStoreError(f"{path} is not a paratrain kvstore state file")
    return [(e["key"], state["values"][n], state["state"].get(n, {})) for n, e in enumerate(state["keys"])]


def read_tables(path: str | os.PathLike[str]) -> list[TableEntry]:
    """The sparse tables of a state file (none in files without tables)."""
    state = torch.load(path, weights_only=True)
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise KVStoreError(f"{path} is not a paratrain kvstore state file")
    return list(state.get("tables", []))


def write_tables(path: str | os.PathLike[str], tables: Sequence[TableEntry]) -> None:
    """Add sparse tables to a state file that write_state wrote (the local store's save_state)."""
    state = torch.load(path, weights_only=True)
    state["tables"] = list(tables)
    _write(path, state)
