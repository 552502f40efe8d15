# mypy: disallow-untyped-calls=False
# (the official kubernetes client ships partial annotations, as in rolloutfleet.adapters.kube)
"""The trainer client's API access: a client from a kubeconfig or in-cluster, reads, writes, error translation.

Called by ``rolloutfleet.trainer.publish`` (and through it by trainers, the ``rolloutfleet publish``/``wait``
commands and ``examples/trainer_loop.py``), by ``rolloutfleet.trainer.wait``, and by
``rolloutfleet.trainer.push`` (the fleet's control token, the push annotations). Owns every call the trainer
side makes to the API server and turning the kubernetes client's exceptions into the trainer-facing errors
of ``rolloutfleet.trainer.errors``.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from typing import Any, cast

import urllib3
from kubernetes import client, config

from rolloutfleet.api import common
from rolloutfleet.api import fleet as fleet_api
from rolloutfleet.api import revision as revision_api
from rolloutfleet.trainer.errors import ControlTokenMissing, FleetNotFound, KubeApiError, PermissionDenied, PublishError

GROUP, VERSION = common.GROUP, common.VERSION
FLEETS, REVISIONS = fleet_api.PLURAL, revision_api.PLURAL
# The engines' control token, as the operator names it (rolloutfleet.resources.labels: token_secret_name,
# TOKEN_KEY; the trainer client may not import the operator's resources, a unit test keeps them equal).
TOKEN_SECRET_SUFFIX = "-control-token"  # noqa: S105 - a name, not a secret
TOKEN_KEY = "token"  # noqa: S105 - the Secret key name


def make_api_client(kubeconfig: str | os.PathLike[str] | None = None, context: str | None = None) -> client.ApiClient:
    """A client for ``kubeconfig`` (default: ``$KUBECONFIG`` or ``~/.kube/config``), or in-cluster config.

    Inside a pod without ``KUBECONFIG`` (a trainer Job), the pod's ServiceAccount is used.
    """
    if kubeconfig is None and "KUBECONFIG" not in os.environ and "KUBERNETES_SERVICE_HOST" in os.environ:
        cfg = client.Configuration()
        config.load_incluster_config(client_configuration=cfg)
        return client.ApiClient(cfg)
    try:
        api: client.ApiClient = config.new_client_from_config(
            config_file=None if kubeconfig is None else os.fspath(kubeconfig), context=context, persist_config=False
        )
    except (config.ConfigException, OSError) as exc:
        raise KubeApiError("loading the kubeconfig", str(exc)) from exc
    return api


def custom_objects_api(api_client: client.ApiClient) -> Any:
    """The CustomObjectsApi used for every call (a seam for unit tests)."""
    return client.CustomObjectsApi(api_client)


def server_message(exc: client.ApiException) -> str:
    body = getattr(exc, "body", None)
    if body:
        try:
            parsed = json.loads(body)
        except (TypeError, ValueError):
            return str(body)
        if isinstance(parsed, dict) and parsed.get("message"):
            return str(parsed["message"])
    return str(getattr(exc, "reason", "") or exc)


def translate(exc: Exception, verb: str, resource: str, namespace: str) -> PublishError:
    if isinstance(exc, client.ApiException):
        status = int(exc.status or 0)
        detail = server_message(exc)
        if status in (401, 403):
            return PermissionDenied(verb, resource, namespace, detail, status=status)
        return KubeApiError(f"{verb} {resource} in {namespace}", detail, status or None)
    return KubeApiError(f"{verb} {resource} in {namespace}", f"{type(exc).__name__}: {exc}")


API_ERRORS = (client.ApiException, urllib3.exceptions.HTTPError, OSError)


def read_fleet(custom: Any, namespace: str, fleet: str) -> dict[str, Any]:
    try:
        return cast(dict[str, Any], custom.get_namespaced_custom_object(GROUP, VERSION, namespace, FLEETS, fleet))
    except client.ApiException as exc:
        if exc.status == 404:
            crd_missing = "could not find the requested resource" in server_message(exc)
            raise FleetNotFound(fleet, namespace, crd_missing=crd_missing) from None
        raise translate(exc, "get", FLEETS, namespace) from None
    except API_ERRORS as exc:
        raise translate(exc, "get", FLEETS, namespace) from None


def read_revision(custom: Any, namespace: str, name: str) -> dict[str, Any] | None:
    try:
        return cast(dict[str, Any], custom.get_namespaced_custom_object(GROUP, VERSION, namespace, REVISIONS, name))
    except client.ApiException as exc:
        if exc.status == 404:
            return None
        raise translate(exc, "get", REVISIONS, namespace) from None
    except API_ERRORS as exc:
        raise translate(exc, "get", REVISIONS, namespace) from None


def list_revisions(custom: Any, namespace: str) -> list[dict[str, Any]]:
    try:
        out = custom.list_namespaced_custom_object(GROUP, VERSION, namespace, REVISIONS)
    except API_ERRORS as exc:
        raise translate(exc, "list", REVISIONS, namespace) from None
    return list(cast(dict[str, Any], out).get("items") or [])


def token_secret_name(fleet: str) -> str:
    """The Secret holding the fleet's control token (the operator creates it with the fleet)."""
    return f"{fleet}{TOKEN_SECRET_SUFFIX}"


def core_api(api_client: client.ApiClient) -> Any:
    """The CoreV1Api used to read the control token (a seam for unit tests)."""
    return client.CoreV1Api(api_client)


def read_control_token(core: Any, namespace: str, fleet: str) -> str:
    """The bearer token the fleet's engines require on ``/update_weights`` (docs/push.md, Security).

    ControlTokenMissing when the Secret or its key is absent or empty; PermissionDenied when the trainer's
    RBAC lacks ``get`` on it.
    """
    name = token_secret_name(fleet)
    try:
        secret = core.read_namespaced_secret(name, namespace)
    except client.ApiException as exc:
        if exc.status == 404:
            raise ControlTokenMissing(name, namespace, "not found (is the fleet reconciled?)") from None
        raise translate(exc, "get", "secrets", namespace) from None
    except API_ERRORS as exc:
        raise translate(exc, "get", "secrets", namespace) from None
    raw = (getattr(secret, "data", None) or {}).get(TOKEN_KEY)
    if not raw:
        raise ControlTokenMissing(name, namespace, f"no {TOKEN_KEY!r} key")
    try:
        token = base64.b64decode(raw, validate=True).decode("utf-8").strip()
    except (binascii.Error, UnicodeDecodeError):
        raise ControlTokenMissing(name, namespace, f"key {TOKEN_KEY!r} is not base64 text") from None
    if not token:
        raise ControlTokenMissing(name, namespace, f"key {TOKEN_KEY!r} is empty")
    return token


def annotate_revision(custom: Any, namespace: str, name: str, annotations: dict[str, str | None]) -> dict[str, Any]:
    """Merge-patch the WeightRevision's annotations (None removes one); return the object."""
    body = {"metadata": {"annotations": annotations}}
    try:
        obj = custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, REVISIONS, name, body)
    except API_ERRORS as exc:
        raise translate(exc, "patch", REVISIONS, namespace) from None
    return cast(dict[str, Any], obj)
