"""What the replication counting jobs share (replication_count.py, replication_sparse_count.py):
which server dies when, and the rounds around the deaths.

argv: MODE ROUNDS SEED DIR [rejoin]. The server chosen by SEED kills itself (SIGKILL) once worker 0
reached a round chosen by SEED (a file in DIR), after a short random delay. With `rejoin` (launched
with --max-restarts 1) the launcher restarts it; once worker 0 heard it is back (the scheduler's
`server_back`), ANOTHER server, chosen by SEED, kills itself, and the job goes on until worker 0
saw that one die, plus ROUNDS rounds; the workers agree at a barrier every ROUNDS rounds whether to
go on. Made before `paratrain.init`, so that a server arms its death before it serves.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from paratrain.system import process_alive


class ServerDeaths:
    def __init__(self, argv: list[str]) -> None:
        self.mode, self.rounds, self.seed = argv[0], int(argv[1]), int(argv[2])
        self.folder, self.rejoin = Path(argv[3]), argv[4:] == ["rejoin"]
        chance = random.Random(self.seed)
        servers = int(os.environ["PARATRAIN_NUM_SERVERS"])
        victim = chance.randrange(servers)
        self.kill_round, self.delay_s = chance.randrange(1, self.rounds - 1), chance.uniform(0.0, 0.02)
        self.second = chance.choice([s for s in range(servers) if s != victim])
        self.signal_file = self.folder / f"round-{self.kill_round}"
        self.back_file, self.second_pid = self.folder / "back", self.folder / "second-pid"
        self.back = threading.Event()
        self._seen: list[int] = []  # the steps at which worker 0 found the second server dead
        role, rank = os.environ.get("PARATRAIN_ROLE"), os.environ.get("PARATRAIN_RANK")
        if role == "server" and rank == str(victim) and not (self.folder / "victim-started").exists():
            (self.folder / "victim-started").touch()  # its restarted process lives on
            self._die_after(self.signal_file)
        if self.rejoin and role == "server" and rank == str(self.second):
            self.second_pid.write_text(str(os.getpid()))
            self._die_after(self.back_file)

    def _die_after(self, path: Path) -> None:
        def die() -> None:
            while not path.exists():
                time.sleep(0.002)
            time.sleep(self.delay_s)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=die, daemon=True).start()

    def _go_on(self, step: int, deadline: float) -> bool:
        """Worker 0's say after `step` rounds: go on while the second death is to come (rejoin)."""
        if not self.rejoin or step < self.rounds:
            return step < self.rounds
        if self.back.is_set():
            self.back_file.touch()
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the restarted server was not back, or server {self.second} not dead, in time"
            )
        if self.back.is_set() and not process_alive(int(self.second_pid.read_text())):
            self._seen.append(step)
        return len(self._seen) < 2  # ROUNDS more rounds after worker 0 saw the second death

    def run(self, ctx, one_round: Callable[[int], None], timeout_s: float) -> int:
        """Runs `one_round(step)` (which returns once its pushes are acknowledged) until the
        workers agree to stop; returns the rounds made, the same on every worker."""
        if self.rejoin and ctx.link is not None:
            ctx.link.on_server_back(lambda *_: self.back.set())
        step, more, deadline = 0, True, time.monotonic() + timeout_s
        while more:
            for _ in range(self.rounds):
                if ctx.rank == 0 and step == self.kill_round:
                    self.signal_file.touch()
                one_round(step)
                step += 1
                if self.rejoin and ctx.rank == 0 and step > self.rounds and not self.back.is_set():
                    time.sleep(0.005)  # while the restarted server catches up: rounds go on, slower
            go_on = self._go_on(step, deadline) if ctx.rank == 0 else None
            more = bool(ctx.barrier(name=f"go on {step}", data=go_on)[0]) if self.rejoin else False
        return step
