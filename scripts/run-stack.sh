#!/usr/bin/env bash
# `make run`: seed a demo tenant once, then run every service and a fleet of simulated desktop
# clients under honcho (Ctrl-C stops them all; each service drains on SIGTERM).
set -euo pipefail
cd "$(dirname "$0")/.."

mkdir -p .run
# A local demo: DEV_MODE accepts this well-known secret (and an ops API without a token); production refuses both.
export DEV_MODE=${DEV_MODE:-1}
export GATEWAY_JWT_SECRET=${GATEWAY_JWT_SECRET:-local-demo-gateway-secret-change-me-0001}
# Phase 2 push-lease (docs/desktop-protocol.md "Push-lease"); DEV_MODE derives the tokens with the development key.
export PUSH_LEASE_ENABLED=${PUSH_LEASE_ENABLED:-1}
if [ "${OBSERVE:-}" = 1 ]; then
  # Every span to `make observe`'s trace sink (100 % sampled).
  export OTEL_TRACES_EXPORTER=otlp OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf \
         OTEL_EXPORTER_OTLP_ENDPOINT=${OTEL_EXPORTER_OTLP_ENDPOINT:-http://127.0.0.1:4318} OTEL_TRACES_SAMPLER=always_on
fi
DEMO=.run/demo.json
if [ ! -s "$DEMO" ]; then
  echo "run-stack: seeding demo data into ${DATABASE_URL} (once; delete $DEMO to seed again)"
  .venv/bin/monitorctl seed-demo --json --tenants 2 --brands 2 --questions 3 --clients 3 > "$DEMO.tmp"
  mv "$DEMO.tmp" "$DEMO"
fi

TENANT=$(.venv/bin/python -c 'import json,sys; t=json.load(open(sys.argv[1]))["tenants"][0]; print(t["tenant_id"], t["workspace_id"], t["user_id"], t["brands"][0]["brand_id"])' "$DEMO")
read -r TENANT_ID WORKSPACE_ID USER_ID BRAND_ID <<<"$TENANT"
TOKEN=$(.venv/bin/monitorctl token issue --tenant "$TENANT_ID" --workspace "$WORKSPACE_ID" --user "$USER_ID")
cat <<MSG

  The stack is starting. Try a collect-now as the demo user:

    curl -s -X POST http://127.0.0.1:8081/api/tenant/monitoring/brands/${BRAND_ID}/collect-now \\
         -H "Authorization: Bearer ${TOKEN}" -H 'Content-Type: application/json' -d '{"preempt": true}'

  then follow it with GET /api/tenant/monitoring/collect-requests/<request_id>, and watch
  .venv/bin/monitorctl status   (lane backlogs, clients online, outbox depth, dead letters)

MSG
exec .venv/bin/honcho start -f Procfile
