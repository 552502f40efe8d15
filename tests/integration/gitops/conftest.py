"""Fixtures of the Git-driven tier: Flux's real controllers and a loopback Git server against the session
cluster, and one fleet of simulated engines that only Git commits change.

Builds on ``tests/integration/conftest.py`` (``local_cluster``, ``k8s_api``, ``kubeconfig_path``) and reuses
the operator tier's helpers (``operator_helpers``, ``sim_harness``, ``operator_process``: a sibling
directory without ``__init__``, put on the path here).

- ``flux`` (session): source-controller and kustomize-controller (:mod:`rolloutfleet.sandbox.flux`; a cold
  build takes minutes and prints its progress live), their CRDs installed, stopped at the end.
- ``git_server`` (session): :class:`rolloutfleet.sandbox.git_server.GitServer` in this process.
- ``gitops`` (module): a namespace with the chart's CRDs, a checkpoint volume, the operator watching that
  namespace only (it never handles another tier's fleets; pytest runs gitops/ before operator/, whose
  session operator watches every namespace and so must not be running yet), the simulated engines of fleet
  ``pol``, a bare repository, and a GitRepository + Kustomization following its ``fleet/`` directory with
  the health rules of ``docs/gitops/flux/fleet-sync.yaml``. Torn down Flux-first: deleting the
  Kustomization prunes the fleet while the operator still runs to release it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from kubernetes import client

REPO = pathlib.Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tests" / "integration" / "operator"))

from operator_helpers import weights_volume  # noqa: E402
from operator_process import OperatorProcess, start_operator, stop_operator  # noqa: E402
from sim_harness import FollowerThread, write_checkpoint  # noqa: E402

from rolloutfleet.sandbox import cluster, flux, git_server, waiting  # noqa: E402

FLEET = "pol"
SOURCE = ("source.toolkit.fluxcd.io", "v1", "gitrepositories")
KUSTOMIZE = ("kustomize.toolkit.fluxcd.io", "v1", "kustomizations")


@pytest.fixture(scope="session")
def flux_controllers(
    local_cluster: cluster.Cluster, pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[flux.Flux]:
    controllers = flux.Flux(local_cluster.kubeconfig, tmp_path_factory.mktemp("flux"), tie_to_parent=True)
    capture = pytestconfig.pluginmanager.getplugin("capturemanager")
    # A cold build takes minutes: show its progress live rather than look like a hang.
    with capture.global_and_fixture_disabled():
        if not all(flux.binary_path(c).exists() for c in flux.CONTROLLERS):
            print("\n[flux] building source-controller and kustomize-controller (cold: about 5 min on 2 cores)")
        controllers.start()
    try:
        yield controllers
    finally:
        controllers.stop()


@pytest.fixture(scope="session")
def git_server_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[git_server.GitServer]:
    root = tmp_path_factory.mktemp("git")
    with git_server.GitServer(root / "repos", log=root / "git-server.log") as server:
        yield server


@dataclasses.dataclass
class GitOps:
    """One fleet that only Git changes: the working copy, what Flux follows, the engines that serve."""

    api: client.ApiClient
    namespace: str
    weights: pathlib.Path
    copy: git_server.WorkingCopy
    engines: FollowerThread
    operator: OperatorProcess
    flux: flux.Flux
    # Seconds from a push to each observed effect, per Git action (written to the report at the end).
    timings: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    # What the Kustomization said when it refused a commit (quoted in the report and the docs).
    messages: dict[str, str] = dataclasses.field(default_factory=dict)
    done: set[str] = dataclasses.field(default_factory=set)

    @property
    def custom(self) -> client.CustomObjectsApi:
        return client.CustomObjectsApi(self.api)

    def get(self, kind: tuple[str, str, str], name: str) -> dict[str, Any]:
        out: dict[str, Any] = self.custom.get_namespaced_custom_object(*kind[:2], self.namespace, kind[2], name)
        return out

    def request_sync(self, kind: tuple[str, str, str] = SOURCE) -> None:
        """What `flux reconcile` does: ask the controller to act now, not at the next interval (on the
        GitRepository: fetch; kustomize-controller follows a new artifact by itself)."""
        body = {"metadata": {"annotations": {flux.REQUESTED_AT: str(time.time_ns())}}}
        self.custom.patch_namespaced_custom_object(*kind[:2], self.namespace, kind[2], "fleet", body)


def apply_chart_crds(kubeconfig: pathlib.Path) -> None:
    """The chart's CRDs, the way docs/install.md tells users to apply them (server-side)."""
    crds = REPO / "charts" / "rolloutfleet" / "crds"
    cluster.apply_crds(kubeconfig, [crds], field_manager="rolloutfleet-gitops-tests")


