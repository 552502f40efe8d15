"""Fixtures for tests that need the CRDs installed and the operator running against the real cluster.

Builds on ``tests/integration/conftest.py`` (cluster, namespace, wait_for). ``crds_installed`` applies
the generated CRDs once per session (like the chart would); ``operator_process`` runs ``rolloutfleet
run`` as a real subprocess watching all namespaces, logging to a file that failing tests print.
"""

from __future__ import annotations

import os
import pathlib
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from kubernetes import client
from operator_process import OperatorProcess, start_operator, stop_operator

REPO = pathlib.Path(__file__).resolve().parents[3]


@pytest.fixture(scope="session")
def crds_installed(k8s_api: client.ApiClient) -> list[str]:
    ext = client.ApiextensionsV1Api(k8s_api)
    names = []
    for path in sorted((REPO / "crds").glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        name = crd["metadata"]["name"]
        names.append(name)
        try:
            existing = ext.read_custom_resource_definition(name)
            crd["metadata"]["resourceVersion"] = existing.metadata.resource_version
            ext.replace_custom_resource_definition(name, crd)
        except client.ApiException as exc:
            if exc.status != 404:
                raise
            ext.create_custom_resource_definition(crd)
    deadline = time.monotonic() + 60
    for name in names:
        while True:
            conds = ext.read_custom_resource_definition(name).status.conditions or []
            if any(c.type == "Established" and c.status == "True" for c in conds):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"CRD {name} not Established")
            time.sleep(0.2)
    return names


@pytest.fixture(scope="session")
def operator_process(
    crds_installed: list[str], kubeconfig_path: pathlib.Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    op = start_operator(kubeconfig_path, tmp_path_factory.mktemp("operator") / "operator.log")
    try:
        yield op
    finally:
        stop_operator(op)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    op = item.funcargs.get("operator_process") if hasattr(item, "funcargs") else None
    if report.failed and isinstance(op, OperatorProcess):
        report.sections.append(("operator log (tail)", "\n".join(op.log().splitlines()[-80:])))


@pytest.fixture(scope="session", autouse=True)
def _snapshot_kubeconfig(kubeconfig_path: pathlib.Path) -> None:
    """Lets timeout messages (operator_helpers.eventually) include a snapshot of the cluster's pods."""
    os.environ["ROLLOUTFLEET_TEST_KUBECONFIG"] = str(kubeconfig_path)
