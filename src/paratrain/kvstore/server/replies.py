"""Pull replies leave a server from one sender thread per worker connection, in order.

Why not from the thread that made the pull ready: that is the connection thread of whichever
worker's push completed the round. Sending the round's values to every waiting worker from there,
with blocking sends on link-limited sockets, it would read nothing from its own worker meanwhile
(whose pushes to this server stall behind other workers' replies), and one worker with a full
socket would hold back the replies to all the others: a per-frame trace of the 64 MB push+pull of
benchmarks/hosts.py (4 workers, 4 servers, 1 Gbit/s links) sending so found each server's
connection threads blocked in reply sends 0.2-0.4 s of each 0.75 s iteration. The same job on
250 Mbit/s links (where the 2 shared cores do not bind) took 3.31-3.40 s per iteration with these
senders against 3.57-3.70 s without, in 4 interleaved jobs each. On 1 Gbit/s links, with the cores
loaded by other programs: 0.82-0.96 s against 0.88-1.12 s, faster in each of 3 interleaved pairs
(medians 0.873 and 0.914 s); other interleaved pairs there were inside the noise.

A reply job runs on its connection's sender; it must not raise (it logs and cleans up itself). The
sender ends when the connection does (`close`).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from paratrain.transport.connection import Connection

logger = logging.getLogger(__name__)

Job = Callable[[], None]


class ReplySenders:
    """One daemon thread per connection that runs that connection's reply jobs in FIFO order."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._queues: dict[Connection, queue.SimpleQueue[Job | None]] = {}
        self._threads: list[threading.Thread] = []

    def send(self, conn: Connection, job: Job) -> None:
        """Run `job` on `conn`'s sender (started on first use); a closed connection's job runs
        here, where its send fails at once and the job cleans up."""
        with self._lock:
            jobs = self._queues.get(conn)
            if jobs is None and not conn.closed:
                jobs = self._queues[conn] = queue.SimpleQueue()
                name = f"{self.name}-reply"
                thread = threading.Thread(target=self._run, args=(jobs,), name=name, daemon=True)
                self._threads = [t for t in self._threads if t.is_alive()] + [thread]
                thread.start()
        if jobs is None:
            job()
        else:
            jobs.put(job)

    def close(self, conn: Connection) -> None:
        """The connection ended: its sender runs the jobs already queued (their sends fail at
        once), then stops."""
        with self._lock:
            jobs = self._queues.pop(conn, None)
        if jobs is not None:
            jobs.put(None)

    def close_all(self, timeout_s: float = 5.0) -> None:
        """The server stops: every sender finishes what it has queued, then ends, before the
        process exits. (A daemon thread still inside torch when Python 3.11 finalises is ended by
        pthread_exit, which aborts the process: "terminate called without an active exception".)"""
        with self._lock:
            queues, self._queues = list(self._queues.values()), {}
            threads = list(self._threads)
        for jobs in queues:
            jobs.put(None)
        for thread in threads:
            thread.join(timeout_s)

    @staticmethod
    def _run(jobs: queue.SimpleQueue[Job | None]) -> None:
        while (job := jobs.get()) is not None:
            try:
                job()
            except Exception:  # a bug in a job must not stop the replies behind it
                logger.exception("sending a reply failed")
