# mypy: disallow-untyped-calls=False
# (the official kubernetes client ships partial annotations, as in rolloutfleet.adapters.kube)
"""The trainer-facing commands ``publish``, ``status`` and ``wait``: shared flags, clients and durations.

Imported by ``rolloutfleet.trainer.cli.{publish,status,wait}``, which ``rolloutfleet.cli`` loads lazily.
Exit codes of all three: 0 success, 1 failure (printed as one line on stderr), 2 usage.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from kubernetes import client, config

from rolloutfleet.trainer.errors import PublishError
from rolloutfleet.trainer.publish import make_api_client

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2

_DURATION = re.compile(r"^(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s)?$")


class UsageError(Exception):
    """Bad command-line input that argparse could not catch (exit 2)."""


def parse_duration(text: str) -> float:
    """Seconds from ``90``, ``90s``, ``30m``, ``1h30m`` or ``1.5h``."""
    text = text.strip()
    try:
        value = float(text)
    except ValueError:
        m = _DURATION.match(text)
        if not text or m is None or not any(m.groups()):
            raise UsageError(f"invalid duration {text!r} (examples: 90, 90s, 30m, 1h30m)") from None
        h, mi, s = (float(g) if g else 0.0 for g in m.groups())
        value = h * 3600 + mi * 60 + s
    if value <= 0:
        raise UsageError(f"duration must be positive, got {text!r}")
    return value


def add_kube_args(parser: argparse.ArgumentParser) -> None:
    """``-n/--namespace``, ``--kubeconfig`` and ``--context``, as kubectl spells them."""
    parser.add_argument("-n", "--namespace", default=None, help="namespace (default: the context's, or default)")
    parser.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: $KUBECONFIG or ~/.kube/config)")
    parser.add_argument("--context", default=None, help="kubeconfig context (default: the current one)")


def namespace_of(args: argparse.Namespace) -> str:
    """The namespace flag, else the kubeconfig context's namespace, else the pod's, else ``default``."""
    if args.namespace:
        return str(args.namespace)
    try:
        contexts, current = config.list_kube_config_contexts(config_file=args.kubeconfig)
        chosen = next((c for c in contexts if c["name"] == args.context), current) if args.context else current
        ns = (chosen or {}).get("context", {}).get("namespace")
        if ns:
            return str(ns)
    except (config.ConfigException, OSError, TypeError):
        pass
    sa_ns = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
    if "KUBERNETES_SERVICE_HOST" in os.environ and os.path.exists(sa_ns):  # noqa: PTH110
        with open(sa_ns, encoding="utf-8") as f:
            return f.read().strip() or "default"
    return "default"


def api_client_of(args: argparse.Namespace) -> client.ApiClient:
    return make_api_client(args.kubeconfig, args.context)


def close_client(api: client.ApiClient) -> None:
    api.close()


def fail(prog: str, exc: BaseException | str) -> int:
    """Print one line on stderr; exit code 1 (or 2 for a usage error)."""
    print(f"rolloutfleet {prog}: {exc}", file=sys.stderr)
    return EXIT_USAGE if isinstance(exc, UsageError) else EXIT_FAILURE


__all__ = [
    "EXIT_FAILURE",
    "EXIT_OK",
    "EXIT_USAGE",
    "PublishError",
    "UsageError",
    "add_kube_args",
    "api_client_of",
    "close_client",
    "fail",
    "namespace_of",
    "parse_duration",
]
