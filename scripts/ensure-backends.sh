#!/usr/bin/env bash
# Make sure Postgres and RabbitMQ answer on localhost: start the local ones if installed,
# else bring them up with docker compose when Docker is available.
set -euo pipefail

PGHOST=${PGHOST:-127.0.0.1}; PGPORT=${PGPORT:-5432}
MQHOST=${MQHOST:-127.0.0.1}; MQPORT=${MQPORT:-5672}

port_open() { (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; }

wait_port() { # host port name seconds
  local deadline=$((SECONDS + $4))
  until port_open "$1" "$2"; do
    if (( SECONDS >= deadline )); then echo "ensure-backends: $3 is not reachable on $1:$2" >&2; return 1; fi
    sleep 0.5
  done
}

have_docker() { command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; }

if ! port_open "$PGHOST" "$PGPORT"; then
  if command -v pg_ctlcluster >/dev/null 2>&1 && [ -d /etc/postgresql ]; then
    echo "ensure-backends: starting the local Postgres cluster"
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start || true
  elif have_docker; then
    echo "ensure-backends: starting Postgres with docker compose"
    docker compose up -d postgres
  fi
  wait_port "$PGHOST" "$PGPORT" Postgres 60
fi

if ! port_open "$MQHOST" "$MQPORT"; then
  if command -v rabbitmq-server >/dev/null 2>&1; then
    echo "ensure-backends: starting the local RabbitMQ"
    rabbitmq-server -detached || true
  elif have_docker; then
    echo "ensure-backends: starting RabbitMQ with docker compose"
    docker compose up -d rabbitmq
  fi
  wait_port "$MQHOST" "$MQPORT" RabbitMQ 120
fi
# The AMQP port opens before the broker accepts sessions; wait for it to be fully booted.
if command -v rabbitmqctl >/dev/null 2>&1; then
  timeout 120 rabbitmqctl await_startup >/dev/null 2>&1 || true
fi
echo "ensure-backends: Postgres $PGHOST:$PGPORT and RabbitMQ $MQHOST:$MQPORT are up"
