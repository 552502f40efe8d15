"""``rolloutfleet publish FLEET REVISION --verifier DIR [--draft DIR]``: the publish API for shell pipelines.

Loaded by ``rolloutfleet.cli``. Mirrors ``rolloutfleet.trainer.publish.publish_revision``: digests the checkpoints,
validates locally, creates the WeightRevision once (a no-op if the same content is already published) and,
unless ``--no-wait``, waits until every engine serves it. Prints the revision's name and phase on stdout
(or JSON with ``-o json``); errors are one line on stderr with exit code 1.
"""

from __future__ import annotations

import argparse
import json

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


def register(parser: argparse.ArgumentParser) -> None:
    """Add the ``publish`` subcommand's arguments."""
    parser.add_argument("fleet", metavar="FLEET", help="the RolloutFleet to publish to")
    parser.add_argument("revision", metavar="REVISION", type=int, help="revision number, e.g. the training step")
    parser.add_argument("--verifier", required=True, metavar="DIR", help="verifier (policy) checkpoint directory")
    parser.add_argument("--draft", default=None, metavar="DIR", help="draft checkpoint directory (co-updated drafts)")
    parser.add_argument("--name", default=None, help="WeightRevision name (default: FLEET-rREVISION)")
    parser.add_argument(
        "--no-digest",
        dest="digest",
        action="store_false",
        help="do not read the files here (no digest pinned; the engines' load is the first check)",
    )
    parser.add_argument("--no-wait", dest="wait", action="store_false", help="return once the revision is created")
    parser.add_argument("--timeout", default="30m", help="how long to wait for Ready (default 30m)")
    parser.add_argument("-o", "--output", choices=("text", "json"), default="text", help="output format")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress line")
    add_kube_args(parser)


def run(args: argparse.Namespace) -> int:
    """Publish; exit 0 when created/Ready (or already there), 1 on any failure, 2 on usage errors."""
    try:
        timeout = parse_duration(args.timeout)
        if args.revision < 0:
            raise UsageError(f"REVISION must be >= 0, got {args.revision}")
        api = api_client_of(args)
    except (UsageError, PublishError) as exc:
        return fail("publish", exc)
    try:
        result = publish.publish_revision(
            args.fleet,
            args.revision,
            args.verifier,
            args.draft,
            namespace=namespace_of(args),
            digest=args.digest,
            wait=args.wait,
            timeout=timeout,
            api_client=api,
            progress=False if args.quiet else None,
            name=args.name,
        )
    except RevisionFailed as exc:
        return fail("publish", exc.detail())
    except PublishError as exc:
        return fail("publish", exc)
    finally:
        close_client(api)
    if args.output == "json":
        print(
            json.dumps(
                {
                    "name": result.name,
                    "namespace": result.namespace,
                    "fleet": result.fleet,
                    "revision": result.revision,
                    "created": result.created,
                    "phase": result.phase,
                    "ready": result.ready,
                    "verifierDigest": result.verifier_digest,
                    "draftDigest": result.draft_digest,
                },
                sort_keys=True,
            )
        )
    else:
        what = "created" if result.created else "unchanged (already published)"
        state = "Ready" if result.ready else result.phase
        print(f"weightrevision/{result.name} {what}, {state}")
    return EXIT_OK
