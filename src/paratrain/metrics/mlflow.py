"""Metrics as an MLflow run: each `log` call is one `log_batch` of metrics at its step, the run's
settings (`log_params`) are its params.

Written through `MlflowClient` (no global active run, so a script's own `mlflow.start_run` is left
alone) to the tracking URI given, else MLFLOW_TRACKING_URI, else MLflow's default. The run starts
on the first call, not when the logger is made: a script that makes it on every worker gets one run,
from the worker the Trainer logs on (rank 0). `mlflow-skinny` is enough (`paratrain[mlflow]`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from paratrain.errors import MissingExtraError
from paratrain.metrics.api import MetricsLogger, as_floats, check_step

logger = logging.getLogger(__name__)

MAX_PARAM_CHARS = 6000
"""MLflow's limit on a param's value; longer ones are cut."""


class MLflowMetrics(MetricsLogger):
    """Logs to the MLflow run `run_id` (resumed), or to a new run named `run_name` in `experiment`
    (made if missing), with `tags`."""

    def __init__(
        self,
        tracking_uri: str | None = None,
        *,
        experiment: str = "paratrain",
        run_name: str | None = None,
        run_id: str | None = None,
        tags: Mapping[str, str] | None = None,
    ) -> None:
        if not experiment:
            raise ValueError(f"MLflowMetrics experiment={experiment!r} must be a non-empty name")
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise MissingExtraError("mlflow", "mlflow", "MLflowMetrics (loggers=['mlflow'])") from exc
        self._client = MlflowClient(tracking_uri=tracking_uri)
        self.experiment, self.run_name, self.tags = experiment, run_name, dict(tags or {})
        self.run_id = run_id
        self._owned = run_id is None  # a run given by id is its owner's to end
        self._closed = False

    def _run(self) -> str:
        if self._closed:
            raise ValueError(f"MLflowMetrics for run {self.run_id} is closed")
        if self.run_id is None:
            found = self._client.get_experiment_by_name(self.experiment)
            experiment_id = found.experiment_id if found else self._client.create_experiment(self.experiment)
            run = self._client.create_run(experiment_id, run_name=self.run_name, tags=self.tags)
            self.run_id = run.info.run_id
            logger.info("metrics go to MLflow run %s of experiment %r", self.run_id, self.experiment)
        return self.run_id

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        check_step(step)
        values = as_floats(scalars)
        now_ms = int(time.time() * 1000)
        metrics = [Metric(name, value, now_ms, step) for name, value in values.items()]
        self._client.log_batch(self._run(), metrics=metrics)

    def log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        given = [Param(str(name), str(value)[:MAX_PARAM_CHARS]) for name, value in params.items()]
        self._client.log_batch(self._run(), params=given)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self.run_id is not None and self._owned:
                self._client.set_terminated(self.run_id)
