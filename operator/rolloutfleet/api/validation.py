"""Semantic validation: the rules the CRD schema cannot express, as pure functions.

Called first in every reconcile (and by tests and ``rolloutfleet publish``). Each function returns a list
of ``FieldError``s with the field path in the API's camelCase (``spec.draft.path: ...``); an empty list
means valid. Nothing here touches the cluster or the engines.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import posixpath
import re

import pydantic

from rolloutfleet.api import common, fleet, revision, vllm_flags
from rolloutfleet.api.fleet import DraftMethod, DraftPolicy, RolloutFleetSpec, UpdateMode
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
    if "." in path.split("/"):
        return [FieldError(field, "must not contain a '.' segment")]
    if not any(is_under(path, root) for root in allowed_roots):
        return [FieldError(field, f"must be under one of spec.weights.allowedRoots ({', '.join(allowed_roots)})")]
    return []


def validate_fleet_name(name: str) -> list[FieldError]:
    """The fleet's name must fit the names of its children (see ``fleet.FLEET_NAME_MAX_LENGTH``)."""
    why = "the fleet's Services are named after it"
    errors: list[FieldError] = []
    if len(name) > fleet.FLEET_NAME_MAX_LENGTH:
        errors.append(
            FieldError(
                "metadata.name",
                f"must be at most {fleet.FLEET_NAME_MAX_LENGTH} characters ({len(name)}): the StatefulSet's pods "
                "carry the label controller-revision-hash=<name>-<hash>, at most 63 characters",
            )
        )
    if not ("a" <= name[:1] <= "z"):
        errors.append(FieldError("metadata.name", f"must start with a letter: {why}"))
    if set(name) - _NAME_CHARS:
        errors.append(
            FieldError("metadata.name", f"must consist of lower-case letters, digits and '-' (no '.'): {why}")
        )
    elif name.endswith("-"):
        errors.append(FieldError("metadata.name", f"must end with a letter or a digit: {why}"))
    return errors


_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-")


def check_mount_path(path: str, field: str) -> list[FieldError]:
    """The weights volume must not hide the image's files nor the kernel's, the runtime's or ours."""
    if not path.startswith("/"):
        return [FieldError(field, "must be an absolute path")]
    norm = posixpath.normpath(path)
    if norm in fleet.REFUSED_MOUNT_PATHS:
        return [FieldError(field, f"must not be {norm}: the read-only volume would hide the image's files")]
    for tree in fleet.REFUSED_MOUNT_TREES:
        if is_under(norm, tree):
            return [
                FieldError(
                    field,
                    f"must not be at or under {tree}: kernel and runtime filesystems, and the operator's own "
                    "mounts (/dev/shm, the control token under /var/run), live there",
                )
            ]
    return []


def validate_fleet(spec: RolloutFleetSpec, *, name: str | None = None) -> list[FieldError]:
    """Rules of a fleet spec beyond its schema; with ``name``, also the rules on the fleet's name."""
    errors: list[FieldError] = [] if name is None else validate_fleet_name(name)
    if spec.gpus_per_pod % spec.tensor_parallel_size != 0:
        errors.append(
            FieldError(
                "spec.tensorParallelSize",
                f"gpusPerPod ({spec.gpus_per_pod}) must be a multiple of tensorParallelSize "
                f"({spec.tensor_parallel_size})",
            )
        )
    errors += check_mount_path(spec.weights.mount_path, "spec.weights.mountPath")
    roots = spec.weights.allowed_roots
    if not roots:
        errors.append(FieldError("spec.weights.allowedRoots", "must list at least one directory"))
    for index, root in enumerate(roots):
        if fleet.ROOT_SEPARATOR in root:
            errors.append(
                FieldError(
                    f"spec.weights.allowedRoots[{index}]",
                    f"must not contain '{fleet.ROOT_SEPARATOR}': the engines receive the roots "
                    f"'{fleet.ROOT_SEPARATOR}'-separated",
                )
            )
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
    transfer = spec.weight_transfer
    if transfer is not None and transfer.nccl is not None and transfer.backend != fleet.TransferBackend.NCCL:
        errors.append(FieldError("spec.weightTransfer.nccl", f"is only used with backend nccl, not {transfer.backend}"))
    errors += validate_extra_args(spec)
    errors += validate_env(spec)
    return errors


_PERCENT = re.compile(r"^([1-9][0-9]?|100)%$")


