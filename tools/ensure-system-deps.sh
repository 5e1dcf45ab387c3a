#!/usr/bin/env bash
# Install the Debian packages kvpool's tests need (real services, not mocks), once.
# Idempotent: does nothing when everything is present. Needs root (CI and dev boxes run as root).
set -euo pipefail
need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
dpkg -s libibverbs1 >/dev/null 2>&1 || need+=(libibverbs1)   # mooncake-transfer-engine's runtime
if ((${#need[@]})); then
  echo "kvpool: installing system packages: ${need[*]}"
  if [ "$(id -u)" != 0 ]; then
    echo "kvpool: need root to apt-get install ${need[*]} (or install them yourself)" >&2
    exit 1
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
