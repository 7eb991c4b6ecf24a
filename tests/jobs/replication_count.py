"""The counting job of tests/test_replication.py: every applied push adds exactly one.

    replication_count.py MODE ROUNDS SEED DIR [rejoin]

W workers push -1 to three keys (one sliced over the servers) for ROUNDS rounds under a server-side
SGD at lr 1, with JobConfig.replication=2. The server chosen by SEED kills itself (SIGKILL) at a
moment chosen by SEED: once worker 0 has reached a round (it writes a file in DIR), after a short
random delay. Every worker counts its acknowledged pushes; at the end each checks that every key
holds exactly the job's acknowledged pushes, and prints `count ok <total>`.

With `rejoin` (launched with --max-restarts 1), the launcher restarts the dead server, which rejoins
as a backup and catches up while the workers go on pushing. Once worker 0 heard it is back (the
scheduler's `server_back`), ANOTHER server, chosen by SEED, kills itself after a short random delay,
and the job goes on until worker 0 saw that one die, plus ROUNDS rounds; the workers agree at a
barrier every ROUNDS rounds whether to go on.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

import torch

import paratrain
from paratrain.cluster.config import JobConfig
from paratrain.kvstore import KVStoreConfig, create

mode, rounds, seed, folder = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
rejoin = sys.argv[5:] == ["rejoin"]
chance = random.Random(seed)
servers = int(os.environ["PARATRAIN_NUM_SERVERS"])
victim = chance.randrange(servers)
kill_round, delay_s = chance.randrange(1, rounds - 1), chance.uniform(0.0, 0.02)
second = chance.choice([s for s in range(servers) if s != victim])
signal_file, back_file, second_pid = folder / f"round-{kill_round}", folder / "back", folder / "second-pid"


def die_after(path: Path) -> None:
    while not path.exists():
        time.sleep(0.002)
    time.sleep(delay_s)
    os.kill(os.getpid(), signal.SIGKILL)


role, rank = os.environ.get("PARATRAIN_ROLE"), os.environ.get("PARATRAIN_RANK")
if role == "server" and rank == str(victim) and not (folder / "victim-started").exists():
    (folder / "victim-started").touch()  # its restarted process lives on
    threading.Thread(target=die_after, args=(signal_file,), daemon=True).start()
if rejoin and role == "server" and rank == str(second):
    second_pid.write_text(str(os.getpid()))
    threading.Thread(target=die_after, args=(back_file,), daemon=True).start()

ctx = paratrain.init(JobConfig(replication=2))
kv = create(KVStoreConfig(consistency=mode, slice_elements=64), ctx)
sizes = {"a": 8, "b": 3, "big": 200}  # "big" is sliced over the servers
kv.init(list(sizes), [torch.zeros(n) for n in sizes.values()])
kv.set_optimizer("torch.optim.SGD", lr=1.0)
outs = {k: torch.empty(n) for k, n in sizes.items()}
back = threading.Event()
if rejoin and ctx.link is not None:
    ctx.link.on_server_back(lambda *_: back.set())


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


seen: list[int] = []  # the steps at which worker 0 found the second server dead


def go_on(step: int, deadline: float) -> bool:
    """Worker 0's say after `step` rounds: go on while the second death is to come (rejoin)."""
    if not rejoin or step < rounds:
        return step < rounds
    if back.is_set():
        back_file.touch()
    if time.monotonic() > deadline:
        raise TimeoutError(f"the restarted server was not back, or server {second} not dead, in time")
    if back.is_set() and not alive(int(second_pid.read_text())):
        seen.append(step)
    return len(seen) < 2  # ROUNDS more rounds after worker 0 saw the second death


acknowledged, step, more, deadline = 0, 0, True, time.monotonic() + 120
while more:
    for _ in range(rounds):
        if ctx.rank == 0 and step == kill_round:
            signal_file.touch()
        values = [torch.full((n,), -1.0) for n in sizes.values()]
        kv.pushpull(list(sizes), values, out=list(outs.values()))
        acknowledged += 1  # one push per key, acknowledged once pushpull returned
        step += 1
        if rejoin and ctx.rank == 0 and step > rounds and not back.is_set():
            time.sleep(0.005)  # while the restarted server catches up: rounds go on, slower
    says = ctx.barrier(name=f"go on {step}", data=go_on(step, deadline) if ctx.rank == 0 else None)
    more = bool(says[0]) if rejoin else False
total = sum(ctx.barrier(name="counted", data=acknowledged).values())
kv.pull(list(sizes), out=list(outs.values()))
for key, out in outs.items():
    assert out.eq(total).all(), f"key {key!r} holds {out.unique().tolist()}, acknowledged {total}"
print(f"count ok {total}", flush=True)