def _validate_max_unavailable(value: int | str | None, field: str) -> list[FieldError]:
    if value is None:
        return []
    if isinstance(value, int):
        return [] if value >= 1 else [FieldError(field, "must be >= 1")]
    return [] if _PERCENT.match(value) else [FieldError(field, "must be an integer >= 1 or a percentage 1%..100%")]


def validate_extra_args(spec: RolloutFleetSpec) -> list[FieldError]:
    """Extra vLLM args must not override operator-owned flags, nor contradict an enabled parity profile.

    Every spelling vLLM's parser accepts counts (``vllm_flags.names_flag``): ``-tp 2``,
    ``--tensor_parallel_size=2``, ``--speculative-config.method=...``, ``--no-enable-sleep-mode``, prefixes.
    """
    errors: list[FieldError] = []
    for index, arg in enumerate(spec.extra_args):
        field = f"spec.extraArgs[{index}]"
        given = "" if arg.split("=", 1)[0] in (vllm_flags.flag_name(arg), "") else f" (given as {arg!r})"
        refused = next((flag for flag in vllm_flags.REFUSED if vllm_flags.names_flag(arg, flag)), None)
        if refused is not None:
            errors.append(FieldError(field, f"{refused} is refused{given}: {vllm_flags.REFUSED[refused]}"))
            continue
        owned = next((flag for flag in sorted(vllm_flags.OPERATOR_OWNED) if vllm_flags.names_flag(arg, flag)), None)
        if owned is not None:
            errors.append(FieldError(field, f"{owned} is set by the operator from the spec{given}; remove it"))
            continue
        if not spec.parity.enabled:
            continue
        for parity_flag in vllm_flags.PARITY_FLAGS:
            contradicted = next((f for f in sorted(parity_flag.contradicted_by) if vllm_flags.names_flag(arg, f)), None)
            if contradicted is not None:
                errors.append(
                    FieldError(
                        field,
                        f"{contradicted} contradicts the parity profile ({parity_flag.why}){given}; "
                        "set spec.parity.enabled: false to pass it",
                    )
                )
                break
    return errors


def validate_env(spec: RolloutFleetSpec) -> list[FieldError]:
    """Extra env must not set what the operator sets or what opens the engine up; one entry per name."""
    errors: list[FieldError] = []
    first: dict[str, int] = {}
    for index, env in enumerate(spec.env):
        field = f"spec.env[{index}].name"
        name = env.name
        if name in first:
            errors.append(FieldError(field, f"duplicate name {name} (first at spec.env[{first[name]}])"))
            continue
        first[name] = index
        if name in vllm_flags.REFUSED_ENV:
            errors.append(FieldError(field, f"{name} {vllm_flags.REFUSED_ENV[name]}"))
        elif (
            name.startswith(vllm_flags.OPERATOR_ENV_PREFIX)
            and not name.startswith(vllm_flags.USER_ENV_PREFIXES)
            and name not in vllm_flags.USER_ENV_NAMES
        ):
            errors.append(
                FieldError(
                    field,
                    f"{name} is reserved for the operator (only the loader's "
                    + ", ".join((*(f"{p}*" for p in vllm_flags.USER_ENV_PREFIXES), *sorted(vllm_flags.USER_ENV_NAMES)))
                    + " may be set)",
                )
            )
        elif spec.parity.enabled and name == vllm_flags.ENV_BATCH_INVARIANT:
            errors.append(FieldError(field, f"{name} is set by the operator from spec.parity.batchInvariant"))
        elif name == vllm_flags.ENV_HTTP_KEEP_ALIVE and not vllm_flags.valid_keep_alive(env.value):
            # vLLM reads it with int() at start: anything else would crash every engine of the fleet.
            errors.append(
                FieldError(
                    f"spec.env[{index}].value",
                    f"{name} must be whole seconds from 1 to {vllm_flags.HTTP_KEEP_ALIVE_MAX}, not {env.value[:40]!r}",
                )
            )
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
    errors += _check_source(spec.verifier, "spec.verifier", roots, fleet_spec)
    errors += _check_nccl_rollout(spec, fleet_spec)
    errors += _check_push_lists(spec, fleet_spec)
    draft = fleet_spec.draft
    if spec.draft is not None:
        if draft.method == DraftMethod.NONE:
            errors.append(FieldError("spec.draft", "the fleet has no draft (spec.draft.method is none)"))
        elif draft.policy == DraftPolicy.FROZEN:
            errors.append(FieldError("spec.draft", "the fleet's draft is frozen; revisions must not carry a draft"))
        elif draft.method not in fleet.METHODS_WITH_OWN_WEIGHTS:
            errors.append(FieldError("spec.draft", f"draft method {draft.method.value} has no weights of its own"))
        else:
            errors += _check_source(spec.draft, "spec.draft", roots, fleet_spec)
    elif draft.policy == DraftPolicy.CO_UPDATE and draft.method in fleet.METHODS_WITH_OWN_WEIGHTS:
        errors.append(
            FieldError(
                "spec.draft",
                f"is required: the fleet co-updates a {draft.method.value} draft with weights of its own",
            )
        )
    if current_revision is not None and spec.revision <= current_revision and not spec.allow_older:
        errors.append(
            FieldError(
                "spec.revision",
                f"must be newer than the fleet's current revision ({current_revision}); "
                "set spec.allowOlder: true for a deliberate rollback",
            )
        )
    if spec.parity_probe is not None and len(spec.parity_probe.expected_logprobs) == 0:
        errors.append(FieldError("spec.parityProbe.expectedLogprobs", "must not be empty"))
    if spec.strategy is not None:
        errors += _validate_max_unavailable(spec.strategy.max_unavailable, "spec.strategy.maxUnavailable")
        if spec.strategy.mode == UpdateMode.SLEEP and not fleet.sleep_mode_enabled(fleet_spec):
            errors.append(
                FieldError(
                    "spec.strategy.mode",
                    "sleep needs engines started with sleep mode, and the fleet's updateStrategy.mode is "
                    f"{fleet_spec.update_strategy.mode.value}; use inflight (or change the fleet's mode)",
                )
            )
    return errors


