"""Semantic validation: the rules the CRD schema cannot express, as pure functions.

Called first in every reconcile (and by tests and ``rolloutfleet publish``). Each function returns a list
of ``FieldError``s with the field path in the API's camelCase (``spec.draft.path: ...``); an empty list
means valid. Nothing here touches the cluster or the engines.
"""

from __future__ import annotations

import dataclasses
import posixpath
import re

import pydantic

from rolloutfleet.api import fleet, revision, vllm_flags
from rolloutfleet.api.fleet import DraftMethod, DraftPolicy, RolloutFleetSpec
from rolloutfleet.api.revision import WeightRevisionSpec


@dataclasses.dataclass(frozen=True)
class FieldError:
    """One problem at one field path."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


def summary(errors: list[FieldError]) -> str:
    """One line for a condition message or an event."""
    return "; ".join(str(e) for e in errors)


def _pydantic_errors(exc: pydantic.ValidationError, prefix: str) -> list[FieldError]:
    out = []
    for err in exc.errors(include_url=False):
        parts = [prefix, *(str(p) if not isinstance(p, int) else f"[{p}]" for p in err["loc"])]
        path = ".".join(p for p in parts if p).replace(".[", "[")
        out.append(FieldError(path, err["msg"]))
    return out


def parse_fleet_spec(raw: object) -> tuple[RolloutFleetSpec | None, list[FieldError]]:
    """Parse a fleet spec from the wire (camelCase dict); errors carry ``spec.``-prefixed paths."""
    try:
        return RolloutFleetSpec.model_validate(raw), []
    except pydantic.ValidationError as exc:
        return None, _pydantic_errors(exc, "spec")


def parse_revision_spec(raw: object) -> tuple[WeightRevisionSpec | None, list[FieldError]]:
    """Parse a WeightRevision spec from the wire; errors carry ``spec.``-prefixed paths."""
    try:
        return WeightRevisionSpec.model_validate(raw), []
    except pydantic.ValidationError as exc:
        return None, _pydantic_errors(exc, "spec")


def is_under(path: str, root: str) -> bool:
    """Whether ``path`` lies at or under ``root``, after normalisation (``..`` can never escape)."""
    norm_path = posixpath.normpath(path)
    norm_root = posixpath.normpath(root)
    return norm_path == norm_root or norm_path.startswith(norm_root.rstrip("/") + "/")


def check_path(path: str, field: str, allowed_roots: list[str]) -> list[FieldError]:
    """An absolute path without ``..`` segments, under one of ``allowed_roots``."""
    if not path.startswith("/"):
        return [FieldError(field, "must be an absolute path")]
    if ".." in path.split("/"):
        return [FieldError(field, "must not contain a '..' segment")]
    if not any(is_under(path, root) for root in allowed_roots):
        return [FieldError(field, f"must be under one of spec.weights.allowedRoots ({', '.join(allowed_roots)})")]
    return []


def validate_fleet(spec: RolloutFleetSpec) -> list[FieldError]:
    """Rules of a fleet spec beyond its schema."""
    errors: list[FieldError] = []
    if spec.gpus_per_pod % spec.tensor_parallel_size != 0:
        errors.append(
            FieldError(
                "spec.tensorParallelSize",
                f"gpusPerPod ({spec.gpus_per_pod}) must be a multiple of tensorParallelSize "
                f"({spec.tensor_parallel_size})",
            )
        )
    roots = spec.weights.allowed_roots
    if not roots:
        errors.append(FieldError("spec.weights.allowedRoots", "must list at least one directory"))
    for index, root in enumerate(roots):
        if not is_under(root, spec.weights.mount_path):
            errors.append(
                FieldError(
                    f"spec.weights.allowedRoots[{index}]",
                    f"must be under spec.weights.mountPath ({spec.weights.mount_path})",
                )
            )
    if roots:
        errors += check_path(spec.verifier.path, "spec.verifier.path", roots)
    draft = spec.draft
    if draft.method in fleet.METHODS_WITH_OWN_WEIGHTS:
        if draft.path is None:
            errors.append(FieldError("spec.draft.path", f"is required for draft method {draft.method.value}"))
        elif roots:
            errors += check_path(draft.path, "spec.draft.path", roots)
    elif draft.method == DraftMethod.NONE:
        if draft.path is not None:
            errors.append(FieldError("spec.draft.path", "must be unset when spec.draft.method is none"))
        if draft.policy == DraftPolicy.FROZEN:
            errors.append(FieldError("spec.draft.policy", "frozen needs a draft (spec.draft.method is none)"))
    if draft.digest is not None and draft.policy != DraftPolicy.FROZEN:
        errors.append(FieldError("spec.draft.digest", "is only used with spec.draft.policy frozen"))
    errors += _validate_max_unavailable(spec.update_strategy.max_unavailable, "spec.updateStrategy.maxUnavailable")
    errors += validate_extra_args(spec)
    return errors


_PERCENT = re.compile(r"^([1-9][0-9]?|100)%$")


def _validate_max_unavailable(value: int | str | None, field: str) -> list[FieldError]:
    if value is None:
        return []
    if isinstance(value, int):
        return [] if value >= 1 else [FieldError(field, "must be >= 1")]
    return [] if _PERCENT.match(value) else [FieldError(field, "must be an integer >= 1 or a percentage 1%..100%")]


def validate_extra_args(spec: RolloutFleetSpec) -> list[FieldError]:
    """Extra vLLM args must not override operator-owned flags, nor contradict an enabled parity profile."""
    errors: list[FieldError] = []
    for index, arg in enumerate(spec.extra_args):
        field = f"spec.extraArgs[{index}]"
        name = vllm_flags.flag_name(arg)
        if name in vllm_flags.OPERATOR_OWNED or name == vllm_flags.ENABLE_SLEEP_MODE:
            errors.append(FieldError(field, f"{name} is set by the operator from the spec; remove it"))
            continue
        if not spec.parity.enabled:
            continue
        for flag in vllm_flags.PARITY_FLAGS:
            if name in flag.contradicted_by:
                errors.append(
                    FieldError(
                        field,
                        f"{name} contradicts the parity profile ({flag.why}); "
                        "set spec.parity.enabled: false to pass it",
                    )
                )
    for index, env in enumerate(spec.env):
        if env.name in (vllm_flags.ENV_DEV_MODE,) or (
            spec.parity.enabled and env.name == vllm_flags.ENV_BATCH_INVARIANT
        ):
            errors.append(FieldError(f"spec.env[{index}].name", f"{env.name} is set by the operator from the spec"))
    return errors


def validate_revision(
    spec: WeightRevisionSpec,
    fleet_spec: RolloutFleetSpec | None,
    *,
    current_revision: int | None = None,
    fleet_name_found: bool = True,
) -> list[FieldError]:
    """Rules of a WeightRevision against its fleet (``fleet_spec`` None: the fleet was not found)."""
    if fleet_spec is None or not fleet_name_found:
        return [FieldError("spec.fleetRef.name", f"RolloutFleet {spec.fleet_ref.name!r} not found in this namespace")]
    errors: list[FieldError] = []
    roots = fleet_spec.weights.allowed_roots
    errors += check_path(spec.verifier.path, "spec.verifier.path", roots)
    draft = fleet_spec.draft
    if spec.draft is not None:
        if draft.method == DraftMethod.NONE:
            errors.append(FieldError("spec.draft", "the fleet has no draft (spec.draft.method is none)"))
        elif draft.policy == DraftPolicy.FROZEN:
            errors.append(FieldError("spec.draft", "the fleet's draft is frozen; revisions must not carry a draft"))
        elif draft.method not in fleet.METHODS_WITH_OWN_WEIGHTS:
            errors.append(FieldError("spec.draft", f"draft method {draft.method.value} has no weights of its own"))
        else:
            errors += check_path(spec.draft.path, "spec.draft.path", roots)
    elif draft.policy == DraftPolicy.CO_UPDATE and draft.method in fleet.METHODS_WITH_OWN_WEIGHTS:
        errors.append(
            FieldError(
                "spec.draft",
                f"is required: the fleet co-updates a {draft.method.value} draft with weights of its own",
            )
        )
    if current_revision is not None and spec.revision <= current_revision:
        errors.append(
            FieldError("spec.revision", f"must be newer than the fleet's current revision ({current_revision})")
        )
    if spec.parity_probe is not None and len(spec.parity_probe.expected_logprobs) == 0:
        errors.append(FieldError("spec.parityProbe.expectedLogprobs", "must not be empty"))
    if spec.strategy is not None:
        errors += _validate_max_unavailable(spec.strategy.max_unavailable, "spec.strategy.maxUnavailable")
    return errors


DIGEST_RE = re.compile(revision.DIGEST_PATTERN)
