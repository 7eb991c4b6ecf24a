"""Mixed precision for the Trainer: autocast around the forward, and fp16's dynamic loss scaling.

Autocast: hooks on a module enter torch.autocast before its forward and leave it after (also when
the forward raises), so an unchanged loop (`loss_fn(model(x), y)`) runs the forward in bf16 or fp16
while the weights, their gradients and the optimizer's state stay fp32. Floating outputs come back
as fp32 (as Hugging Face Accelerate's convert_outputs_to_fp32 does), so the loss a user computes
after the forward is computed in fp32, as autocast itself does for the losses it knows.

Loss scaling (fp16): `LossScaler` is torch.amp.GradScaler's arithmetic with GradScaler's own ops
(`torch._amp_foreach_non_finite_check_and_unscale_`, `torch._amp_update_scale_`), taken apart so
that the Trainer unscales the *aggregated* gradient (train/gradients.py): the loss is scaled before
backward, the engine aggregates the scaled gradients (an inf anywhere stays an inf in the sum), and
every worker then finds the same overflow in the same aggregated gradient and skips the same step,
with no message more.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, MutableMapping
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

DTYPES = {"32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
"""Strategy.precision -> the dtype the forward runs in under autocast (None: no autocast)."""


def to_fp32(output: Any) -> Any:
    """`output` with its bf16/fp16 tensors as fp32: tensors, tuples, lists and mappings of them
    (a mapping that is no plain dict, such as a Hugging Face ModelOutput, is updated in place)."""
    if isinstance(output, torch.Tensor):
        return output.float() if output.dtype in (torch.float16, torch.bfloat16) else output
    if isinstance(output, tuple) and hasattr(output, "_fields"):  # a namedtuple
        return type(output)(*(to_fp32(value) for value in output))
    if isinstance(output, (tuple, list)):
        return type(output)(to_fp32(value) for value in output)
    if type(output) is dict:
        return {key: to_fp32(value) for key, value in output.items()}
    if isinstance(output, MutableMapping):
        for key in list(output):
            output[key] = to_fp32(output[key])
    return output


class Autocast:
    """Forward hooks that run a module's forward under torch.autocast (see the module docstring).
    `fp32_outputs`: give the forward's floating outputs back as fp32."""

    def __init__(self, device_type: str, dtype: torch.dtype, fp32_outputs: bool = True) -> None:
        self.device_type, self.dtype, self.fp32_outputs = device_type, dtype, fp32_outputs
        self._open: list[torch.autocast] = []

    def attach(self, module: nn.Module) -> None:
        # First among the pre-hooks, and an exit that runs even when the forward raises: every
        # autocast entered is left, in order, whatever the other hooks do.
        module.register_forward_pre_hook(self._enter, prepend=True)
        module.register_forward_hook(self._exit, always_call=True)

    def _enter(self, module: nn.Module, args: tuple) -> None:
        context = torch.autocast(self.device_type, dtype=self.dtype)
        context.__enter__()
        self._open.append(context)

    def _exit(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if self._open:
            self._open.pop().__exit__(None, None, None)
        return to_fp32(output) if self.fp32_outputs else None

    def __deepcopy__(self, memo: dict) -> Autocast:
        return self  # a deep copy of the model (an EMA copy, say) shares the hooks' state


class LossScaler:
    """torch.amp.GradScaler's dynamic loss scale, in parts: `scale_loss` before backward,
    `unscale_` on the aggregated gradient (returns 1.0 where it holds inf or NaN, else 0.0), and
    `update` with what every worker agreed on. The defaults are GradScaler's."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self._scale = torch.full((1,), init_scale, dtype=torch.float32)
        self._growth_tracker = torch.zeros(1, dtype=torch.int32)

    @property
    def scale(self) -> float:
        return float(self._scale.item())

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self._scale.to(loss.device, non_blocking=True).reshape(())  # keeps a 0-d loss 0-d

    def scaled(self, loss_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """`loss_fn` whose loss is scaled (for a pipeline, which runs backward on it itself)."""
        return lambda *args: self.scale_loss(loss_fn(*args))

    def inverse(self) -> torch.Tensor:
        """1 / scale, a 1-element fp32 tensor, as GradScaler computes it."""
        return self._scale.double().reciprocal().float()

    def unscale_(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """Divide `grads` by the scale in place; returns found_inf, a 1-element CPU tensor."""
        inv_scale = self.inverse()
        found = torch.zeros(1)
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for grad in grads:
            groups.setdefault((grad.device, grad.dtype), []).append(grad)
        for (device, _), group in groups.items():
            found_here = torch.zeros(1, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(group, found_here, inv_scale.to(device))
            found += found_here.cpu()
        return found.clamp_(max=1.0)

    def update(self, found_inf: torch.Tensor) -> None:
        """Halve the scale after an overflow; double it after growth_interval clean steps."""
        torch._amp_update_scale_(
            self._scale,
            self._growth_tracker,
            found_inf.to(torch.float32),
            self.growth_factor,
            self.backoff_factor,
            self.growth_interval,
        )

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "growth_tracker": int(self._growth_tracker.item())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._scale.fill_(float(state["scale"]))
        self._growth_tracker.fill_(int(state["growth_tracker"]))