def _check_source(
    source: revision.WeightSource, field: str, roots: list[str], fleet_spec: RolloutFleetSpec
) -> list[FieldError]:
    """One source of a revision: a path under the roots, or a push the fleet can receive (docs/push.md)."""
    if (source.path is None) == (source.push is None):
        return [FieldError(field, "set exactly one of path and push")]
    if source.path is not None:
        return check_path(source.path, f"{field}.path", roots)
    errors = []
    if source.digest is None:
        errors.append(
            FieldError(f"{field}.digest", "is required with push: the digest the trainer computed over what it sends")
        )
    if fleet_spec.weight_transfer is None:
        errors.append(
            FieldError(
                f"{field}.push",
                "the fleet has no spec.weightTransfer: its engines were not started with a weight-transfer backend",
            )
        )
    return errors


def _check_nccl_rollout(spec: WeightRevisionSpec, fleet_spec: RolloutFleetSpec) -> list[FieldError]:
    """A NCCL push feeds every engine of the transfer group with one broadcast: all pods at once."""
    transfer = fleet_spec.weight_transfer
    pushed = spec.verifier.push is not None or (spec.draft is not None and spec.draft.push is not None)
    if not pushed or transfer is None or transfer.backend != fleet.TransferBackend.NCCL:
        return []
    override = spec.strategy.rollout if spec.strategy is not None else None
    rollout = override or fleet_spec.update_strategy.rollout
    if rollout == fleet.RolloutType.ALL_AT_ONCE:
        return []
    field = "spec.strategy.rollout" if override is not None else "spec.verifier.push"
    return [
        FieldError(
            field,
            f"a push over NCCL reaches every engine of the transfer group at once (one broadcast): rollout "
            f"{rollout.value} cannot run it; use AllAtOnce, or a path for a {rollout.value} update",
        )
    ]


# A pushed revision's status lists every pod of its fleet (``status.push.sessions``, and with NCCL the group's
# ``ranks``): unlike ``status.pods`` it cannot leave a pod out, since the trainer must reach every engine. The API
# server stores an object whole and etcd refuses one over 1.5 MiB by default; the two lists may take this much of
# it, the rest being the status's other fields (at most ``MAX_POD_ENTRIES`` pods listed), the spec and metadata.
PUSH_LISTS_MAX_BYTES = 1_000_000
_LONGEST_ADDRESS = common.host_port("ffff:" * 7 + "ffff", 65535)  # an IPv6 pod's, at its longest
_LONGEST_EPOCH = 10**10 - 1  # one per set of sessions opened: ten digits are never reached


def push_bytes_per_pod(fleet_name: str, fleet_spec: RolloutFleetSpec) -> int:
    """The most one pod adds to a pushed revision's stored status (its compact JSON): its session, and with NCCL
    its ranks, each written with the fleet's longest pod name, the longest address and epoch, and a comma."""
    return _bytes_per_pod(fleet_name, fleet_spec.replicas, _nccl_workers(fleet_spec))


