#!/usr/bin/env bash
# Install the Debian packages kvpool's tests need (real services, not mocks), once.
# Idempotent: does nothing when everything is present. Needs root (CI and dev boxes run as root).
#
# prometheus (Debian's Prometheus 2.x server and promtool): `kvpool-operator up --monitoring`
# runs it on 127.0.0.1 and the e2e suite queries it; `promtool test rules` checks the chart's
# alerts. Its package enables a system service bound to 0.0.0.0:9090; nothing may start it
# here, so the install runs under a policy-rc.d that refuses every service start (the usual
# Docker one already does; one is put in place for the install only when there is none), and
# the unit it enables is disabled again. Its recommended prometheus-node-exporter is not
# installed. 13-18 s on this 2-core box with the package lists fresh; ~100 MB on disk.
#
# nftables and iproute2: the chaos suite (`make chaos`, e2e/chaos/netns.py) partitions a worker's
# ports with nft inside a network namespace of its own (never the machine's), and adds a veth
# there for Mooncake; Debian's nftables service is not enabled by the package.
set -euo pipefail
need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
dpkg -s libibverbs1 >/dev/null 2>&1 || need+=(libibverbs1)   # mooncake-transfer-engine's runtime
{ command -v prometheus && command -v promtool; } >/dev/null 2>&1 || need+=(prometheus)
command -v nft >/dev/null 2>&1 || need+=(nftables)   # the chaos suite's network cut (e2e/chaos)
command -v ip >/dev/null 2>&1 || need+=(iproute2)    # its namespace's veth, for Mooncake
if ((${#need[@]})); then
  echo "kvpool: installing system packages: ${need[*]}"
  if [ "$(id -u)" != 0 ]; then
    echo "kvpool: need root to apt-get install ${need[*]} (or install them yourself)" >&2
    exit 1
  fi
  policy=/usr/sbin/policy-rc.d
  ours=""
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\n# kvpool: no service starts during the install\nexit 101\n' >"$policy"
    chmod 755 "$policy"
    ours=1
  fi
  trap '[ -n "$ours" ] && rm -f "$policy"' EXIT
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  if [[ " ${need[*]} " == *" prometheus "* ]]; then  # nor at the next boot, where systemd runs
    systemctl disable prometheus >/dev/null 2>&1 ||
      rm -f /etc/systemd/system/multi-user.target.wants/prometheus.service
  fi
fi
