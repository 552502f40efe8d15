"""Publish a WeightRevision after a training step and wait until every engine serves it.

Only the official ``kubernetes`` client; copy it into a trainer. The identity that runs it needs
``create``/``get``/``list``/``watch`` on ``weightrevisions`` in the fleet's namespace. For digests, typed
errors and an async variant, use ``rolloutfleet.trainer`` (``publish_revision``) instead (docs/trainer.md).

    python publish_and_wait.py --namespace rl --fleet policy-7b --step 42 \\
        --verifier /weights/policy-7b/step-42/verifier --draft /weights/policy-7b/step-42/draft
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from kubernetes import client, config, watch

GROUP, VERSION, PLURAL = "rolloutfleet.io", "v1alpha1", "weightrevisions"


def publish(
    api: client.CustomObjectsApi,
    namespace: str,
    fleet: str,
    step: int,
    verifier: str,
    draft: str | None = None,
    digest: str | None = None,
) -> str:
    """Create the WeightRevision of training step ``step`` (idempotent: a retried step reuses it)."""
    name = f"{fleet}-step-{step}"
    spec: dict[str, Any] = {"fleetRef": {"name": fleet}, "revision": step, "verifier": {"path": verifier}}
    if digest:
        spec["verifier"]["digest"] = digest  # `rolloutfleet digest DIR` on any machine, no GPU
    if draft:
        spec["draft"] = {"path": draft}
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "WeightRevision", "metadata": {"name": name}, "spec": spec}
    try:
        api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)
    except client.ApiException as exc:
        if exc.status != 409:  # 409: published already (the trainer restarted); wait for it
            raise
    return name


def wait_ready(api: client.CustomObjectsApi, namespace: str, name: str, timeout: float = 1800) -> dict[str, Any]:
    """Block until the revision Succeeded; raise on Failed/RolledBack/Superseded or after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stream = watch.Watch().stream(
            api.list_namespaced_custom_object,
            GROUP,
            VERSION,
            namespace,
            PLURAL,
            field_selector=f"metadata.name={name}",
            timeout_seconds=max(1, min(300, int(deadline - time.monotonic()))),
        )
        for event in stream:  # the first event is the current state, then every change
            obj: dict[str, Any] = event["object"]
            status = obj.get("status") or {}
            phase = status.get("phase")
            if phase == "Succeeded":
                return obj
            if phase in ("Failed", "RolledBack", "Superseded"):
                raise RuntimeError(f"{name}: {phase}: {status.get('message')}")
    raise TimeoutError(f"{name} not Ready after {timeout:.0f}s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--fleet", required=True)
    parser.add_argument("--step", type=int, required=True)
    parser.add_argument("--verifier", required=True)
    parser.add_argument("--draft")
    parser.add_argument("--digest")
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args()
    config.load_config()  # in-cluster service account, else ~/.kube/config
    api = client.CustomObjectsApi()
    name = publish(api, args.namespace, args.fleet, args.step, args.verifier, args.draft, args.digest)
    done = wait_ready(api, args.namespace, name, args.timeout)
    print(f"{name}: {done['status'].get('updated')} pods serve revision {args.step}")


if __name__ == "__main__":
    main()
