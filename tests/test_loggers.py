"""The Trainer's loggers with the real trackers (MLflow on a local file store, W&B offline), the JSON
lines fallback when an extra is missing, and the Grafana dashboard against a real job's /metrics.

One 2-worker, 1-server job (tests/jobs/loggers_job.py, run once per module) logs to JSON lines,
MLflow and W&B at once and serves the dashboard: its loss and steps must be the same in all three,
and every metric the Grafana dashboard queries must have samples in its /metrics.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any
from unittest import mock

import httpx
import pytest

from paratrain.metrics import (
    JsonLinesMetrics,
    MLflowMetrics,
    MultiMetrics,
    TensorBoardMetrics,
    WandbMetrics,
    open_loggers,
    open_metrics,
)
from paratrain.metrics import api as metrics_api
from paratrain.metrics.dashboard import DashboardConfig
from paratrain.testing import run_job

JOB = Path(__file__).parent / "jobs" / "loggers_job.py"
GRAFANA = Path(__file__).parents[1] / "src" / "paratrain" / "metrics" / "grafana.json"
WANDB = Path(sys.executable).with_name("wandb")
URL = re.compile(r"dashboard at (http://\S+)")
METRIC = re.compile(r"\bparatrain_[a-z_]+\b")

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def trackers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """MLflow's file store and W&B's offline mode, both under tmp_path."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 wants a database otherwise
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    return tmp_path


def mlflow_history(uri: str, experiment: str = "paratrain") -> tuple[dict, dict[int, float]]:
    """(params, {step: loss}) of the experiment's one run."""
    from mlflow.tracking import MlflowClient

    with mock.patch.dict(os.environ, {"MLFLOW_ALLOW_FILE_STORE": "true"}):
        client = MlflowClient(tracking_uri=uri)
        runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
        assert len(runs) == 1, [r.info.run_id for r in runs]
        history = client.get_metric_history(runs[0].info.run_id, "loss")
    return runs[0].data.params, {m.step: m.value for m in history}