def _nccl_workers(fleet_spec: RolloutFleetSpec) -> int | None:
    """The ranks one engine brings to a NCCL group (``None``: the fleet is not pushed to over NCCL)."""
    transfer = fleet_spec.weight_transfer
    if transfer is None or transfer.backend != fleet.TransferBackend.NCCL:
        return None
    return fleet.engine_workers(fleet_spec)


def _bytes_per_pod(fleet_name: str, replicas: int, nccl_workers: int | None) -> int:
    replicas = max(replicas, 1)
    pod = f"{fleet_name}-{replicas - 1}"
    entries: list[common.WireModel] = [
        revision.PushSessionStatus(pod=pod, address=_LONGEST_ADDRESS, target="verifier", epoch=_LONGEST_EPOCH)
    ]
    if nccl_workers is not None:
        entries.append(
            revision.PushGroupRank(pod=pod, rank_offset=1 + replicas * nccl_workers, world_size=nccl_workers)
        )
    return sum(len(json.dumps(e.to_wire(), separators=(",", ":"))) + 1 for e in entries)


def push_limit(fleet_name: str, fleet_spec: RolloutFleetSpec) -> int:
    """The most pods whose handshake fits ``PUSH_LISTS_MAX_BYTES``, with every other field of ``fleet_spec`` as it is.

    What a pod adds grows with the fleet (its longest pod name and, with NCCL, its rank offsets gain digits), so
    the limit is the largest size whose own lists fit, searched for, not the budget divided by what a pod of
    today's size adds: that said 8,474 pods for a three-pod fleet named ``policy`` whose 8,475th pod name is three
    characters longer, and 8,264 (the true limit) once scaled past it.
    """
    return _limit(fleet_name, _nccl_workers(fleet_spec))


# Kept by what the limit depends on: the fleet's status asks at every write (every 1-2 s during a pass).
@functools.lru_cache(maxsize=256)
def _limit(fleet_name: str, nccl_workers: int | None) -> int:
    lo, hi = 0, fleet.MAX_REPLICAS
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if mid * _bytes_per_pod(fleet_name, mid, nccl_workers) <= PUSH_LISTS_MAX_BYTES:
            lo = mid
        else:
            hi = mid - 1
    return lo


def push_limit_problem(fleet_name: str, fleet_spec: RolloutFleetSpec) -> tuple[int, str | None]:
    """(the most pods a pushed revision of this fleet can list, why this fleet is past it or ``None``).

    Called for each pushed revision (``validate_revision``) and for the fleet's own status
    (``planning.fleet_status``: its ``PushWithinLimit`` condition), so that a fleet scaled past the limit says so
    before a trainer's push is refused. A fleet without ``weightTransfer`` is never pushed to: (0, None).
    """
    transfer = fleet_spec.weight_transfer
    if transfer is None:
        return 0, None
    most = push_limit(fleet_name, fleet_spec)
    if fleet_spec.replicas <= most:
        return most, None
    per_pod = push_bytes_per_pod(fleet_name, fleet_spec)
    ranks = " and its NCCL ranks" if transfer.backend == fleet.TransferBackend.NCCL else ""
    return most, (
        f"the fleet has {fleet_spec.replicas} pods and a pushed revision lists each one's session{ranks} in its "
        f"status (up to {per_pod} bytes a pod, {fleet_spec.replicas * per_pod / 1e6:.1f} MB here), more than the "
        f"API server can store with the rest of the object (docs/push.md): push to a fleet of at most {most} pods, "
        "or load the weights from a path"
    )


def _check_push_lists(spec: WeightRevisionSpec, fleet_spec: RolloutFleetSpec) -> list[FieldError]:
    """A push to more pods than its handshake can list (``PUSH_LISTS_MAX_BYTES``) is refused before any pod
    moves: accepted, it opened its sessions and then could never store them for the trainer to see."""
    pushed = [name for name, source in (("verifier", spec.verifier), ("draft", spec.draft)) if source and source.push]
    if not pushed:
        return []
    _, problem = push_limit_problem(spec.fleet_ref.name, fleet_spec)
    if problem is None:
        return []
    return [FieldError(f"spec.{name}.push", problem) for name in pushed]


DIGEST_RE = re.compile(revision.DIGEST_PATTERN)
