"""Helpers of the chart tests: the helm/kubectl binaries, rendering, and the value sets every test uses.

Used by ``tests/chart`` (render and lint, no cluster) and ``tests/integration/chart`` (server dry runs and
the operator run with the chart's identity). The value sets are the defaults and three deployments users
ask for; ``{ns}`` stands for the release namespace and ``{other}`` for a second watched namespace.
"""

from __future__ import annotations

import copy
import pathlib
import subprocess
from collections.abc import Sequence
from typing import Any

import pytest
import yaml

from rolloutfleet.sandbox import binaries

REPO = pathlib.Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "rolloutfleet"
CRD_DIRS = (CHART / "crds", CHART / "charts" / "kopf-peering" / "crds")
RBAC_KINDS = ("ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding")


def tool(name: str) -> str:
    """Path of a built tool (helm, kubectl); fails with the command that builds it."""
    path = binaries.binary_path(name)
    if not path.exists():
        pytest.fail(f"{name} is not built: run `make binaries` (it builds {path})")
    return str(path)


def helm(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([tool("helm"), *args], input=stdin, capture_output=True, text=True, timeout=60, check=False)


def render(
    values: dict[str, Any], namespace: str = "rf-system", release: str = "rf", *extra: str
) -> tuple[str, list[dict[str, Any]]]:
    """``helm template`` with these values; returns the YAML text and the parsed objects."""
    out = helm(
        "template", release, str(CHART), "--namespace", namespace, "--values", "-", *extra, stdin=yaml.safe_dump(values)
    )
    assert out.returncode == 0, out.stderr
    return out.stdout, [d for d in yaml.safe_load_all(out.stdout) if d]


def to_yaml(objs: Sequence[dict[str, Any]]) -> str:
    return yaml.safe_dump_all(list(objs), sort_keys=False)


def kinds(objs: Sequence[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: Sequence[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = kinds(objs, kind)
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def operator_container(objs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    container: dict[str, Any] = one(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    return container


VALUE_SETS: dict[str, dict[str, Any]] = {
    "default": {},
    "namespaced": {"watch": {"namespaces": ["{ns}", "{other}"]}, "networkPolicy": {"enabled": True}},
    "cluster-wide": {"watch": {"clusterWide": True}},
    "ha": {"replicaCount": 2},
}


def values_for(name: str, ns: str, other: str = "default") -> dict[str, Any]:
    """A value set with its namespace placeholders filled in."""

    def fill(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: fill(v) for k, v in node.items()}
        if isinstance(node, list):
            return [fill(v) for v in node]
        if isinstance(node, str):
            return node.replace("{ns}", ns).replace("{other}", other)
        return node

    return fill(copy.deepcopy(VALUE_SETS[name]))
