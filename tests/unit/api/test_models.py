"""Model and semantic validation of bad input: every error names its field path."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from rolloutfleet.api import validation

BASE_FLEET: dict[str, Any] = {
    "image": "vllm:0.33",
    "replicas": 2,
    "verifier": {"path": "/weights/p/step-0/v"},
    "draft": {"method": "eagle3", "path": "/weights/p/step-0/d"},
    "weights": {"claimName": "ckpt", "allowedRoots": ["/weights/p"]},
}

BASE_REV: dict[str, Any] = {
    "fleetRef": {"name": "p"},
    "revision": 3,
    "verifier": {"path": "/weights/p/step-3/v"},
    "draft": {"path": "/weights/p/step-3/d"},
}


def patched(base: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A deep copy of ``base`` with the dotted ``path`` set (``None``-valued REMOVE deletes it)."""
    out = copy.deepcopy(base)
    node = out
    keys = path.split(".")
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    if value is REMOVE:
        node.pop(keys[-1], None)
    else:
        node[keys[-1]] = value
    return out


REMOVE = object()


def fleet_errors(raw: dict[str, Any]) -> list[str]:
    spec, errors = validation.parse_fleet_spec(raw)
    if spec is not None:
        errors = validation.validate_fleet(spec)
    return [str(e) for e in errors]


def revision_errors(
    raw: dict[str, Any], fleet_raw: dict[str, Any] | None = BASE_FLEET, current: int | None = 2
) -> list[str]:
    spec, errors = validation.parse_revision_spec(raw)
    if spec is None:
        return [str(e) for e in errors]
    fleet_spec = None
    if fleet_raw is not None:
        fleet_spec, ferrs = validation.parse_fleet_spec(fleet_raw)
        assert not ferrs
    return [str(e) for e in validation.validate_revision(spec, fleet_spec, current_revision=current)]


def test_valid_objects_have_no_errors() -> None:
    assert fleet_errors(BASE_FLEET) == []
    assert revision_errors(BASE_REV) == []


FLEET_CASES = [
    ("image", REMOVE, "spec.image: Field required"),
    ("replicas", -1, "spec.replicas: Input should be greater than or equal to 0"),
    ("verifier.path", "weights/p/v", "spec.verifier.path: String should match pattern"),
    ("verifier.path", "/elsewhere/v", "spec.verifier.path: must be under one of spec.weights.allowedRoots"),
    ("verifier.path", "/weights/p/../q/v", "spec.verifier.path: must not contain a '..' segment"),
    ("draft.method", "medusa", "spec.draft.method: Input should be"),
    ("draft.path", REMOVE, "spec.draft.path: is required for draft method eagle3"),
    ("draft.path", "/tmp/d", "spec.draft.path: must be under one of spec.weights.allowedRoots"),
    ("draft.numSpeculativeTokens", 0, "spec.draft.numSpeculativeTokens: Input should be greater than or equal to 1"),
    ("draft.digest", "sha256:abc", "spec.draft.digest: String should match pattern"),
    ("weights.allowedRoots", [], "spec.weights.allowedRoots: List should have at least 1 item"),
    ("weights.allowedRoots", ["/data/p"], "spec.weights.allowedRoots[0]: must be under spec.weights.mountPath"),
    ("weights.claimName", "Bad_Name", "spec.weights.claimName: String should match pattern"),
    ("gpusPerPod", 6, "spec.tensorParallelSize: gpusPerPod (6) must be a multiple of tensorParallelSize (4)"),
    (
        "updateStrategy.maxUnavailable",
        "0%",
        "spec.updateStrategy.maxUnavailable: must be an integer >= 1 or a percentage",
    ),
    ("updateStrategy.maxUnavailable", 0, "spec.updateStrategy.maxUnavailable: must be >= 1"),
    ("updateStrategy.mode", "hot", "spec.updateStrategy.mode: Input should be 'sleep' or 'inflight'"),
    ("updateStrategy.timeouts.loadSeconds", 0, "spec.updateStrategy.timeouts.loadSeconds: Input should be greater"),
    ("parity.logprobsMode", "weird", "spec.parity.logprobsMode: Input should be"),
    (
        "extraArgs",
        ["--enable-prefix-caching"],
        "spec.extraArgs[0]: --enable-prefix-caching contradicts the parity profile",
    ),
    ("extraArgs", ["--max-model-len=4096", "--async-scheduling"], "spec.extraArgs[1]: --async-scheduling contradicts"),
    (
        "extraArgs",
        ["--logprobs-mode=raw_logprobs"],
        "spec.extraArgs[0]: --logprobs-mode contradicts the parity profile",
    ),
    ("extraArgs", ["--port", "9000"], "spec.extraArgs[0]: --port is set by the operator"),
    (
        "env",
        [{"name": "VLLM_SERVER_DEV_MODE", "value": "0"}],
        "spec.env[0].name: VLLM_SERVER_DEV_MODE is set by the operator",
    ),
    ("surprise", 1, "spec.surprise: Extra inputs are not permitted"),
]


