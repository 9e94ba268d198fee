#!/usr/bin/env bash
# Make sure contracts/node_modules holds the exact tools contracts/package-lock.json pins (@redocly/cli, which
# `make lint` runs on the committed OpenAPI documents). Installs Node.js and npm from Debian when missing, then
# `npm ci` only when the lock file changed since the last install (a stamp), so a warm run costs nothing.
set -euo pipefail
cd "$(dirname "$0")/../contracts"

if ! command -v npm >/dev/null 2>&1; then
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "ensure-contract-tools: npm is missing and there is no apt-get; install Node.js 20+ and npm" >&2
    exit 1
  fi
  SUDO=""
  if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
  echo "ensure-contract-tools: installing Debian's nodejs and npm"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null
fi

stamp=node_modules/.package-lock.sha256
wanted=$(sha256sum package-lock.json | cut -d' ' -f1)
if [ -x node_modules/.bin/redocly ] && [ "$(cat "$stamp" 2>/dev/null)" = "$wanted" ]; then
  exit 0
fi
echo "ensure-contract-tools: npm ci (contracts/package-lock.json)"
npm ci --no-audit --no-fund --loglevel=error
echo "$wanted" > "$stamp"
