#!/usr/bin/env bash
# `make run`: the whole stack under honcho, plus a demo fleet of simulated desktop clients.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/honcho start -f Procfile
