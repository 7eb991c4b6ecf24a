"""Metrics as a Weights & Biases run: each `log` call is one `run.log(scalars, step=step)`, the run's
settings (`log_params`) its config.

The run starts on the first call, not when the logger is made, so a script that makes it on every
worker gets one run, from the worker the Trainer logs on (rank 0). W&B's own settings apply
(WANDB_MODE=offline writes the run under `dir` for a later `wandb sync`; WANDB_PROJECT,
WANDB_ENTITY); its console capture is off by default, since the launcher already collects every
process's output.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from paratrain.errors import MissingExtraError
from paratrain.metrics.api import MetricsLogger, as_floats, check_step

logger = logging.getLogger(__name__)


class WandbMetrics(MetricsLogger):
    """Logs to a W&B run of `project` (W&B's default without one: WANDB_PROJECT) named `name`,
    written under `dir` (W&B's default without one); `init` adds keyword arguments to `wandb.init`."""

    def __init__(
        self,
        project: str | None = None,
        *,
        name: str | None = None,
        dir: str | Path | None = None,
        mode: str | None = None,
        **init: Any,
    ) -> None:
        if mode not in (None, "online", "offline", "disabled"):
            raise ValueError(f"WandbMetrics mode={mode!r} must be 'online', 'offline' or 'disabled'")
        try:
            import wandb
        except ImportError as exc:
            raise MissingExtraError("wandb", "wandb", "WandbMetrics (loggers=['wandb'])") from exc
        self._wandb = wandb
        self._init = {"project": project, "name": name, "mode": mode, **init}
        if dir is not None:
            Path(dir).mkdir(parents=True, exist_ok=True)
            self._init["dir"] = str(dir)
        self._init.setdefault("settings", wandb.Settings(console="off"))
        self._init.setdefault("reinit", "create_new")
        self._params: dict[str, Any] = {}
        self.run: Any = None
        self._closed = False

    def _started(self) -> Any:
        if self._closed:
            raise ValueError("WandbMetrics is closed")
        if self.run is None:
            init = {k: v for k, v in self._init.items() if v is not None}
            self.run = self._wandb.init(config=self._params or None, **init)
            logger.info("metrics go to W&B run %s (%s)", self.run.id, self.run.dir)
        return self.run

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        check_step(step)
        self._started().log(as_floats(scalars), step=step)

    def log_params(self, params: Mapping[str, Any]) -> None:
        if self.run is None:
            self._params.update(params)  # given to wandb.init as the run's config
        else:
            self.run.config.update(dict(params), allow_val_change=True)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self.run is not None:
                self.run.finish()
