"""Every example manifest validates against the models and the semantic rules."""

from __future__ import annotations

import pathlib

import pytest
import yaml

from rolloutfleet.api import validation

EXAMPLES = pathlib.Path(__file__).resolve().parents[3] / "examples"


def manifests() -> list[pathlib.Path]:
    return sorted(EXAMPLES.glob("*.yaml"))


def test_there_are_examples() -> None:
    kinds = [yaml.safe_load(p.read_text())["kind"] for p in manifests()]
    assert kinds.count("RolloutFleet") >= 1 and kinds.count("WeightRevision") >= 2


@pytest.mark.parametrize("path", manifests(), ids=lambda p: p.name)
def test_example_is_valid(path: pathlib.Path) -> None:
    doc = yaml.safe_load(path.read_text())
    fleets = {
        yaml.safe_load(p.read_text())["metadata"]["name"]: yaml.safe_load(p.read_text())["spec"]
        for p in manifests()
        if yaml.safe_load(p.read_text())["kind"] == "RolloutFleet"
    }
    if doc["kind"] == "RolloutFleet":
        spec, errors = validation.parse_fleet_spec(doc["spec"])
        assert spec is not None, errors
        assert validation.validate_fleet(spec, name=doc["metadata"]["name"]) == []
    else:
        spec_r, errors = validation.parse_revision_spec(doc["spec"])
        assert spec_r is not None, errors
        fleet_spec, _ = validation.parse_fleet_spec(fleets[spec_r.fleet_ref.name])
        assert validation.validate_revision(spec_r, fleet_spec, current_revision=0) == []
