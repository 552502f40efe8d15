"""A training loop that pushes every step's weights to a rolloutfleet fleet without writing a checkpoint.

    train one step (tiny torch models) -> push_revision(...): the operator opens a weight-transfer session
    on each engine, this process sends the tensors into it (verifier, then draft), the engines verify the
    digest -> ask an engine for a completion and check it is stamped with the new weight version.

With real vLLM engines on this machine's GPUs (fleet ``spec.weightTransfer.backend: ipc``)::

    python examples/trainer_push.py --fleet policy --namespace rl --device cuda

With real vLLM engines on other GPUs or hosts (``backend: nccl``; this process becomes rank 0 of the fleet's
transfer group, listening at the address given, which the engines must reach)::

    python examples/trainer_push.py --fleet policy --namespace rl --device cuda --nccl-host "$POD_IP"

Against simulated engines the tensors travel as bytes instead of CUDA IPC handles. Their fleet needs
``spec.weightTransfer`` and initial weights of this example's model (an engine takes pushed tensors only
under its model's names and shapes, as vLLM's ``load_weights`` does); the sandbox demo's fleet has neither,
``tests/integration/operator/test_trainer_push.py`` shows such a fleet::

    python examples/trainer_push.py --simulated --fleet tiny --namespace NS --steps 3

Revisions continue after the newest one the fleet has seen (``--start-revision`` to choose). The model,
the training step and the completion check are ``examples/trainer_loop.py``'s; only the hand-over differs:
``push_revision`` where that loop saves and publishes (docs/trainer.md, "Pushing weights"; the protocol
is docs/push.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from trainer_loop import TinyLM, batch, complete, stamped_versions, train_step  # the sibling example

from rolloutfleet.sandbox.binaries import cache_root
from rolloutfleet.trainer import IpcSender, NcclSender, PublishError, Sender, SimulatedSender, push_revision
from rolloutfleet.trainer.kube import custom_objects_api, list_revisions, make_api_client, read_fleet


def served_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What the engines load, named as in the fleet's checkpoints (float32 here, like trainer_loop's files).

    A real trainer passes its parameters as they are (``dict(model.named_parameters())`` or the gathered
    full state dict on rank 0) in the engine's dtype, so nothing is copied.
    """
    return {k: v.detach().to(torch.float32) for k, v in model.state_dict().items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--kubeconfig", default=None, help="kubeconfig (default: $KUBECONFIG or ~/.kube/config)")
    parser.add_argument("--context", default=None, help="kubeconfig context")
    parser.add_argument("--namespace", "-n", default="demo", help="namespace of the fleet (default: the demo's)")
    parser.add_argument("--fleet", default="policy", help="RolloutFleet name (default: policy, the demo's)")
    parser.add_argument("--steps", type=int, default=3, help="training steps, one revision each")
    parser.add_argument("--start-revision", type=int, default=None, help="first revision number")
    parser.add_argument("--simulated", action="store_true", help="simulated engines: send bytes, not CUDA IPC handles")
    parser.add_argument("--nccl-host", default=None, help="NCCL fleets: the address the engines reach this trainer at")
    parser.add_argument("--device", default="cpu", help="where the model trains (cuda for real engines)")
    parser.add_argument("--engine-url", default=None, help="an engine to query (default: first pod of the fleet)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds for each revision to become Ready")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    kubeconfig = args.kubeconfig
    demo_kubeconfig = cache_root() / "clusters" / "demo" / "kubeconfig"
    if kubeconfig is None and "KUBECONFIG" not in os.environ and demo_kubeconfig.exists():
        kubeconfig = str(demo_kubeconfig)  # the sandbox demo's cluster
    api = make_api_client(kubeconfig, args.context)
    custom = custom_objects_api(api)
    try:
        fleet = read_fleet(custom, args.namespace, args.fleet)
    except PublishError as exc:
        print(f"trainer_push: {exc}", file=sys.stderr)
        return 1
    spec, status = fleet["spec"], fleet.get("status") or {}
    draft_spec = spec.get("draft") or {}
    with_draft = draft_spec.get("method", "none") not in ("none", "mtp") and draft_spec.get("policy") != "frozen"
    model_name = (spec.get("verifier") or {}).get("servedModelName") or "policy"
    first = args.start_revision
    if first is None:
        numbers = [
            r["spec"]["revision"]
            for r in list_revisions(custom, args.namespace)
            if r["spec"]["fleetRef"]["name"] == args.fleet
        ]
        first = max([status.get("currentRevision") or 0, *numbers]) + 1

    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    policy, draft = TinyLM(hidden=32).to(args.device), TinyLM(hidden=16).to(args.device)
    opt_p = torch.optim.AdamW(policy.parameters(), lr=3e-3)
    opt_d = torch.optim.AdamW(draft.parameters(), lr=3e-3)
    sender: Sender = IpcSender()
    if args.simulated:
        sender = SimulatedSender()
    elif args.nccl_host:
        sender = NcclSender(args.nccl_host)

    for i in range(args.steps):
        revision = first + i
        loss, kl = train_step(policy, draft, opt_p, opt_d, batch(gen).to(args.device))
        t0 = time.monotonic()
        try:
            # Blocks until every engine serves the revision: the optimizer must not touch the tensors meanwhile.
            result = push_revision(
                args.fleet,
                revision,
                served_tensors(policy),
                served_tensors(draft) if with_draft else None,
                args.namespace,
                sender=sender,
                timeout=args.timeout,
                api_client=api,
            )
        except PublishError as exc:
            print(f"step {revision}: push failed: {exc}", file=sys.stderr)
            return 1
        took = time.monotonic() - t0
        engine_url = args.engine_url
        if engine_url is None:
            pods = (read_fleet(custom, args.namespace, args.fleet).get("status") or {}).get("pods") or []
            ips = [p["ip"] for p in pods if p.get("ip")]
            if not ips:
                print("trainer_push: no pod IP in the fleet's status; pass --engine-url", file=sys.stderr)
                return 1
            engine_url = f"http://{ips[0]}:{spec.get('port', 8000)}"
        versions = stamped_versions(complete(engine_url, model_name, prompt=f"step {revision}")["choices"][0])
        epochs = ", ".join(f"{t} epochs {list(e)}" for t, e in result.served.items())
        print(
            f"step {revision}: loss {loss:.3f} draft-kl {kl:.4f} | {result.name} {result.phase} in {took:.1f}s "
            f"({result.sends} sends: {epochs}) | completion stamped {sorted(versions)}",
            flush=True,
        )
        if versions != {str(revision)}:
            print(f"step {revision}: expected weight version {revision!r}, got {sorted(versions)}", file=sys.stderr)
            return 1
    api.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
