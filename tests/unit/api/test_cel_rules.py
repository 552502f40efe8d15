"""The CRDs' CEL rules: where they sit, and what they accept and refuse.

The API server is the first line of validation (a `kubectl apply` that breaks a rule is refused before
the operator sees it), so each rule here is asserted where it sits in the generated schema. When a CEL
library is installed (`pip install cel-python`), the rules are also evaluated on the same objects the API
server would see; the integration tier applies the CRDs to a real kube-apiserver, which also checks
their syntax and cost.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from rolloutfleet.api import crdgen

CRDS = crdgen.custom_resource_definitions()
FLEET_ROOT: dict[str, Any] = CRDS["rolloutfleet.io_rolloutfleets.yaml"]["spec"]["versions"][0]["schema"][
    "openAPIV3Schema"
]
WREV_ROOT: dict[str, Any] = CRDS["rolloutfleet.io_weightrevisions.yaml"]["spec"]["versions"][0]["schema"][
    "openAPIV3Schema"
]


def node(root: dict[str, Any], path: str) -> dict[str, Any]:
    """The schema node at a dotted property path (``[]`` steps into list items)."""
    out = root
    for key in [k for k in path.split(".") if k]:
        out = out["items"] if key == "[]" else out["properties"][key]
    return out


def rules(root: dict[str, Any], path: str) -> list[str]:
    return [r["rule"] for r in node(root, path).get("x-kubernetes-validations", [])]


def every_rule(schema: Any) -> list[str]:
    found: list[str] = []
    if isinstance(schema, dict):
        found += [r["rule"] for r in schema.get("x-kubernetes-validations", [])]
        for value in schema.values():
            found += every_rule(value)
    elif isinstance(schema, list):
        for value in schema:
            found += every_rule(value)
    return found


def cel_holds(rule: str, self: Any, old_self: Any = None) -> bool:
    """Evaluate one rule like the API server (``oldSelf`` only for transition rules)."""
    celpy = pytest.importorskip("celpy")
    env = celpy.Environment()
    program = env.program(env.compile(rule))
    activation = {"self": celpy.json_to_cel(self)}
    if old_self is not None:
        activation["oldSelf"] = celpy.json_to_cel(old_self)
    return bool(program.evaluate(activation))


def all_hold(rule_list: list[str], self: Any, old_self: Any = None) -> bool:
    return all(cel_holds(r, self, old_self) for r in rule_list)


@pytest.mark.parametrize("root", [FLEET_ROOT, WREV_ROOT], ids=["fleet", "wrev"])
def test_every_rule_compiles(root: dict[str, Any]) -> None:
    celpy = pytest.importorskip("celpy")
    for rule in every_rule(root):
        celpy.Environment().compile(rule)


# --- WeightRevision: a revision's sources never change under its number (review 12/18, 20b) ---------------

REV: dict[str, Any] = {
    "fleetRef": {"name": "p"},
    "revision": 3,
    "verifier": {"path": "/weights/p/step-3/v"},
    "draft": {"path": "/weights/p/step-3/d"},
    "parityProbe": {"promptTokenIds": [1, 2], "expectedLogprobs": [-0.5], "tolerance": 0.02},
    "allowOlder": False,
}


@pytest.mark.parametrize("field", ["fleetRef", "revision", "verifier", "draft", "parityProbe", "allowOlder"])
def test_revision_fields_are_immutable(field: str) -> None:
    # A revision number must name one checkpoint forever: re-applying the same object with other paths,
    # digests, probe or rollback flag would swap weights under one number, so every such change is refused
    # (publish a new revision instead). Only `strategy` (how to roll, not what) stays mutable.
    assert "self == oldSelf" in rules(WREV_ROOT, f"spec.{field}")


def test_revision_strategy_stays_mutable() -> None:
    # How a revision rolls (e.g. fewer concurrent loads while storage is slow) is not what it serves.
    assert "self == oldSelf" not in rules(WREV_ROOT, "spec.strategy")


def test_revision_source_change_refused_by_cel() -> None:
    verifier_rules = rules(WREV_ROOT, "spec.verifier")
    assert all_hold(verifier_rules, REV["verifier"], REV["verifier"])
    assert not all_hold(verifier_rules, {"path": "/weights/p/other"}, REV["verifier"])
    pinned = {"path": REV["verifier"]["path"], "digest": "blake3:" + "0" * 64}
    assert not all_hold(verifier_rules, pinned, REV["verifier"])


@pytest.mark.parametrize("field", ["draft", "parityProbe"])
def test_optional_source_cannot_appear_or_vanish(field: str) -> None:
    # A field-level rule does not run when the field is absent on one side, so the spec-level rule must
    # catch a draft (or probe) added to, or removed from, an existing revision.
    spec_rules = rules(WREV_ROOT, "spec")
    without = {k: v for k, v in REV.items() if k != field}
    assert all_hold(spec_rules, REV, copy.deepcopy(REV))
    assert all_hold(spec_rules, without, copy.deepcopy(without))
    assert not all_hold(spec_rules, REV, without)
    assert not all_hold(spec_rules, without, REV)


def test_revision_number_bounded_in_schema() -> None:
    # 2^62 was accepted and then blocked every later revision; 10^15 still fits a training step or a
    # millisecond timestamp (until the year 33658).
    assert node(WREV_ROOT, "spec.revision")["maximum"] == 10**15


# --- RolloutFleet --------------------------------------------------------------------------------------------

FLEET: dict[str, Any] = {
    "metadata": {"name": "policy"},
    "spec": {
        "verifier": {"path": "/weights/p/step-0/v"},
        "draft": {"method": "eagle3", "path": "/weights/p/step-0/d"},
    },
}
SERVED = {"served": {"revision": 0, "verifierPath": "/weights/p/step-0/v"}}


def test_fleet_name_fits_every_child_name() -> None:
    root_rules = rules(FLEET_ROOT, "")
    assert root_rules, "the fleet's name is checked at the root, where metadata.name is visible"
    ok = {"metadata": {"name": "a" * 52}, "spec": FLEET["spec"]}
    assert all_hold(root_rules, ok, ok)
    # 53 characters: the StatefulSet's controller-revision-hash label `<name>-<10-char hash>` would exceed
    # 63, so pods could never be created.
    long = {"metadata": {"name": "a" * 53}, "spec": FLEET["spec"]}
    assert not all_hold(root_rules, long, long)
    # The Service is named after the fleet and Service names are DNS-1035 labels: a leading digit or a dot
    # (both legal in a custom resource's name) would make the Service invalid.
    for bad in ("1policy", "policy.v2"):
        obj = {"metadata": {"name": bad}, "spec": FLEET["spec"]}
        assert not all_hold(root_rules, obj, obj), bad


def test_fleet_initial_weights_mutable_until_served() -> None:
    # Before the fleet has served anything a typo in the initial path must be fixable in place.
    root_rules = rules(FLEET_ROOT, "")
    moved = copy.deepcopy(FLEET)
    moved["spec"]["verifier"]["path"] = "/weights/p/other"
    assert all_hold(root_rules, moved, FLEET)


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("verifier.path", "/weights/p/other"),
        ("draft.path", "/weights/p/other-d"),
        ("draft.digest", "blake3:" + "0" * 64),
    ],
)
def test_fleet_initial_weights_immutable_once_served(path: str, value: str) -> None:
    # spec.verifier.path and the draft's path/digest define revision 0; once served, changing them would
    # make revision 0 mean two checkpoints. Other weights come through a WeightRevision.
    root_rules = rules(FLEET_ROOT, "")
    old = {**copy.deepcopy(FLEET), "status": SERVED}
    new = copy.deepcopy(old)
    section, key = path.split(".")
    new["spec"][section][key] = value
    assert all_hold(root_rules, old, copy.deepcopy(old))
    assert not all_hold(root_rules, new, old)


def test_env_is_a_map_keyed_by_name() -> None:
    # Duplicate names reached the StatefulSet apply and failed there with a 500; as a list-map the API
    # server refuses them on the fleet itself with a field error.
    env = node(FLEET_ROOT, "spec.env")
    assert env["x-kubernetes-list-type"] == "map" and env["x-kubernetes-list-map-keys"] == ["name"]


@pytest.mark.parametrize(
    ("name", "allowed"),
    [
        ("HF_HOME", True),
        ("ROLLOUTFLEET_LOAD_READAHEAD_BYTES", True),  # loader tuning, documented in docs/install.md
        ("ROLLOUTFLEET_HASH_THREADS", True),
        ("ROLLOUTFLEET_WEIGHT_ROOTS", False),
        ("ROLLOUTFLEET_CONTROL_TOKEN_FILE", False),
        ("ROLLOUTFLEET_DRAFT_PATH", False),
        ("VLLM_SERVER_DEV_MODE", False),
        ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", False),
        ("VLLM_API_KEY", False),
    ],
)
def test_env_name_rule(name: str, allowed: bool) -> None:
    name_rules = rules(FLEET_ROOT, "spec.env.[].name")
    assert name_rules
    assert all_hold(name_rules, name) is allowed


@pytest.mark.parametrize(
    ("mount", "roots", "allowed"),
    [
        ("/weights", ["/weights/p"], True),
        ("/weights", ["/weights"], True),
        ("/weights/", ["/weights/p/"], True),
        ("/data/models", ["/data/models/p"], True),
        ("/", ["/weights"], False),
        ("/weights", ["/"], False),
        ("/weights", ["/weightsx"], False),
        ("/proc", ["/proc/p"], False),
        ("/etc/models", ["/etc/models"], False),
        ("/dev/shm", ["/dev/shm"], False),
        ("/var/run/rolloutfleet", ["/var/run/rolloutfleet"], False),
        ("/var", ["/var/w"], False),
        ("/usr", ["/usr/w"], False),
        ("/weights/./x", ["/weights/./x"], False),
    ],
)
def test_weights_volume_rules(mount: str, roots: list[str], allowed: bool) -> None:
    volume = {"claimName": "ckpt", "mountPath": mount, "allowedRoots": roots}
    checks = [(rule, volume) for rule in rules(FLEET_ROOT, "spec.weights")]
    checks += [(rule, mount) for rule in rules(FLEET_ROOT, "spec.weights.mountPath")]
    checks += [(rule, root) for rule in rules(FLEET_ROOT, "spec.weights.allowedRoots.[]") for root in roots]
    verdicts = [cel_holds(rule, value) for rule, value in checks]
    assert all(verdicts) is allowed, list(zip(checks, verdicts, strict=True))


def test_allowed_root_colon_refused_by_cel() -> None:
    # The engines receive the roots ':'-separated; a ':' inside one would split it into two.
    root_rules = rules(FLEET_ROOT, "spec.weights.allowedRoots.[]")
    assert all_hold(root_rules, "/weights/p")
    assert not all_hold(root_rules, "/weights/x:/")


def test_source_is_a_path_or_a_push_never_both_and_a_push_has_a_digest() -> None:
    # The API server refuses what the operator could not act on: a source with both or neither, and a push
    # without the trainer's digest (nothing would verify what arrives).
    source_rules = [r for r in rules(WREV_ROOT, "spec.verifier") if "oldSelf" not in r]
    digest = "blake3:" + "1" * 64
    assert all_hold(source_rules, {"path": "/w/v"})
    assert all_hold(source_rules, {"push": {}, "digest": digest})
    assert not all_hold(source_rules, {"push": {}})
    assert not all_hold(source_rules, {"push": {}, "path": "/w/v", "digest": digest})
    assert not all_hold(source_rules, {"digest": digest})
    assert rules(WREV_ROOT, "spec.draft") == rules(WREV_ROOT, "spec.verifier")


@pytest.mark.parametrize(
    ("env", "allowed"),
    [
        ({"name": "VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "value": "60"}, True),
        ({"name": "VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "value": "3600"}, True),
        ({"name": "VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "value": "0"}, False),
        ({"name": "VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "value": "3601"}, False),
        ({"name": "VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "value": "5s"}, False),
        ({"name": "VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "value": ""}, False),
        ({"name": "VLLM_HTTP_TIMEOUT_KEEP_ALIVE"}, False),
        ({"name": "HF_HOME", "value": "5s"}, True),  # other variables' values are the user's
    ],
)
def test_engine_keep_alive_value_rule(env: dict[str, str], allowed: bool) -> None:
    # vLLM int()s it at start (any other value crashes every engine of the fleet); the operator keeps its
    # connections by it. The operator's validation (vllm_flags.valid_keep_alive) agrees with the rule.
    from rolloutfleet.api import vllm_flags

    env_rules = rules(FLEET_ROOT, "spec.env.[]")
    assert env_rules
    assert all_hold(env_rules, env) is allowed
    if env["name"] == vllm_flags.ENV_HTTP_KEEP_ALIVE:
        assert vllm_flags.valid_keep_alive(env.get("value", "")) is allowed
