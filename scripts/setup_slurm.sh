#!/usr/bin/env bash
# Installs what the Slurm tests start (tests/test_slurm.py): Debian's slurm-wlm and munge. Quick when
# they are there already; as another user than root it only says what is missing (the tests then skip).
# It starts no service: the tests run their own munged, slurmctld and slurmd from a temporary config.
set -euo pipefail
needed=(munged slurmctld slurmd sbatch srun)
missing=()
for tool in "${needed[@]}"; do
    command -v "$tool" > /dev/null || missing+=("$tool")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get > /dev/null; then
    echo "setup: ${missing[*]} missing; as root on Debian this installs slurm-wlm and munge (the Slurm tests skip)" >&2
    exit 0
fi
# Keep the packages' own services from starting (Debian starts a daemon it installs unless told no).
policy=/usr/sbin/policy-rc.d
made_policy=
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod 755 "$policy" && made_policy=1
fi
trap '[ -n "$made_policy" ] && rm -f "$policy"' EXIT
export DEBIAN_FRONTEND=noninteractive
if ! { apt-get update -q && apt-get install -y -q --no-install-recommends slurm-wlm munge; } \
        > /tmp/paratrain-setup-slurm.log 2>&1; then
    cat /tmp/paratrain-setup-slurm.log
    echo "setup: installing slurm-wlm and munge failed (log above)" >&2
    exit 1
fi
echo "setup: installed slurm-wlm and munge"
