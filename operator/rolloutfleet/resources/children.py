"""Pure builders of the objects a RolloutFleet owns.

Called by ``reconcile.fleet`` which server-side-applies what these return. Every child carries the
fleet's owner reference (deleting the fleet deletes them), the common labels, and a spec hash so that a
diff between desired and observed is one string compare. Nothing here reads the clock or the cluster.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
from typing import Any

from rolloutfleet.api import common
from rolloutfleet.api.fleet import RolloutFleetSpec
from rolloutfleet.resources import command, labels

Manifest = dict[str, Any]
GPU_RESOURCE = "nvidia.com/gpu"
ENGINE_CONTAINER = "engine"
TERMINATION_GRACE_SECONDS = 120
PROBE_PERIOD_SECONDS = 10


@dataclasses.dataclass(frozen=True)
class Owner:
    """The fleet object children point at."""

    name: str
    namespace: str
    uid: str

    def reference(self) -> Manifest:
        """An ownerReference that makes the fleet the controller of the child."""
        return {
            "apiVersion": common.API_VERSION,
            "kind": "RolloutFleet",
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


def spec_hash(payload: object) -> str:
    """A short stable hash of a JSON-able payload."""
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _metadata(owner: Owner, name: str, extra_labels: dict[str, str] | None = None) -> Manifest:
    return {
        "name": name,
        "namespace": owner.namespace,
        "labels": {**labels.common_labels(owner.name), **(extra_labels or {})},
        "ownerReferences": [owner.reference()],
    }


def _with_hash(manifest: Manifest) -> Manifest:
    manifest["metadata"].setdefault("annotations", {})[labels.SPEC_HASH_ANNOTATION] = spec_hash(
        {k: v for k, v in manifest.items() if k != "metadata"}
    )
    return manifest


def _resources(spec: RolloutFleetSpec) -> Manifest:
    requests: dict[str, Any] = {**spec.resources.requests, GPU_RESOURCE: spec.gpus_per_pod}
    limits: dict[str, Any] = {**spec.resources.limits, GPU_RESOURCE: spec.gpus_per_pod}
    return {"requests": {k: str(v) for k, v in requests.items()}, "limits": {k: str(v) for k, v in limits.items()}}


READY_PATH = "/rolloutfleet/ready"  # the worker middleware's admission route (worker_image/README.md)


def _probe(
    spec: RolloutFleetSpec, failure_threshold: int, period: int = PROBE_PERIOD_SECONDS, path: str = "/health"
) -> Manifest:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failure_threshold,
    }


def pod_template(owner: Owner, spec: RolloutFleetSpec) -> Manifest:
    """The engine pod template; its hash decides whether pods roll (weights never change it)."""
    scheduling = spec.scheduling
    pod_spec: Manifest = {
        "terminationGracePeriodSeconds": TERMINATION_GRACE_SECONDS,
        "enableServiceLinks": False,
        # The Service routes to a pod only once the operator says it serves the fleet's verified weights
        # (a restarted pod starts on the initial checkpoint: /health alone would route to it).
        "readinessGates": [{"conditionType": labels.WEIGHTS_READY_CONDITION}],
        "containers": [
            {
                "name": ENGINE_CONTAINER,
                "image": spec.image,
                "command": ["vllm", "serve"],
                "args": command.engine_args(spec),
                "env": command.engine_env(spec),
                "ports": [{"name": "http", "containerPort": spec.port, "protocol": "TCP"}],
                "resources": _resources(spec),
                # Ready only once the operator admitted this engine process (it verified what it serves):
                # a restarted container comes back on the initial checkpoint, un-admitted.
                "readinessProbe": _probe(spec, failure_threshold=1, path=READY_PATH),
                "livenessProbe": _probe(spec, failure_threshold=6, period=30),
                "startupProbe": _probe(
                    spec, failure_threshold=max(1, spec.startup_timeout_seconds // PROBE_PERIOD_SECONDS)
                ),
                "volumeMounts": [
                    {"name": "weights", "mountPath": spec.weights.mount_path, "readOnly": True},
                    {"name": "shm", "mountPath": labels.SHM_MOUNT},
                    {"name": "control-token", "mountPath": labels.TOKEN_MOUNT_DIR, "readOnly": True},
                ],
            }
        ],
        "volumes": [
            {"name": "weights", "persistentVolumeClaim": {"claimName": spec.weights.claim_name, "readOnly": True}},
            # vLLM's tensor-parallel workers exchange tensors through shared memory.
            {"name": "shm", "emptyDir": {"medium": "Memory"}},
            {
                "name": "control-token",
                "secret": {"secretName": labels.token_secret_name(owner.name), "defaultMode": 0o440},
            },
        ],
    }
    if scheduling.node_selector:
        pod_spec["nodeSelector"] = dict(scheduling.node_selector)
    if scheduling.tolerations:
        pod_spec["tolerations"] = [t.to_wire() for t in scheduling.tolerations]
    if scheduling.affinity:
        pod_spec["affinity"] = scheduling.affinity
    if scheduling.priority_class_name:
        pod_spec["priorityClassName"] = scheduling.priority_class_name
    return {"metadata": {"labels": labels.common_labels(owner.name)}, "spec": pod_spec}


def build_statefulset(owner: Owner, spec: RolloutFleetSpec) -> Manifest:
    """The engines' StatefulSet: parallel pod management, RollingUpdate on template changes."""
    template = pod_template(owner, spec)
    template["metadata"]["annotations"] = {labels.SPEC_HASH_ANNOTATION: spec_hash(template)}
    return _with_hash(
        {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": _metadata(owner, labels.statefulset_name(owner.name)),
            "spec": {
                "replicas": spec.replicas,
                "serviceName": labels.headless_service_name(owner.name),
                "podManagementPolicy": "Parallel",
                "selector": {"matchLabels": labels.selector_labels(owner.name)},
                "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"partition": 0}},
                "template": template,
            },
        }
    )


