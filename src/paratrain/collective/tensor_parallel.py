"""Tensor parallelism: torch's DTensor (`torch.distributed.tensor.parallel`), not a split of our own.

A plan names modules and how each is split over the workers of a tensor-parallel group, in the
words of Megatron and of Hugging Face's `tp_plan`:

    colwise      nn.Linear: its output features split (each worker computes a slice of the output,
                 which stays split for the next layer); nn.Embedding: its embedding dimension split
    colwise_rep  the same, with the output gathered whole (a model's last Linear before the loss)
    rowwise      nn.Linear: its input features split, taking a colwise layer's split output; the
                 partial outputs are summed (all-reduce); nn.Embedding: its rows (the vocabulary) split

so that an MLP's pair (colwise, activation, rowwise) costs one all-reduce forward and one backward.
Patterns are dotted module names in which `*` stands for one name ("blocks.*.mlp.0"), as
`parallelize_module` reads them; here they are expanded first, so that a pattern that matches
nothing, a module that cannot be split so, or a dimension that does not divide by the group's size
is refused before any tensor moves. The default plan (`default_plan`) is the one split that holds
for any model: the Linear pairs of an nn.Sequential MLP. Attention needs a plan the model was
written for (its heads split: the forward must reshape with -1 heads), so it is never guessed.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

logger = logging.getLogger(__name__)

STYLES = ("colwise", "colwise_rep", "rowwise")

_ELEMENTWISE = (
    nn.ReLU,
    nn.ReLU6,
    nn.GELU,
    nn.SiLU,
    nn.Tanh,
    nn.Sigmoid,
    nn.LeakyReLU,
    nn.ELU,
    nn.Mish,
    nn.Softplus,
    nn.Hardtanh,
    nn.Dropout,
    nn.Identity,
)
"""Modules that act on each element alone: between a colwise and a rowwise Linear they see only
their worker's slice of the hidden features and compute the same values as on the whole."""


def plan_text(plan: str | Mapping[str, str]) -> str:
    """A plan ("pattern:style ..." or a dict) in its canonical text form, its words checked."""
    if isinstance(plan, Mapping):
        items = [(str(pattern), str(style)) for pattern, style in plan.items()]
    elif isinstance(plan, str):
        items = []
        for item in plan.split():
            pattern, colon, style = item.rpartition(":")
            if not colon or not pattern:
                raise ValueError(f"Strategy.tp_plan item {item!r} is not pattern:style (e.g. mlp.0:colwise)")
            items.append((pattern, style))
    else:
        raise ValueError(
            f"Strategy.tp_plan={plan!r} must be 'pattern:style ...', a dict of them, or a function"
        )
    if not items:
        raise ValueError(f"Strategy.tp_plan={plan!r} names no module; leave it None for the default")
    for pattern, style in items:
        if style not in STYLES:
            raise ValueError(
                f"Strategy.tp_plan gives {pattern!r} the style {style!r}, which is not one of "
                f"{', '.join(STYLES)}"
            )
        if any(c.isspace() or c == ":" for c in pattern):
            raise ValueError(f"Strategy.tp_plan pattern {pattern!r} holds a space or a colon")
    return " ".join(f"{pattern}:{style}" for pattern, style in items)


def parse_plan(text: str) -> dict[str, str]:
    """The canonical text form (plan_text) as {pattern: style}."""
    return dict(item.rsplit(":", 1) for item in text.split())


def default_plan(model: nn.Module) -> dict[str, str]:
    """colwise then rowwise for every Linear pair of an nn.Sequential whose Linears are joined by
    elementwise modules only (the first's outputs the second's inputs): an MLP, split so that its
    hidden features never leave their worker."""
    plan: dict[str, str] = {}
    for prefix, seq in model.named_modules():
        if not isinstance(seq, nn.Sequential):
            continue
        first: tuple[str, nn.Linear] | None = None
        for name, child in seq.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if isinstance(child, nn.Linear):
                if first is not None and first[1].out_features == child.in_features:
                    plan[first[0]], plan[path] = "colwise", "rowwise"
                    first = None
                else:
                    first = (path, child)
            elif not isinstance(child, _ELEMENTWISE):
                first = None
    return plan