def wandb_history(folder: Path) -> tuple[dict, dict[int, float]]:
    """(config, {step: loss}) of the one W&B run written under folder, read by W&B's own reader."""
    runs = list(folder.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(runs) == 1, runs
    text = subprocess.run(
        [str(WANDB), "leet", "inspect", "--json", str(runs[0])],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    records = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    config = next(r["run"]["config"]["update"] for r in records if r["type"] == "run")
    history = {
        r["history"]["step"]["num"]: r["history"]["item"]["loss"]
        for r in records
        if r["type"] == "history" and "loss" in r["history"]["item"]
    }
    return config, history


# -- one process ------------------------------------------------------------------------------------
@pytest.mark.jobs  # mlflow runs `uname -p` (platform) while it starts a run
def test_mlflow_run_has_params_and_each_step(trackers: Path) -> None:
    metrics = MLflowMetrics(run_name="unit")
    metrics.log_params({"strategy": "ps", "num_workers": 2})
    for step in (1, 2, 3):
        metrics.log(step, {"loss": 1.0 / step})
    metrics.close()
    metrics.close()
    params, history = mlflow_history((trackers / "mlruns").as_uri())
    assert params == {"strategy": "ps", "num_workers": "2"}
    assert history == {1: 1.0, 2: 0.5, 3: pytest.approx(1 / 3)}


@pytest.mark.jobs  # mlflow runs `uname -p` (platform) while it starts a run
def test_mlflow_made_but_unused_makes_no_run(trackers: Path) -> None:
    """Workers other than rank 0 make the logger too; only a logged call starts a run."""
    MLflowMetrics().close()
    assert not (trackers / "mlruns").exists() or not list((trackers / "mlruns").glob("*/*/meta.yaml"))


def test_wandb_offline_run_has_config_and_each_step(trackers: Path) -> None:
    import wandb

    metrics = WandbMetrics(dir=trackers)
    metrics.log_params({"strategy": "ps"})
    for step in (1, 2, 3):
        metrics.log(step, {"loss": 1.0 / step})
    metrics.close()
    wandb.teardown()  # W&B's service process ends with it
    config, history = wandb_history(trackers)
    assert config["strategy"] == "ps"
    assert history == {1: 1.0, 2: 0.5, 3: pytest.approx(1 / 3)}


@pytest.mark.parametrize("value", ["mlflow", [3], ["comet"]])
def test_open_loggers_refuses_what_is_not_a_list_of_loggers(tmp_path: Path, value: Any) -> None:
    with pytest.raises((TypeError, ValueError), match="loggers"):
        open_loggers(value, tmp_path, rank=0)


def test_file_loggers_need_a_metrics_dir() -> None:
    with pytest.raises(ValueError, match="'jsonl' writes files and needs metrics_dir"):
        open_loggers(["jsonl"], None, rank=0)


def _without(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    """Importing `modules` fails from here on, as on an install without their extra."""
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setattr(metrics_api, "_warned", set())


def test_missing_extras_fall_back_to_json_lines_and_warn_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _without(monkeypatch, "mlflow", "mlflow.tracking", "wandb")
    caplog.set_level(logging.WARNING, logger="paratrain.metrics.api")
    for _ in range(2):
        metrics = open_loggers(["mlflow", "wandb"], tmp_path, rank=1)
        assert isinstance(metrics, JsonLinesMetrics), metrics
        metrics.log(1, {"loss": 0.5})
        metrics.close()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said  # one per missing library, not one per Trainer
    assert "paratrain[mlflow]" in said[0] and "paratrain[wandb]" in said[1]
    lines = (tmp_path / "metrics-rank1.jsonl").read_text().splitlines()
    assert [json.loads(line)["loss"] for line in lines] == [0.5, 0.5]


def test_default_metrics_without_tensorboard_write_json_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A submitted job's default metrics_dir on a base install: JSON lines, no failure."""
    _without(monkeypatch, "torch.utils.tensorboard")
    metrics = open_metrics(tmp_path, rank=0)
    assert isinstance(metrics, JsonLinesMetrics)
    metrics = open_metrics(tmp_path, rank=0, jsonl=False)
    assert isinstance(metrics, JsonLinesMetrics)
    metrics.close()
    monkeypatch.undo()
    both = open_metrics(tmp_path, rank=0)
    assert isinstance(both, MultiMetrics) and isinstance(both.loggers[1], TensorBoardMetrics)
    both.close()


# -- a real job -------------------------------------------------------------------------------------
class LoggedJob:
    """Runs the job in a thread; scrapes /metrics once the workers trained, then lets them end."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.urls: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.outcome: Any = None
        self.error: BaseException | None = None
        self.samples: dict[str, int] = {}

    def _run(self) -> None:
        env = {
            "MLFLOW_TRACKING_URI": (self.folder / "mlruns").as_uri(),
            "MLFLOW_ALLOW_FILE_STORE": "true",
            "WANDB_MODE": "offline",
            "WANDB_SILENT": "true",
            "OMP_NUM_THREADS": "1",
        }
        try:
            self.outcome = run_job(
                JOB,
                workers=2,
                servers=1,
                args=[str(self.folder)],
                env=env,
                timeout_s=150,
                dashboard=DashboardConfig(),
                watch=self._watch,
            )
        except BaseException as exc:
            self.error = exc

    def _watch(self, line: str) -> None:
        if found := URL.search(line):
            self.urls.put(found[1])
        if line.endswith("] trained"):
            self.urls.put("trained")

    def run(self, wanted: set[str]) -> None:
        job = threading.Thread(target=self._run, name="job", daemon=True)
        job.start()
        try:
            base, token = self.urls.get(timeout=90).split("/?token=")
            for _ in range(2):  # both workers trained: the last heartbeats carry every figure
                assert self.urls.get(timeout=120) == "trained"
            self.samples = _scrape_until(f"{base}/metrics", token, wanted)
        finally:
            (self.folder / "end").touch()
            job.join(120)
        if self.error is not None:
            raise self.error


def _scrape_until(url: str, token: str, wanted: set[str], tries: int = 40) -> dict[str, int]:
    """{sample name: samples} of /metrics, once every wanted name has one (or after `tries` looks)."""
    from prometheus_client.parser import text_string_to_metric_families

    counts: dict[str, int] = {}
    for _ in range(tries):
        text = httpx.get(url, headers={"Authorization": f"Bearer {token}"}, timeout=30).text
        counts = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                counts[sample.name] = counts.get(sample.name, 0) + 1
        if wanted <= set(counts):
            break
        time.sleep(0.5)
    return counts


def grafana_metrics() -> set[str]:
    """Every paratrain metric name in the Grafana dashboard's queries and variables."""
    dashboard = json.loads(GRAFANA.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    return {name for expr in exprs for name in METRIC.findall(expr)}


@pytest.fixture(scope="module")
def logged_job(tmp_path_factory: pytest.TempPathFactory) -> LoggedJob:
    job = LoggedJob(tmp_path_factory.mktemp("loggers"))
    job.run(grafana_metrics())
    return job


def test_job_loss_and_steps_match_in_jsonl_mlflow_and_wandb(logged_job: LoggedJob) -> None:
    metrics = logged_job.folder / "metrics"
    lines = [json.loads(line) for line in (metrics / "metrics-rank0.jsonl").read_text().splitlines()]
    jsonl = {line["step"]: line["loss"] for line in lines}
    assert sorted(jsonl) == [5, 10, 15, 20, 25, 30]
    assert jsonl[30] < jsonl[5]  # it learned
    params, from_mlflow = mlflow_history((logged_job.folder / "mlruns").as_uri())
    assert from_mlflow == pytest.approx(jsonl)
    assert params["architecture"] == "ps" and params["num_workers"] == "2"
    config, from_wandb = wandb_history(metrics)
    assert from_wandb == pytest.approx(jsonl)
    assert config["consistency"] == "sync"


def test_grafana_dashboard_is_well_formed() -> None:
    dashboard = json.loads(GRAFANA.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), ids
    queries = [t for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(queries) > 20 and all(t["expr"] and t["refId"] for t in queries)
    assert {"datasource", "job"} <= {v["name"] for v in dashboard["templating"]["list"]}


def test_every_grafana_metric_is_in_a_real_jobs_scrape(logged_job: LoggedJob) -> None:
    wanted = grafana_metrics()
    named = {"paratrain_worker_step_seconds_total", "paratrain_push_staleness_rounds_bucket"}
    assert named | {"paratrain_worker_peak_memory_bytes"} <= wanted
    missing = sorted(wanted - set(logged_job.samples))
    assert not missing, f"queried by grafana.json but not in /metrics: {missing}"


def test_a_submitted_jobs_trainer_on_a_base_install_logs_json_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`paratrain submit` gives every process an output folder, and the Trainer's metrics default
    there to JSON lines and TensorBoard; without the tensorboard extra it must still train."""
    import torch

    from paratrain.cluster.context import Context
    from paratrain.train import Trainer

    _without(monkeypatch, "torch.utils.tensorboard")
    monkeypatch.setenv("PARATRAIN_OUTPUT_DIR", str(tmp_path))
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ctx = Context(role="worker", rank=0, num_workers=1, num_servers=0)
    trainer = Trainer(model, optimizer, strategy="local", log_every=1, progress=False, ctx=ctx)
    for _ in range(2):
        trainer.step(model(torch.ones(4, 2)).pow(2).mean())
    trainer.close()
    lines = (tmp_path / "metrics" / "metrics-rank0.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
