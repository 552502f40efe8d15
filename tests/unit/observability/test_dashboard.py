"""Every metric the Grafana dashboard queries exists in the operator's /metrics, with the labels used.

The exposition comes from a real ``rolloutfleet.metrics.Metrics()`` whose labelled metrics are touched
once each, rendered by ``prometheus_client.generate_latest``; the dashboard's PromQL (panel targets and
variable queries) is tokenised to its series names and label names.
"""

from __future__ import annotations

import json
import pathlib
import re
from typing import Any

import prometheus_client as prom
import pytest

from rolloutfleet.metrics import Metrics

DASHBOARD = pathlib.Path(__file__).resolve().parents[3] / "docs" / "observability" / "grafana-dashboard.json"

KEYWORDS = frozenset(
    {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset"}
)
# Aggregations may put their by/without clause before the parenthesis: ``sum by (le) (...)``.
AGGREGATIONS = frozenset(
    {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk", "quantile"}
)
LABEL_LISTS = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
MATCHERS = re.compile(r"\{([^}]*)\}")
MATCHER_LABEL = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)")
IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def exported_series() -> dict[str, set[str]]:
    """Series name -> label names, as the operator's /metrics renders them."""
    metrics = Metrics()
    for value in vars(metrics).values():
        names = getattr(value, "_labelnames", None)
        if isinstance(value, prom.metrics.MetricWrapperBase) and names:
            value.labels(*["x"] * len(names))
    out: dict[str, set[str]] = {}
    for family in metrics.registry.collect():
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return out


def queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable."""
    out = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            for target in panel.get("targets") or []:
                out.append((f"panel {panel['title']!r} target {target.get('refId')}", target["expr"]))
            walk(panel.get("panels") or [])

    walk(dashboard["panels"])
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            inner = re.fullmatch(r"label_values\((.*),\s*([a-zA-Z_][a-zA-Z0-9_]*)\)", query)
            assert inner, f"variable {var['name']}: expected label_values(series, label), got {query!r}"
            out.append((f"variable {var['name']}", f"sum by ({inner.group(2)}) ({inner.group(1)})"))
    return out


def parse(expr: str) -> tuple[set[str], set[str]]:
    """(series names, label names) used by one PromQL expression."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)  # string literals
    text = re.sub(r"\$\{[^}]*\}|\$[a-zA-Z_]+", "", text)  # Grafana variables
    labels: set[str] = set()
    for block in MATCHERS.findall(text):
        labels.update(m.group(1) for m in MATCHER_LABEL.finditer(block))
    text = MATCHERS.sub(" ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range selectors
    for _, names in LABEL_LISTS.findall(text):
        labels.update(n.strip() for n in names.split(",") if n.strip())
    text = LABEL_LISTS.sub(lambda m: m.group(1) + " ", text)
    series = set()
    for m in IDENT.finditer(text):
        word = m.group(0)
        if word in KEYWORDS or word in AGGREGATIONS or text[m.end() :].lstrip().startswith("("):
            continue  # a keyword, or a function / aggregation
        if m.start() > 0 and (text[m.start() - 1].isdigit() or text[m.start() - 1] == "."):
            continue  # part of a number such as 1e3
        series.add(word)
    return series, labels


def test_parser_sees_series_and_labels() -> None:
    series, labels = parse(
        'histogram_quantile(0.95, sum by (le, step) (rate(a_bucket{mode=~"$mode", x!="y"}[$__rate_interval])))'
        " / on (step) group_left b_total"
    )
    assert series == {"a_bucket", "b_total"}
    assert labels == {"le", "step", "mode", "x"}


def test_dashboard_is_grafana_json() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 36
    ids = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for p in panels:
            ids.append(p["id"])
            assert p.get("title"), p
            if p["type"] != "row":
                assert p["datasource"]["uid"] == "${datasource}", p["title"]
                assert p["targets"], p["title"]
            walk(p.get("panels") or [])

    walk(dash["panels"])
    assert len(ids) == len(set(ids))


def test_every_queried_metric_exists() -> None:
    exported = exported_series()
    dash = json.loads(DASHBOARD.read_text())
    used: set[str] = set()
    problems = []
    for where, expr in queries(dash):
        series, labels = parse(expr)
        if not series:
            problems.append(f"{where}: no metric found in {expr!r}")
        for name in series:
            if name not in exported:
                problems.append(f"{where}: {name} is not exported by rolloutfleet.metrics")
        known = set().union(*(exported.get(n, set()) for n in series))
        for label in labels - known:
            problems.append(f"{where}: label {label!r} is not on {sorted(series)}")
        used |= series
    assert not problems, "\n".join(problems)
    # The four views are all there.
    for needed in (
        "rolloutfleet_update_step_duration_seconds_bucket",
        "rolloutfleet_pods_at_revision",
        "rolloutfleet_rollbacks_total",
        "rolloutfleet_revisions_total",
        "rolloutfleet_engine_request_duration_seconds_bucket",
    ):
        assert needed in used, needed


@pytest.mark.parametrize("bad", ["rolloutfleet_update_step_duration_seconds", "rolloutfleet_rollback_total"])
def test_a_wrong_name_would_be_caught(bad: str) -> None:
    series, _ = parse(f"sum(rate({bad}[5m]))")
    assert series == {bad} and bad not in exported_series()
