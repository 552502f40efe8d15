"""The committed CRDs are exactly what the models generate, and they are structural."""

from __future__ import annotations

import pathlib
from typing import Any

import pydantic
import pytest
import yaml

from rolloutfleet import cli
from rolloutfleet.api import crdgen, fleet

REPO = pathlib.Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("directory", ["crds", "charts/rolloutfleet/crds"])
def test_committed_crds_match_the_models(directory: str) -> None:
    path = REPO / directory
    if not path.is_dir():
        pytest.skip(f"{directory} not present yet")
    assert cli.main(["crds", "--check", "--out", str(path)]) == 0, "run `rolloutfleet crds` and commit"


def test_check_fails_when_a_model_changes(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert cli.main(["crds", "--out", str(tmp_path)]) == 0
    assert cli.main(["crds", "--check", "--out", str(tmp_path)]) == 0

    class ChangedSpec(fleet.RolloutFleetSpec):
        new_knob: int = pydantic.Field(default=1, description="A field someone added without regenerating.")

    class ChangedFleet(fleet.RolloutFleet):
        spec: ChangedSpec

    monkeypatch.setattr(fleet, "RolloutFleet", ChangedFleet)
    assert cli.main(["crds", "--check", "--out", str(tmp_path)]) == 1


def walk(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    if isinstance(node, dict):
        out.append((path, node))
        for key, value in node.items():
            out += walk(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            out += walk(value, f"{path}[{i}]")
    return out


@pytest.mark.parametrize("name", sorted(crdgen.custom_resource_definitions()))
def test_schema_is_structural(name: str) -> None:
    crd = crdgen.custom_resource_definitions()[name]
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in walk(schema):
        assert "$ref" not in node, path
        assert "title" not in node or path.endswith(".properties"), path
        assert "additionalProperties" not in node or node["additionalProperties"] is not False, path
        assert not any(k.startswith("x-rolloutfleet") for k in node), path
        if "anyOf" in node:
            assert node.get("x-kubernetes-int-or-string") is True, path
        if ".properties." in path and not path.endswith(".properties") and "x-kubernetes-int-or-string" not in node:
            parent_is_properties = path.rsplit(".", 2)[-2] == "properties"
            if parent_is_properties:
                assert "type" in node, f"{path} has no type"


def test_crd_shape() -> None:
    crds = crdgen.custom_resource_definitions()
    fleet_crd = crds["rolloutfleet.io_rolloutfleets.yaml"]
    wrev_crd = crds["rolloutfleet.io_weightrevisions.yaml"]
    assert fleet_crd["spec"]["names"]["shortNames"] == ["rfleet"]
    assert wrev_crd["spec"]["names"]["shortNames"] == ["wrev"]
    fv = fleet_crd["spec"]["versions"][0]
    assert fv["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"
    wv = wrev_crd["spec"]["versions"][0]
    columns = [c["name"] for c in wv["additionalPrinterColumns"]]
    assert columns == ["Fleet", "Revision", "Phase", "Updated", "Age"]
    spec = wv["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["properties"]["revision"]["x-kubernetes-validations"][0]["rule"] == "self == oldSelf"
    assert spec["properties"]["fleetRef"]["x-kubernetes-validations"][0]["rule"] == "self == oldSelf"
    strategy = fv["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["updateStrategy"]
    assert strategy["properties"]["maxUnavailable"]["x-kubernetes-int-or-string"] is True
    assert strategy["default"] == {}


def test_rendering_is_stable() -> None:
    for crd in crdgen.custom_resource_definitions().values():
        text = crdgen.render(crd)
        assert text == crdgen.render(yaml.safe_load(text))


def test_fleet_status_records_served_weights() -> None:
    # Steady state and rollbacks read what the fleet serves from status.served, so deleting WeightRevision
    # objects never changes what is served (review: rollback to revision 0 when an object was gone).
    crd = crdgen.custom_resource_definitions()["rolloutfleet.io_rolloutfleets.yaml"]
    version = crd["spec"]["versions"][0]
    served = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["served"]
    assert set(served["properties"]) == {
        "revision",
        "name",
        "verifierPath",
        "verifierDigest",
        "draftPath",
        "draftDigest",
        "since",
        "verifierPushed",  # pushed weights have no path: a rollback to them needs the trainer (docs/push.md)
        "draftPushed",
    }
    assert served["required"] == ["revision"]
    assert "default" not in served  # absent until the operator records it
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["Replicas", "Ready", "Revision", "Target", "Available", "Age"]


def test_the_category_shadows_no_resource_name() -> None:
    # kubectl expands a category before it looks for a resource of that name: when the category was
    # `rolloutfleet`, `kubectl get rolloutfleet NAME` meant both kinds and failed ("you must specify only
    # one resource"). The integration test runs kubectl itself; this one keeps the rule cheap to check.
    crds = crdgen.custom_resource_definitions().values()
    taken = set()
    for crd in crds:
        names = crd["spec"]["names"]
        taken |= {names["singular"], names["plural"], names["kind"].lower(), *names.get("shortNames", [])}
    categories = {c for crd in crds for c in crd["spec"]["names"]["categories"]}
    assert categories == {crdgen.CATEGORY}
    assert not categories & taken


def test_the_statuses_per_pod_lists_are_atomic() -> None:
    # One entry per pod, written whole by the operator alone. As maps keyed by pod, every key was tracked in
    # managedFields on every write of the object: at 1,024 pods a one-field write of a RolloutFleet's status
    # took 388 ms (664 ms of the API server's CPU) against 146 ms atomic (bench/results/
    # fleet_status_write_cost.md), and a revision's pass makes two of them on its critical path.
    crds = crdgen.custom_resource_definitions()

    def status(name: str) -> dict[str, Any]:
        root = crds[name]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        return dict(root["properties"]["status"]["properties"])

    fleet_status, revision_status = (
        status("rolloutfleet.io_rolloutfleets.yaml"),
        status("rolloutfleet.io_weightrevisions.yaml"),
    )
    push = revision_status["push"]["properties"]
    per_pod = {
        "RolloutFleet status.pods": fleet_status["pods"],
        "WeightRevision status.pods": revision_status["pods"],
        "WeightRevision status.push.sessions": push["sessions"],
        "WeightRevision status.push.group.ranks": push["group"]["properties"]["ranks"],
    }
    for where, node in per_pod.items():
        assert node["x-kubernetes-list-type"] == "atomic", where
        assert "x-kubernetes-list-map-keys" not in node, where
