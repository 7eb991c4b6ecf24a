"""A job for the Ray engine's tests: each process says where it runs and with how many threads,
then argv[1] decides what the workers do.

    ok     every worker passes a barrier and exits 0
    raise  worker 1 raises once it joined; the others wait at a barrier until the job is aborted
    hang   every worker says "ready PID" and sleeps until it is stopped (kill and interrupt tests)
"""

import os
import sys
import time

import paratrain

role = os.environ["PARATRAIN_ROLE"]
print(
    f"pid {os.getpid()} host {os.environ['PARATRAIN_HOST']} threads {os.environ.get('OMP_NUM_THREADS')}",
    flush=True,
)
mode = sys.argv[1]
ctx = paratrain.init()  # the scheduler and servers serve here until the job ends, then exit
if mode == "raise" and ctx.rank == 1:
    raise RuntimeError("worker 1 fails on purpose")
if mode == "hang":
    print(f"ready {os.getpid()}", flush=True)
    time.sleep(600)
ctx.barrier(timeout_s=60)
print("done", flush=True)
