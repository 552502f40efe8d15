"""The ``rolloutfleet`` console script: one argparse tree, each subcommand delegating to its module.

Called by users, the README, ``.ci/run`` and the operator image's entrypoint. Subcommand modules are
imported lazily so that ``rolloutfleet digest`` never pays for kopf, and ``rolloutfleet crds`` never needs
a cluster.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

# name -> (module, help). Each module exposes ``register(parser)`` and ``run(args) -> int``.
COMMANDS: dict[str, tuple[str, str]] = {
    "crds": ("rolloutfleet.api.commands", "write the CRD manifests generated from the models"),
    "digest": ("rolloutfleet.digest", "print the weights digest of a safetensors checkpoint directory"),
    "sandbox": ("rolloutfleet.sandbox.commands", "the local control plane: build, up, down, status, demo"),
    "sim": ("rolloutfleet.sim.commands", "run simulated vLLM engines (GPU-free, for tests and the sandbox)"),
    "run": ("rolloutfleet.handlers.commands", "run the operator"),
    "publish": ("rolloutfleet.trainer.cli.publish", "publish a WeightRevision from checkpoints and wait until Ready"),
    "status": ("rolloutfleet.trainer.cli.status", "show which pod of a fleet serves which weights"),
    "wait": ("rolloutfleet.trainer.cli.wait", "wait until a WeightRevision is Ready (or say why it failed)"),
}


def _load(
    module: str,
) -> tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]:
    import importlib

    mod = importlib.import_module(module)
    return mod.register, mod.run


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run one subcommand; return its exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="rolloutfleet", description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    # Only the chosen subcommand's module is imported (fast start, minimal dependencies).
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_text)
        if name == chosen:
            try:
                register, run = _load(module)
            except ModuleNotFoundError as exc:
                # The operator image ships without the test rig (sim, sandbox): say so instead of a traceback.
                if exc.name is None or not module.startswith(exc.name):
                    raise
                print(
                    f"rolloutfleet {name}: not in this installation (the operator image leaves it out)", file=sys.stderr
                )
                return 2
            register(sp)
            sp.set_defaults(_run=run)
    args = parser.parse_args(argv)
    code: int = args._run(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
