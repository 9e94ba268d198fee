#!/usr/bin/env bash
# The npm packages the tests run (pinned in each folder's package.json and package-lock.json): the AsyncAPI validator
# in contracts/ and the TypeScript desktop SDK in sdk/typescript/ (its conformance test runs on node's test runner).
# `npm ci` runs only when a folder's lock file changed since its last install; install scripts never run.
# Needs node >= 20 and npm (Debian's nodejs/npm packages are installed when apt-get can).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""
    if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
    echo "ensure-node-tools: installing node and npm (Debian packages)"
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq nodejs npm >/dev/null
  else
    echo "ensure-node-tools: node >= 20 and npm are needed; install them" >&2
    exit 1
  fi
fi
major=$(node -p 'process.versions.node.split(".")[0]')
if [ "$major" -lt 20 ]; then
  echo "ensure-node-tools: node $(node --version) is too old; node >= 20 is needed" >&2
  exit 1
fi

for dir in contracts sdk/typescript; do
  [ -f "$dir/package-lock.json" ] || continue
  stamp="$dir/node_modules/.lock-installed"
  if [ -f "$stamp" ] && cmp -s "$dir/package-lock.json" "$stamp"; then
    continue
  fi
  echo "ensure-node-tools: npm ci in $dir"
  (cd "$dir" && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error)
  cp "$dir/package-lock.json" "$stamp"
done
