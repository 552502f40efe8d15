"""The product driven only through Git commits, as a platform team runs it: Flux's real source-controller and
kustomize-controller sync a loopback repository into the session cluster, the operator rolls simulated
engines, and every step is checked on the engines' own reports (what each one claims to serve, verified,
and what its memory holds), on the objects' status, and on the Kustomization's Ready condition computed by
the health rules of docs/gitops/flux/fleet-sync.yaml.

Only the last test changes the cluster by hand (drift, which Flux puts back to Git's value).
The tests are one Git history, run in file order: each builds on the commits of the one before and skips
(naming the missing step) when that one did not pass. Each records the seconds from ``git push`` to every
effect it waits for (``$ROLLOUTFLEET_GITOPS_REPORT``; bench/results/gitops_flux.md).
"""

from __future__ import annotations

import pathlib
import time
from collections.abc import Callable
from typing import Any

import pytest
import yaml
from kubernetes import client
from sim_harness import ok_calls

from rolloutfleet.digest import digest_directory

from .conftest import FLEET, KUSTOMIZE, SOURCE, GitOps

pytestmark = pytest.mark.integration

GROUP, VERSION = "rolloutfleet.io", "v1alpha1"
REVISIONS = (GROUP, VERSION, "weightrevisions")
FLEETS = (GROUP, VERSION, "rolloutfleets")
REPLICAS = 3
SLOW = 120.0  # seconds any one Git action may take here (a shared 2-core machine); they take a few


# -- the repository --------------------------------------------------------------------------------------


def fleet_file(root: pathlib.Path) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "RolloutFleet",
        "metadata": {"name": FLEET},
        "spec": {
            "replicas": REPLICAS,
            "image": "vllm-rolloutfleet:0.33.0",
            "verifier": {"path": str(root / "policy/step-0/verifier")},
            "draft": {"method": "draft_model", "path": str(root / "policy/step-0/draft"), "policy": "coUpdate"},
            "weights": {"claimName": "ckpt", "mountPath": str(root), "allowedRoots": [str(root / "policy")]},
            "updateStrategy": {"maxRetries": 1, "timeouts": {"wakeSeconds": 5, "loadSeconds": 10}},
        },
    }


def revision_file(root: pathlib.Path, name: str, number: int, step: int, **extra: Any) -> dict[str, Any]:
    """A WeightRevision as a trainer's CI job commits it: the checkpoint of ``step``, its digest pinned."""
    verifier = root / f"policy/step-{step}/verifier"
    spec: dict[str, Any] = {
        "fleetRef": {"name": FLEET},
        "revision": number,
        "verifier": {"path": str(verifier), "digest": digest_directory(str(verifier))},
        "draft": {"path": str(root / f"policy/step-{step}/draft")},
        **extra,
    }
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "WeightRevision", "metadata": {"name": name}, "spec": spec}


def revision_path(name: str) -> str:
    return f"fleet/weightrevision-{name}.yaml"


def push(
    state: GitOps, message: str, *, write: dict[str, dict[str, Any]] | None = None, remove: tuple[str, ...] = ()
) -> tuple[str, float]:
    """Commit the changes with a kustomization.yaml listing every file of fleet/ (the layout of
    docs/gitops/flux/fleet), push, and ask Flux to fetch now; returns (sha, monotonic time of the push)."""
    for path, body in (write or {}).items():
        state.copy.write(path, yaml.safe_dump(body, sort_keys=False))
    for path in remove:
        state.copy.remove(path)
    fleet_dir = state.copy.directory / "fleet"
    resources = sorted(p.name for p in fleet_dir.glob("*.yaml") if p.name != "kustomization.yaml")
    kustomization = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "resources": resources}
    state.copy.write("fleet/kustomization.yaml", yaml.safe_dump(kustomization, sort_keys=False))
    sha = state.copy.commit_and_push(message)
    pushed = time.monotonic()
    state.request_sync()
    return sha, pushed


# -- what Flux, the objects and the engines say --------------------------------------------------------------


def ready(obj: dict[str, Any]) -> dict[str, Any]:
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond["type"] == "Ready":
            return dict(cond)
    return {}


def sync_at(state: GitOps, sha: str, status: str) -> dict[str, Any] | None:
    """The Kustomization once it has judged commit ``sha``: Ready is ``status`` ("True"/"False")."""
    obj = state.get(KUSTOMIZE, "fleet")
    st = obj.get("status") or {}
    if st.get("observedGeneration") != obj["metadata"]["generation"]:
        return None
    attempted = str(st.get("lastAttemptedRevision") or "")
    return obj if attempted.endswith(sha) and ready(obj).get("status") == status else None


