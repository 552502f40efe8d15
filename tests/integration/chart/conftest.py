"""Fixtures for running the chart against the real control plane: its CRDs, its RBAC, its identity.

Builds on ``tests/integration/conftest.py`` (cluster, kubeconfig, namespace). ``chart_crds`` installs the
chart's CRDs the way docs/install.md tells users to (``kubectl apply --server-side``), including kopf's
peering CRDs from the kopf-peering subchart. ``service_account_kubeconfig`` turns a ServiceAccount into a
kubeconfig holding a TokenRequest token, and ``start_operator_as`` runs ``rolloutfleet run`` with the
container args and env of the chart's Deployment, so the process sees exactly what a pod of the chart
would: its flags, its namespaces, its RBAC.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import pathlib
import re
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import yaml
from kubernetes import client

REPO = pathlib.Path(__file__).resolve().parents[3]

# The simulated-engine harness and helpers of the operator tests, and the chart tests' helpers (sibling
# directories without __init__.py, so they are put on the path here).
sys.path.insert(0, str(REPO / "tests" / "integration" / "operator"))
sys.path.insert(0, str(REPO / "tests" / "chart"))

from chart_support import CRD_DIRS, operator_container  # noqa: E402
from operator_helpers import GROUP, VERSION, fleet_manifest  # noqa: E402
from sim_harness import write_checkpoint  # noqa: E402

from rolloutfleet.digest import digest_directory  # noqa: E402
from rolloutfleet.sandbox import cluster  # noqa: E402


def kubectl(kubeconfig: pathlib.Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return cluster.kubectl(kubeconfig, *args, stdin=stdin, timeout=60)


@pytest.fixture(scope="session")
def chart_crds(kubeconfig_path: pathlib.Path) -> list[str]:
    """The chart's CRDs and kopf's peering CRDs, server-side applied (the documented upgrade remedy)."""
    return cluster.apply_crds(kubeconfig_path, list(CRD_DIRS), field_manager="rolloutfleet-chart-tests")


def service_account_kubeconfig(
    k8s_api: client.ApiClient, admin_kubeconfig: pathlib.Path, namespace: str, account: str, out: pathlib.Path
) -> pathlib.Path:
    """A kubeconfig that authenticates as ``namespace/account`` with a TokenRequest token (1 hour)."""
    core = client.CoreV1Api(k8s_api)
    request = client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=3600))
    token = core.create_namespaced_service_account_token(account, namespace, request).status.token
    admin = yaml.safe_load(admin_kubeconfig.read_text())
    context = next(c for c in admin["contexts"] if c["name"] == admin["current-context"])["context"]
    cluster = next(c for c in admin["clusters"] if c["name"] == context["cluster"])["cluster"]
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "chart-test", "cluster": cluster}],
        "users": [{"name": f"system:serviceaccount:{namespace}:{account}", "user": {"token": token}}],
        "contexts": [
            {
                "name": "chart-test-sa",
                "context": {
                    "cluster": "chart-test",
                    "user": f"system:serviceaccount:{namespace}:{account}",
                    "namespace": namespace,
                },
            }
        ],
        "current-context": "chart-test-sa",
    }
    out.write_text(yaml.safe_dump(config))
    out.chmod(0o600)
    return out


@dataclasses.dataclass
class ChartOperator:
    """``rolloutfleet run`` started with a chart Deployment's args and env; ``log()`` is what it printed."""

    proc: subprocess.Popen[bytes]
    log_path: pathlib.Path
    args: list[str]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


