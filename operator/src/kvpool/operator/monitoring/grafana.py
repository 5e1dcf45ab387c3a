"""Dashboard JSON from ``panels`` with grafana-foundation-sdk (Grafana's own typed builders).

Why the SDK: Grafana's dashboard schema changes between releases; the SDK is generated from
that schema, so a field it does not know does not reach the JSON, and the JSON it writes is
what Grafana's sidecar loads. It is a generate-time dependency (the operator's ``dashboards``
extra, part of ``test``): ``python -m kvpool.operator.gen`` writes
``charts/kvpool/monitoring/dashboards/*.json`` and ``--check`` fails on drift; nothing the
operator runs imports this module.

Layout: two panels per row, 8 high; a ``datasource`` variable (any Prometheus), ``namespace``
and ``pool`` variables (multi, All) from the scraped series, and ``instance`` for the
per-instance dashboard. Every query goes to ``${datasource}``.
"""

from __future__ import annotations

import json
from typing import Any

from grafana_foundation_sdk.builders import common as gc
from grafana_foundation_sdk.builders import dashboard as gd
from grafana_foundation_sdk.builders import prometheus as gp
from grafana_foundation_sdk.builders import stat as gs
from grafana_foundation_sdk.builders import timeseries as gt
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import LegendDisplayMode, LegendPlacement
from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh

from kvpool.operator.monitoring.panels import DASHBOARDS, Dashboard, Panel

DASHBOARDS_DIR = "charts/kvpool/monitoring/dashboards"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
WIDTH, HEIGHT = 12, 8


def _variables(d: Dashboard) -> list[Any]:
    out: list[Any] = [gd.DatasourceVariable("datasource").label("Data source").type("prometheus")]
    chain = [
        ("namespace", 'label_values(up{job=~"kvpool-.*"}, namespace)'),
        ("pool", 'label_values(up{job=~"kvpool-.*", namespace=~"$namespace"}, pool)'),
    ]
    if d.per_instance:
        chain.append(
            (
                "instance",
                'label_values(up{job="kvpool-worker", namespace=~"$namespace", '
                'pool=~"$pool"}, instance)',
            )
        )
    for name, query in chain:
        out.append(
            gd.QueryVariable(name)
            .label(name.capitalize())
            .datasource(DATASOURCE)
            .query(query)
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .multi(True)
            .include_all(True)
            .all_value(".+")
        )
    return out


def _panel(p: Panel) -> Any:
    builder: Any
    if p.kind == "stat":  # the latest value of each series
        builder = gs.Panel().reduce_options(gc.ReduceDataOptions().calcs(["lastNotNull"]))
    else:  # a legend table with each series' last value and max
        legend = (
            gc.VizLegendOptions()
            .show_legend(True)
            .display_mode(LegendDisplayMode.TABLE)
            .placement(LegendPlacement.BOTTOM)
            .calcs(["lastNotNull", "max"])
        )
        builder = gt.Panel().legend(legend).fill_opacity(10)
    builder = builder.title(p.title).description(p.description).unit(p.unit)
    builder = builder.datasource(DATASOURCE).span(WIDTH).height(HEIGHT)
    for i, q in enumerate(p.queries):
        target = gp.Dataquery().expr(q.expr).legend_format(q.legend).ref_id(chr(ord("A") + i))
        builder = builder.with_target(target.datasource(DATASOURCE))
    return builder


def build(d: Dashboard) -> dict[str, Any]:
    """One dashboard as the JSON model Grafana imports."""
    b = (
        gd.Dashboard(d.title)
        .uid(d.uid)
        .description(d.description)
        .tags(["kvpool"])
        .time("now-1h", "now")
        .refresh("30s")
        .editable()
    )
    for v in _variables(d):
        b = b.with_variable(v)
    for p in d.panels:
        b = b.with_panel(_panel(p))
    model: dict[str, Any] = json.loads(json.dumps(b.build(), cls=JSONEncoder))
    return model


def dashboard_files() -> dict[str, str]:
    """Path relative to the repository root -> JSON text, one file per dashboard."""
    return {
        f"{DASHBOARDS_DIR}/{d.filename}": json.dumps(build(d), indent=2, sort_keys=True) + "\n"
        for d in DASHBOARDS
    }