def published_sync(namespace: str) -> dict[str, Any]:
    """docs/gitops/flux/fleet-sync.yaml as users copy it (prune, wait, force off, the health rules), pointed
    at this test's repository and namespace; no dependsOn (the operator runs beside, not from a HelmRelease)."""
    doc: dict[str, Any] = yaml.safe_load((REPO / "docs" / "gitops" / "flux" / "fleet-sync.yaml").read_text())
    doc["metadata"] = {"name": "fleet", "namespace": namespace}
    spec = doc["spec"]
    spec.pop("dependsOn", None)
    spec.update(path="./fleet", sourceRef={"kind": "GitRepository", "name": "fleet"}, targetNamespace=namespace)
    # Long interval: every sync here is requested (reconcile.fluxcd.io/requestedAt), so the measured times
    # are Flux's reaction to a push, never a poll period; a short timeout so that a hang fails in minutes.
    spec.update(interval="10m", timeout="2m")
    assert spec["prune"] is True and spec["wait"] is True and spec["healthCheckExprs"], spec
    return doc


def _create_namespace(core: client.CoreV1Api, name: str) -> None:
    core.create_namespace(
        client.V1Namespace(metadata=client.V1ObjectMeta(name=name, labels={"rolloutfleet.io/test": "1"}))
    )

    def has_default_account() -> bool:
        return bool(core.list_namespaced_service_account(name, field_selector="metadata.name=default").items)

    waiting.wait_for(has_default_account, timeout=30, what=f"serviceaccount default in {name}")


@pytest.fixture(scope="module")
def gitops(
    flux_controllers: flux.Flux,
    git_server_root: git_server.GitServer,
    k8s_api: client.ApiClient,
    kubeconfig_path: pathlib.Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[GitOps]:
    namespace = f"t-gitops-{uuid.uuid4().hex[:6]}"
    work = tmp_path_factory.mktemp("gitops")
    weights = work / "weights"
    for step in range(0, 4):
        write_checkpoint(weights / "policy" / f"step-{step}" / "verifier", seed=300 + step)
        write_checkpoint(weights / "policy" / f"step-{step}" / "draft", seed=400 + step, tensors=2)
    apply_chart_crds(kubeconfig_path)
    core = client.CoreV1Api(k8s_api)
    custom = client.CustomObjectsApi(k8s_api)
    with contextlib.ExitStack() as stack:
        _create_namespace(core, namespace)
        stack.callback(core.delete_namespace, namespace, propagation_policy="Background")
        weights_volume(k8s_api, namespace)
        stack.callback(core.delete_persistent_volume, f"{namespace}-ckpt")
        # This namespace only: an all-namespaces operator of another tier's session may be running too, and
        # two operators on one fleet would race.
        operator = start_operator(kubeconfig_path, work / "operator.log", namespaces=[namespace])
        stack.callback(stop_operator, operator)
        engines = FollowerThread(k8s_api, namespace, FLEET)
        stack.callback(engines.stop)
        repo = git_server.create_repository(git_server_root.root, namespace)
        copy = git_server.WorkingCopy.clone(f"{git_server_root.url}/{repo.name}", work / "config")
        stack.callback(copy.__exit__)
        copy.write("fleet/kustomization.yaml", flux.EMPTY_KUSTOMIZATION)
        copy.commit_and_push("an empty fleet directory")
        source = flux.git_repository("fleet", namespace, f"{git_server_root.url}/{repo.name}", interval="10m")
        sync = published_sync(namespace)
        custom.create_namespaced_custom_object(*SOURCE[:2], namespace, SOURCE[2], source)
        custom.create_namespaced_custom_object(*KUSTOMIZE[:2], namespace, KUSTOMIZE[2], sync)
        # Last registered, first run: the Kustomization goes (pruning the fleet) while the operator and
        # the engines still run, so nothing is left with a finalizer nobody removes.
        stack.callback(_delete_flux_objects, custom, namespace)
        state = GitOps(k8s_api, namespace, weights, copy, engines, operator, flux_controllers)
        yield state
        _write_report(state)


def _delete_flux_objects(custom: client.CustomObjectsApi, namespace: str) -> None:
    for group, version, plural in (KUSTOMIZE, SOURCE):
        with contextlib.suppress(client.ApiException):
            custom.delete_namespaced_custom_object(group, version, namespace, plural, "fleet")

    def gone() -> bool:
        fleets = custom.list_namespaced_custom_object("rolloutfleet.io", "v1alpha1", namespace, "rolloutfleets")
        syncs = custom.list_namespaced_custom_object(*KUSTOMIZE[:2], namespace, KUSTOMIZE[2])
        return not fleets["items"] and not syncs["items"]

    waiting.wait_for(gone, timeout=90, what=f"the Kustomization in {namespace} deleted and its fleet pruned")


def _write_report(state: GitOps) -> None:
    """The measured latencies, to ``$ROLLOUTFLEET_GITOPS_REPORT`` (bench/results/gitops_flux.md is made
    from one) and to the terminal."""
    import json

    lines = [
        f"{action}: " + ", ".join(f"{k} {v:.2f}s" for k, v in marks.items()) for action, marks in state.timings.items()
    ]
    print("\n[gitops] seconds from git push to each effect:\n  " + "\n  ".join(lines))
    target = os.environ.get("ROLLOUTFLEET_GITOPS_REPORT")
    if target:
        report = {"seconds_from_push": state.timings, "kustomization_messages": state.messages}
        pathlib.Path(target).write_text(json.dumps(report, indent=2))