@pytest.mark.parametrize(("path", "value", "expected"), FLEET_CASES, ids=[f"{c[0]}={c[1]!r}" for c in FLEET_CASES])
def test_bad_fleet_reports_field_path(path: str, value: Any, expected: str) -> None:
    raw = patched(BASE_FLEET, path, value)
    if path == "gpusPerPod":
        raw["tensorParallelSize"] = 4
    errors = fleet_errors(raw)
    assert any(e.startswith(expected) for e in errors), errors


def test_parity_contradiction_allowed_when_profile_off() -> None:
    raw = patched(BASE_FLEET, "extraArgs", ["--enable-prefix-caching", "--async-scheduling"])
    raw["parity"] = {"enabled": False}
    assert fleet_errors(raw) == []


def test_draft_path_without_draft_refused() -> None:
    raw = patched(BASE_FLEET, "draft", {"method": "none", "path": "/weights/p/d"})
    assert "spec.draft.path: must be unset when spec.draft.method is none" in fleet_errors(raw)


REVISION_CASES = [
    ("revision", -1, "spec.revision: Input should be greater than or equal to 0"),
    ("revision", 2, "spec.revision: must be newer than the fleet's current revision (2)"),
    ("fleetRef.name", "", "spec.fleetRef.name: String should have at least 1 character"),
    ("verifier.path", "relative/v", "spec.verifier.path: String should match pattern"),
    ("verifier.path", "/weights/p/../../etc", "spec.verifier.path: must not contain a '..' segment"),
    ("verifier.path", "/weights/other/v", "spec.verifier.path: must be under one of spec.weights.allowedRoots"),
    ("verifier.digest", "blake3:XYZ", "spec.verifier.digest: String should match pattern"),
    ("draft", REMOVE, "spec.draft: is required: the fleet co-updates a eagle3 draft"),
    ("draft.path", "/weights/q/d", "spec.draft.path: must be under one of spec.weights.allowedRoots"),
    ("parityProbe", {"promptTokenIds": [], "expectedLogprobs": [-1.0]}, "spec.parityProbe.promptTokenIds: List should"),
    ("strategy.maxUnavailable", "150%", "spec.strategy.maxUnavailable: must be an integer >= 1 or a percentage"),
]


@pytest.mark.parametrize(
    ("path", "value", "expected"), REVISION_CASES, ids=[f"{c[0]}={c[1]!r}" for c in REVISION_CASES]
)
def test_bad_revision_reports_field_path(path: str, value: Any, expected: str) -> None:
    errors = revision_errors(patched(BASE_REV, path, value))
    assert any(e.startswith(expected) for e in errors), errors


def test_revision_for_missing_fleet() -> None:
    assert revision_errors(BASE_REV, fleet_raw=None) == [
        "spec.fleetRef.name: RolloutFleet 'p' not found in this namespace"
    ]


def test_draft_given_for_fleet_without_draft() -> None:
    fleet = patched(BASE_FLEET, "draft", {"method": "none"})
    assert "spec.draft: the fleet has no draft (spec.draft.method is none)" in revision_errors(BASE_REV, fleet)


def test_draft_given_for_frozen_draft() -> None:
    fleet = patched(BASE_FLEET, "draft.policy", "frozen")
    assert "spec.draft: the fleet's draft is frozen; revisions must not carry a draft" in revision_errors(
        BASE_REV, fleet
    )


def test_camel_case_on_the_wire() -> None:
    spec, errors = validation.parse_fleet_spec(BASE_FLEET)
    assert spec is not None and not errors
    wire = spec.to_wire()
    assert wire["gpusPerPod"] == 1 and wire["updateStrategy"]["maxUnavailable"] == 1
    assert wire["parity"] == {
        "enabled": True,
        "logprobsMode": "processed_logprobs",
        "prefixCaching": "Disabled",
        "fp32LmHead": True,
        "asyncScheduling": False,
        "batchInvariant": False,
    }
