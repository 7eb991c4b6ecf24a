"""What every kvstore implementation checks before a call changes anything, and what a long wait
is waiting for.

A refused call must leave no trace: a worker whose clock moved for a push that was never sent would
join a later round than the others, and every worker would then wait, silently, for a round that
never completes. So the stores (client.DistKVStore, device.HostKVStore, local.LocalKVStore and the
sparse tables) run these checks on every argument first. A call that still waits long asks its
servers why (`explain_wait`: ops "waiting" and "sparse_waiting") and says so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from paratrain.errors import RemoteError, TransportError
from paratrain.kvstore.api import Keys, WaitDiagnosis, check_key
from paratrain.transport.tensors import dtype_name


def explain_wait(probes: list[tuple[Any, str, dict]], timeout_s: float | None) -> WaitDiagnosis:
    """Send each (client, op, query) probe of a long wait ("waiting", "sparse_waiting") and say what
    the servers answered: the rounds the call waits for and the workers that have not pushed them."""
    probe_s = min(10.0, timeout_s or 10.0)
    asked: list[tuple[str, Any]] = []
    for client, op, query in probes:
        try:
            asked.append((client.name, client.request(op, query)))
        except TransportError as exc:
            asked.append((client.name, exc))
    reasons: list[str] = []
    awaited: set[int] = set()
    for name, probe in asked:
        reply = None
        try:
            reply = probe.wait(probe_s) if not isinstance(probe, Exception) else None
        except (RemoteError, TransportError, TimeoutError) as exc:
            probe = exc
        if reply is None:
            reasons.append(f"{name} does not answer ({probe})")
            continue
        waits = reply.meta.get("waits", [])
        for wait in waits:
            awaited.update(int(rank) for rank in wait["missing"])
            missing = ", ".join(map(str, wait["missing"])) or "none (being applied)"
            reasons.append(
                f"round {wait['round']} of {wait.get('kind', 'key')} {wait['key']!r} on {name} waits for "
                f"worker(s) {missing}, which have not pushed it"
            )
        if not waits:
            reasons.append(f"{name} has not replied, though it reports no round this call waits for")
    text = "; ".join(dict.fromkeys(reasons))  # each reason once (a key's slices on one server)
    return WaitDiagnosis(text, tuple(sorted(awaited)))


def check_init_value(key: Any, value: Any) -> None:
    """An init's value is a tensor of a dtype the wire carries."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"init of key {key!r}: the value must be a tensor, not a {type(value).__name__}")
    dtype_name(value.dtype)


def check_tensors(what: str, keys: list, tensors: list, spec: Callable[[Any], tuple[list[int], Any]]) -> None:
    """Every tensor has its key's shape and dtype (`spec(key)`); checked before any state changes,
    so that a refused call leaves nothing behind (no clock moved, nothing sent)."""
    for key, tensor in zip(keys, tensors, strict=True):
        shape, dtype = spec(key)
        if not isinstance(tensor, torch.Tensor):
            kind = type(tensor).__name__
            raise TypeError(f"{what} for key {key!r} must be a {dtype} tensor of shape {shape}, not a {kind}")
        if list(tensor.shape) != shape or tensor.dtype != dtype:
            raise ValueError(
                f"{what} for key {key!r} is {tensor.dtype}{list(tensor.shape)}; it must be {dtype}{shape}"
            )


def check_call(
    keys: list,
    values: list | None,
    outs: list | None,
    spec: Callable[[Any], tuple[list[int], Any]],
    refuse_non_finite: bool,
    rank: int,
) -> None:
    """A push's values and a pull's outs, checked against the keys' shapes and dtypes before any
    value changes or any collective starts."""
    if values is not None:
        check_tensors("push", keys, values, spec)
        if refuse_non_finite:
            check_finite(keys, values, rank)
    if outs is not None:
        check_tensors("out", keys, outs, spec)


def check_finite(keys: list, values: list, rank: int, what: str = "key") -> None:
    """Refuse NaN and infinite values in a push (KVStoreConfig.refuse_non_finite)."""
    for key, value in zip(keys, values, strict=True):
        if value.is_floating_point() or value.is_complex():
            bad = int(value.numel() - torch.isfinite(value).sum())
            if bad:
                raise ValueError(
                    f"worker {rank} pushed {bad} non-finite value(s) (NaN or inf) to {what} {key!r}: refused "
                    "(KVStoreConfig.refuse_non_finite); nothing was sent"
                )


def as_lists(keys: Keys, values: Any = None) -> tuple[list, list]:
    if isinstance(keys, (list, tuple)):
        keys = list(keys)
        values = [None] * len(keys) if values is None else list(values)
    else:
        keys, values = [keys], [values]
    if len(values) != len(keys):
        raise ValueError(f"{len(keys)} keys but {len(values)} values")
    for key in keys:
        check_key(key)
    return keys, [_summed(key, v) for key, v in zip(keys, values, strict=True)]


def _summed(key: Any, value: Any) -> Any:
    """A list of tensors for one key (one per local device) is summed first, as MXNet does."""
    if isinstance(value, (list, tuple)):
        wrong = next((v for v in value if not isinstance(v, torch.Tensor)), None)
        if wrong is not None or not value:
            what = f"a list holding a {type(wrong).__name__}" if value else "an empty list"
            raise TypeError(
                f"the value for key {key!r} must be a tensor (or a list of tensors, one per local "
                f"device), not {what}"
            )
        total = value[0].detach().to("cpu", copy=True)
        for v in value[1:]:
            total += v.detach().to("cpu")
        return total
    return value