def start_operator_as(
    kubeconfig: pathlib.Path, objs: Sequence[dict[str, Any]], log_path: pathlib.Path
) -> ChartOperator:
    """Run the operator as the chart's pod would, except: no metrics/liveness ports (tests share a host)."""
    container = operator_container(objs)
    args = [*container["args"], "--metrics-port=0", "--liveness="]
    env = dict(os.environ)
    env.update({e["name"]: e["value"] for e in container["env"] if "value" in e})
    env.update(
        KUBECONFIG=str(kubeconfig),
        ROLLOUTFLEET_RESYNC_SECONDS="2",
        PYTHONUNBUFFERED="1",
        POD_ID=f"chart-test-{log_path.stem}",  # distinct per process, like pod names
    )
    env.pop("KUBERNETES_SERVICE_HOST", None)  # never pick up an in-cluster identity by accident
    sink = log_path.open("ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "rolloutfleet.cli", "run", *args],
        env=env,
        stdout=sink,
        stderr=subprocess.STDOUT,
        cwd=REPO,
        start_new_session=True,
    )
    return ChartOperator(proc, log_path, args)


@pytest.fixture
def cluster_scoped_cleanup(kubeconfig_path: pathlib.Path) -> Iterator[list[str]]:
    """Names ("kind/name") of cluster-scoped objects a test created; deleted afterwards."""
    created: list[str] = []
    try:
        yield created
    finally:
        if created:
            kubectl(kubeconfig_path, "delete", "--ignore-not-found", "--wait=false", *created)


# A 403 as the API server and kopf/our client report it: a status word, never the milliseconds of a
# log timestamp ("12:00:01,403" made this flaky about one run in a thousand lines).
FORBIDDEN_RE = re.compile(r"(?<![,.\d])\b403\b|[Ff]orbidden")


@pytest.fixture
def weights(tmp_path: pathlib.Path) -> pathlib.Path:
    root = tmp_path / "weights"
    for rev in (0, 1):
        write_checkpoint(root / "policy" / f"step-{rev}" / "verifier", seed=300 + rev)
        write_checkpoint(root / "policy" / f"step-{rev}" / "draft", seed=400 + rev, tensors=2)
    return root


def _publish_snippet() -> Any:
    """docs/gitops/publish_and_wait.py, the trainer snippet the docs show, loaded as a module."""
    spec = importlib.util.spec_from_file_location("publish_and_wait", REPO / "docs" / "gitops" / "publish_and_wait.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


publish_snippet = _publish_snippet()
REVISION = "pol-step-1"  # the name publish_and_wait.publish gives step 1 of fleet "pol"


def create_fleet_and_revision(api: client.CustomObjectsApi, namespace: str, root: pathlib.Path) -> str:
    """What a user and a trainer apply with their own identity (admin here): a 2-engine fleet, then step 1
    published with the documented snippet. Returns the revision's name."""
    body = fleet_manifest(
        "pol",
        2,
        verifier={"path": str(root / "policy/step-0/verifier")},
        draft={"method": "draft_model", "path": str(root / "policy/step-0/draft"), "policy": "coUpdate"},
        weights={"claimName": "ckpt", "mountPath": str(root), "allowedRoots": [str(root / "policy")]},
        updateStrategy={"maxRetries": 1, "timeouts": {"wakeSeconds": 5, "loadSeconds": 10}},
    )
    api.create_namespaced_custom_object(GROUP, VERSION, namespace, "rolloutfleets", body)
    verifier = str(root / "policy/step-1/verifier")
    name: str = publish_snippet.publish(
        api, namespace, "pol", 1, verifier, draft=str(root / "policy/step-1/draft"), digest=digest_directory(verifier)
    )
    assert name == REVISION
    return name


def phase(api: client.CustomObjectsApi, namespace: str, name: str) -> str | None:
    obj = api.get_namespaced_custom_object(GROUP, VERSION, namespace, "weightrevisions", name)
    return (obj.get("status") or {}).get("phase")


def forbidden_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if FORBIDDEN_RE.search(line)]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    for op in getattr(item, "chart_operators", []):
        if report.failed and isinstance(op, ChartOperator):
            report.sections.append(("operator log (tail)", "\n".join(op.log().splitlines()[-80:])))
