# mypy: disallow-untyped-calls=False
# (the official kubernetes client ships partial annotations, as in rolloutfleet.adapters.kube)
"""``rolloutfleet status FLEET [--watch]``: which pod serves which weights, as a table per pod.

Loaded by ``rolloutfleet.cli``. Reads the RolloutFleet's status (what the operator last observed on each
engine) and the fleet's WeightRevisions (for the ages and the rollout in progress); ``render`` is pure so
it is unit-tested. ``--watch`` redraws whenever the table changes until interrupted. A fleet of more than
256 pods lists only its pods unlike the rest (``planning.fleet_status.listing``): the table shows them, then one
row for the others.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from typing import Any

from rolloutfleet.api.common import MAX_POD_ENTRIES
from rolloutfleet.trainer import publish
from rolloutfleet.trainer.cli import (
    EXIT_OK,
    UsageError,
    add_kube_args,
    api_client_of,
    close_client,
    fail,
    namespace_of,
    parse_duration,
)
from rolloutfleet.trainer.errors import PublishError

COLUMNS = ("POD", "IP", "READY", "VERIFIER", "DRAFT", "STEP", "WEIGHT-VERSION", "REVISION-AGE")


def register(parser: argparse.ArgumentParser) -> None:
    """Add the ``status`` subcommand's arguments."""
    parser.add_argument("fleet", metavar="FLEET", help="the RolloutFleet")
    parser.add_argument("-w", "--watch", action="store_true", help="redraw when anything changes (Ctrl-C to stop)")
    parser.add_argument("--interval", default="1s", help="--watch refresh period (default 1s)")
    parser.add_argument("-o", "--output", choices=("table", "json"), default="table", help="output format")
    add_kube_args(parser)


def _fleet_revisions(revisions: list[dict[str, Any]], fleet: str) -> list[dict[str, Any]]:
    mine = [r for r in revisions if ((r.get("spec") or {}).get("fleetRef") or {}).get("name") == fleet]
    return sorted(mine, key=lambda r: (int((r.get("spec") or {}).get("revision") or 0), r["metadata"]["name"]))


def _revision_since(revisions: list[dict[str, Any]], number: int | None) -> str | None:
    """When revision ``number`` started being served: its completion time (else creation) if it exists."""
    if number is None:
        return None
    best: dict[str, Any] | None = None
    for r in revisions:
        if (r.get("spec") or {}).get("revision") == number and (
            best is None or (r.get("status") or {}).get("phase") == "Succeeded"
        ):
            best = r
    if best is None:
        return None
    status = best.get("status") or {}
    return str(status.get("completionTime") or best["metadata"].get("creationTimestamp") or "") or None


def _state(entry: dict[str, Any], mine: list[dict[str, Any]], now: datetime.datetime | None) -> dict[str, Any]:
    """What the table shows of one status entry (a pod's row, or podsCommon), beside the pod's name and IP."""
    rev = entry.get("revision")
    return {
        "ready": bool(entry.get("ready")),
        "phase": entry.get("phase"),
        "revision": rev,
        "draftRevision": entry.get("draftRevision"),
        "step": entry.get("step"),
        "weightVersion": entry.get("weightVersion"),
        "revisionAge": publish.age(_revision_since(mine, rev), now),
    }


def rows(
    fleet_obj: dict[str, Any], revisions: list[dict[str, Any]], now: datetime.datetime | None = None
) -> list[dict[str, Any]]:
    """One dict per pod: name, ip, ready, revision, draftRevision, step, weightVersion, revisionAge."""
    mine = _fleet_revisions(revisions, fleet_obj["metadata"]["name"])
    return [
        {"name": pod.get("name"), "ip": pod.get("ip"), **_state(pod, mine, now)}
        for pod in (fleet_obj.get("status") or {}).get("pods") or []
    ]


def common(
    fleet_obj: dict[str, Any], revisions: list[dict[str, Any]], now: datetime.datetime | None = None
) -> dict[str, Any] | None:
    """A fleet of more than 256 pods: the state its unlisted pods share (``status.podsCommon``), as a row
    without a name or IP and with how many pods it stands for; None for a fleet whose status lists every pod."""
    shared = (fleet_obj.get("status") or {}).get("podsCommon")
    if not shared:
        return None
    mine = _fleet_revisions(revisions, fleet_obj["metadata"]["name"])
    return {"pods": int(shared.get("pods") or 0), **_state(shared, mine, now)}


