#!/usr/bin/env bash
# Installs Debian's chromium, the headless browser tests/test_dashboard.py drives with playwright
# (playwright's own browser download does not work here). Quick when it is there already; as another
# user than root it only says it is missing (the browser tests then skip).
set -euo pipefail
command -v chromium > /dev/null && exit 0
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get > /dev/null; then
    echo "setup: chromium missing; as root on Debian this installs it (the dashboard's browser tests skip)" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
if ! { apt-get update -q && apt-get install -y -q --no-install-recommends chromium; } \
        > /tmp/paratrain-setup-chromium.log 2>&1; then
    cat /tmp/paratrain-setup-chromium.log
    echo "setup: installing chromium failed (log above)" >&2
    exit 1
fi
echo "setup: installed chromium"