def resolve_plan(model: nn.Module, plan: Mapping[str, str], size: int) -> dict[str, str]:
    """{module name: style} for every module the patterns of `plan` match, each checked: a Linear
    or an Embedding whose split dimension divides by `size`."""
    modules = dict(model.named_modules())
    resolved: dict[str, str] = {}
    for pattern, style in plan.items():
        atoms = pattern.split(".")
        names = [
            name
            for name in modules
            if name
            and len(name.split(".")) == len(atoms)
            and all(fnmatch.fnmatchcase(a, p) for a, p in zip(name.split("."), atoms, strict=True))
        ]
        if not names:
            raise ValueError(
                f"Strategy.tp_plan pattern {pattern!r} matches no module of the model "
                f"({type(model).__name__})"
            )
        for name in names:
            _check_split(name, modules[name], style, size)
            resolved[name] = style
    return resolved


def _check_split(name: str, module: nn.Module, style: str, size: int) -> None:
    if isinstance(module, nn.Linear):
        dims = {"rowwise": ("in_features", module.in_features)}
        field, value = dims.get(style, ("out_features", module.out_features))
    elif isinstance(module, nn.Embedding):
        dims = {"rowwise": ("num_embeddings", module.num_embeddings)}
        field, value = dims.get(style, ("embedding_dim", module.embedding_dim))
    else:
        raise ValueError(
            f"Strategy.tp_plan splits {name!r} {style}, but it is a {type(module).__name__}: "
            "colwise and rowwise split nn.Linear and nn.Embedding only"
        )
    if value % size:
        raise ValueError(
            f"Strategy.tensor_parallel={size} does not divide {name!r}'s {field} ({value}), "
            f"which a {style} split divides among the workers"
        )


def _style(module: nn.Module, style: str) -> Any:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if style == "colwise":
        return ColwiseParallel()
    if style == "colwise_rep":
        return ColwiseParallel(output_layouts=Replicate())
    if isinstance(module, nn.Embedding):  # token ids arrive whole, not split like a hidden layer's
        return RowwiseParallel(input_layouts=Replicate())
    return RowwiseParallel()


def device_mesh(dims: Mapping[str, int], device_type: str) -> DeviceMesh:
    """The job's workers laid on named dimensions, the last innermost (consecutive ranks)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, tuple(dims.values()), mesh_dim_names=tuple(dims))


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    plan: str | Mapping[str, str] | Callable[[nn.Module, DeviceMesh], Any] | None,
) -> nn.Module:
    """`model` split in place over the 1-d `mesh` by `plan` (its text form or a dict, a function
    that splits the model itself, or None for `default_plan`). Parameters of modules the plan
    leaves alone stay whole on every worker of the mesh, computed alike from the same inputs."""
    if callable(plan):
        plan(model, mesh)
        return model
    size = mesh.size()
    chosen = parse_plan(plan_text(plan)) if plan is not None else default_plan(model)
    if not chosen:
        raise ValueError(
            f"Strategy.tensor_parallel={size} with no tp_plan: paratrain's default splits the "
            f"Linear pairs of nn.Sequential MLPs, and {type(model).__name__} has none; give "
            "Strategy.tp_plan (e.g. 'blocks.*.mlp.0:colwise blocks.*.mlp.2:rowwise')"
        )
    resolved = resolve_plan(model, chosen, size)
    from torch.distributed.tensor.parallel import parallelize_module

    modules = dict(model.named_modules())
    styles = {name: _style(modules[name], style) for name, style in resolved.items()}
    parallelize_module(model, mesh, styles)
    logger.debug("tensor parallel over %d workers: %s", size, resolved)
    return model


def align_random_state(mesh: DeviceMesh) -> None:
    """Every worker of the 1-d `mesh` takes its first worker's random state (torch's CPU
    generator, and the current GPU's where there is one). Where the model is whole, a group's
    workers must compute alike: a dropout there drawing a different mask on each would make
    their copies of the same parameters drift apart."""
    import torch
    import torch.distributed as dist

    group = mesh.get_group()
    carrier = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
    states = [(torch.get_rng_state, torch.set_rng_state)]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states.append((torch.cuda.get_rng_state, torch.cuda.set_rng_state))
    for get, put in states:
        state = get()
        sent = state.to(carrier) if carrier is not None else state
        dist.broadcast(sent, group=group, group_src=0)
        put(sent.cpu())
