"""Manifests of fake GPU nodes that kwok plays the kubelet for.

Called by :mod:`rolloutfleet.sandbox.cluster` (the nodes of ``sandbox up`` and of the test fixture) and
by ``bench/pods_to_running.py``. Pure: it builds ``Node`` bodies; the cluster module creates them.

Why each node carries ``spec.podCIDR = 127.1.<index>.0/24``: kwok hands out pod IPs from the node's
podCIDR (sigs.k8s.io/kwok v0.8.0 ``pkg/kwok/controllers/pod_controller.go``, ``funcPodIPsWith``), and on
Linux all of 127.0.0.0/8 is loopback, so a test or the engine simulator can listen on each pod's own IP.
The controller-manager runs with ``--allocate-node-cidrs=false`` so nothing overwrites these.
"""

from __future__ import annotations

from typing import Any, Final

KWOK_ANNOTATION: Final = "kwok.x-k8s.io/node"
KWOK_ANNOTATION_VALUE: Final = "fake"
GPU_RESOURCE: Final = "nvidia.com/gpu"
POOL_LABEL: Final = "rolloutfleet.io/gpu-pool"
PRODUCT_LABEL: Final = "nvidia.com/gpu.product"
GPU_PRODUCT: Final = "NVIDIA-H200-sim"
POD_NETWORK_PREFIX: Final = "127.1"
# One /24 per node from 127.1.0.0/16; .255 is kept for kwok's fallback --cidr (nodes without podCIDR).
MAX_NODES: Final = 255
FALLBACK_POD_CIDR: Final = f"{POD_NETWORK_PREFIX}.255.0/24"


def node_name(index: int, prefix: str = "gpu-node") -> str:
    return f"{prefix}-{index:03d}"


def pod_cidr(subnet: int) -> str:
    if not 0 <= subnet < MAX_NODES:
        raise ValueError(f"pod subnet {subnet} outside 0..{MAX_NODES - 1}: one /24 of 127.1.0.0/16 per node")
    return f"{POD_NETWORK_PREFIX}.{subnet}.0/24"


def fake_gpu_node(
    index: int,
    *,
    gpus: int = 8,
    pool: str = "default",
    cpu: str = "96",
    memory: str = "1024Gi",
    pods: int = 110,
    prefix: str = "gpu-node",
    subnet: int | None = None,
) -> dict[str, Any]:
    """A Node body with GPU capacity, pool labels and the annotation kwok selects on.

    ``subnet`` picks the node's 127.1.<subnet>.0/24 (default: its index); clusters that may run side by
    side (the sandbox and a test session) use disjoint subnets so their pod IPs never collide.
    """
    name = node_name(index, prefix)
    cidr = pod_cidr(index if subnet is None else subnet)
    resources = {"cpu": cpu, "memory": memory, "pods": str(pods), GPU_RESOURCE: str(gpus)}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {KWOK_ANNOTATION: KWOK_ANNOTATION_VALUE, "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
                POOL_LABEL: pool,
                PRODUCT_LABEL: GPU_PRODUCT,
                "nvidia.com/gpu.count": str(gpus),
            },
        },
        "spec": {"podCIDR": cidr, "podCIDRs": [cidr]},
        # The apiserver keeps status on Node create (the kubelet registers this way); kwok's
        # node-initialize stage keeps capacity/allocatable and adds the Ready condition.
        "status": {
            "capacity": resources,
            "allocatable": dict(resources),
            "addresses": [
                {"type": "InternalIP", "address": "127.0.0.1"},
                {"type": "Hostname", "address": name},
            ],
        },
    }


def is_ready(node: dict[str, Any]) -> bool:
    """Ready condition true and no not-ready/unreachable taint left (the scheduler honours those)."""
    conditions = node.get("status", {}).get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    taints = node.get("spec", {}).get("taints") or []
    blocking = {"node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"}
    return ready and not any(t.get("key") in blocking for t in taints)