def fetched(state: GitOps, sha: str) -> bool:
    artifact = (state.get(SOURCE, "fleet").get("status") or {}).get("artifact") or {}
    return str(artifact.get("revision") or "").endswith(sha)


def revision_status(state: GitOps, name: str) -> dict[str, Any]:
    try:
        return dict(state.get(REVISIONS, name).get("status") or {})
    except client.ApiException as exc:
        if exc.status == 404:
            return {"absent": True}
        raise


def revision_absent(state: GitOps, name: str) -> bool:
    return bool(revision_status(state, name).get("absent"))


def fleet_status(state: GitOps) -> dict[str, Any]:
    try:
        return dict(state.get(FLEETS, FLEET).get("status") or {})
    except client.ApiException as exc:
        if exc.status == 404:
            return {}
        raise


def fleet_available(state: GitOps) -> bool:
    conds = fleet_status(state).get("conditions") or []
    return any(c["type"] == "Available" and c["status"] == "True" for c in conds)


def engine_reports(state: GitOps) -> dict[str, dict[str, Any]]:
    """Each engine's own report (the extension's ``rolloutfleet_state``) and what its memory holds."""

    async def read() -> dict[str, dict[str, Any]]:
        sim = state.engines.follower.sim
        out: dict[str, dict[str, Any]] = {}
        for key, engine in (sim.engines if sim is not None else {}).items():
            report = engine.core.state_results()[0]
            out[key] = {
                "verifier": report["verifier"],
                "draft": report["draft"],
                "memory": engine.core.pair(),
                "paused": engine.core.paused,
                "weight_version": engine.core.weight_version,
            }
        return out

    return state.engines.call(read())


def serving(state: GitOps, step: int, number: int) -> bool:
    """Every engine reports the verified checkpoint of ``step`` as revision ``number``, its memory holds
    that pair (verifier and draft of one generation), and it is serving (not paused)."""
    reports = engine_reports(state)
    path = str(state.weights / f"policy/step-{step}/verifier")
    return len(reports) == REPLICAS and all(
        r["verifier"]["path"] == path
        and r["verifier"]["revision"] == number
        and r["verifier"]["verified"]
        and r["memory"]["verifier"] == number
        and r["memory"]["draft"] == number
        and not r["memory"]["mixed"]
        and not r["paused"]
        for r in reports.values()
    )


def serving_initial(state: GitOps) -> bool:
    """Every engine serves what ``vllm serve`` loaded at start-up (step-0), unpaused."""
    reports = engine_reports(state)
    return len(reports) == REPLICAS and all(
        r["memory"]["verifier_content"] == "initial" and r["memory"]["resident"] and not r["paused"]
        for r in reports.values()
    )


def engine_changes(state: GitOps) -> int:
    """State-changing engine calls so far (pause, sleep, loads, ...): a step that must not touch the
    engines leaves this count as it was."""
    moves = ("pause", "sleep", "wake_up", "rolloutfleet_load", "resume", "update_weight_version")
    logs = state.engines.logs()
    return sum(1 for log in logs.values() for e in ok_calls(log) if str(e.get("key") or e["step"]).startswith(moves))


def watch(
    state: GitOps,
    action: str,
    since: float,
    marks: dict[str, Callable[[], Any]],
    *,
    also: Callable[[], None] | None = None,
) -> dict[str, float]:
    """Poll until every mark holds; record the seconds from ``since`` (the push) to each mark's first
    success under ``action``. ``also`` runs on every round (an invariant that must hold meanwhile)."""
    seen: dict[str, float] = {}
    deadline = time.monotonic() + SLOW
    while len(seen) < len(marks):
        for name, check in marks.items():
            if name not in seen and check():
                seen[name] = time.monotonic() - since
        if also is not None:
            also()
        if len(seen) == len(marks):
            break
        if time.monotonic() > deadline:
            missing = [m for m in marks if m not in seen]
            sync = state.get(KUSTOMIZE, "fleet").get("status")
            raise AssertionError(
                f"{action}: timed out waiting for {missing} (seen {seen}); Kustomization status {sync}; "
                f"fleet status {fleet_status(state)}; engines {engine_reports(state)}"
            )
        time.sleep(0.05)
    state.timings[action] = seen
    return seen


def requires(state: GitOps, *steps: str) -> None:
    missing = [s for s in steps if s not in state.done]
    if missing:
        pytest.skip(f"needs the earlier step(s) {missing} of this Git history, which did not pass")


# -- the history -------------------------------------------------------------------------------------------


