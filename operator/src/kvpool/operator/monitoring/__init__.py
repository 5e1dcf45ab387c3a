"""Monitoring of cache domains: what Prometheus scrapes, the alerts, the Grafana dashboards.

Why a package of its own: the chart ships ServiceMonitors, a PrometheusRule and dashboard
ConfigMaps, and ``kvpool-operator up --monitoring`` runs a real Prometheus over a local
domain; both must come from one definition, or the local check proves nothing about the chart.
Everything here is pure data and pure functions (``scrape``, ``alerts``, ``panels``,
``catalog``); only ``grafana`` imports a third-party builder (grafana-foundation-sdk), at
generate time (``python -m kvpool.operator.gen``), never from the operator's runtime or the
local stack (an import-linter contract keeps it so).
"""
