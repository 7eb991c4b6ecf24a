"""The kvstore's state file: every key's whole value and optimizer state, independent of how many
servers held it. Tensors and plain data only, so loading runs no code (`weights_only=True`); written
as every checkpoint file is (checkpoint.save_file): to a hidden temporary file, fsynced, renamed, so
a reader never sees half a file and a kill mid-write leaves only debris that `commit` removes.

With it, the two moves between the file's per-key entries and the servers' slices: `gather_state`
(the servers' `get_state` replies to entries) and `scatter_state` (entries to `set_state` frames
for the current placement)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from paratrain.checkpoint import save_file
from paratrain.errors import KVStoreError
from paratrain.transport.tensors import dtype_name

if TYPE_CHECKING:
    from paratrain.kvstore.worker.client import KeyInfo

STATE_FORMAT = "paratrain.kvstore/1"

# One key's entry: (key, whole value, optimizer state tensors by name).
Entry = tuple[Any, torch.Tensor, dict[str, torch.Tensor]]
# One sparse table's entry (embedding.TableClient.gather): key, dim, config, step, and tensors by id:
# "ids", "values", "ages" (steps since each row was last seen) and "state" (optimizer state by name).
TableEntry = dict[str, Any]


def write_state(
    path: str | os.PathLike[str],
    entries: list[Entry],
    optimizer: list,
    tables: Sequence[TableEntry] = (),
    hyper: dict[Any, dict] | None = None,
) -> None:
    """`hyper`: per key, the hyperparameters set_hyperparameters gave it over `optimizer`'s."""
    state = {
        "format": STATE_FORMAT,
        "keys": [{"key": k, "shape": list(v.shape), "dtype": dtype_name(v.dtype)} for k, v, _ in entries],
        "values": {n: v for n, (_, v, _) in enumerate(entries)},
        "state": {n: s for n, (_, _, s) in enumerate(entries) if s},
        "optimizer": optimizer,
    }
    if tables:
        state["tables"] = list(tables)
    if hyper:
        state["hyper"] = [[key, values] for key, values in hyper.items()]
    _write(path, state)


def _write(path: str | os.PathLike[str], state: dict) -> None:
    save_file(path, state)


def read_state(path: str | os.PathLike[str]) -> list[Entry]:
    state = torch.load(path, weights_only=True)  # tensors and plain data only: no code runs
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise KVStoreError(f"{path} is not a paratrain kvstore state file")
    return [(e["key"], state["values"][n], state["state"].get(n, {})) for n, e in enumerate(state["keys"])]


def read_hyper(path: str | os.PathLike[str]) -> dict[Any, dict]:
    """Per key, the hyperparameters that set_hyperparameters gave it (none in older files)."""
    state = torch.load(path, weights_only=True)
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise KVStoreError(f"{path} is not a paratrain kvstore state file")
    return {key: dict(values) for key, values in state.get("hyper", [])}


def by_values(hyper: dict[Any, dict]) -> list[tuple[list, dict]]:
    """The keys of `hyper` grouped by equal values (one set_hyper per group)."""
    groups: list[tuple[list, dict]] = []
    for key, values in hyper.items():
        for keys, same in groups:
            if same == values:
                keys.append(key)
                break
        else:
            groups.append(([key], values))
    return groups


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


class _Slice(NamedTuple):
    """One server's slice of a dense key: where it starts, its values, its optimizer state."""

    start: int
    value: torch.Tensor
    state: dict[str, torch.Tensor]


def gather_state(replies: list) -> list[Entry]:
    """Per-server shard lists -> one entry per key: whole value, whole optimizer state tensors."""
    pieces: dict[Any, list[_Slice]] = {}
    shapes: dict[Any, list[int]] = {}
    newest: dict[tuple, int] = {}  # with replication a slice comes from each copy: keep the newest
    for reply in replies:
        for entry in reply.meta["shards"]:
            where = (entry["key"], entry["start"])
            newest[where] = max(newest.get(where, -1), entry["version"])
    for reply in replies:
        i = 0
        for entry in reply.meta["shards"]:
            tensors = reply.tensors[i : i + 1 + len(entry["state"])]
            i += len(tensors)
            where = (entry["key"], entry["start"])
            if newest.pop(where, None) != entry["version"]:
                continue
            state = dict(zip(entry["state"], tensors[1:], strict=True))
            pieces.setdefault(entry["key"], []).append(_Slice(entry["start"], tensors[0], state))
            shapes[entry["key"]] = entry["shape"]
    entries = []
    for key, parts in pieces.items():
        parts.sort(key=lambda part: part.start)
        value = torch.cat([part.value for part in parts]).reshape(shapes[key])
        first = parts[0]
        state = {  # per-element state is cut like the value; scalars (Adam's step) are shared
            name: torch.cat([part.state[name].reshape(-1) for part in parts])
            if first.state[name].numel() == first.value.numel()
            else first.state[name]
            for name in first.state
        }
        entries.append((key, value, state))
    return entries


def scatter_state(entries: list[Entry], keys: dict[Any, KeyInfo]) -> dict[int, tuple[list, list]]:
    """One file's per-key state -> per-server set_state frames for the current placement."""
    per_server: dict[int, tuple[list, list]] = {}
    for key, value, key_state in entries:
        info = keys.get(key)
        if info is None:
            raise KVStoreError(f"the state file has key {key!r}, which this job never initialized")
        value = value.reshape(-1)
        if value.numel() != info.numel:
            raise KVStoreError(f"key {key!r} has {value.numel()} elements in the file but {info.numel} here")
        for piece in info.slices:
            meta, tensors = per_server.setdefault(piece.server, ([], []))
            sliced = {
                name: t.reshape(-1)[piece.start : piece.stop] if t.numel() == info.numel else t
                for name, t in key_state.items()
            }
            meta.append({"key": key, "start": piece.start, "stop": piece.stop, "state": list(sliced)})
            tensors += [value[piece.start : piece.stop].contiguous()] + [
                t.contiguous() for t in sliced.values()
            ]
    return per_server
