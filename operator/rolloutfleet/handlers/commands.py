"""``rolloutfleet run``: start the operator (kopf) with the project's handlers and settings.

Called through ``rolloutfleet.cli`` and by the operator image's entrypoint, and by the integration tests
as a subprocess. Watches the given namespaces (or all), with kopf peering for HA unless ``--standalone``.
The operator never installs CRDs: the chart (or the test fixture) does.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys


def register(parser: argparse.ArgumentParser) -> None:
    """Add this command's arguments."""
    parser.add_argument("-n", "--namespace", action="append", default=[], help="namespace to watch (repeatable)")
    parser.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace")
    parser.add_argument("--standalone", action="store_true", help="no peering (single replica only)")
    parser.add_argument("--peering", default=None, help="kopf peering object name (HA with several replicas)")
    parser.add_argument(
        "--priority",
        type=int,
        default=None,
        help="peering priority (default: derived from POD_ID, so replicas never tie and pause each other)",
    )
    parser.add_argument("--metrics-port", type=int, default=int(os.environ.get("ROLLOUTFLEET_METRICS_PORT", "8080")))
    parser.add_argument("--liveness", default="http://0.0.0.0:8081/healthz", help="kopf liveness endpoint")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def run(args: argparse.Namespace) -> int:
    """Run the operator until it is signalled to stop."""
    import kopf

    from rolloutfleet.adapters.kube import credentials_problem
    from rolloutfleet.handlers import event_loop, gc_tuning, wiring  # wiring: imported for its decorators, too

    problem = credentials_problem()
    if problem is not None:
        # kopf would log a login failure and retry its startup every minute, forever: a pod would never
        # crash-loop and a container run by hand would never exit. One line and a non-zero exit instead.
        print(f"rolloutfleet run: {problem}", file=sys.stderr)
        return 2
    try:
        gc_threshold = gc_tuning.threshold_from(os.environ)
        loop_name, loop_factory = event_loop.choose(os.environ)
    except ValueError as exc:
        print(f"rolloutfleet run: {exc}", file=sys.stderr)
        return 2
    _raise_open_files_limit()
    os.environ[wiring.METRICS_PORT_ENV] = str(args.metrics_port)
    os.environ[wiring.CLUSTER_WIDE_ENV] = "1" if args.all_namespaces else "0"
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    namespaces = (
        [] if args.all_namespaces else (args.namespace or [os.environ.get("ROLLOUTFLEET_WATCH_NAMESPACE", "default")])
    )
    priority = args.priority if args.priority is not None else _priority(os.environ.get("POD_ID", ""))
    logging.getLogger(__name__).info("event loop: %s", loop_name)
    gc_tuning.apply(gc_threshold)  # last before the loop: everything loaded so far is frozen
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(
            kopf.operator(
                priority=priority,
                clusterwide=args.all_namespaces,
                namespaces=namespaces,
                standalone=args.standalone,
                peering_name=args.peering,
                liveness_endpoint=args.liveness or None,
            )
        )
    return 0


def _raise_open_files_limit() -> None:
    """Soft RLIMIT_NOFILE up to the hard one: a connection per engine pod needs more than the usual 1,024."""
    import contextlib
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
        # On refusal keep the soft limit: the pool still works, with more connection churn.
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def _priority(pod_id: str) -> int:
    """A stable per-replica peering priority: kopf pauses every replica that ties with another live one."""
    if not pod_id:
        return 0
    import zlib

    return 1 + zlib.crc32(pod_id.encode()) % 10_000
