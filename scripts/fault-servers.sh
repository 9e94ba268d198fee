#!/usr/bin/env bash
# A private Postgres cluster and a private RabbitMQ node for the fault suite (tests/faults): the suite stops,
# crashes and alarms them, and nothing else on the machine uses them, so `make faults` can run beside anything.
#
#   scripts/fault-servers.sh up     start both (idempotent), print the URLs as shell assignments
#   scripts/fault-servers.sh down   stop both and remove their data
#   scripts/fault-servers.sh env    print the URLs and control settings the tests read (FAULT_PG_DATA, ...)
#
# Postgres: initdb in $FAULT_DIR/pg (trust auth, like the machine's), port FAULT_PG_PORT (5433).
# RabbitMQ: node faults@localhost, AMQP port FAULT_MQ_PORT (5673), no plugins, data in $FAULT_DIR/mq.
# docs/reliability.md ("The fault suite").
set -euo pipefail

FAULT_DIR=${FAULT_DIR:-/tmp/monitoring-faults}
PG_PORT=${FAULT_PG_PORT:-5433}
MQ_PORT=${FAULT_MQ_PORT:-5673}
MQ_DIST_PORT=${FAULT_MQ_DIST_PORT:-25673}
MQ_NODE=${FAULT_MQ_NODE:-faults@localhost}
PG_DATA=$FAULT_DIR/pg
MQ_BASE=$FAULT_DIR/mq

pg_bin() {
  local dir
  dir=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n1)
  [ -n "$dir" ] || { echo "fault-servers: no Postgres binaries under /usr/lib/postgresql" >&2; exit 1; }
  echo "$dir"
}

as_postgres() { runuser -u postgres -- "$@"; }

mq_env() {
  export RABBITMQ_NODENAME=$MQ_NODE RABBITMQ_NODE_PORT=$MQ_PORT RABBITMQ_DIST_PORT=$MQ_DIST_PORT \
    RABBITMQ_MNESIA_BASE=$MQ_BASE/mnesia RABBITMQ_LOG_BASE=$MQ_BASE/log RABBITMQ_PID_FILE=$MQ_BASE/pid \
    RABBITMQ_ENABLED_PLUGINS_FILE=$MQ_BASE/enabled_plugins RABBITMQ_CONFIG_FILE=$MQ_BASE/rabbitmq
}

print_env() {
  echo "FAULT_DATABASE_URL=postgresql://postgres@127.0.0.1:$PG_PORT/postgres"
  echo "FAULT_AMQP_URL=amqp://guest:guest@127.0.0.1:$MQ_PORT/"
  echo "FAULT_PG_DATA=$PG_DATA"
  echo "FAULT_PG_BIN=$(pg_bin)"
  echo "FAULT_MQ_NODE=$MQ_NODE"
}

pg_up() {
  local bin; bin=$(pg_bin)
  mkdir -p "$FAULT_DIR"; chmod 755 "$FAULT_DIR"
  if [ ! -f "$PG_DATA/PG_VERSION" ]; then
    install -d -o postgres -g postgres "$PG_DATA"
    as_postgres "$bin/initdb" -D "$PG_DATA" -U postgres --auth=trust >/dev/null
    cat >>"$PG_DATA/postgresql.conf" <<EOF
port = $PG_PORT
listen_addresses = '127.0.0.1'
unix_socket_directories = '$PG_DATA'
max_connections = 100
EOF
  fi
  if ! as_postgres "$bin/pg_ctl" -D "$PG_DATA" status >/dev/null 2>&1; then
    as_postgres "$bin/pg_ctl" -D "$PG_DATA" -l "$PG_DATA/server.log" -w -t 60 start >/dev/null
  fi
}

mq_up() {
  mq_env
  install -d -o rabbitmq -g rabbitmq "$MQ_BASE"
  [ -f "$MQ_BASE/enabled_plugins" ] || { echo "[]." >"$MQ_BASE/enabled_plugins"; chown rabbitmq "$MQ_BASE/enabled_plugins"; }
  if ! rabbitmqctl -n "$MQ_NODE" status >/dev/null 2>&1; then
    (cd "$MQ_BASE" && rabbitmq-server -detached)
  fi
  rabbitmqctl -n "$MQ_NODE" await_startup --timeout 120 >/dev/null
  # A previous run's alarm or stopped application must not carry over.
  rabbitmqctl -n "$MQ_NODE" start_app >/dev/null 2>&1 || true
  rabbitmqctl -n "$MQ_NODE" set_vm_memory_high_watermark 0.4 >/dev/null
}

down() {
  local bin; bin=$(pg_bin)
  if [ -f "$PG_DATA/PG_VERSION" ]; then
    as_postgres "$bin/pg_ctl" -D "$PG_DATA" -m immediate -w stop >/dev/null 2>&1 || true
  fi
  mq_env
  rabbitmqctl -n "$MQ_NODE" stop >/dev/null 2>&1 || true
  rm -rf "$FAULT_DIR"
}

case "${1:-}" in
  up) pg_up; mq_up; print_env ;;
  down) down ;;
  env) print_env ;;
  *) echo "usage: $0 up|down|env" >&2; exit 2 ;;
esac