def build_headless_service(owner: Owner, spec: RolloutFleetSpec) -> Manifest:
    """Stable per-pod DNS names; publishes not-ready pods so the operator can reach sleeping engines."""
    return _with_hash(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _metadata(owner, labels.headless_service_name(owner.name)),
            "spec": {
                "clusterIP": "None",
                "publishNotReadyAddresses": True,
                "selector": labels.selector_labels(owner.name),
                "ports": [{"name": "http", "port": spec.port, "targetPort": "http"}],
            },
        }
    )


def build_service(owner: Owner, spec: RolloutFleetSpec) -> Manifest:
    """The Service clients send generation requests to (ready pods only)."""
    return _with_hash(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _metadata(owner, labels.service_name(owner.name)),
            "spec": {
                "type": "ClusterIP",
                "selector": labels.selector_labels(owner.name),
                "ports": [{"name": "http", "port": spec.port, "targetPort": "http"}],
            },
        }
    )


def build_network_policy(owner: Owner, spec: RolloutFleetSpec, operator_namespace: str | None) -> Manifest:
    """Admit the engine port from the operator's pods and from the configured clients only."""
    operator_peer: Manifest = {"podSelector": {"matchLabels": dict(labels.OPERATOR_POD_LABELS)}}
    if operator_namespace:
        operator_peer["namespaceSelector"] = {"matchLabels": {"kubernetes.io/metadata.name": operator_namespace}}
    client_peer: Manifest = {"podSelector": {"matchLabels": dict(spec.network.client_pod_selector)}}
    if spec.network.client_namespace_selector is not None:
        client_peer["namespaceSelector"] = {"matchLabels": dict(spec.network.client_namespace_selector)}
    return _with_hash(
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": _metadata(owner, labels.network_policy_name(owner.name)),
            "spec": {
                "podSelector": {"matchLabels": labels.selector_labels(owner.name)},
                "policyTypes": ["Ingress"],
                "ingress": [{"from": [operator_peer, client_peer], "ports": [{"protocol": "TCP", "port": spec.port}]}],
            },
        }
    )


def build_pdb(owner: Owner, spec: RolloutFleetSpec) -> Manifest:
    """Voluntary disruptions take out no more engines than a Rolling update would."""
    return _with_hash(
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": _metadata(owner, labels.pdb_name(owner.name)),
            "spec": {
                "maxUnavailable": spec.update_strategy.max_unavailable,
                "selector": {"matchLabels": labels.selector_labels(owner.name)},
            },
        }
    )


def build_token_secret(owner: Owner, token: str) -> Manifest:
    """The control-token Secret (created once; the token is generated by reconcile, never logged)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": _metadata(owner, labels.token_secret_name(owner.name)),
        "data": {labels.TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def build_children(owner: Owner, spec: RolloutFleetSpec, operator_namespace: str | None) -> list[Manifest]:
    """Every applied child except the Secret, in apply order (Services before the StatefulSet)."""
    return [
        build_headless_service(owner, spec),
        build_service(owner, spec),
        build_network_policy(owner, spec, operator_namespace),
        build_pdb(owner, spec),
        build_statefulset(owner, spec),
    ]
