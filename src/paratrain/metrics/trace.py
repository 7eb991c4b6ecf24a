"""A timeline of one process, as a Chrome-trace file (Perfetto and chrome://tracing read it).

    tracer = open_tracer("traces", role="worker", rank=1, clock_offset_s=0.0002)
    with tracer.range("push"):
        ...
    tracer.close()                        # flushes traces/trace-worker1.json

Ranges are "complete" events (ph "X") on the thread that ran them, in microseconds of this host's
wall clock; `clock_offset_s` (the scheduler's clock minus this one, measured at start) is stored
in the file so that `merge_traces` can put every process on the scheduler's clock. Events are
appended to the file every second (JSON Array Format), so a killed process leaves its timeline.
Our own writer rather than torch.profiler: a range costs two clock reads and a list append (about a
microsecond), the profiler tens with its collection on. When no tracer is open, `tracer()` returns a null one
whose ranges cost a function call.

`merge_traces(folder)` joins the files into one trace with one track (pid) per process, named and
ordered scheduler, servers, workers.
"""

from __future__ import annotations

import atexit
import json
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

ROLE_ORDER = {"scheduler": 0, "server": 1, "worker": 2}


def _now_us() -> float:
    return time.time_ns() / 1000.0


class Tracer:
    """Collects ranges in memory and appends them to its file every `flush_s` seconds (a thread),
    so a process that is killed leaves its timeline up to the last second."""

    enabled = True

    def __init__(
        self, path: str | Path, *, role: str, rank: int, clock_offset_s: float = 0.0, flush_s: float = 1.0
    ) -> None:
        self.path = Path(path)
        self.role, self.rank = role, rank
        self._events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # The JSON Array Format: "[" then events each followed by ",", the "]" left out, as Chrome
        # and Perfetto allow, so every flush leaves a readable file.
        self.path.write_text("[\n")
        self.clock_offset_s = clock_offset_s
        self._flusher = threading.Thread(target=self._flush_every, args=(flush_s,), name="trace", daemon=True)
        self._flusher.start()

    @property
    def clock_offset_s(self) -> float:
        return self._offset

    @clock_offset_s.setter
    def clock_offset_s(self, offset: float) -> None:
        """The scheduler's clock minus ours; the file keeps the latest (a metadata event)."""
        self._offset = offset
        meta = {"role": self.role, "rank": self.rank, "clock_offset_s": offset}
        self._events.append({"name": "paratrain", "ph": "M", "pid": 0, "tid": 0, "args": meta})

    @contextmanager
    def range(self, name: str, **args: Any) -> Iterator[None]:
        start = _now_us()
        try:
            yield
        finally:
            self.add(name, start, _now_us() - start, args)

    def begin(self) -> float:
        """A start time for `add` (for ranges that open and close in different calls)."""
        return _now_us()

    def add(self, name: str, start_us: float, dur_us: float, args: dict | None = None) -> None:
        event = {"name": name, "ph": "X", "ts": start_us, "dur": max(0.0, dur_us), "pid": 0}
        event["tid"] = threading.get_ident() % 2**31
        if args:
            event["args"] = args
        self._events.append(event)  # list.append is atomic under the GIL

    def flush(self) -> None:
        with self._lock:
            events, self._events = self._events, []
            if events:
                with open(self.path, "a") as f:
                    f.write("".join(json.dumps(e) + ",\n" for e in events))

    def _flush_every(self, every_s: float) -> None:
        while not self._closed.wait(every_s):
            try:
                self.flush()
            except OSError as exc:
                logger.warning("could not write the trace %s: %s", self.path, exc)
                return

    def close(self) -> None:
        """Write what is left (once); later ranges are dropped."""
        if self._closed.is_set():
            return
        self._closed.set()
        self.flush()
        logger.info("wrote the trace %s", self.path)


class NullTracer:
    enabled = False
    _null = nullcontext()

    def range(self, name: str, **args: Any) -> nullcontext:
        return self._null

    def begin(self) -> float:
        return 0.0

    def add(self, name: str, start_us: float, dur_us: float, args: dict | None = None) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


_NULL = NullTracer()
_active: Tracer | NullTracer = _NULL


def tracer() -> Tracer | NullTracer:
    """This process's open tracer, or the null one."""
    return _active


def open_tracer(folder: str | Path, *, role: str, rank: int, clock_offset_s: float = 0.0) -> Tracer:
    """Start this process's timeline, written to `folder/trace-{role}{rank}.json` on close; a
    second call returns the tracer already open."""
    global _active
    if role not in ROLE_ORDER:
        raise ValueError(f"trace role={role!r} must be one of {sorted(ROLE_ORDER)}")
    if not isinstance(rank, int) or rank < 0:
        raise ValueError(f"trace rank={rank!r} must be an int >= 0")
    if isinstance(_active, Tracer):
        return _active
    path = Path(folder) / f"trace-{role}{rank}.json"
    _active = Tracer(path, role=role, rank=rank, clock_offset_s=clock_offset_s)
    atexit.register(_active.close)
    return _active


def close_tracer() -> None:
    global _active
    _active.close()
    _active = _NULL


def read_trace(path: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(paratrain's metadata: role, rank, clock_offset_s; the events) of one process's file."""
    text = Path(path).read_text().rstrip().rstrip(",")
    events = json.loads(text if text.endswith("]") else text + "]")
    meta = [e["args"] for e in events if e.get("ph") == "M" and e.get("name") == "paratrain"]
    if not meta:
        raise ValueError(f"{path} is not a paratrain trace (no paratrain metadata event)")
    return meta[-1], [e for e in events if e.get("name") != "paratrain"]


def merge_traces(folder: str | Path) -> dict[str, Any]:
    """One Chrome trace of every `trace-*.json` in `folder`: one pid per process (named "worker 1",
    sorted scheduler, servers, workers), timestamps moved onto the scheduler's clock."""
    files = sorted(Path(folder).glob("trace-*.json"))
    if not files:
        raise FileNotFoundError(f"no trace-*.json files in {folder}")
    docs = []
    for path in files:
        try:
            meta, events = read_trace(path)
            docs.append((ROLE_ORDER[meta["role"]], int(meta["rank"]), meta, events))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path} is not a paratrain trace: {exc}") from None
    docs.sort(key=lambda d: (d[0], d[1]))
    merged: list[dict[str, Any]] = []
    for pid, (_, rank, meta, events) in enumerate(docs, start=1):
        name = f"{meta['role']} {rank}"
        merged.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}})
        sort = {"sort_index": pid}
        merged.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": sort})
        shift = float(meta.get("clock_offset_s", 0.0)) * 1e6
        merged += [{**event, "pid": pid, "ts": event["ts"] + shift} for event in events if "ts" in event]
    return {"traceEvents": merged, "displayTimeUnit": "ms"}