def test_first_sync_creates_the_fleet(gitops: GitOps) -> None:
    sha, pushed = push(gitops, "the fleet", write={"fleet/rolloutfleet.yaml": fleet_file(gitops.weights)})
    watch(
        gitops,
        "first commit (fleet of 3 engines)",
        pushed,
        {
            "fetched": lambda: fetched(gitops, sha),
            "engines serving": lambda: serving_initial(gitops),
            "fleet Available": lambda: fleet_available(gitops),
            "Kustomization Ready": lambda: sync_at(gitops, sha, "True"),
        },
    )
    assert fleet_available(gitops)
    gitops.done.add("fleet")


def test_a_new_revision_commit_rolls_the_fleet_and_ready_follows_the_health_rules(gitops: GitOps) -> None:
    requires(gitops, "fleet")
    root = gitops.weights
    # Ready must never come before the engines serve: the health rules wait for Succeeded.
    early: list[str] = []
    for step in (1, 2):
        name = f"pol-step-{step}"
        sha, pushed = push(
            gitops, f"publish step {step}", write={revision_path(name): revision_file(root, name, step, step)}
        )

        def not_ready_before_served(step: int = step, sha: str = sha) -> None:
            if sync_at(gitops, sha, "True") and not serving(gitops, step, step):
                early.append(f"Ready at {sha[:8]} while engines were not serving step {step}")

        watch(
            gitops,
            f"new revision {step}" + (" (over step 1)" if step == 2 else ""),
            pushed,
            {
                "fetched": lambda sha=sha: fetched(gitops, sha),
                "applied": lambda name=name: not revision_absent(gitops, name),
                "engines serving": lambda step=step: serving(gitops, step, step),
                "revision Succeeded": lambda name=name: revision_status(gitops, name).get("phase") == "Succeeded",
                "Kustomization Ready": lambda sha=sha: sync_at(gitops, sha, "True"),
            },
            also=not_ready_before_served,
        )
        assert not early, early
    # Both stay in Git and on the server: a completed revision that a newer one replaced stays Succeeded.
    assert revision_status(gitops, "pol-step-1")["phase"] == "Succeeded"
    assert fleet_status(gitops)["currentRevision"] == 2
    gitops.done.add("revisions")


def test_an_older_revision_commit_is_refused_with_the_reason_in_the_kustomization(gitops: GitOps) -> None:
    requires(gitops, "revisions")
    name = "pol-step-1-again"
    moves = engine_changes(gitops)
    sha, pushed = push(
        gitops, "publish step 1 again", write={revision_path(name): revision_file(gitops.weights, name, 1, 1)}
    )
    watch(
        gitops,
        "older revision (refused)",
        pushed,
        {
            "revision Failed": lambda: revision_status(gitops, name).get("phase") == "Failed",
            "Kustomization not Ready": lambda: sync_at(gitops, sha, "False"),
        },
    )
    assert revision_status(gitops, name)["reason"] == "NotNewer"
    condition = ready(gitops.get(KUSTOMIZE, "fleet"))
    assert condition["reason"] == "HealthCheckFailed", condition
    # Flux names the refused object and its state; the reason (NotNewer) is in that object's status: Flux's
    # CEL health checks carry no message of their own.
    assert f"WeightRevision/{gitops.namespace}/{name} status: 'Failed'" in condition["message"], condition
    gitops.messages["older revision"] = condition["message"]
    assert serving(gitops, 2, 2) and engine_changes(gitops) == moves, "a refused revision touched the engines"

    sha, pushed = gitops.copy.revert_last("revert: step 1 is older than what is served"), time.monotonic()
    gitops.request_sync()
    watch(
        gitops,
        "revert of the refused commit (pruned, Ready again)",
        pushed,
        {
            "refused revision pruned": lambda: revision_absent(gitops, name),
            "Kustomization Ready": lambda: sync_at(gitops, sha, "True"),
        },
    )
    assert serving(gitops, 2, 2) and engine_changes(gitops) == moves
    gitops.done.add("older")


def test_pruning_revision_files_keeps_what_the_fleet_serves(gitops: GitOps) -> None:
    requires(gitops, "revisions")
    moves = engine_changes(gitops)
    unavailable: list[str] = []

    def still_available() -> None:
        if not fleet_available(gitops):
            unavailable.append("the fleet left Available while Flux pruned its revisions")

    removed = (revision_path("pol-step-1"), revision_path("pol-step-2"))
    sha, pushed = push(gitops, "prune old revisions, the served one too", remove=removed)
    watch(
        gitops,
        "prune the revision files (2 objects deleted)",
        pushed,
        {
            "objects deleted": lambda: revision_absent(gitops, "pol-step-1") and revision_absent(gitops, "pol-step-2"),
            "Kustomization Ready": lambda: sync_at(gitops, sha, "True"),
        },
        also=still_available,
    )
    assert not unavailable, unavailable[0]
    served = fleet_status(gitops)["served"]
    assert served["revision"] == 2 and served["name"] == "pol-step-2", served
    assert serving(gitops, 2, 2), engine_reports(gitops)
    assert engine_changes(gitops) == moves, "pruning revision objects touched the engines"
    gitops.done.add("pruned")


