"""The chart's RBAC is exactly sufficient: the operator, authenticated as the chart's ServiceAccount (a
TokenRequest token) and started with the chart Deployment's args and env, completes a sandbox rollout
with zero 403s; the same rollout with one rule removed never succeeds."""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from chart_support import RBAC_KINDS, render, to_yaml
from kubernetes import client
from operator_helpers import eventually, get_fleet, weights_volume
from sim_harness import FollowerThread

from rolloutfleet.resources import labels

from .conftest import (
    ChartOperator,
    create_fleet_and_revision,
    forbidden_lines,
    kubectl,
    phase,
    publish_snippet,
    service_account_kubeconfig,
    start_operator_as,
)

pytestmark = [pytest.mark.chart, pytest.mark.integration]


Editor = Callable[[list[dict[str, Any]]], None]


@pytest.fixture
def chart_operator(
    chart_crds: list[str],
    k8s_api: client.ApiClient,
    kubeconfig_path: pathlib.Path,
    namespace: str,
    tmp_path: pathlib.Path,
    cluster_scoped_cleanup: list[str],
    request: pytest.FixtureRequest,
) -> Iterator[Callable[[Editor | None], ChartOperator]]:
    """Install the chart's ServiceAccount and RBAC (optionally edited) in ``namespace``, the release and
    watched namespace, then start the operator as that ServiceAccount."""
    started: list[ChartOperator] = []
    request.node.chart_operators = started  # their logs are attached to failure reports (conftest)

    def start(edit: Editor | None = None) -> ChartOperator:
        release = f"rf{namespace[-6:]}"  # cluster-scoped names must not collide across tests
        _, objs = render({"watch": {"namespaces": [namespace]}}, namespace, release)
        rbac = [o for o in objs if o["kind"] in RBAC_KINDS]
        if edit is not None:
            edit(rbac)
        cluster_scoped_cleanup.extend(
            f"{o['kind'].lower()}/{o['metadata']['name']}" for o in rbac if o["kind"].startswith("Cluster")
        )
        applied = kubectl(kubeconfig_path, "apply", "-f", "-", stdin=to_yaml(rbac))
        assert applied.returncode == 0, applied.stderr
        account = next(o for o in rbac if o["kind"] == "ServiceAccount")["metadata"]["name"]
        kubeconfig = service_account_kubeconfig(
            k8s_api, kubeconfig_path, namespace, account, tmp_path / "sa.kubeconfig"
        )
        op = start_operator_as(kubeconfig, objs, tmp_path / "operator.log")
        started.append(op)
        return op

    try:
        yield start
    finally:
        for op in started:
            op.stop()


@pytest.fixture
def engines(k8s_api: client.ApiClient, namespace: str) -> Iterator[FollowerThread]:
    weights_volume(k8s_api, namespace)
    follower = FollowerThread(k8s_api, namespace, "pol")
    try:
        yield follower
    finally:
        follower.stop()


def test_chart_identity_completes_a_rollout_without_403(
    chart_operator: Callable[[Editor | None], ChartOperator],
    engines: FollowerThread,
    k8s_api: client.ApiClient,
    namespace: str,
    weights: pathlib.Path,
) -> None:
    op = chart_operator(None)
    assert f"--namespace={namespace}" in op.args and "--standalone" in op.args
    api = client.CustomObjectsApi(k8s_api)
    name = create_fleet_and_revision(api, namespace, weights)
    try:
        done = publish_snippet.wait_ready(api, namespace, name, timeout=120)  # the documented trainer wait
        assert done["status"]["phase"] == "Succeeded"
        eventually(
            lambda: get_fleet(api, namespace, "pol").get("status", {}).get("currentRevision") == 1,
            timeout=30,
            what="fleet at revision 1",
        )
        # The children the operator server-side applied and the token Secret it created, as the SA.
        apps, core = client.AppsV1Api(k8s_api), client.CoreV1Api(k8s_api)
        sts = apps.read_namespaced_stateful_set(labels.statefulset_name("pol"), namespace)
        assert any(f.manager == "rolloutfleet-operator" for f in sts.metadata.managed_fields or [])
        assert core.read_namespaced_secret(labels.token_secret_name("pol"), namespace).data
        events = core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}").items
        assert any(e.reason == "AllPodsUpdated" for e in events), [e.reason for e in events]
    finally:
        log = op.log()
    assert op.proc.poll() is None, log[-3000:]
    assert forbidden_lines(log) == [], "\n".join(forbidden_lines(log)[:20])


def drop_rule(resource: str, verb: str) -> Editor:
    """An RBAC edit that removes one verb on one resource from the operator's Role."""

    def edit(rbac: list[dict[str, Any]]) -> None:
        role = next(o for o in rbac if o["kind"] == "Role")
        hits = 0
        for rule in role["rules"]:
            if resource in rule["resources"] and verb in rule["verbs"]:
                rule["verbs"] = [v for v in rule["verbs"] if v != verb]
                hits += 1
        role["rules"] = [r for r in role["rules"] if r["verbs"]]
        assert hits == 1, f"no rule grants {verb} on {resource}"

    return edit


def test_one_rule_less_and_the_rollout_never_succeeds(
    chart_operator: Callable[[Editor | None], ChartOperator],
    engines: FollowerThread,
    k8s_api: client.ApiClient,
    namespace: str,
    weights: pathlib.Path,
) -> None:
    op = chart_operator(drop_rule("weightrevisions/status", "patch"))
    api = client.CustomObjectsApi(k8s_api)
    name = create_fleet_and_revision(api, namespace, weights)
    eventually(lambda: forbidden_lines(op.log()), timeout=90, what="a 403 in the operator log")

    # The engines do move (the operator can drive them) but the revision can never be reported done:
    # wait until every engine has resumed on revision 1, then give the operator a few passes more.
    def all_resumed() -> bool:
        logs = engines.logs()
        return len(logs) == 2 and all(
            any(str(e.get("key") or e.get("step")) == "resume" and e.get("status") == 200 for e in log)
            for log in logs.values()
        )

    eventually(all_resumed, timeout=90, what="both engines resumed after loading revision 1")
    with pytest.raises(AssertionError, match="timed out"):
        eventually(lambda: phase(api, namespace, name) == "Succeeded", timeout=8, what="no success")
    assert phase(api, namespace, name) in (None, "Pending")
    assert any("weightrevisions" in line for line in forbidden_lines(op.log()))
