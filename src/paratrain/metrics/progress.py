"""The training progress display: steps, the latest scalars (loss) and samples/s, from one process.

On a terminal (the stream is a TTY) it is a tqdm bar with postfix `loss=0.2345, samples/s=1523.4`.
Otherwise (the launcher pipes each child's output and prefixes its lines, so carriage returns would
garble it) it writes plain lines: one at the first update, then at most one every `every_s` seconds,
and one at close:

    {desc} step {n}[/{total}][ {name} {value:.4g}]...[ samples/s {rate:.1f}][ peak mem {size}]
    {desc} done step {n}[/{total}][ {name} {value:.4g}]...[ samples/s {overall:.1f}][ peak mem {size}]
        time {elapsed:.1f}s   (one line)

e.g. `train step 120/300 loss 0.2345 samples/s 1523.4 peak mem 1.25 GiB`. Scalars are the latest
values passed to `update`, in the order first given, and so is the process's peak memory (the
Trainer gives it: metrics/telemetry.py). samples/s covers the last `window_s` seconds (a little
more: from the newest update at least that old), and the close line gives it over the whole run;
it is left out until samples are counted and time has passed. Disabled, it writes nothing (the
trainer enables it on worker 0 only) but still counts, so `samples_per_s` can feed metrics on every rank.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import IO, Any

from tqdm import tqdm

logger = logging.getLogger(__name__)


class Progress:
    """Counts steps and samples and shows them; use as a context manager or call `close()`."""

    def __init__(
        self,
        total: int | None = None,
        *,
        enabled: bool = True,
        desc: str = "train",
        every_s: float = 2.0,
        stream: IO[str] | None = None,
        initial: int = 0,
        window_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        _check_args(total, every_s, initial, window_s)
        self.total = total
        self.enabled = enabled
        self.desc = desc
        self.every_s = every_s
        self.window_s = window_s
        self.stream = stream if stream is not None else sys.stderr
        self.step = initial
        self.samples = 0
        self.scalars: dict[str, float] = {}
        self.memory_bytes: int | None = None
        self._clock = clock
        self._start = clock()
        self._window: deque[tuple[float, int]] = deque([(self._start, 0)])  # (time, samples so far)
        self._last_line = float("-inf")
        self._closed = False
        self._bar: Any = None
        if enabled and _is_tty(self.stream):
            self._bar = tqdm(total=total, initial=initial, desc=desc, file=self.stream, unit="step")

    def update(
        self, *, steps: int = 1, samples: int = 0, memory_bytes: int | None = None, **scalars: float
    ) -> None:
        """Count `steps` steps and `samples` samples; remember the latest `scalars` (e.g. loss=...)
        and the process's peak `memory_bytes`, where given."""
        if steps < 0 or samples < 0:
            raise ValueError(f"Progress.update steps={steps!r} and samples={samples!r} must be >= 0")
        now = self._clock()
        self.step += steps
        self.samples += samples
        self.scalars.update({name: float(value) for name, value in scalars.items()})
        if memory_bytes is not None:
            self.memory_bytes = memory_bytes
        self._window.append((now, self.samples))
        while len(self._window) > 1 and self._window[1][0] <= now - self.window_s:
            self._window.popleft()
        if not self.enabled or self._closed:
            return
        if self._bar is not None:
            self._bar.set_postfix(self._postfix(self.samples_per_s), refresh=False)
            self._bar.update(steps)
        elif now - self._last_line >= self.every_s:
            self._last_line = now
            self._write(self._line("step", self.samples_per_s))

    @property
    def samples_per_s(self) -> float | None:
        """Samples per second over the recent window; None before any sample or time has passed."""
        (t0, n0), (t1, n1) = self._window[0], self._window[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 and n1 > 0 else None

    @property
    def overall_samples_per_s(self) -> float | None:
        """Samples per second since this Progress was made."""
        return self._overall(self._clock() - self._start)

    def _overall(self, elapsed: float) -> float | None:
        return self.samples / elapsed if elapsed > 0 and self.samples > 0 else None

    def close(self) -> None:
        """Show the final line (or bar) with the overall samples/s; calling it twice is harmless."""
        if self._closed:
            return
        self._closed = True
        if not self.enabled:
            return
        elapsed = self._clock() - self._start
        overall = self._overall(elapsed)
        if self._bar is not None:
            self._bar.set_postfix(self._postfix(overall), refresh=False)
            self._bar.close()
        else:
            self._write(f"{self._line('done step', overall)} time {elapsed:.1f}s")

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _line(self, what: str, rate: float | None) -> str:
        parts = [f"{self.desc} {what} {self.step}" + (f"/{self.total}" if self.total is not None else "")]
        parts += [f"{name} {value:.4g}" for name, value in self.scalars.items()]
        if rate is not None:
            parts.append(f"samples/s {rate:.1f}")
        if self.memory_bytes is not None:
            parts.append(f"peak mem {size(self.memory_bytes)}")
        return " ".join(parts)

    def _postfix(self, rate: float | None) -> dict[str, str]:
        postfix = {name: f"{value:.4g}" for name, value in self.scalars.items()}
        if rate is not None:
            postfix["samples/s"] = f"{rate:.1f}"
        if self.memory_bytes is not None:
            postfix["peak mem"] = size(self.memory_bytes)
        return postfix

    def _write(self, line: str) -> None:
        self.stream.write(line + "\n")
        self.stream.flush()


def size(count: int) -> str:
    """A byte count for people: 512 B, 3.4 MiB, 1.25 GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.3g} {unit}"
    return f"{count} B"


def _is_tty(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _check_args(total: int | None, every_s: float, initial: int, window_s: float) -> None:
    if total is not None and (not isinstance(total, int) or total < 0):
        raise ValueError(f"Progress total={total!r} must be None or an int >= 0")
    if not every_s >= 0:
        raise ValueError(f"Progress every_s={every_s!r} must be >= 0")
    if not isinstance(initial, int) or initial < 0:
        raise ValueError(f"Progress initial={initial!r} must be an int >= 0")
    if not window_s > 0:
        raise ValueError(f"Progress window_s={window_s!r} must be > 0")
