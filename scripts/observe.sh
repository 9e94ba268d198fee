#!/usr/bin/env bash
# `make observe`: next to a running `make run` stack, a local Prometheus (http://127.0.0.1:9090) scraping every
# service with the shipped alert rules loaded, and the local trace sink (OTLP/HTTP on 127.0.0.1:4318, spans in
# .run/traces.jsonl). Start the stack with tracing on to fill the sink: `OBSERVE=1 make run`. Ctrl-C stops both.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/ensure-promtool.sh  # Debian's prometheus package: the server and promtool
DIR=.run/observe
mkdir -p "$DIR/data"
.venv/bin/python -m tools.observe config "$DIR" >/dev/null
promtool check config "$DIR/prometheus.yml" >/dev/null

.venv/bin/python -m tools.trace_sink --host 127.0.0.1 --port 4318 --out .run/traces.jsonl &
SINK=$!
trap 'kill "$SINK" 2>/dev/null || true' EXIT

cat <<MSG

  Prometheus: http://127.0.0.1:9090   (Alerts: http://127.0.0.1:9090/alerts; try the query
              sum by (lane) (rate(dispatch_decisions_count[1m])) or monitor_dispatch_high_backlog)
  Traces:     .run/traces.jsonl       (after a collect-now: .venv/bin/monitorctl trace REQUEST_ID)

MSG
prometheus --config.file="$DIR/prometheus.yml" --storage.tsdb.path="$DIR/data" \
  --web.listen-address=127.0.0.1:9090 --log.level=warn
