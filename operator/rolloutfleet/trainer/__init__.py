"""rolloutfleet.trainer: the trainer-facing client — publish or push a WeightRevision, wait, watch.

Imported by training loops (``from rolloutfleet.trainer import publish_revision, push_revision``), by the
``rolloutfleet publish``/``status``/``wait`` commands (``rolloutfleet.trainer.cli``, which
``rolloutfleet.cli`` loads by name) and by ``examples/``. It talks to the API server (and, when pushing,
to the engines' ``/update_weights``) and never imports the operator runtime or kopf (import-linter
contracts in pyproject.toml). The package exports its public API lazily: importing it costs nothing, and
``rolloutfleet.trainer.digest`` works without the kubernetes client.

Modules, top to bottom (each imports only those below it): ``cli`` (commands) → ``push`` (the push
handshake, docs/push.md) → ``publish`` (digest, validate, create once; docs/trainer.md) and ``senders``
(``/update_weights`` wire formats) → ``wait`` (Ready or why not), ``digest`` (the digest of tensors) and
``sessions`` (the handshake as data) → ``kube`` (API calls), ``progress`` (progress lines), ``tensors``
(torch tensors: bytes, IPC handles, the GPU digest) and ``nccl`` (rank 0 of a NCCL transfer group through
vLLM; the only modules that touch torch) → ``errors`` (the typed errors).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rolloutfleet.trainer.digest import RawTensor, TensorSource, digest_tensors
    from rolloutfleet.trainer.errors import (
        CheckpointMissing,
        ControlTokenMissing,
        FleetNotFound,
        InvalidRevision,
        InvalidTensors,
        KubeApiError,
        PermissionDenied,
        PodFailure,
        PublishCancelled,
        PublishError,
        PublishTimeout,
        PushError,
        PushProtocolError,
        PushSendFailed,
        PushSessionTimeout,
        PushUnsupported,
        RevisionConflict,
        RevisionDeleted,
        RevisionFailed,
        RevisionNotFound,
        RevisionNotNewer,
        SendError,
        SendFailure,
    )
    from rolloutfleet.trainer.progress import PublishProgress
    from rolloutfleet.trainer.publish import (
        PublishResult,
        async_publish_revision,
        make_api_client,
        publish_revision,
        revision_name,
        wait_for_fleet_revision,
        wait_for_revision,
    )
    from rolloutfleet.trainer.push import PushResult, async_push_revision, push_revision
    from rolloutfleet.trainer.senders import IpcSender, NcclSender, Sender, SimulatedSender

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(("RawTensor", "TensorSource", "digest_tensors"), "digest"),
    **dict.fromkeys(
        (
            "CheckpointMissing",
            "ControlTokenMissing",
            "FleetNotFound",
            "InvalidRevision",
            "InvalidTensors",
            "KubeApiError",
            "PermissionDenied",
            "PodFailure",
            "PublishCancelled",
            "PublishError",
            "PublishTimeout",
            "PushError",
            "PushProtocolError",
            "PushSendFailed",
            "PushSessionTimeout",
            "PushUnsupported",
            "RevisionConflict",
            "RevisionDeleted",
            "RevisionFailed",
            "RevisionNotFound",
            "RevisionNotNewer",
            "SendError",
            "SendFailure",
        ),
        "errors",
    ),
    "PublishProgress": "progress",
    **dict.fromkeys(
        (
            "PublishResult",
            "async_publish_revision",
            "make_api_client",
            "publish_revision",
            "revision_name",
            "wait_for_fleet_revision",
            "wait_for_revision",
        ),
        "publish",
    ),
    **dict.fromkeys(("PushResult", "async_push_revision", "push_revision"), "push"),
    **dict.fromkeys(("IpcSender", "NcclSender", "Sender", "SimulatedSender"), "senders"),
}

__all__ = [
    "CheckpointMissing",
    "ControlTokenMissing",
    "FleetNotFound",
    "InvalidRevision",
    "InvalidTensors",
    "IpcSender",
    "KubeApiError",
    "NcclSender",
    "PermissionDenied",
    "PodFailure",
    "PublishCancelled",
    "PublishError",
    "PublishProgress",
    "PublishResult",
    "PublishTimeout",
    "PushError",
    "PushProtocolError",
    "PushResult",
    "PushSendFailed",
    "PushSessionTimeout",
    "PushUnsupported",
    "RawTensor",
    "RevisionConflict",
    "RevisionDeleted",
    "RevisionFailed",
    "RevisionNotFound",
    "RevisionNotNewer",
    "SendError",
    "SendFailure",
    "Sender",
    "SimulatedSender",
    "TensorSource",
    "async_publish_revision",
    "async_push_revision",
    "digest_tensors",
    "make_api_client",
    "publish_revision",
    "push_revision",
    "revision_name",
    "wait_for_fleet_revision",
    "wait_for_revision",
]
# (a unit test checks that __all__ and _EXPORTS name the same things)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
