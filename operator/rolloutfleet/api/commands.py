"""``rolloutfleet crds``: write (or check) the generated CRD manifests.

Called through ``rolloutfleet.cli``. Writes ``crds/`` and the chart's ``crds/`` from ``crdgen``;
``--check`` exits 1 when the files on disk differ (used by CI and the drift test).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from rolloutfleet.api import crdgen

DEFAULT_DIRS = ("crds", "charts/rolloutfleet/crds")


def register(parser: argparse.ArgumentParser) -> None:
    """Add this command's arguments."""
    parser.add_argument(
        "--out",
        action="append",
        help=f"directory to write (repeatable; default: {', '.join(DEFAULT_DIRS)} when they exist)",
    )
    parser.add_argument("--check", action="store_true", help="do not write; fail if the files differ")


def run(args: argparse.Namespace) -> int:
    """Write or check the CRD files; return the exit code."""
    dirs = [pathlib.Path(d) for d in (args.out or [d for d in DEFAULT_DIRS if pathlib.Path(d).is_dir()] or ["crds"])]
    stale: list[str] = []
    for directory in dirs:
        for name, crd in crdgen.custom_resource_definitions().items():
            path = directory / name
            text = crdgen.render(crd)
            if args.check:
                if not path.exists() or path.read_text() != text:
                    stale.append(str(path))
                continue
            directory.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print("stale generated CRDs (run `rolloutfleet crds`): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0