def test_re_adding_the_served_revision_is_ready_at_once(gitops: GitOps) -> None:
    requires(gitops, "pruned")
    name = "pol-step-2"
    moves = engine_changes(gitops)
    sha, pushed = push(gitops, "re-add step 2", write={revision_path(name): revision_file(gitops.weights, name, 2, 2)})
    watch(
        gitops,
        "re-add the served revision (AlreadyServed)",
        pushed,
        {
            "revision Succeeded": lambda: revision_status(gitops, name).get("phase") == "Succeeded",
            "Kustomization Ready": lambda: sync_at(gitops, sha, "True"),
        },
    )
    assert revision_status(gitops, name)["reason"] == "AlreadyServed"
    assert serving(gitops, 2, 2) and engine_changes(gitops) == moves, "re-adding a served revision touched engines"
    gitops.done.add("readded")


def test_editing_a_published_revision_is_refused(gitops: GitOps) -> None:
    requires(gitops, "readded")
    name = "pol-step-2"
    moves = engine_changes(gitops)
    edited = revision_file(gitops.weights, name, 2, 3)  # same name and number, another checkpoint
    sha, pushed = push(gitops, "point step 2 at another checkpoint", write={revision_path(name): edited})
    watch(
        gitops,
        "edit a published revision (refused)",
        pushed,
        {"Kustomization not Ready": lambda: sync_at(gitops, sha, "False")},
    )
    condition = ready(gitops.get(KUSTOMIZE, "fleet"))
    # The API server's CEL rule refuses the change at Flux's dry run; its words reach the Kustomization.
    assert "immutable" in condition["message"], condition
    gitops.messages["edited revision"] = condition["message"]
    on_server = gitops.get(REVISIONS, name)["spec"]["verifier"]["path"]
    assert on_server == str(gitops.weights / "policy/step-2/verifier")
    assert serving(gitops, 2, 2) and engine_changes(gitops) == moves

    sha, pushed = gitops.copy.revert_last("revert: publish a new revision instead"), time.monotonic()
    gitops.request_sync()
    watch(
        gitops,
        "revert of the edit (Ready again)",
        pushed,
        {"Kustomization Ready": lambda: sync_at(gitops, sha, "True")},
    )
    gitops.done.add("edited")


def test_a_rollback_commit_moves_the_fleet_back(gitops: GitOps) -> None:
    requires(gitops, "readded")
    name = "pol-rollback-to-1"
    body = revision_file(gitops.weights, name, 1, 1, allowOlder=True)
    sha, pushed = push(gitops, "roll back to step 1", write={revision_path(name): body})
    watch(
        gitops,
        "rollback commit (allowOlder, to step 1)",
        pushed,
        {
            "engines serving": lambda: serving(gitops, 1, 1),
            "revision Succeeded": lambda: revision_status(gitops, name).get("phase") == "Succeeded",
            "Kustomization Ready": lambda: sync_at(gitops, sha, "True"),
        },
    )
    status = fleet_status(gitops)
    assert status["currentRevision"] == 1 and status["served"]["name"] == name, status
    # The revision it rolled back from stays in Git and on the server, as it ended; Flux is Ready with both.
    assert revision_status(gitops, "pol-step-2")["phase"] == "Succeeded"


def test_a_manual_edit_of_the_fleet_is_put_back_to_what_git_says(gitops: GitOps) -> None:
    """Drift: someone edits the fleet by hand (a field Flux applied); the next sync restores Git's value."""
    requires(gitops, "fleet")
    fleet = gitops.get(FLEETS, FLEET)
    in_git = fleet["spec"]["updateStrategy"]["maxRetries"]
    body = {"spec": {"updateStrategy": {"maxRetries": in_git + 2}}}
    gitops.custom.patch_namespaced_custom_object(GROUP, VERSION, gitops.namespace, "rolloutfleets", FLEET, body)
    assert gitops.get(FLEETS, FLEET)["spec"]["updateStrategy"]["maxRetries"] == in_git + 2
    edited = time.monotonic()
    gitops.request_sync(KUSTOMIZE)  # no commit: ask kustomize-controller to re-apply the same revision
    watch(
        gitops,
        "manual edit of the fleet (drift) put back",
        edited,
        {"restored": lambda: gitops.get(FLEETS, FLEET)["spec"]["updateStrategy"]["maxRetries"] == in_git},
    )
