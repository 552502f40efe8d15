"""The Argo CD health checks of docs/gitops, run the way Argo CD runs them (the script is a chunk with a
global ``obj`` that returns ``{status, message}``) by two interpreters: C Lua 5.1 (lupa) and gopher-lua, the
Go implementation Argo CD embeds (``glua`` v1.1.1, built from its Go module with the control plane:
``rolloutfleet.sandbox.binaries``). Every case runs under both, so a script that leans on behaviour only
one of them has fails here.

For gopher-lua, ``obj`` is written as a table constructor the way Argo CD converts the object (maps to
tables keyed by string, lists to 1-based tables, JSON numbers to Lua numbers, null to nil), and ``os``,
``io`` and ``debug`` are taken away before the script runs (Argo CD does not give them to health scripts
unless a cluster opts in).
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import tempfile
from typing import Any

import pytest
import yaml
from lupa import lua51

from rolloutfleet.sandbox import binaries

pytestmark = pytest.mark.unit

ARGOCD = pathlib.Path(__file__).resolve().parents[3] / "docs" / "gitops" / "argocd"
ARGO_STATUSES = {"Healthy", "Progressing", "Degraded", "Suspended", "Missing", "Unknown"}


_interpreter = "lua5.1"


@pytest.fixture(autouse=True, params=["lua5.1", "gopher-lua"])
def interpreter(request: pytest.FixtureRequest) -> str:
    """Which interpreter ``health`` uses in this test."""
    global _interpreter
    if request.param == "gopher-lua" and not binaries.binary_path("glua").exists():
        pytest.skip("glua is not built: python -m rolloutfleet.sandbox.binaries glua (make binaries does)")
    _interpreter = request.param
    return _interpreter


def health(script: str, obj: dict[str, Any]) -> tuple[str, str]:
    if _interpreter == "gopher-lua":
        status, message = _gopher_lua(script, obj)
    else:
        lua = lua51.LuaRuntime(unpack_returned_tuples=True)
        lua.globals().obj = lua.table_from(obj, recursive=True)
        result = lua.execute((ARGOCD / script).read_text())
        status, message = result["status"], result["message"]
    assert status in ARGO_STATUSES
    assert isinstance(message, str) and message
    return str(status), str(message)


def lua_literal(value: Any) -> str:
    """``value`` (decoded JSON) as a Lua 5.1 expression; strings byte by byte, so any text survives."""
    if value is None:
        return "nil"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        # Decimal escapes of three digits: Lua reads up to three, so a short one before a digit would grow.
        plain = {ord(c) for c in " .-_:/"}
        escaped = (chr(b) if (chr(b).isalnum() and b < 128) or b in plain else f"\\{b:03d}" for b in value.encode())
        return '"' + "".join(escaped) + '"'
    if isinstance(value, list):
        return "{" + ",".join(lua_literal(item) for item in value) + "}"
    if isinstance(value, dict):
        return "{" + ",".join(f"[{lua_literal(str(k))}]={lua_literal(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"not JSON: {value!r}")


def _gopher_lua(script: str, obj: dict[str, Any]) -> tuple[Any, Any]:
    # The script runs as a function body (a chunk's top-level `return` works the same there); status and
    # message go out through the io.write kept aside before io is taken away.
    program = "\n".join(
        [
            f"obj = {lua_literal(json.loads(json.dumps(obj)))}",
            "local write = io.write",
            "os, io, debug = nil, nil, nil",
            "local hs = (function()",
            (ARGOCD / script).read_text(),
            "end)()",
            'write(type(hs.status) == "string" and hs.status or "?", "\\0", tostring(hs.message))',
        ]
    )
    with tempfile.NamedTemporaryFile("w", suffix=".lua") as chunk:  # glua reads scripts from files only
        chunk.write(program)
        chunk.flush()
        done = subprocess.run(
            [str(binaries.binary_path("glua")), chunk.name],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    assert done.returncode == 0, done.stderr
    status, _, message = done.stdout.partition("\0")
    return status, message


def cond(type_: str, status: str, reason: str = "R", message: str = "") -> dict[str, Any]:
    return {"type": type_, "status": status, "reason": reason, "message": message}


def fleet(*conditions: dict[str, Any], generation: int = 2, observed: int | None = 2, **status: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"metadata": {"name": "pol", "generation": generation}, "spec": {"replicas": 2}}
    if conditions or observed is not None or status:
        body["status"] = {"conditions": list(conditions), **status}
        if observed is not None:
            body["status"]["observedGeneration"] = observed
    return body


FLEET = "rolloutfleet-health.lua"
WREV = "weightrevision-health.lua"


def test_fleet_available_and_settled_is_healthy() -> None:
    status, message = health(
        FLEET,
        fleet(
            cond("Available", "True"),
            cond("Progressing", "False"),
            cond("Degraded", "False"),
            replicas=2,
            readyReplicas=2,
            currentRevision=7,
        ),
    )
    assert status == "Healthy"
    assert message == "2/2 engines ready, serving revision 7"


def test_fleet_without_revision_says_initial_weights() -> None:
    _, message = health(FLEET, fleet(cond("Available", "True"), replicas=1, readyReplicas=1))
    assert message.endswith("serving initial weights")


@pytest.mark.parametrize("available", ["True", "False"])
def test_fleet_degraded_wins(available: str) -> None:
    status, message = health(
        FLEET,
        fleet(
            cond("Available", available),
            cond("Progressing", "True"),
            cond("Degraded", "True", "ValidationFailed", "spec.draft.path: outside allowedRoots"),
        ),
    )
    assert (status, message) == ("Degraded", "spec.draft.path: outside allowedRoots")


def test_fleet_progressing_while_rolling() -> None:
    status, message = health(
        FLEET,
        fleet(
            cond("Available", "True"),
            cond("Progressing", "True", "RolloutInProgress", "3/8 pods at revision 4"),
            cond("Degraded", "False"),
        ),
    )
    assert (status, message) == ("Progressing", "3/8 pods at revision 4")


def test_fleet_not_yet_available_is_progressing_with_the_reason() -> None:
    status, message = health(FLEET, fleet(cond("Available", "False", "EnginesStarting")))
    assert (status, message) == ("Progressing", "EnginesStarting")


@pytest.mark.parametrize(
    "body",
    [
        {"metadata": {"name": "pol", "generation": 1}, "spec": {}},
        fleet(generation=1, observed=None),
        fleet(cond("Available", "True"), generation=3, observed=2),
        fleet(cond("Available", "True"), generation=3, observed=None),
    ],
    ids=["no-status", "empty-status", "stale-generation", "no-observed-generation"],
)
def test_fleet_not_observed_yet_is_progressing(body: dict[str, Any]) -> None:
    assert health(FLEET, body)[0] == "Progressing"


def wrev(phase: str | None = None, *conditions: dict[str, Any], **status: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"metadata": {"name": "step-42"}, "spec": {"fleetRef": {"name": "pol"}, "revision": 42}}
    if phase is not None or conditions or status:
        body["status"] = {"conditions": list(conditions), **status}
        if phase is not None:
            body["status"]["phase"] = phase
    return body


def test_revision_succeeded_is_healthy() -> None:
    status, message = health(WREV, wrev("Succeeded", cond("Ready", "True", "AllPodsUpdated"), updated="8/8"))
    assert (status, message) == ("Healthy", "8/8 pods serve revision 42")


def test_revision_ready_without_phase_is_healthy() -> None:
    assert health(WREV, wrev(None, cond("Ready", "True")))[0] == "Healthy"


def test_superseded_is_healthy_with_a_message_never_suspended() -> None:
    status, message = health(WREV, wrev("Superseded", cond("Ready", "False"), message="superseded by step-43"))
    assert status == "Healthy"
    assert message == "Superseded: superseded by step-43"
    assert health(WREV, wrev("Superseded"))[1].startswith("Superseded: a newer revision replaced revision 42")


@pytest.mark.parametrize("phase", ["Failed", "RolledBack"])
def test_failed_and_rolled_back_are_degraded(phase: str) -> None:
    status, message = health(
        WREV, wrev(phase, cond("Ready", "False", "VerifyFailed", "digest mismatch"), message="pol-engine-3: digest")
    )
    assert status == "Degraded"
    assert message == f"{phase}: pol-engine-3: digest"
    assert health(WREV, wrev(phase, cond("Ready", "False", "X", "only the condition says")))[1].endswith(
        "only the condition says"
    )


def test_failed_wins_over_a_stale_ready_condition() -> None:
    assert health(WREV, wrev("Failed", cond("Ready", "True")))[0] == "Degraded"


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (wrev(), "Waiting for the operator to pick up revision 42"),
        (wrev("Pending", cond("Ready", "False", "FleetNotFound", "RolloutFleet 'pol' not found")), "Pending"),
        (wrev("Progressing", cond("Ready", "False", "Rolling"), updated="3/8", message="loading"), "3/8: loading"),
    ],
    ids=["no-status", "pending", "progressing"],
)
def test_in_flight_is_progressing(body: dict[str, Any], expected: str) -> None:
    status, message = health(WREV, body)
    assert status == "Progressing"
    assert expected in message


def test_argocd_cm_snippet_embeds_the_scripts_verbatim() -> None:
    cm = yaml.safe_load((ARGOCD / "argocd-cm.yaml").read_text())
    assert cm["kind"] == "ConfigMap" and cm["metadata"]["name"] == "argocd-cm"
    data = cm["data"]
    assert data["resource.customizations.health.rolloutfleet.io_RolloutFleet"] == (ARGOCD / FLEET).read_text()
    assert data["resource.customizations.health.rolloutfleet.io_WeightRevision"] == (ARGOCD / WREV).read_text()


def test_the_object_reaches_the_script_unchanged() -> None:
    # Under gopher-lua the object travels as Lua source: non-ASCII, quotes, newlines and digits right
    # after an escaped byte must arrive as the operator wrote them.
    message = 'naïve "quoted"\nline 2\t\x01' + "5" * 3
    status, seen = health(FLEET, fleet(cond("Degraded", "True", "X", message)))
    assert (status, seen) == ("Degraded", message)
