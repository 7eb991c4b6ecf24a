"""Prints this process's pid, then runs the script named by argv[1] with the rest of argv: a test
that kills processes of a job learns every pid from the launcher's output ("[role rank] pid N")."""

import os
import runpy
import sys

print(f"pid {os.getpid()}", flush=True)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
