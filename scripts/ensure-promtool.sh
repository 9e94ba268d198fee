#!/usr/bin/env bash
# Make sure `promtool` (Prometheus' rule checker and unit-test runner) is on PATH: the tests in
# tests/unit/test_prometheus_rules.py run it against deploy/k8s/base/prometheusrule.yaml.
# Installs Debian's `prometheus` package when missing, without leaving a Prometheus server running.
set -euo pipefail

if command -v promtool >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "ensure-promtool: promtool is missing and there is no apt-get; install Prometheus' promtool" >&2
  exit 1
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi

# The package's maintainer scripts would start the server (port 9090): forbid service starts for the
# duration of the install unless a policy is already in place.
policy=/usr/sbin/policy-rc.d
added_policy=""
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$policy" >/dev/null
  $SUDO chmod +x "$policy"
  added_policy=1
fi
cleanup() { if [ -n "$added_policy" ]; then $SUDO rm -f "$policy"; fi; }
trap cleanup EXIT

echo "ensure-promtool: installing Debian's prometheus package (for promtool)"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
# Belt and braces: stop a server that an init system started anyway.
if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet prometheus 2>/dev/null; then
  $SUDO systemctl disable --now prometheus >/dev/null 2>&1 || true
fi
command -v promtool >/dev/null 2>&1 || { echo "ensure-promtool: promtool still missing" >&2; exit 1; }
