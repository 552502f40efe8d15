"""``rolloutfleet sandbox demo``: the whole product on a laptop, in one command.

Called through ``rolloutfleet sandbox demo`` (the README's first command, via ``make demo``). It builds or
reuses the local control plane, starts it, installs the CRDs, runs the real operator as a process,
serves a simulated vLLM engine on every pod's loopback IP (the pod follower), creates a fleet of 8 pods
with a co-updated draft, and applies three WeightRevisions in turn: a level-2-sleep AllAtOnce update,
an in-flight Rolling update, and one whose checkpoint does not exist (the engines' pre-flight refuses it
before any pod leaves service).
Progress per pod is shown live; a summary table ends it. Nothing is left running unless ``--keep``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import pathlib
import subprocess
import time
from typing import Any, cast

from kubernetes import client, config

from rolloutfleet.adapters.kube import Kube
from rolloutfleet.api import crdgen
from rolloutfleet.digest import digest_directory
from rolloutfleet.sandbox import binaries, cluster, demo_weights, operator_process
from rolloutfleet.sim.config import Latencies
from rolloutfleet.sim.follower import PodFollower

GROUP, VERSION = "rolloutfleet.io", "v1alpha1"
NAMESPACE, FLEET, PODS = "demo", "policy", 8
FINAL = ("Succeeded", "Failed", "RolledBack", "Superseded")
# Simulated step latencies (seconds), so that progress is visible; loads also scale with bytes.
LATENCIES = Latencies(steps={"*": 0.05, "sleep": 0.3, "wake_up": 0.2, "rolloutfleet_load": 0.6, "resume": 0.1})


def add_parser(sub: Any) -> None:
    """Register ``demo`` under ``rolloutfleet sandbox``."""
    demo = sub.add_parser("demo", help="run the sandbox demo: operator + simulated engines + three revisions")
    demo.add_argument("--keep", action="store_true", help="leave the cluster, operator and engines running")
    demo.add_argument("--name", default="demo", help="cluster name (default: demo)")
    demo.set_defaults(_sandbox=run)


def say(message: str) -> None:
    print(f"[demo] {message}", flush=True)


def run(args: argparse.Namespace) -> int:
    """Run the demo; returns 0 when every revision ended as expected."""
    return asyncio.run(_main(args))


async def _main(args: argparse.Namespace) -> int:
    binaries.ensure(cluster.COMPONENTS)
    local = cluster.Cluster.named(args.name, tie_to_parent=not args.keep)
    if local.running():
        local.stop(quiet=True)
    local.start()
    kube = Kube.from_environment(str(local.kubeconfig))
    api = config.new_client_from_config(config_file=str(local.kubeconfig), persist_config=False)  # type: ignore[no-untyped-call]
    workdir = local.directory / "demo"
    operator: subprocess.Popen[bytes] | None = None
    follower_task: asyncio.Task[None] | None = None
    try:
        await _install(kube, workdir)
        operator = operator_process.start(local.kubeconfig, local.directory / "logs" / "operator.log")
        # Recorded with the cluster: ``sandbox down`` stops the operator, and with --keep this process too
        # (it serves the simulated engines), not only the control plane.
        log = local.directory / "logs" / "operator.log"
        local.adopt("operator", operator.pid, operator_process.executable(operator), str(log))
        if args.keep:
            local.adopt_this_process("demo")
        say(f"operator running ({operator_process.describe(operator)}, log {log})")
        follower = PodFollower(api, NAMESPACE, FLEET, latencies=LATENCIES, interval=0.2)
        follower_task = asyncio.create_task(follower.run())
        await _wait_fleet(api)
        results = []
        for name, body, expect in _revisions(workdir):
            say(f"applying {name}: {expect['what']}")
            await asyncio.to_thread(
                client.CustomObjectsApi(api).create_namespaced_custom_object,
                GROUP,
                VERSION,
                NAMESPACE,
                "weightrevisions",
                body,
            )
            started = time.monotonic()
            final = await _watch(api, name)
            results.append((name, expect, final, time.monotonic() - started))
        ok = _summary(results)
        if args.keep:
            kubectl = binaries.ensure(("kubectl",))["kubectl"]  # only a kept demo needs it (built once)
            say(f"kept running. export KUBECONFIG={local.kubeconfig}; {kubectl} -n {NAMESPACE} get rfleet,wrev")
            say(f"stop everything with: rolloutfleet sandbox down --name {args.name}")
            follower_task = None  # keep serving until interrupted
            with contextlib.suppress(asyncio.CancelledError, KeyboardInterrupt):
                await asyncio.Event().wait()
        return 0 if ok else 1
    finally:
        if follower_task is not None:
            follower_task.cancel()
            with contextlib.suppress(BaseException):
                await follower_task
        if operator is not None and operator.poll() is None:
            operator.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                operator.wait(timeout=15)
            if operator.poll() is None:
                operator.kill()
        api.close()
        await kube.aclose()
        if not args.keep:
            local.stop()
            say("cluster stopped; nothing left running")


async def _install(kube: Kube, workdir: pathlib.Path) -> None:
    for crd in crdgen.custom_resource_definitions().values():
        await kube.apply(crd)
    for crd in crdgen.custom_resource_definitions().values():
        for _ in range(100):
            seen = await kube.get("apiextensions.k8s.io/v1", "CustomResourceDefinition", None, crd["metadata"]["name"])
            conds = ((seen or {}).get("status") or {}).get("conditions") or []
            if any(c.get("type") == "Established" and c.get("status") == "True" for c in conds):
                break
            await asyncio.sleep(0.1)
    say("CRDs installed (generated from the pydantic models)")
    await kube.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    for _ in range(100):
        if await kube.get("v1", "ServiceAccount", NAMESPACE, "default"):
            break
        await asyncio.sleep(0.1)
    root = workdir / "weights"
    for step in range(0, 3):
        demo_weights.write_checkpoint(
            root / "policy" / f"step-{step}" / "verifier", seed=1000 + step, tensors=6, size=256
        )
        demo_weights.write_checkpoint(root / "policy" / f"step-{step}" / "draft", seed=2000 + step, tensors=2, size=128)
    say(f"checkpoints written under {root}")
    await kube.apply(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": f"{NAMESPACE}-weights"},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadOnlyMany"],
                "storageClassName": "",
                "hostPath": {"path": str(root)},
                "claimRef": {"namespace": NAMESPACE, "name": "weights"},
            },
        }
    )
    await kube.apply(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": "weights", "namespace": NAMESPACE},
            "spec": {
                "accessModes": ["ReadOnlyMany"],
                "storageClassName": "",
                "volumeName": f"{NAMESPACE}-weights",
                "resources": {"requests": {"storage": "1Gi"}},
            },
        }
    )
    fleet = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "RolloutFleet",
        "metadata": {"name": FLEET, "namespace": NAMESPACE},
        "spec": {
            "replicas": PODS,
            "image": "vllm-rolloutfleet:0.33.0",
            "verifier": {"path": str(root / "policy/step-0/verifier")},
            "draft": {"method": "draft_model", "path": str(root / "policy/step-0/draft"), "policy": "coUpdate"},
            "weights": {"claimName": "weights", "mountPath": str(root), "allowedRoots": [str(root / "policy")]},
            "updateStrategy": {
                "mode": "sleep",
                "rollout": "AllAtOnce",
                "maxConcurrentLoads": 4,
                "maxRetries": 1,
                "timeouts": {"wakeSeconds": 5, "loadSeconds": 10},
            },
        },
    }
    await kube.apply(fleet)
    say(f"RolloutFleet {NAMESPACE}/{FLEET}: {PODS} pods, draft_model draft co-updated, parity profile on")


async def _wait_fleet(api: client.ApiClient) -> None:
    say(f"waiting for {PODS} pods on fake GPU nodes and their simulated engines ...")
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        fleet = await asyncio.to_thread(_get, api, "rolloutfleets", FLEET)
        status = fleet.get("status") or {}
        if status.get("readyReplicas") == PODS:
            ips = ", ".join(p.get("ip") or "?" for p in status.get("pods") or [])
            say(f"fleet Available: {PODS}/{PODS} engines ready on {ips}")
            return
        await asyncio.sleep(0.5)
    raise RuntimeError("the fleet did not become ready in 180 s (see the operator log)")


def _get(api: client.ApiClient, plural: str, name: str) -> dict[str, Any]:
    out = client.CustomObjectsApi(api).get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, plural, name)
    return cast(dict[str, Any], out)


def _revisions(workdir: pathlib.Path) -> list[tuple[str, dict[str, Any], dict[str, str]]]:
    root = workdir / "weights" / "policy"

    def body(name: str, number: int, verifier: pathlib.Path, draft: pathlib.Path, **extra: Any) -> dict[str, Any]:
        spec: dict[str, Any] = {
            "fleetRef": {"name": FLEET},
            "revision": number,
            "verifier": {"path": str(verifier), "digest": digest_directory(str(verifier))}
            if verifier.is_dir()
            else {"path": str(verifier)},
            "draft": {"path": str(draft), "digest": digest_directory(str(draft))}
            if draft.is_dir()
            else {"path": str(draft)},
        }
        spec.update(extra)
        return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "WeightRevision", "metadata": {"name": name}, "spec": spec}

    v1, d1 = root / "step-1/verifier", root / "step-1/draft"
    v2, d2 = root / "step-2/verifier", root / "step-2/draft"
    return [
        (
            "step-1",
            body("step-1", 1, v1, d1),
            {"what": "level-2 sleep, AllAtOnce barrier, digest pinned", "phase": "Succeeded"},
        ),
        (
            "step-2",
            body("step-2", 2, v2, d2, strategy={"mode": "inflight", "rollout": "Rolling", "maxUnavailable": 2}),
            {"what": "in-flight (pause keep), Rolling, 2 pods at a time", "phase": "Succeeded"},
        ),
        (
            "step-3",
            body("step-3", 3, root / "step-3/verifier", root / "step-3/draft"),
            {
                "what": "a checkpoint that does not exist: refused by the engines' pre-flight, no pod leaves service",
                "phase": "Failed",
            },
        ),
    ]


async def _watch(api: client.ApiClient, name: str) -> dict[str, Any]:
    last = ""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        wrev = await asyncio.to_thread(_get, api, "weightrevisions", name)
        fleet = await asyncio.to_thread(_get, api, "rolloutfleets", FLEET)
        status = wrev.get("status") or {}
        pods = (fleet.get("status") or {}).get("pods") or []
        # The revision's own per-pod step is fresher than the fleet's (written on the fleet's resync).
        steps = {p["name"]: p.get("step") for p in status.get("pods") or []}
        cells = " ".join(_cell(p, steps.get(p["name"])) for p in pods)
        line = f"  {name} {status.get('phase', 'Pending'):<11} {status.get('updated', '0/0'):>5} | {cells}"
        if line != last:
            print(line, flush=True)
            last = line
        if status.get("phase") in FINAL:
            return wrev
        await asyncio.sleep(0.5)
    raise RuntimeError(f"{name} did not finish in 300 s")


def _cell(pod: dict[str, Any], step: str | None) -> str:
    ordinal = pod["name"].rsplit("-", 1)[-1]
    return f"{ordinal}:r{pod.get('revision', '-')}/{(step or pod.get('step') or '?')[:8]:<8}"


def _summary(results: list[tuple[str, dict[str, str], dict[str, Any], float]]) -> bool:
    print()
    print(f"{'revision':<9} {'expected':<11} {'phase':<11} {'updated':>7} {'seconds':>8}  verification / reason")
    ok = True
    for name, expect, wrev, seconds in results:
        status = wrev.get("status") or {}
        verified: dict[str, Any] = next((c for c in status.get("conditions") or [] if c["type"] == "Verified"), {})
        detail = (
            verified.get("message", "") if status.get("phase") == "Succeeded" else (status.get("message") or "")[:110]
        )
        good = status.get("phase") == expect["phase"]
        ok = ok and good
        phase, updated = status.get("phase", "?"), status.get("updated", "?")
        print(f"{name:<9} {expect['phase']:<11} {phase:<11} {updated:>7} {seconds:8.1f}  {detail}")
    print()
    print("per-step timings (median / max seconds across pods):")
    for name, _, wrev, _ in results:
        order = [
            "Pause",
            "Sleep",
            "WakeWeights",
            "LoadVerifier",
            "LoadDraft",
            "RestoreDraft",
            "Resume",
        ]
        timings = sorted(
            (wrev.get("status") or {}).get("timings") or [],
            key=lambda t: order.index(t["step"]) if t["step"] in order else len(order),
        )
        cells = ", ".join(f"{t['step']} {t['medianSeconds']:.2f}/{t['maxSeconds']:.2f}" for t in timings)
        print(f"  {name}: {cells or '-'}")
    print()
    say("all three revisions ended as expected" if ok else "a revision did not end as expected (see the operator log)")
    return ok
