"""The sandbox's kwok stages follow a kubelet's readiness rule (``cluster.with_kubelet_readiness``).

The integration test ``test_a_gated_pod_is_ready_only_while_its_weights_gate_is_true_as_a_kubelet_decides`` runs
them on kwok; these pin the text they are made from: kwok's own stages as the build copies them, which a new kwok
version could change under the edit.
"""

from __future__ import annotations

import pytest
import yaml

from rolloutfleet.resources import labels
from rolloutfleet.sandbox import binaries, cluster

pytestmark = pytest.mark.unit


def _stage(name: str, conditions: str) -> str:
    """A kwok Stage document as kwok's own stages.yaml writes one, reduced to its status template."""
    head = f"apiVersion: kwok.x-k8s.io/v1alpha1\nkind: Stage\nmetadata:\n  name: {name}\nspec:\n  next:\n"
    return head + "    statusTemplate: |\n      conditions:\n" + conditions


POD_READY = _stage(
    "pod-ready",
    """\
      - lastTransitionTime: {{ $now | Quote }}
        status: "True"
        type: Initialized
      - lastTransitionTime: {{ $now | Quote }}
        status: "True"
        type: Ready
      - lastTransitionTime: {{ $now | Quote }}
        status: "True"
        type: ContainersReady
""",
)
NODE = _stage(
    "node-initialize",
    """\
      - status: "True"
        type: Ready
""",
)


def test_a_gated_pod_starts_not_ready_and_two_stages_follow_the_weights_gate() -> None:
    out = cluster.with_kubelet_readiness(NODE + "---\n" + POD_READY)
    stages = {s["metadata"]["name"]: s for s in yaml.safe_load_all(out) if s}
    assert set(stages) == {"node-initialize", "pod-ready", "pod-gate-opened-ready", "pod-gate-closed-not-ready"}
    template = stages["pod-ready"]["spec"]["next"]["statusTemplate"]
    assert 'status: {{ if .spec.readinessGates }}"False"{{ else }}"True"{{ end }}\n  type: Ready' in template
    assert 'status: "True"\n  type: ContainersReady' in template  # the containers are ready all the same
    assert stages["node-initialize"]["spec"]["next"]["statusTemplate"].count('"True"') == 1  # nodes untouched
    for name in ("pod-gate-opened-ready", "pod-gate-closed-not-ready"):
        keys = [e["key"] for e in stages[name]["spec"]["selector"]["matchExpressions"]]
        assert any(labels.WEIGHTS_READY_CONDITION in k for k in keys), keys
        # kwok renders the template, then reads it as YAML: the time must be the template's call, not a string
        assert "- lastTransitionTime: {{ Now | Quote }}\n" in stages[name]["spec"]["next"]["statusTemplate"]


def test_kwok_stages_without_a_pod_ready_condition_are_refused_not_passed_through() -> None:
    """A kwok whose pod-ready stage changed shape would otherwise leave every pod Ready from the start, silently."""
    with pytest.raises(cluster.ClusterError, match="pod-ready"):
        cluster.with_kubelet_readiness(NODE)
    with pytest.raises(cluster.ClusterError, match="Ready condition"):
        cluster.with_kubelet_readiness(POD_READY.replace("type: Ready\n", "type: Started\n"))


def test_the_built_kwok_stages_take_the_edit() -> None:
    try:
        stages = binaries.asset_path("kwok", "stages.yaml").read_text()
    except OSError as exc:  # (a machine without the built control plane)
        pytest.skip(f"kwok's stages are not built here: {exc}")
    out = cluster.with_kubelet_readiness(cluster.without_gate_stage(stages))
    assert "pod-gate-closed-not-ready" in out and "{{ if .spec.readinessGates }}" in out
