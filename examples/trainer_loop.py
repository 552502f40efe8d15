"""A minimal but real RL-style training loop that publishes every step to a rolloutfleet fleet.

    train one step (CPU, tiny torch models) -> save verifier + draft as safetensors into the weights root
    -> publish_revision(...) and wait until every engine serves it -> ask an engine for a completion and
    check that it is stamped with the new weight version.

Run it against the sandbox demo fleet (``rolloutfleet sandbox demo --keep`` in another terminal: fleet
``policy`` in namespace ``demo``, whose weights volume is this machine's disk)::

    python examples/trainer_loop.py --steps 3

or point it anywhere with ``--kubeconfig`` (default: ``$KUBECONFIG``, else the sandbox demo cluster's),
``--namespace``, ``--fleet``, ``--weights-root`` (default: the fleet's first ``allowedRoots`` entry, i.e. the
trainer and the engines share the volume) and ``--engine-url`` (default: the first pod's IP and port from
the fleet's status). Revisions continue after the newest one the fleet
has seen (``--start-revision`` to choose). tests/integration/operator/test_trainer_loop.py runs it.

The model is deliberately tiny (a one-token-context language model over 64 tokens and a smaller draft that is
distilled towards it); the point is the cycle, not the learning. In a real trainer the save and the
``publish_revision`` call go where your framework writes its per-step checkpoint (see docs/trainer.md).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import sys
import time
import urllib.request
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from rolloutfleet.sandbox.binaries import cache_root
from rolloutfleet.trainer import PublishError, make_api_client, publish_revision
from rolloutfleet.trainer.kube import custom_objects_api, list_revisions, read_fleet

VOCAB, SEQ, BATCH = 64, 16, 32


class TinyLM(nn.Module):
    """Embedding -> MLP -> lm_head: next-token logits for every position."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, hidden))
        self.lm_head = nn.Linear(hidden, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(tokens)
        return self.lm_head(h + self.mlp(h))


def batch(generator: torch.Generator) -> torch.Tensor:
    """Sequences with structure to learn: each token is the previous one plus a small step, mod VOCAB."""
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=generator)
    steps = torch.randint(1, 4, (BATCH, SEQ - 1), generator=generator)
    return torch.cat([start, start + steps.cumsum(dim=1)], dim=1) % VOCAB


def train_step(
    policy: TinyLM, draft: TinyLM, opt_p: torch.optim.Optimizer, opt_d: torch.optim.Optimizer, data: torch.Tensor
) -> tuple[float, float]:
    """One optimizer step for the policy (next-token loss) and the draft (distilled towards the policy)."""
    inputs, targets = data[:, :-1], data[:, 1:]
    logits = policy(inputs)
    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
    opt_p.zero_grad()
    loss.backward()
    opt_p.step()
    with torch.no_grad():
        teacher = policy(inputs).log_softmax(-1)
    student = draft(inputs).log_softmax(-1)
    kl = nn.functional.kl_div(student, teacher, log_target=True, reduction="batchmean")
    opt_d.zero_grad()
    kl.backward()
    opt_d.step()
    return loss.item(), kl.item()


def save_checkpoint(model: nn.Module, directory: pathlib.Path) -> pathlib.Path:
    """Write ``model.safetensors`` atomically: engines never see a half-written directory."""
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(tmp / "model.safetensors"))
    shutil.rmtree(directory, ignore_errors=True)
    tmp.rename(directory)
    return directory


def stamped_versions(choice: dict[str, Any]) -> set[str]:
    """The weight versions a completion choice was generated with (spans or plain strings)."""
    out = set()
    for item in choice.get("weight_versions") or []:
        out.add(str(item.get("version") if isinstance(item, dict) else item))
    return out


def complete(engine_url: str, model: str, prompt: str, timeout: float = 30) -> dict[str, Any]:
    body = json.dumps(
        {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 1.0, "return_weight_versions": True}
    ).encode()
    req = urllib.request.Request(
        engine_url.rstrip("/") + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        out: dict[str, Any] = json.loads(resp.read())
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--kubeconfig", default=None, help="kubeconfig (default: $KUBECONFIG or ~/.kube/config)")
    parser.add_argument("--context", default=None, help="kubeconfig context")
    parser.add_argument("--namespace", "-n", default="demo", help="namespace of the fleet (default: the demo's)")
    parser.add_argument("--fleet", default="policy", help="RolloutFleet name (default: policy, the demo's)")
    parser.add_argument("--weights-root", type=pathlib.Path, default=None, help="where checkpoints are written")
    parser.add_argument("--steps", type=int, default=3, help="training steps, one revision each")
    parser.add_argument("--start-revision", type=int, default=None, help="first revision number")
    parser.add_argument("--engine-url", default=None, help="an engine to query (default: first pod of the fleet)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds to wait for each revision")
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
        print(f"trainer_loop: {exc}", file=sys.stderr)
        return 1
    spec, status = fleet["spec"], fleet.get("status") or {}
    draft_spec = spec.get("draft") or {}
    with_draft = draft_spec.get("method", "none") not in ("none", "mtp") and draft_spec.get("policy") != "frozen"
    root = args.weights_root or pathlib.Path(spec["weights"]["allowedRoots"][0])
    model_name = (spec.get("verifier") or {}).get("servedModelName") or "policy"
    first = args.start_revision
    if first is None:
        # After the newest revision the fleet has seen (a failed one keeps its number forever).
        numbers = [
            r["spec"]["revision"]
            for r in list_revisions(custom, args.namespace)
            if r["spec"]["fleetRef"]["name"] == args.fleet
        ]
        first = max([status.get("currentRevision") or 0, *numbers]) + 1

    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    policy, draft = TinyLM(hidden=32), TinyLM(hidden=16)
    opt_p = torch.optim.AdamW(policy.parameters(), lr=3e-3)
    opt_d = torch.optim.AdamW(draft.parameters(), lr=3e-3)

    for i in range(args.steps):
        revision = first + i
        loss, kl = train_step(policy, draft, opt_p, opt_d, batch(gen))
        step_dir = root / args.fleet / f"step-{revision}"
        verifier_dir = save_checkpoint(policy, step_dir / "verifier")
        draft_dir = save_checkpoint(draft, step_dir / "draft") if with_draft else None
        t0 = time.monotonic()
        try:
            result = publish_revision(
                args.fleet,
                revision,
                verifier_dir,
                draft_dir,
                namespace=args.namespace,
                timeout=args.timeout,
                api_client=api,
            )
        except PublishError as exc:
            print(f"step {revision}: publish failed: {exc}", file=sys.stderr)
            return 1
        took = time.monotonic() - t0
        engine_url = args.engine_url
        if engine_url is None:
            pods = (read_fleet(custom, args.namespace, args.fleet).get("status") or {}).get("pods") or []
            ips = [p["ip"] for p in pods if p.get("ip")]
            if not ips:
                print("trainer_loop: no pod IP in the fleet's status; pass --engine-url", file=sys.stderr)
                return 1
            engine_url = f"http://{ips[0]}:{spec.get('port', 8000)}"
        out = complete(engine_url, model_name, prompt=f"step {revision}")
        versions = stamped_versions(out["choices"][0])
        print(
            f"step {revision}: loss {loss:.3f} draft-kl {kl:.4f} | {result.name} {result.phase} in {took:.1f}s "
            f"| completion stamped {sorted(versions)}",
            flush=True,
        )
        if versions != {str(revision)}:
            print(f"step {revision}: expected weight version {revision!r}, got {sorted(versions)}", file=sys.stderr)
            return 1
    api.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
