"""What a process tells the scheduler about itself, on the heartbeats it already sends.

A worker's figures are cumulative counters (steps, samples, seconds of data loading, compute,
communication and waiting) plus the latest loss and its peak memory (`peak_memory_bytes`); the
scheduler turns differences between two heartbeats into rates and per-step splits (board.py), so
nothing is sent per step and a lost heartbeat loses no count.
A server's figures come from its KVServer (kvstore/report.py). The report is a small msgpack-able
dict; `report()` is called by the heartbeat thread once per interval.

    telemetry = worker_telemetry()       # one per process
    telemetry.step_done(samples=64, loss=0.3, compute_s=0.02, communication_s=0.004, waiting_s=0.001,
                        data_s=0.002)
"""

from __future__ import annotations

import math
import os
import resource
import sys
import threading
import time
from typing import Any

PHASES = ("data", "compute", "communication", "waiting")


class WorkerTelemetry:
    """Counters a worker's training loop adds to; `report()` reads them (any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.steps = 0
        self.samples = 0
        self.loss: float | None = None
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.strategy: str | None = None
        """The Trainer's strategy, shown on the job page."""
        self.device: Any = None
        """The Trainer's device (a torch.device): where its peak memory is measured."""

    def step_done(
        self,
        *,
        samples: int,
        loss: float | None,
        compute_s: float,
        communication_s: float = 0.0,
        waiting_s: float = 0.0,
        data_s: float = 0.0,
    ) -> None:
        """One optimizer step: its samples (over every replica of this worker's data), latest loss
        and where its time went."""
        with self._lock:
            self.steps += 1
            self.samples += samples
            if loss is not None and math.isfinite(loss):
                self.loss = loss
            self.seconds["compute"] += max(0.0, compute_s)
            self.seconds["communication"] += max(0.0, communication_s)
            self.seconds["waiting"] += max(0.0, waiting_s)
            self.seconds["data"] += max(0.0, data_s)

    def report(self) -> dict[str, Any]:
        with self._lock:
            return {
                "steps": self.steps,
                "samples": self.samples,
                "loss": self.loss,
                "seconds": dict(self.seconds),
                "strategy": self.strategy,
                **process_figures(),
                "peak_memory_bytes": peak_memory_bytes(self.device),
            }


def process_figures() -> dict[str, Any]:
    """The process's resident memory (bytes) and its clock, for every role."""
    return {"rss_bytes": rss_bytes(), "time": time.time()}


def rss_bytes() -> int:
    """Resident set size now (Linux: /proc/self/statm), else the peak from getrusage."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_memory_bytes(device: Any = None) -> int:
    """The most memory this process has held for training: on a GPU (a torch.device of type cuda)
    the caching allocator's peak of allocated tensor bytes on it, else the peak resident set
    (getrusage's ru_maxrss, whatever the process allocated)."""
    if device is not None and device.type == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, kB elsewhere


_worker: WorkerTelemetry | None = None
_worker_lock = threading.Lock()


def worker_telemetry() -> WorkerTelemetry:
    """This process's worker telemetry (made on first use)."""
    global _worker
    with _worker_lock:
        if _worker is None:
            _worker = WorkerTelemetry()
        return _worker
