"""The served model: built by the user's factory, weighted from a checkpoint, swapped on reload.

`load_factory("pkg.module:make_model")` (or "path/to/file.py:make_model") imports the factory; a
factory that takes a `kv` parameter is given the serving process's read-only tables (remote.py).
`ModelHolder` keeps the current `Loaded` model. Given an output folder it checks every
`reload_interval_s` for a newer complete checkpoint, builds a fresh model from it beside the current
one and swaps the reference: a batch that started keeps the model it took, so no request fails or
sees half-loaded weights. A checkpoint pruned or unreadable mid-load is skipped until the next check.

Convolutions run channels-last (NHWC) by default: `ModelHolder(channels_last=True)` stores the 4-D
weights of a model with 2-D convolutions that way, so oneDNN's NHWC kernels run them and the output
of each convolution and pooling stays NHWC; answers are the same up to float rounding. Measured
on the benchmark's small CNN through the server's batch function (one thread, 2 shared cores, two
runs each): 0.63-0.78 ms per image at batch 1 against 1.14-1.52 in NCHW, and 0.22-0.23 at batch 32
against 0.41-0.42 (NCHW max-pooling is not vectorised across channels).
A model that fails channels-last (a `.view` of a convolution's output, say) before any batch ran is
put back to contiguous and run again, for good (`run`).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paratrain import checkpoint
from paratrain.checkpoint.store import META
from paratrain.errors import CheckpointError
from paratrain.serve.api import ServeError
from paratrain.serve.weights import SAFETENSORS_SUFFIX, checkpoint_state, read_state

logger = logging.getLogger(__name__)

Factory = Callable[..., nn.Module]


def load_factory(spec: str) -> Factory:
    """The callable named by `module:attr` or `path/file.py:attr`."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--model {spec!r} must be MODULE:FACTORY or FILE.py:FACTORY")
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise ValueError(f"--model {spec!r}: {path} is not a file")
        name = f"_paratrain_serve_{path.stem}"
        module_spec = importlib.util.spec_from_file_location(name, path)
        if module_spec is None or module_spec.loader is None:
            raise ValueError(f"--model {spec!r}: {path} cannot be imported as a module")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ValueError(f"--model {spec!r}: cannot import {module_name!r}: {exc}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"--model {spec!r}: {module_name} has no callable {attr!r}")
    return factory


def has_convolutions(model: nn.Module) -> bool:
    return any(isinstance(module, nn.Conv2d) for module in model.modules())


def build(factory: Factory, kv: Any = None) -> nn.Module:
    """A fresh model from `factory` (given `kv` if it takes one), in eval mode."""
    takes_kv = "kv" in inspect.signature(factory).parameters
    model = factory(kv=kv) if takes_kv else factory()
    if not isinstance(model, nn.Module):
        raise ServeError(f"the model factory returned a {type(model).__name__}, not an nn.Module")
    return model.eval()


@dataclass(frozen=True)
class Loaded:
    model: nn.Module
    step: int | None
    """The training step of its checkpoint (None: unknown, e.g. a safetensors file without it)."""
    source: str


class ModelHolder:
    """The current model for `source` (a .safetensors file, a checkpoint folder or an output folder);
    see the module docstring. `on_reload(loaded)` is told of every swap."""

    def __init__(
        self,
        factory: Factory,
        source: str | Path,
        *,
        reload_interval_s: float = 2.0,
        kv: Any = None,
        on_reload: Callable[[Loaded], None] | None = None,
        channels_last: bool = True,
    ) -> None:
        self.factory, self.source, self.kv = factory, Path(source), kv
        self.on_reload = on_reload
        self.channels_last = channels_last
        """Whether models with convolutions are run channels-last (see the module docstring)."""
        self._proven = False
        """Whether a batch has run in the current layout (then a failure is the request's fault)."""
        self.watching = self._is_output_folder() and reload_interval_s > 0
        self.current = self._load_first()
        self._stop = threading.Event()
        self._thread = None
        if self.watching:
            self._thread = threading.Thread(
                target=self._watch, args=(reload_interval_s,), name="model-reload", daemon=True
            )
            self._thread.start()

    def _is_output_folder(self) -> bool:
        return self.source.is_dir() and not (self.source / META).is_file()

    def _load_first(self) -> Loaded:
        if self.source.suffix == SAFETENSORS_SUFFIX or not self._is_output_folder():
            state, step = read_state(self.source)
            return self._build(state, step, str(self.source))
        attempts = 3  # a commit with `keep` may prune the checkpoint just found
        while True:
            found = checkpoint.latest(self.source)
            if found is None:
                raise ServeError(f"no complete checkpoint in {self.source} to serve")
            try:
                return self._build(checkpoint_state(found), found.step, str(found.path))
            except CheckpointError:
                attempts -= 1
                if attempts == 0:
                    raise

    def _build(self, state: dict[str, torch.Tensor], step: int | None, source: str) -> Loaded:
        model = build(self.factory, self.kv)
        try:
            model.load_state_dict(state)
        except RuntimeError as exc:
            raise ServeError(f"the weights in {source} do not fit the factory's model: {exc}") from None
        if self.channels_last and has_convolutions(model):
            # Module.to takes memory_format; torch's type stubs leave it out.
            model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        logger.info("serving the model of %s (step %s)", source, step)
        return Loaded(model, step, source)

    def run(self, call: Callable[[nn.Module], torch.Tensor]) -> tuple[torch.Tensor, int | None]:
        """call(the current model) and that model's step; the batch thread's only entry. A model
        that fails channels-last before any batch ran is made contiguous and called again: if that
        works, every model is contiguous from then on."""
        loaded = self.current  # one reference for the whole batch: a reload swaps it, never mutates
        if self._proven or not (self.channels_last and has_convolutions(loaded.model)):
            return call(loaded.model), loaded.step
        try:
            output = call(loaded.model)
        except Exception as exc:
            loaded.model.to(memory_format=torch.contiguous_format)  # type: ignore[call-overload]
            try:
                output = call(loaded.model)
            except Exception:
                loaded.model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
                raise exc from None
            logger.warning(
                "the model fails channels-last (%s: %s); serving it contiguous", type(exc).__name__, exc
            )
            self.channels_last = False
        self._proven = True
        return output, loaded.step

    def refresh(self) -> bool:
        """Load the output folder's newest checkpoint if it is newer than the current one."""
        found = checkpoint.latest(self.source)
        if found is None or (self.current.step is not None and found.step <= self.current.step):
            return False
        try:
            loaded = self._build(checkpoint_state(found), found.step, str(found.path))
        except (CheckpointError, OSError) as exc:  # pruned or replaced while read: try again later
            logger.info("skipping checkpoint %s for now: %s", found.path, exc)
            return False
        self.current = loaded
        if self.on_reload is not None:
            self.on_reload(loaded)
        return True

    def _watch(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.refresh()
            except Exception:
                logger.exception(
                    "reloading from %s failed; still serving step %s", self.source, self.current.step
                )

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10.0)
