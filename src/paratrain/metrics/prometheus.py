"""The board's figures as Prometheus metrics (`/metrics` on the dashboard's server).

Built at scrape time from the latest heartbeat reports by a custom collector (prometheus-client's
metric families), so nothing is counted twice and no process but the scheduler is scraped. Every
series carries `role` and `rank`; counters end in `_total`, units are in the names (`_bytes`,
`_seconds`), per Prometheus's naming conventions. Per-key series are kept to each server's hottest
keys (board.TOP_KEYS) so that a model of many keys does not blow up the label count.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from paratrain.metrics.board import JobBoard
from paratrain.metrics.telemetry import PHASES

STALENESS_BUCKETS = (0, 1, 2, 4, 8, 16, 32)

_SERVER_COUNTERS = (
    ("pushes", "paratrain_server_pushes", "Slices pushed to this server."),
    ("pulls", "paratrain_server_pulls", "Slices pulled from this server."),
    ("bytes_in", "paratrain_server_received_bytes", "Bytes of pushed slices received."),
    ("bytes_out", "paratrain_server_sent_bytes", "Bytes of pulled slices sent."),
    ("late", "paratrain_server_late_pushes", "Pushed slices dropped: their round applied without them."),
)
_KEY_COUNTERS = (
    (
        "pushes",
        "paratrain_key_pushes",
        "Pushes of a key (each of its slices on this server sees every push).",
    ),
    ("pulls", "paratrain_key_pulls", "Pulls of a key."),
    ("bytes_in", "paratrain_key_received_bytes", "Bytes pushed to a key's slices on this server."),
    ("bytes_out", "paratrain_key_sent_bytes", "Bytes pulled from a key's slices on this server."),
)


class BoardCollector:
    def __init__(self, board: JobBoard) -> None:
        self.board = board

    def collect(self) -> Iterator[Metric]:
        state = self.board.state()
        yield from _node_metrics(state["roles"])
        yield from _worker_metrics(state["workers"])
        yield from _straggler_metrics(state["job"], state["workers"])
        yield from _server_metrics(state["servers"])


def _node_metrics(roles: list[dict[str, Any]]) -> Iterator[Metric]:
    up = GaugeMetricFamily(
        "paratrain_node_up", "1 while the process is in the job, 0 once failed.", labels=["role", "rank"]
    )
    age = GaugeMetricFamily(
        "paratrain_node_heartbeat_age_seconds", "Seconds since the last heartbeat.", labels=["role", "rank"]
    )
    for node in roles:
        labels = [node["role"], str(node["rank"])]
        up.add_metric(labels, 0.0 if node["state"] == "failed" else 1.0)
        age.add_metric(labels, node["heartbeat_age_s"])
    yield up
    yield age


def _worker_metrics(workers: list[dict[str, Any]]) -> Iterator[Metric]:
    labels = ["role", "rank"]
    steps = CounterMetricFamily("paratrain_worker_steps", "Optimizer steps taken.", labels=labels)
    samples = CounterMetricFamily("paratrain_worker_samples", "Training samples processed.", labels=labels)
    loss = GaugeMetricFamily("paratrain_worker_loss", "The latest training loss.", labels=labels)
    seconds = CounterMetricFamily(
        "paratrain_worker_step_seconds", "Time in training steps, by phase.", labels=[*labels, "phase"]
    )
    memory = GaugeMetricFamily("paratrain_worker_resident_memory_bytes", "Resident memory.", labels=labels)
    peak = GaugeMetricFamily(
        "paratrain_worker_peak_memory_bytes",
        "Peak memory: the allocator's peak of tensor bytes on the worker's GPU, else peak resident memory.",
        labels=labels,
    )
    for w in workers:
        who = ["worker", str(w["rank"])]
        steps.add_metric(who, w["step"])
        samples.add_metric(who, w["samples"])
        if w["loss"] is not None:
            loss.add_metric(who, w["loss"])
        for phase in PHASES:
            seconds.add_metric([*who, phase], w["seconds"].get(phase, 0.0))
        if w["rss_bytes"] is not None:
            memory.add_metric(who, w["rss_bytes"])
        if w["peak_memory_bytes"] is not None:
            peak.add_metric(who, w["peak_memory_bytes"])
    yield from (steps, samples, loss, seconds, memory, peak)


def _straggler_metrics(job: dict[str, Any], workers: list[dict[str, Any]]) -> Iterator[Metric]:
    labels = ["role", "rank"]
    straggler = GaugeMetricFamily(
        "paratrain_worker_straggler",
        "1 while the scheduler names this worker a straggler (cluster/stragglers.py), else 0.",
        labels=labels,
    )
    ratio = GaugeMetricFamily(
        "paratrain_worker_slowdown_ratio",
        "This worker's own time per step (data + compute) over the other workers' median.",
        labels=labels,
    )
    slow = {s["rank"] for s in job.get("stragglers", [])}
    for w in workers:
        straggler.add_metric(["worker", str(w["rank"])], 1.0 if w["rank"] in slow else 0.0)
    for rank, value in job.get("slowdown", []):
        ratio.add_metric(["worker", str(rank)], value)
    yield from (straggler, ratio)


def _server_metrics(servers: list[dict[str, Any]]) -> Iterator[Metric]:
    labels = ["role", "rank"]
    totals = {name: CounterMetricFamily(metric, doc, labels=labels) for name, metric, doc in _SERVER_COUNTERS}
    per_key = {
        name: CounterMetricFamily(metric, doc, labels=[*labels, "key"]) for name, metric, doc in _KEY_COUNTERS
    }
    version = GaugeMetricFamily(
        "paratrain_key_version", "Updates applied to a key (its oldest slice here).", labels=[*labels, "key"]
    )
    waiting = GaugeMetricFamily("paratrain_server_waiting_pulls", "Pulls queued for a round.", labels=labels)
    rounds = GaugeMetricFamily("paratrain_server_open_rounds", "Rounds collecting pushes.", labels=labels)
    memory = GaugeMetricFamily("paratrain_server_resident_memory_bytes", "Resident memory.", labels=labels)
    rows = GaugeMetricFamily(
        "paratrain_sparse_table_rows", "Rows of a sparse table on this server.", labels=[*labels, "key"]
    )
    stale = HistogramMetricFamily(
        "paratrain_push_staleness_rounds",
        "How many updates a key received between the pull a gradient was computed from and its push.",
        labels=labels,
    )
    for s in servers:
        who = ["server", str(s["rank"])]
        for name, family in totals.items():
            family.add_metric(who, s[name])
        for key in s["keys"]:
            for name, family in per_key.items():
                family.add_metric([*who, key["key"]], key[name])
            version.add_metric([*who, key["key"]], key["version"])
        waiting.add_metric(who, s["waiting_pulls"])
        rounds.add_metric(who, s["open_rounds"])
        if s["rss_bytes"] is not None:
            memory.add_metric(who, s["rss_bytes"])
        for table in s["tables"]:
            rows.add_metric([*who, str(table["key"])], table["rows"])
        buckets, total = _histogram(s["staleness"])
        stale.add_metric(who, buckets, total)
    yield from totals.values()
    yield from per_key.values()
    yield from (version, waiting, rounds, memory, rows, stale)


def _histogram(counts: list[list[int]]) -> tuple[list[tuple[str, float]], float]:
    """Cumulative buckets (le) and the sum from [[rounds behind, pushes], ...]."""
    buckets = [(str(le), float(sum(c for behind, c in counts if behind <= le))) for le in STALENESS_BUCKETS]
    buckets.append(("+Inf", float(sum(c for _, c in counts))))
    return buckets, float(sum(behind * c for behind, c in counts))


def prometheus_text(board: JobBoard) -> bytes:
    """The exposition text of the board's figures."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(BoardCollector(board))
    return generate_latest(registry)
