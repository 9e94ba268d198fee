#!/usr/bin/env bash
# Make sure `iptables` is there for the infrastructure-fault tests (tests/faults: a silent leader's packets are
# dropped by cgroup). Installs Debian's package when missing; as a non-root user, or without apt-get, those tests
# skip and say why.
set -euo pipefail

if command -v iptables >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "ensure-fault-tools: no iptables (and no root apt-get): tests/faults will skip" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get install -y --no-install-recommends iptables >/dev/null 2>&1 \
  || { apt-get update >/dev/null && apt-get install -y --no-install-recommends iptables >/dev/null; }
