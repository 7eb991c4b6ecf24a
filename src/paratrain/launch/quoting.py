"""The one function that writes a value into a script or manifest an engine generates.

Every name, path, argument and variable that reaches an sbatch script or a Kubernetes manifest
goes through `quote`, which knows the three readers of those texts:

- "bash": a word of a bash script (the sbatch script's commands). shlex.quote: single quotes,
  inside which bash expands nothing (`$()`, backticks, `$VAR`), and a newline is part of the word.
  Only a NUL byte cannot be carried, and is refused.
- "sbatch": the value of an `#SBATCH --name=value` line. sbatch reads these lines itself, before
  bash runs the script (to bash they are comments): it strips single and double quotes as a shell
  does, but ends the value at the line's end and takes a backslash as an escape even inside
  quotes. A line break would end the directive and leave the rest of the value as a line that bash
  runs, so line breaks, NUL and backslashes are refused (naming the field); the rest is quoted
  as for bash.
- "k8s": a string of a manifest (a container's command or env value). The YAML writer quotes it
  for YAML; Kubernetes then expands `$(VAR)` in commands and env values, which `$$` prevents.

A refused value raises ValueError naming the field and the value.
"""

from __future__ import annotations

import shlex
from typing import Literal

Into = Literal["bash", "sbatch", "k8s"]

_SBATCH_REFUSED = {"\n": "a line break", "\r": "a line break", "\\": "a backslash"}


def quote(value: str, into: Into, field: str) -> str:
    """`value` written for `into`'s reader so that it reads back exactly `value` and runs nothing;
    ValueError naming `field` when that reader cannot carry it."""
    if not isinstance(value, str):
        raise TypeError(f"{field} must be a str, got {value!r}")
    if "\0" in value:
        raise ValueError(f"{field} holds a NUL byte, which no script can carry: {value!r}")
    if into == "k8s":
        return value.replace("$", "$$")
    if into == "sbatch":
        for char, what in _SBATCH_REFUSED.items():
            if char in value:
                raise ValueError(
                    f"{field} holds {what}, which an #SBATCH line cannot carry: {value!r} (choose a name "
                    "or folder without it)"
                )
    elif into != "bash":
        raise ValueError(f"into must be 'bash', 'sbatch' or 'k8s', got {into!r}")
    return shlex.quote(value)
