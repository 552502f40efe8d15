"""Model and semantic validation of bad input: every error names its field path."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from rolloutfleet.api import fleet as fleet_mod
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


# --- Review 15: spec.env, extraArgs and the fleet's name ------------------------------------------------------

ENV_REFUSED = [
    # Operator-owned: the operator sets these itself (resources/command.py); a second entry would either be
    # ignored or win, and a duplicate name fails the StatefulSet apply.
    ("VLLM_SERVER_DEV_MODE", "is set by the operator"),
    ("ROLLOUTFLEET_CONTROL_TOKEN_FILE", "is reserved for the operator"),
    ("ROLLOUTFLEET_DRAFT_POLICY", "is reserved for the operator"),
    ("ROLLOUTFLEET_DRAFT_PATH", "is reserved for the operator"),
    # Read by the worker to confine loads; a user value would widen spec.weights.allowedRoots.
    ("ROLLOUTFLEET_WEIGHT_ROOTS", "is reserved for the operator"),
    # vLLM serves /v1/load_lora_adapter without authentication when this is set.
    ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "unauthenticated"),
    # vLLM's --api-key from the environment: the operator's parity probe calls /v1 without a key.
    ("VLLM_API_KEY", "parity probe"),
]


@pytest.mark.parametrize(("name", "expected"), ENV_REFUSED, ids=[c[0] for c in ENV_REFUSED])
def test_env_cannot_override_operator_variables(name: str, expected: str) -> None:
    errors = fleet_errors(patched(BASE_FLEET, "env", [{"name": "HF_HOME", "value": "/x"}, {"name": name}]))
    assert any(e.startswith(f"spec.env[1].name: {name}") and expected in e for e in errors), errors


def test_env_loader_tuning_allowed() -> None:
    # docs/install.md tells users to tune the worker's loader through spec.env; the operator never sets these.
    env = [{"name": "ROLLOUTFLEET_LOAD_READAHEAD_BYTES", "value": "1073741824"}, {"name": "ROLLOUTFLEET_HASH_THREADS"}]
    assert fleet_errors(patched(BASE_FLEET, "env", env)) == []


def test_env_duplicate_names_refused() -> None:
    # The API server answered a 500 ("duplicate entries for key") when the StatefulSet was applied.
    env = [{"name": "HF_HOME", "value": "/a"}, {"name": "OMP_NUM_THREADS"}, {"name": "HF_HOME", "value": "/b"}]
    assert "spec.env[2].name: duplicate name HF_HOME (first at spec.env[0])" in fleet_errors(
        patched(BASE_FLEET, "env", env)
    )


EXTRA_ARGS_REFUSED = [
    # vLLM's argparse accepts each of these for an operator-owned flag; an exact-spelling match missed them.
    (["-tp", "2"], "--tensor-parallel-size is set by the operator"),
    (["-tp=2"], "--tensor-parallel-size is set by the operator"),
    (["--tensor_parallel_size=2"], "--tensor-parallel-size is set by the operator"),
    (["--tensor-parallel", "2"], "--tensor-parallel-size is set by the operator"),  # an argparse abbreviation
    (["--served_model_name", "x"], "--served-model-name is set by the operator"),
    (["--speculative-config.method=ngram"], "--speculative-config is set by the operator"),  # vLLM's dot form
    (["--no-enable-sleep-mode"], "--enable-sleep-mode is set by the operator"),
    (["--model", "/weights/p/x"], "--model is set by the operator"),
    (["--config", "/weights/p/vllm.yaml"], "--config"),
    (["--enable_prefix_caching"], "--enable-prefix-caching contradicts the parity profile"),
    (["--logprobs_mode=raw_logits"], "--logprobs-mode contradicts the parity profile"),
    (["--hf-overrides.head_dtype=bfloat16"], "--hf-overrides contradicts the parity profile"),
    (["--api-key", "k"], "parity probe"),
    (["--api_key=k"], "parity probe"),
]


@pytest.mark.parametrize(("args", "expected"), EXTRA_ARGS_REFUSED, ids=[" ".join(c[0]) for c in EXTRA_ARGS_REFUSED])
def test_extra_args_refused_in_every_spelling(args: list[str], expected: str) -> None:
    errors = fleet_errors(patched(BASE_FLEET, "extraArgs", args))
    assert any(e.startswith("spec.extraArgs[0]: ") and expected in e for e in errors), errors


def test_extra_args_that_are_not_operator_flags_pass() -> None:
    # Ordinary tuning must keep working, including short aliases and underscores of flags nobody owns.
    args = ["--max-model-len=4096", "--gpu_memory_utilization", "0.9", "-pp", "2", "-q", "fp8", "--enable-lora"]
    raw = patched(BASE_FLEET, "extraArgs", args)
    raw["gpusPerPod"] = 2
    assert fleet_errors(raw) == []


def test_runtime_lora_updating_refused_with_enable_lora() -> None:
    raw = patched(BASE_FLEET, "extraArgs", ["--enable-lora"])
    raw["env"] = [{"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "True"}]
    errors = fleet_errors(raw)
    assert any(e.startswith("spec.env[0].name: VLLM_ALLOW_RUNTIME_LORA_UPDATING") for e in errors), errors


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("a" * 53, "metadata.name: must be at most 52 characters"),
        ("1policy", "metadata.name: must start with a letter"),
        ("policy.v2", "metadata.name: must consist of lower-case letters, digits and '-'"),
    ],
)
def test_fleet_name_must_fit_child_names(name: str, expected: str) -> None:
    # The StatefulSet is named after the fleet, and its pods carry `controller-revision-hash:
    # <name>-<hash of up to 10 characters>`, a label value of at most 63: names over 52 make pods
    # uncreatable. The Services are `<name>` and `<name>-engines`: DNS-1035 labels (a letter first, no dot).
    spec, errors = validation.parse_fleet_spec(BASE_FLEET)
    assert spec is not None and not errors
    assert any(str(e).startswith(expected) for e in validation.validate_fleet(spec, name=name))
    assert validation.validate_fleet(spec, name="a" * 52) == []


# --- Review 15e: sleep strategy needs engines started with sleep mode -----------------------------------------


def test_sleep_override_refused_on_fleet_without_sleep_mode() -> None:
    # `--enable-sleep-mode` is only passed when the fleet's mode is sleep; an engine started without it has
    # no /sleep route, so a sleep-mode revision could never progress.
    fleet_raw = patched(BASE_FLEET, "updateStrategy", {"mode": "inflight"})
    rev = patched(BASE_REV, "strategy", {"mode": "sleep"})
    assert any(e.startswith("spec.strategy.mode: sleep needs") for e in revision_errors(rev, fleet_raw))
    assert revision_errors(patched(BASE_REV, "strategy", {"mode": "inflight"}), fleet_raw) == []
    assert revision_errors(rev) == []  # the base fleet sleeps


def test_sleep_mode_enabled_follows_the_fleet_mode() -> None:
    sleeping, _ = validation.parse_fleet_spec(BASE_FLEET)
    inflight, _ = validation.parse_fleet_spec(patched(BASE_FLEET, "updateStrategy", {"mode": "inflight"}))
    assert sleeping is not None and inflight is not None
    assert fleet_mod.sleep_mode_enabled(sleeping) and not fleet_mod.sleep_mode_enabled(inflight)


# --- Review 20: bounded revision numbers and deliberate rollback ---------------------------------------------


def test_revision_number_is_bounded() -> None:
    assert revision_errors(patched(BASE_REV, "revision", 10**15), current=None) == []
    errors = revision_errors(patched(BASE_REV, "revision", 2**62))
    assert any(e.startswith("spec.revision: Input should be less than or equal to 1000000000000000") for e in errors)


def test_allow_older_skips_only_the_not_newer_check() -> None:
    # A deliberate rollback: revision 1 after 2. Without allowOlder the monotonic rule refuses it.
    older = patched(BASE_REV, "revision", 1)
    assert any(e.startswith("spec.revision: must be newer") for e in revision_errors(older))
    rollback = patched(older, "allowOlder", True)
    assert revision_errors(rollback) == []
    # Every other check still applies.
    bad = patched(rollback, "verifier.path", "/weights/other/v")
    assert any(e.startswith("spec.verifier.path: must be under") for e in revision_errors(bad))


def test_allow_older_defaults_to_false() -> None:
    spec, _ = validation.parse_revision_spec(BASE_REV)
    assert spec is not None and spec.allow_older is False


# --- Review 22: paths and parity-probe contents ----------------------------------------------------------------

CONTROL_CHARS = ["\n", "\t", "\x1b", "\x7f", "\x00"]


@pytest.mark.parametrize("char", CONTROL_CHARS, ids=[repr(c) for c in CONTROL_CHARS])
def test_control_characters_in_paths_refused(char: str) -> None:
    errors = revision_errors(patched(BASE_REV, "verifier.path", f"/weights/p/step{char}3/v"))
    assert any(e.startswith("spec.verifier.path: String should match pattern") for e in errors), errors
    assert any(
        e.startswith("spec.weights.mountPath: String should match pattern")
        for e in fleet_errors(patched(BASE_FLEET, "weights.mountPath", f"/wei{char}ghts"))
    )


@pytest.mark.parametrize(
    "mount",
    ["/", "/proc", "/sys/x", "/dev", "/dev/shm", "/etc", "/etc/models", "/run", "/var/run/rolloutfleet", "/var"],
)
def test_system_mount_paths_refused(mount: str) -> None:
    raw = patched(BASE_FLEET, "weights.mountPath", mount)
    errors = fleet_errors(raw)
    assert any(e.startswith("spec.weights.mountPath: must not be") for e in errors), errors


def test_data_mount_paths_allowed() -> None:
    raw = patched(
        BASE_FLEET, "weights", {"claimName": "ckpt", "mountPath": "/data/ckpt", "allowedRoots": ["/data/ckpt"]}
    )
    raw["verifier"] = {"path": "/data/ckpt/v"}
    raw["draft"] = {"method": "mtp"}
    assert fleet_errors(raw) == []


def test_allowed_root_slash_refused() -> None:
    errors = fleet_errors(patched(BASE_FLEET, "weights.allowedRoots", ["/"]))
    assert any(e.startswith("spec.weights.allowedRoots[0]: must be under spec.weights.mountPath") for e in errors)


def test_mount_path_covers_the_operators_own_mounts() -> None:
    # api may not import resources; this pins that the refused list covers the mounts resources makes.
    from rolloutfleet.resources import labels

    for own in (labels.SHM_MOUNT, labels.TOKEN_MOUNT_DIR):
        raw = patched(BASE_FLEET, "weights.mountPath", own)
        assert any(e.startswith("spec.weights.mountPath: must not be") for e in fleet_errors(raw)), own


PROBE_CASES = [
    (
        {"promptTokenIds": [-1], "expectedLogprobs": [-0.1]},
        "spec.parityProbe.promptTokenIds[0]: Input should be greater",
    ),
    (
        {"promptTokenIds": [2**31], "expectedLogprobs": [-0.1]},
        "spec.parityProbe.promptTokenIds[0]: Input should be less",
    ),
    ({"promptTokenIds": [1], "expectedLogprobs": [0.5]}, "spec.parityProbe.expectedLogprobs[0]: Input should be less"),
    ({"promptTokenIds": [1], "expectedLogprobs": [float("nan")]}, "spec.parityProbe.expectedLogprobs[0]: Input should"),
    (
        {"promptTokenIds": [1], "expectedLogprobs": [float("-inf")]},
        "spec.parityProbe.expectedLogprobs[0]: Input should",
    ),
    ({"promptTokenIds": [1], "expectedLogprobs": [-0.1], "tolerance": float("nan")}, "spec.parityProbe.tolerance:"),
]


@pytest.mark.parametrize(("probe", "expected"), PROBE_CASES, ids=[str(i) for i in range(len(PROBE_CASES))])
def test_parity_probe_contents_checked(probe: dict[str, Any], expected: str) -> None:
    # Token ids index a vocabulary (non-negative, int32 on the engine); a logprob is log(p) <= 0 and finite.
    errors = revision_errors(patched(BASE_REV, "parityProbe", probe))
    assert any(e.startswith(expected) for e in errors), errors


def test_parity_probe_valid() -> None:
    probe = {"promptTokenIds": [0, 2**31 - 1], "expectedLogprobs": [0.0, -12.5], "tolerance": 0.05}
    assert revision_errors(patched(BASE_REV, "parityProbe", probe)) == []


def _full_featured_spec() -> Any:
    raw = copy.deepcopy(BASE_FLEET)
    raw["parity"] = {"batchInvariant": True}
    spec, errors = validation.parse_fleet_spec(raw)
    assert spec is not None and not errors
    return spec


def test_every_env_the_operator_sets_is_refused_in_spec_env() -> None:
    # api may not import resources; this pins the refusal table to what resources/command.py renders, so a
    # variable the operator starts setting cannot be overridden (or duplicated) through spec.env.
    from rolloutfleet.resources import command

    spec = _full_featured_spec()
    for env in command.engine_env(spec):
        raw = patched(BASE_FLEET, "env", [{"name": env["name"], "value": "x"}])
        raw["parity"] = {"batchInvariant": True}
        assert any(e.startswith("spec.env[0].name: ") for e in fleet_errors(raw)), env["name"]


def test_every_flag_the_operator_renders_is_refused_in_extra_args() -> None:
    # Same pin for flags: each flag resources/command.py renders is owned or pinned by the parity profile.
    from rolloutfleet.resources import command

    spec = _full_featured_spec()
    for arg in command.engine_args(spec):
        if not arg.startswith("--"):
            continue  # the model path and flag values
        raw = patched(BASE_FLEET, "extraArgs", [arg])
        assert any(e.startswith("spec.extraArgs[0]: ") for e in fleet_errors(raw)), arg


def test_allowed_root_with_colon_refused() -> None:
    # resources/command.py hands the engines the roots ':'-separated (ROLLOUTFLEET_WEIGHT_ROOTS): a root
    # `/weights/x:/` would reach the engine as the two roots `/weights/x` and `/`.
    errors = fleet_errors(patched(BASE_FLEET, "weights.allowedRoots", ["/weights/p", "/weights/x:/"]))
    assert any(e.startswith("spec.weights.allowedRoots[1]: must not contain ':'") for e in errors), errors


# --- pushed sources (docs/push.md): refused with a field path, nothing moves -------------------------------

PUSH_FLEET = patched(BASE_FLEET, "weightTransfer", {"backend": "ipc"})
PUSHED = {"push": {}, "digest": "blake3:" + "1" * 64}


def test_pushed_revision_on_a_transfer_fleet_is_valid() -> None:
    rev = patched(patched(BASE_REV, "verifier", PUSHED), "draft", PUSHED)
    assert revision_errors(rev, PUSH_FLEET) == []
    mixed = patched(BASE_REV, "draft", PUSHED)  # a path verifier with a pushed draft
    assert revision_errors(mixed, PUSH_FLEET) == []


@pytest.mark.parametrize(
    ("path", "value", "fleet", "expected"),
    [
        ("verifier", PUSHED, BASE_FLEET, "spec.verifier.push: the fleet has no spec.weightTransfer"),
        ("draft", PUSHED, BASE_FLEET, "spec.draft.push: the fleet has no spec.weightTransfer"),
        ("verifier", {"push": {}}, PUSH_FLEET, "spec.verifier.digest: is required with push"),
        ("verifier", {"push": {}, "path": "/weights/p/v", "digest": PUSHED["digest"]}, PUSH_FLEET, "exactly one"),
        ("verifier", {"digest": PUSHED["digest"]}, PUSH_FLEET, "spec.verifier: set exactly one of path and push"),
        (
            "verifier",
            PUSHED,
            patched(patched(BASE_FLEET, "weightTransfer", {"backend": "nccl"}), "updateStrategy.rollout", "Rolling"),
            "spec.verifier.push: a push over NCCL reaches every engine of the transfer group at once",
        ),
    ],
)
def test_bad_push_sources_name_their_field(path: str, value: Any, fleet: dict[str, Any], expected: str) -> None:
    errors = revision_errors(patched(BASE_REV, path, value), fleet)
    assert any(expected in e for e in errors), errors


def test_nccl_pushes_need_all_at_once() -> None:
    # One broadcast from the trainer feeds the whole group: a Rolling wave cannot be fed alone.
    nccl = patched(BASE_FLEET, "weightTransfer", {"backend": "nccl"})
    assert revision_errors(patched(BASE_REV, "verifier", PUSHED), nccl) == []
    rolling = patched(patched(BASE_REV, "verifier", PUSHED), "strategy", {"rollout": "Rolling"})
    errors = revision_errors(rolling, nccl)
    assert any(e.startswith("spec.strategy.rollout: a push over NCCL") for e in errors), errors
    assert revision_errors(patched(BASE_REV, "strategy", {"rollout": "Rolling"}), nccl) == []  # a path update


@pytest.mark.parametrize("backend", ["nccl", "ipc"])
def test_a_push_to_more_pods_than_its_handshake_can_list_is_refused(backend: str) -> None:
    # A pushed revision's status lists every pod (status.push.sessions, and with NCCL the group's ranks): unlike
    # status.pods it cannot leave one out, the trainer must reach every engine. etcd stores an object of at most
    # 1.5 MiB, and at 20,000 pods those lists are 2.4-6 MB. Accepted, such a revision took its pods out of service
    # and opened their sessions, and then no write of its handshake could ever be stored: the trainer never saw a
    # session. Refused instead, before any pod moves, by the same rule the trainer's publish runs.
    large = patched(patched(BASE_FLEET, "weightTransfer", {"backend": backend}), "replicas", 20_000)
    errors = revision_errors(patched(BASE_REV, "verifier", PUSHED), large)
    assert any(e.startswith("spec.verifier.push: ") and "20000 pods" in e for e in errors), errors
    errors = revision_errors(patched(BASE_REV, "draft", PUSHED), large)
    assert any(e.startswith("spec.draft.push: ") for e in errors), errors
    assert revision_errors(BASE_REV, large) == []  # from a path, a fleet of any size
    assert revision_errors(patched(BASE_REV, "verifier", PUSHED), patched(large, "replicas", 1024)) == []


def test_pushed_draft_for_a_fleet_without_a_draft_refused() -> None:
    fleet = patched(patched(PUSH_FLEET, "draft", {"method": "none"}), "draft.path", REMOVE)
    errors = revision_errors(patched(BASE_REV, "draft", PUSHED), fleet)
    assert any(e.startswith("spec.draft: the fleet has no draft") for e in errors), errors


def test_nccl_options_only_with_nccl() -> None:
    errors = fleet_errors(patched(BASE_FLEET, "weightTransfer", {"backend": "ipc", "nccl": {"port": 29600}}))
    assert any(e.startswith("spec.weightTransfer.nccl: is only used with backend nccl") for e in errors), errors


def test_weight_transfer_flag_and_insecure_serialization_env_are_the_operators() -> None:
    errors = fleet_errors(patched(PUSH_FLEET, "extraArgs", ["--weight-transfer-config", '{"backend":"nccl"}']))
    assert any("spec.extraArgs" in e for e in errors), errors
    errors = fleet_errors(patched(BASE_FLEET, "env", [{"name": "VLLM_ALLOW_INSECURE_SERIALIZATION", "value": "1"}]))
    assert any("VLLM_ALLOW_INSECURE_SERIALIZATION" in e for e in errors), errors


@pytest.mark.parametrize("value", ["0", "-1", "5s", "1.5", "", "3601"])
def test_engine_keep_alive_must_be_whole_seconds(value: str) -> None:
    # vLLM reads VLLM_HTTP_TIMEOUT_KEEP_ALIVE with int() at start: anything else would crash every engine of the
    # fleet; the operator also derives how long it keeps its connections to the engines from it.
    env = [{"name": "HF_HOME", "value": "/x"}, {"name": "VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "value": value}]
    errors = fleet_errors(patched(BASE_FLEET, "env", env))
    assert any(e.startswith("spec.env[1].value: VLLM_HTTP_TIMEOUT_KEEP_ALIVE must be whole seconds") for e in errors)


def test_engine_keep_alive_in_range_passes() -> None:
    for value in ("1", "60", "3600"):
        env = [{"name": "VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "value": value}]
        assert fleet_errors(patched(BASE_FLEET, "env", env)) == [], value
