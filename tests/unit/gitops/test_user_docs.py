"""The user docs name what the code has: every operator metric is in docs/metrics.md, the docs the chart's
NOTES point at exist, and the GitOps examples parse."""

from __future__ import annotations

import pathlib

import pytest
import yaml

from rolloutfleet.metrics import Metrics

pytestmark = pytest.mark.unit

REPO = pathlib.Path(__file__).resolve().parents[3]


def test_every_metric_is_documented() -> None:
    text = (REPO / "docs" / "metrics.md").read_text()
    names = {metric.name for metric in Metrics().registry.collect()}
    assert names, "no metrics registered"
    for name in sorted(names):
        # prometheus_client reports counters without their _total suffix.
        documented = f"`{name}`" in text or f"`{name}_total`" in text
        assert documented, f"{name} is missing from docs/metrics.md"


@pytest.mark.parametrize(
    "doc", ["install.md", "metrics.md", "troubleshooting.md", "gitops/README.md", "gitops/publish_and_wait.py"]
)
def test_docs_named_by_the_chart_exist(doc: str) -> None:
    assert (REPO / "docs" / doc).is_file()
    assert f"docs/{doc.split('/')[0]}" in (REPO / "charts/rolloutfleet/templates/NOTES.txt").read_text()


def test_gitops_examples_parse() -> None:
    gitops = REPO / "docs" / "gitops"
    files = [*sorted((gitops / "flux").rglob("*.yaml")), gitops / "argocd" / "argocd-cm.yaml"]
    for path in files:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        assert docs and all("apiVersion" in d and "kind" in d for d in docs), path
