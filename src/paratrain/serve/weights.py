"""A trained model's weights, from a checkpoint or a safetensors file, and their export.

    state = paratrain.serve.load("ckpt")                  # newest complete checkpoint of a folder
    model = paratrain.serve.load("ckpt/step-00000100", model=MyNet())   # ... loaded into a model
    paratrain.serve.export("ckpt", "model.safetensors")  # weights only: loads with no code execution

A Trainer checkpoint keeps the model's state dict in `model.pt` (strategies with one model) or in each
`worker-R.pt` (local, local SGD, pipelines): worker 0's is served; fsdp's is sharded (DCP, in
`sharded/`) and is gathered whole here. Checkpoint files are read with
torch's `weights_only` loader and safetensors files hold raw tensors, so neither runs code.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paratrain import checkpoint
from paratrain.checkpoint import sharded
from paratrain.errors import CheckpointError
from paratrain.system import atomic_write

SAFETENSORS_SUFFIX = ".safetensors"


def checkpoint_state(found: checkpoint.Checkpoint) -> dict[str, torch.Tensor]:
    """The model state dict a Trainer saved in checkpoint `found`."""
    if sharded.is_sharded(found.file(sharded.FOLDER)):  # saved by fsdp workers: gathered here, whole
        return sharded.load_tensors(found.file(sharded.FOLDER), "model")
    for name in ("model.pt", "worker-0.pt"):
        if name in found.meta.get("files", []) or found.file(name).is_file():
            state = checkpoint.load_file(found.file(name))
            if isinstance(state.get("model"), dict):
                return state["model"]
    raise CheckpointError(
        f"checkpoint {found.path} holds no model state (no model.pt or worker-0.pt 'model')"
    )


def load(path: str | os.PathLike[str], model: nn.Module | None = None, *, strict: bool = True) -> Any:
    """The weights at `path` (a .safetensors file, a checkpoint folder, or an output folder: its
    newest complete checkpoint) as a state dict, or loaded into `model` (returned, in eval mode)."""
    state = read_state(path)[0]
    if model is None:
        return state
    model.load_state_dict(state, strict=strict)
    return model.eval()


def read_state(path: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], int | None]:
    """(state dict, training step or None) of `path` (see `load`)."""
    path = Path(path)
    if path.suffix == SAFETENSORS_SUFFIX:
        return _read_safetensors(path)
    found = checkpoint.load(path)  # a checkpoint folder, or the newest of a root; raises if none
    return checkpoint_state(found), found.step


def _read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], int | None]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            state = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (not a dict)
            step = (f.metadata() or {}).get("step")
    except FileNotFoundError:
        raise CheckpointError(f"weights file {path} does not exist") from None
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"weights file {path} is not a valid safetensors file: {exc}") from None
    return state, int(step) if step is not None and step.isdigit() else None


def export(source: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """Write the model weights of checkpoint `source` (a folder, or the newest of an output folder)
    to `out` in safetensors format, with the step as metadata; returns `out`."""
    from safetensors.torch import save

    state, step = read_state(source)
    tensors = {}
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"{source}: model state {name!r} is a {type(value).__name__}, not a tensor")
        tensors[name] = value.detach().to("cpu").contiguous().clone()  # no shared storage in safetensors
    out = Path(out)
    if out.suffix != SAFETENSORS_SUFFIX:
        raise ValueError(f"export out={str(out)!r} must end in {SAFETENSORS_SUFFIX}")
    out.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"format": "pt", "step": str(step if step is not None else "")}
    atomic_write(out, save(tensors, metadata=metadata))
    return out
