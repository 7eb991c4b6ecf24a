"""Dynamic batching: requests that arrive close together run through the model as one batch.

`Batcher.submit(inputs)` queues one request (named tensors, [rows, ...] each) and returns a Future
of (its output rows, the batch's tag); `await Batcher.predict(inputs)` is the same in an event loop.
One thread takes the oldest request and the queued ones of the same signature (names, dtypes, row
shapes), up to `max_batch` rows; if that is fewer rows than the largest of the last `RECENT`
batches had, it waits up to `batch_wait_s` from the oldest one's arrival for more, until there are
as many (or `max_batch`). It concatenates them, runs `run_batch` once and hands each request its own
slice of the output.

Why "as many as the recent batches": the wait pays only when more requests are on their way, and
the recent batches say how many clients are sending. A lone client's request runs at once (the
first batch too), where a fixed wait for `max_batch` rows added the whole wait to it: on the
benchmark's CNN at 1 client, 7.7 ms p50 against 1.2-1.6 ms. 32 clients still fill batches of 32:
they all wait for their answers while a batch runs, so requests queue and the batches grow to the
clients' number. Running at once whatever is queued (Triton's dynamic batcher with no delay) split
them into batches of 9-16 and 17-32 in turn, which took more CPU per request (0.44 ms against 0.35,
load 12 on 2 cores); waiting for the previous batch's size alone let one batch cut short by a busy
machine shrink the next ones (batches of 1 to 16 among those of 32); the largest of the last 8 does
not. Requests of another signature wait for the next batch, in order. If a batch of several
requests fails, each is run alone, so a bad request fails only itself (a `ModelInputError` for it);
a model that fails alone on every request fails them all. A ParatrainError (a server or stage
process gone) fails the whole batch at once.

Why a thread and not asyncio: the model runs outside the event loop anyway (torch releases the GIL
in its kernels), and a thread with a condition variable keeps the batching policy in one loop that a
unit test can drive without HTTP. The hand-offs between the threads are per batch, not per request
(each one wakes a thread, and on a busy machine a wake-up costs as much CPU as an HTTP request): a
request wakes the batch thread only if it waits for a first request or the batch it gathers can now
be filled, and the answers of a batch reach an event loop in one call (`call_soon_threadsafe`).
Measured beside a model that costs almost nothing (784 -> 10), 32 clients, batches of 32: the batch
thread took 0.2 ms of CPU per request with a wake-up and a hand-off per request (and 0.28 ms more
in an OpenMP thread, see `_loop`), 0.05 ms without.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from paratrain.errors import ParatrainError
from paratrain.serve.api import dtype_name

logger = logging.getLogger(__name__)

Inputs = dict[str, torch.Tensor]
RECENT = 8
"""Batches whose sizes set how many rows the next one waits for."""
FEW_ROWS = 8
"""Batches of fewer rows run on one intra-op thread; larger ones on the threads the server was
given (torch's default: the machine's cores)."""
RunBatch = Callable[[Inputs], tuple[torch.Tensor, int | None]]
"""Runs one batch: (output rows, a tag handed to every request of the batch, e.g. the model's step)."""


class ModelInputError(Exception):
    """The model raised on this request alone: the request, not the server, is at fault."""


@dataclass
class Item:
    inputs: Inputs
    rows: int
    signature: tuple
    future: Future | asyncio.Future
    loop: asyncio.AbstractEventLoop | None = None
    """The loop of an asyncio future (set from that loop only), None for a concurrent one."""
    arrived: float = field(default_factory=time.monotonic)


@dataclass
class Outcome:
    """One request's answer (output rows and the batch's tag) or error, before its future has it."""

    item: Item
    result: tuple[torch.Tensor, int | None] | None = None
    error: BaseException | None = None

    def settle(self) -> None:
        future = self.item.future
        if future.done():  # an asyncio future whose request was cancelled (the client went away)
            return
        if self.error is not None:
            future.set_exception(self.error)
        else:
            future.set_result(self.result)

    @staticmethod
    def settle_all(outcomes: list[Outcome]) -> None:
        for outcome in outcomes:
            outcome.settle()


def signature(inputs: Inputs) -> tuple:
    return tuple(sorted((name, t.dtype, tuple(t.shape[1:])) for name, t in inputs.items()))


def describe(inputs: Inputs) -> str:
    return ", ".join(f"{name}: {dtype_name(t.dtype)}{list(t.shape)}" for name, t in inputs.items())


class Batcher:
    """See the module docstring. `on_batch(rows, requests)` is told of every batch run (metrics)."""

    def __init__(
        self,
        run_batch: RunBatch,
        max_batch: int,
        batch_wait_s: float,
        on_batch: Callable[[int, int], None] | None = None,
        name: str = "batcher",
    ) -> None:
        self.run_batch, self.max_batch, self.batch_wait_s = run_batch, max_batch, batch_wait_s
        self.on_batch = on_batch
        self._threads = torch.get_num_threads()
        self._queue: deque[Item] = deque()
        self._queued_rows = 0
        self._wanted: int | None = None
        """Rows the batch being gathered still wants (None: the thread is not gathering)."""
        self._recent_rows: deque[int] = deque([1], maxlen=RECENT)
        """Rows of the last batches: the next one waits for as many as the largest (module docstring)."""
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, inputs: Inputs) -> Future:
        future: Future = Future()
        self._enqueue(inputs, future, None)
        return future

    async def predict(self, inputs: Inputs) -> tuple[torch.Tensor, int | None]:
        """submit's answer, awaited in the running loop with no thread hand-off of its own."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._enqueue(inputs, future, loop)
        return await future

    def _enqueue(
        self, inputs: Inputs, future: Future | asyncio.Future, loop: asyncio.AbstractEventLoop | None
    ) -> None:
        rows = next(iter(inputs.values())).shape[0]
        item = Item(inputs, rows, signature(inputs), future, loop)
        with self._cond:
            if self._closed:
                raise RuntimeError("the batcher is closed")
            self._queue.append(item)
            self._queued_rows += rows
            if self._wanted is None or self._queued_rows >= self._wanted:
                self._cond.notify()

    def close(self, timeout_s: float = 10.0) -> None:
        """Run what is queued, then stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)

    def _loop(self) -> None:
        # A new thread's OpenMP team is the machine's size, not what torch.set_num_threads set on
        # the main thread: without this, MKL's GEMMs of a batch started a second thread here that
        # spun after each of them (with --threads 1 on 2 cores, beside a tiny model: 0.28 ms of CPU
        # per request, where the rest of the server took 0.4 ms).
        torch.set_num_threads(self._threads)
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            self._run(batch)

    def _next_batch(self) -> list[Item] | None:
        with self._cond:
            while not self._queue:
                if self._closed:
                    return None
                self._cond.wait()
            first = self._take(0)
            batch, rows = [first], first.rows
            deadline = first.arrived + self.batch_wait_s
            target = min(max(self._recent_rows), self.max_batch)
            while rows < self.max_batch:
                taken = self._take_matching(first.signature, self.max_batch - rows)
                if taken is not None:
                    batch.append(taken)
                    rows += taken.rows
                    continue
                left = deadline - time.monotonic()
                if rows >= target or left <= 0 or self._closed:
                    break
                self._wanted = target - rows
                try:
                    self._cond.wait(left)
                finally:
                    self._wanted = None
            self._recent_rows.append(rows)
            return batch

    def _take(self, i: int) -> Item:
        item = self._queue[i]
        del self._queue[i]
        self._queued_rows -= item.rows
        return item

    def _take_matching(self, sig: tuple, room: int) -> Item | None:
        """The oldest queued request of signature `sig` with at most `room` rows (holds the lock)."""
        for i, item in enumerate(self._queue):
            if item.signature == sig and item.rows <= room:
                return self._take(i)
        return None

    def _run(self, batch: list[Item]) -> None:
        outcomes = self._outcomes(batch)
        by_loop: dict[asyncio.AbstractEventLoop, list[Outcome]] = {}
        for outcome in outcomes:
            if outcome.item.loop is None:
                outcome.settle()
            else:
                by_loop.setdefault(outcome.item.loop, []).append(outcome)
        for loop, group in by_loop.items():
            try:
                loop.call_soon_threadsafe(Outcome.settle_all, group)
            except RuntimeError:  # the loop is closed: nobody waits for these answers
                pass

    def _outcomes(self, batch: list[Item]) -> list[Outcome]:
        inputs = (
            batch[0].inputs
            if len(batch) == 1
            else {name: torch.cat([item.inputs[name] for item in batch]) for name in batch[0].inputs}
        )
        rows = sum(item.rows for item in batch)
        try:
            output, tag = self._forward(inputs, rows)
        except ParatrainError as exc:  # the system failed (a server or stage is gone), not a request
            return [Outcome(item, error=exc) for item in batch]
        except Exception as exc:
            if len(batch) == 1:
                text = f"the model failed on {describe(inputs)}: {type(exc).__name__}: {exc}"
                return [Outcome(batch[0], error=ModelInputError(text))]
            logger.info("a batch of %d requests failed (%s); running each alone", len(batch), exc)
            return [outcome for item in batch for outcome in self._outcomes([item])]
        if self.on_batch is not None:
            self.on_batch(rows, len(batch))
        outcomes, at = [], 0
        for item in batch:
            outcomes.append(Outcome(item, (output[at : at + item.rows], tag)))
            at += item.rows
        return outcomes

    def _forward(self, inputs: Inputs, rows: int) -> tuple[torch.Tensor, int | None]:
        threads = 1 if rows < FEW_ROWS else self._threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        output, tag = self.run_batch(inputs)
        if not isinstance(output, torch.Tensor) or output.dim() == 0 or output.shape[0] != rows:
            got = f"shape {list(output.shape)}" if isinstance(output, torch.Tensor) else type(output).__name__
            raise TypeError(f"the model must return one tensor with a row per input row ({rows}); got {got}")
        return output, tag
