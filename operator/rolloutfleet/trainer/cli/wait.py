"""``rolloutfleet wait wrev/NAME [--timeout 30m]``: block until a WeightRevision is Ready, or say why not.

Loaded by ``rolloutfleet.cli``. The same test as ``kubectl wait --for=condition=Ready wrev/NAME``, but it
also ends early (exit 1) when the revision Failed, RolledBack or was Superseded, printing the reason and
the failing pods.
"""

from __future__ import annotations

import argparse

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
from rolloutfleet.trainer.errors import PublishError, RevisionFailed

KINDS = frozenset(
    {
        "wrev",
        "weightrevision",
        "weightrevisions",
        "weightrevision.rolloutfleet.io",
        "weightrevisions.rolloutfleet.io",
    }
)


def parse_target(text: str) -> str:
    """The revision name from ``wrev/NAME`` (or ``weightrevision/NAME``, or a bare ``NAME``)."""
    kind, sep, name = text.partition("/")
    if not sep:
        kind, name = "wrev", text
    if kind.lower() not in KINDS:
        raise UsageError(f"{text!r} is not a WeightRevision (use wrev/NAME)")
    if not name or "/" in name:
        raise UsageError(f"invalid name in {text!r} (use wrev/NAME)")
    return name


def register(parser: argparse.ArgumentParser) -> None:
    """Add the ``wait`` subcommand's arguments."""
    parser.add_argument("target", metavar="wrev/NAME", help="the WeightRevision to wait for")
    parser.add_argument("--timeout", default="30m", help="give up after this long (default 30m)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress line")
    add_kube_args(parser)


def run(args: argparse.Namespace) -> int:
    """Exit 0 once Ready; 1 when it failed, was deleted or timed out; 2 on usage errors."""
    try:
        name = parse_target(args.target)
        timeout = parse_duration(args.timeout)
        api = api_client_of(args)
    except (UsageError, PublishError) as exc:
        return fail("wait", exc)
    namespace = namespace_of(args)
    try:
        obj = publish.wait_for_revision(
            name, namespace, timeout=timeout, api_client=api, progress=False if args.quiet else None
        )
    except RevisionFailed as exc:
        return fail("wait", exc.detail())
    except PublishError as exc:
        return fail("wait", exc)
    finally:
        close_client(api)
    status = obj.get("status") or {}
    print(f"weightrevision/{name} Ready ({status.get('updated', '?')} pods, revision {obj['spec']['revision']})")
    return EXIT_OK
