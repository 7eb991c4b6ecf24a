"""The registry of launch engines: `paratrain launch --backend NAME` and a spec's `backend: NAME`.

An engine is a class implementing engines/api.py's `Engine`, registered here under its name: the
built-in ones below by where they live (imported when first asked for, so that `paratrain launch`
imports only the engine it runs), others with `register`. This is the one place that compares an
engine's name; everything else asks the engine.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from paratrain.launch.engines.api import Engine

_ENGINES: dict[str, str | type[Engine]] = {
    "local": "paratrain.launch.engines.local:LocalEngine",
    "ray": "paratrain.launch.engines.ray:RayEngine",
    "slurm": "paratrain.launch.engines.slurm:SlurmEngine",
    "k8s": "paratrain.launch.engines.k8s:K8sEngine",
}
DEFAULT = "local"
_instances: dict[str, Engine] = {}


def register(name: str, engine: str | type[Engine]) -> None:
    """Adds (or replaces) the engine `name`: its class, or "module:Class" to import when first used."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"an engine's name must be an identifier, got {name!r}")
    _ENGINES[name] = engine
    _instances.pop(name, None)


def unregister(name: str) -> None:
    _ENGINES.pop(name, None)
    _instances.pop(name, None)


def names(where: Callable[[Engine], bool] | None = None) -> tuple[str, ...]:
    """The registered engines' names, in registration order (those `where` accepts)."""
    return tuple(name for name in _ENGINES if where is None or where(get(name)))


def get(name: str) -> Engine:
    """The engine registered as `name`; ValueError naming the known ones."""
    if name not in _ENGINES:
        raise ValueError(f"no launch engine {name!r}; known: {', '.join(_ENGINES)}")
    if name not in _instances:
        found = _ENGINES[name]
        if isinstance(found, str):
            module, _, attr = found.partition(":")
            found = getattr(importlib.import_module(module), attr)
        engine = found()
        engine.name = name
        _instances[name] = engine
    return _instances[name]


class EngineChoice(click.Choice):
    """click's choice of `--backend`, read from the registry when the command line is parsed (an
    engine registered after this module was imported is a choice too)."""

    def __init__(self) -> None:
        super().__init__(())

    @property
    def choices(self) -> tuple[str, ...]:
        return names()

    @choices.setter
    def choices(self, value: Any) -> None:
        """click.Choice sets its choices once; ours are the registry's."""