def _cell(value: Any, initial: str = "-") -> str:
    if value is None:
        return initial
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def render(fleet_obj: dict[str, Any], revisions: list[dict[str, Any]], now: datetime.datetime | None = None) -> str:
    """The whole screen: a fleet summary line, the newest revision's rollout, then the per-pod table."""
    meta, spec, status = fleet_obj["metadata"], fleet_obj.get("spec") or {}, fleet_obj.get("status") or {}
    available = next(
        (c.get("status") for c in status.get("conditions") or [] if c.get("type") == "Available"), "Unknown"
    )
    lines = [
        f"RolloutFleet {meta.get('namespace')}/{meta['name']}: "
        f"{status.get('readyReplicas', 0)}/{spec.get('replicas', 0)} ready, "
        f"current revision {_cell(status.get('currentRevision'), 'initial')}, "
        f"target {_cell(status.get('targetRevision'))}, Available {available}"
    ]
    mine = _fleet_revisions(revisions, meta["name"])
    if mine:
        latest = mine[-1]
        rstatus = latest.get("status") or {}
        line = (
            f"Latest WeightRevision {latest['metadata']['name']} (revision {latest['spec'].get('revision')}): "
            f"{rstatus.get('phase', 'Pending')} {rstatus.get('updated', '0/0')}, "
            f"age {publish.age(latest['metadata'].get('creationTimestamp'), now)}"
        )
        if rstatus.get("reason") and rstatus.get("phase") not in ("Succeeded", None):
            line += f" - {rstatus['reason']}: {rstatus.get('message') or ''}".rstrip(": ")
        lines.append(line)
    table = [list(COLUMNS)]
    draft_initial = "initial" if spec.get("draft", {}).get("method", "none") != "none" else "-"
    shared = common(fleet_obj, revisions, now)
    listed = rows(fleet_obj, revisions, now)
    # A large fleet's status lists only the pods unlike the rest: those first, then one row for the others.
    for row in [*listed, *([{**shared, "name": f"({shared['pods']} other pods)", "ip": None}] if shared else [])]:
        table.append(
            [
                _cell(row["name"]),
                _cell(row["ip"]),
                _cell(row["ready"]),
                _cell(row["revision"], "initial"),
                _cell(row["draftRevision"], draft_initial),
                _cell(row["step"]),
                _cell(row["weightVersion"]),
                row["revisionAge"],
            ]
        )
    widths = [max(len(r[i]) for r in table) for i in range(len(COLUMNS))]
    lines.append("")
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in table]
    if len(table) == 1:
        lines.append("(no pods observed yet)")
    truncated = status.get("podsTruncated")
    if truncated:
        lines.append(
            f"({truncated} more pods differ from the other pods but are not listed: the status lists at most "
            f"{MAX_POD_ENTRIES})"
        )
    return "\n".join(lines)


def _read(custom: Any, namespace: str, fleet: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    fleet_obj = publish.read_fleet(custom, namespace, fleet)
    try:
        revisions = publish.list_revisions(custom, namespace)
    except PublishError:
        revisions = []  # the table is still useful without ages
    return fleet_obj, revisions


def run(args: argparse.Namespace) -> int:
    """Print the table (once, or on every change with ``--watch``); exit 1 if the fleet cannot be read."""
    try:
        interval = parse_duration(args.interval)
        api = api_client_of(args)
    except (UsageError, PublishError) as exc:
        return fail("status", exc)
    namespace = namespace_of(args)
    custom = publish.custom_objects_api(api)
    tty = sys.stdout.isatty()
    try:
        last = ""
        while True:
            try:
                fleet_obj, revisions = _read(custom, namespace, args.fleet)
            except PublishError as exc:
                if not args.watch:
                    return fail("status", exc)
                print(f"rolloutfleet status: {exc}", file=sys.stderr)
                time.sleep(interval)
                continue
            if args.output == "json":
                out = {"fleet": args.fleet, "namespace": namespace, "pods": rows(fleet_obj, revisions)}
                shared = common(fleet_obj, revisions)
                if shared is not None:  # a fleet of more than 256 pods: the state the pods not listed share
                    out["otherPods"] = shared
                    out["podsNotListed"] = int((fleet_obj.get("status") or {}).get("podsTruncated") or 0)
                text = json.dumps(out, sort_keys=True)
            else:
                text = render(fleet_obj, revisions)
            if text != last:
                if args.watch and tty:
                    sys.stdout.write("\x1b[H\x1b[2J")
                elif last:
                    sys.stdout.write("\n")
                print(text, flush=True)
                last = text
            if not args.watch:
                return EXIT_OK
            time.sleep(interval)
    except KeyboardInterrupt:
        return EXIT_OK
    finally:
        close_client(api)
