"""``rolloutfleet sandbox build|up|down|status``: the local control plane from the command line.

Called by :mod:`rolloutfleet.cli` (``register`` then ``run``). Thin: the work is in
:mod:`rolloutfleet.sandbox.binaries` and :mod:`rolloutfleet.sandbox.cluster`. ``sandbox up`` leaves the
components running detached (their own sessions) and returns; ``sandbox down`` stops them from any
later shell. The ``demo`` subcommand is registered by the integrator's module, not here; ``--flux`` (on
``up`` and ``demo``) adds Flux's controllers and a loopback Git server (:mod:`rolloutfleet.sandbox.flux`).
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import sys
import urllib.error
from typing import Any

from rolloutfleet.sandbox import binaries, cluster, flux, nodes


def _add_name(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--name", default="default", help="cluster name (dir: <cache>/clusters/<name>)")
    parser.add_argument("--dir", type=pathlib.Path, default=None, help="cluster directory (overrides --name's)")


def _cluster(args: argparse.Namespace, **kwargs: Any) -> cluster.Cluster:
    if args.dir is not None:
        return cluster.Cluster(args.dir.resolve(), name=args.name, **kwargs)
    return cluster.Cluster.named(args.name, **kwargs)


def register(parser: argparse.ArgumentParser) -> None:
    """Add the sandbox subcommands to ``parser``."""
    sub = parser.add_subparsers(dest="sandbox_command", metavar="SUBCOMMAND", required=True)

    build = sub.add_parser("build", help="build (or reuse) the control-plane binaries from Go modules")
    build.add_argument("tools", nargs="*", help=f"default: {' '.join((*binaries.CONTROL_PLANE, 'helm'))}")
    build.add_argument("--force", action="store_true", help="rebuild even if cached")
    build.set_defaults(_sandbox=_build)

    up = sub.add_parser("up", help="start a local control plane with fake GPU nodes (detached)")
    _add_name(up)
    up.add_argument("--nodes", type=int, default=4, help="fake GPU nodes (default 4)")
    up.add_argument("--gpus", type=int, default=8, help="nvidia.com/gpu per node (default 8)")
    up.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for readiness")
    up.add_argument("--flux", action="store_true", help=_FLUX_HELP)
    up.set_defaults(_sandbox=_up)

    down = sub.add_parser("down", help="stop the cluster; no process or tmpfs data is left behind")
    _add_name(down)
    down.add_argument("--purge", action="store_true", help="also delete its directory (certs, logs)")
    down.set_defaults(_sandbox=_down)

    status = sub.add_parser("status", help="what runs, on which ports, with how many nodes and pods")
    _add_name(status)
    status.set_defaults(_sandbox=_status)

    # `demo` lives in its own module (it pulls in the operator, the simulator and the pod follower).
    from rolloutfleet.sandbox import demo

    demo.add_parser(sub)
    demo_parser = sub.choices["demo"]
    demo_parser.add_argument("--flux", action="store_true", help=_FLUX_HELP)
    demo_parser.set_defaults(_sandbox=_demo)


_FLUX_HELP = "also run Flux (source- and kustomize-controller, built from Go modules) and a loopback Git server"


def run(args: argparse.Namespace) -> int:
    """Run the chosen subcommand; return the exit code."""
    try:
        code: int = args._sandbox(args)
    except binaries.BuildError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except (cluster.ClusterError, flux.FluxError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return code


def _where(args: argparse.Namespace) -> str:
    return f"--dir {args.dir.resolve()}" if args.dir is not None else f"--name {args.name}"


def _build(args: argparse.Namespace) -> int:
    return binaries.main([*args.tools, *(["--force"] if args.force else [])])


def _up(args: argparse.Namespace) -> int:
    target = _cluster(args, nodes=args.nodes, gpus_per_node=args.gpus)
    # kubectl too, so that the hint printed below works on a fresh machine.
    binaries.ensure(binaries.CONTROL_PLANE)
    if args.flux:
        flux.ensure()  # before the cluster starts: a cold build takes minutes
    target.start(timeout=args.timeout)
    kubectl = binaries.binary_path("kubectl")
    print(f"kubeconfig: {target.kubeconfig}")
    print("try:")
    print(f"  export KUBECONFIG={target.kubeconfig}")
    print(f"  {kubectl} get nodes -L {nodes.POOL_LABEL}")
    if args.flux:
        _start_flux(target, tie_to_parent=False)
    print(f"stop with: rolloutfleet sandbox down {_where(args)}")
    return 0


def _start_flux(target: cluster.Cluster, *, tie_to_parent: bool) -> flux.SandboxFlux | None:
    running = flux.running_beside(target)
    if running:
        print(f"flux: already running beside this cluster ({', '.join(running)})")
        return None
    started = flux.start_for_cluster(target, tie_to_parent=tie_to_parent)
    kubectl = binaries.binary_path("kubectl")
    namespace = flux.NAMESPACE
    print(
        f"flux: source-controller {flux.SOURCE_CONTROLLER_VERSION} and kustomize-controller "
        f"{flux.KUSTOMIZE_CONTROLLER_VERSION} running (logs: {started.flux.logs})"
    )
    print(f"git:  {started.repo_url} (push allowed), followed by GitRepository {namespace}/sandbox")
    print("  git clone " + started.repo_url + " fleet-config && cd fleet-config   # commit manifests under fleet/")
    print(f"  {kubectl} apply -f {started.sync_file}   # Kustomization of ./fleet: prune, wait, our health rules")
    print(
        f"  {kubectl} -n {namespace} annotate --overwrite gitrepository/sandbox "
        f'{flux.REQUESTED_AT}="$(date +%s)"   # sync a push now, not at the next interval'
    )
    print(f"  {kubectl} -n {namespace} get gitrepository,kustomization")
    return started


def _demo(args: argparse.Namespace) -> int:
    """The demo; with ``--flux``, Flux and the Git server start beside its cluster once that is up."""
    from rolloutfleet.sandbox import demo

    if not args.flux:
        return demo.run(args)
    flux.ensure()  # built before the demo starts, never in its middle (a cold build takes minutes)
    beside = flux.BesideCluster(cluster.Cluster.named(args.name), keep=args.keep, start=_start_flux)
    beside.start()
    try:
        return demo.run(args)
    finally:
        beside.finish()


def _down(args: argparse.Namespace) -> int:
    target = _cluster(args)
    target.stop()
    leftovers = target.pids()
    if leftovers:
        print(f"error: processes still running: {leftovers}", file=sys.stderr)
        return 1
    if args.purge:
        shutil.rmtree(target.directory, ignore_errors=True)
    print(f"cluster {args.name!r} stopped; no process left")
    return 0


def _status(args: argparse.Namespace) -> int:
    target = _cluster(args)
    components = target.status()
    if not components:
        print(f"cluster {args.name!r}: not running ({target.directory})")
        return 3
    for component in components:
        state = "running" if component.running else "STOPPED"
        print(f"{component.name:<24} pid {component.pid:<8} {state:<8} log {component.log}")
    if not target.running():
        print(f"cluster {args.name!r}: degraded; `rolloutfleet sandbox down {_where(args)}` cleans up")
        return 1
    try:
        node_list = target.request("GET", "/api/v1/nodes")["items"]
        pods = target.request("GET", "/api/v1/pods")["items"]
    except (OSError, urllib.error.URLError) as err:
        print(f"apiserver {target.server}: not answering ({err})")
        return 1
    ready = len([n for n in node_list if nodes.is_ready(n)])
    print(f"apiserver {target.server}  nodes {ready}/{len(node_list)} ready  pods {len(pods)}")
    print(f"kubeconfig: {target.kubeconfig}")
    return 0
