"""Pushed weights on real vLLM 0.26 (H200): the operator's own transaction drives weight-transfer sessions.

One vLLM server at a time on loopback, started as the GPU tier starts it (tests/gpu/gpu_support.py: tiny
random Llama verifier, a ``draft_model`` draft, our extension and auth middleware, sleep mode) plus the
weight-transfer flags the operator renders for ``--backend`` (``ipc``: ``--weight-transfer-config
'{"backend":"ipc"}'`` and ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``; ``nccl``: ``{"backend":"nccl"}``). This
process is both sides of a pushed revision:

- the operator: ``EngineClient.observe`` → ``planning.transaction.next_step`` → ``reconcile.executor.execute``
  with a ``SessionContext`` (a new epoch per opened session, the engine's open session, ``init_info=None``:
  IPC needs no group), exactly what ``reconcile.revision`` does for one pod; ``RestartPod`` (which the
  operator does by deleting the pod) is done here by restarting the server;
- the trainer: when the planner answers ``AwaitPush`` it sends the open session's target as CUDA IPC
  handles (``POST /update_weights`` with ``{"names", "dtype_names", "shapes", "ipc_handles_pickled"}``, the
  tensors kept alive until the call returns), then sets the goal's push marks (what its annotation does).
  With ``--backend nccl`` the trainer is the push client's own ``rolloutfleet.trainer.NcclSender``: it
  becomes rank 0 of the transfer group when the planner waits for a rendezvous (the goal's group epoch, one
  per server process), the planner's JoinGroup step joins the engine through ``/init_weight_transfer_engine``
  with the operator's ``init_info``, and each session's tensors go by ``senders.deliver`` (the post and the
  broadcast at once).

NCCL on the one lent GPU: NCCL refuses two ranks of one communicator on one device when their host hashes
match ("Duplicate GPU detected"); with a different ``NCCL_HOSTID`` per process the trainer and the engine are
two "hosts" of one GPU each and talk over NCCL's socket transport on loopback
(bench/results/gpu/nccl-hostid-probe-2026-12-02.log). This proves the protocol through real vLLM and NCCL;
the bandwidth of a broadcast between two GPUs is issue 20's (nvidia-h200-x2).

Experiments (``--parts``, in this order; results in ``$OUT/push-proof-<backend>.json``):

1. ``stale``: path-load the A pair (draft = verifier: acceptance ~1); push verifier B only and resume
   (acceptance ~0: the stale draft); then a draft session with B (acceptance ~1 again). Digests reported
   by the engine equal ``digest_directory`` of the files the trainer sent.
2. ``cycles``: ten level-2 sleep cycles alternating A/B, both targets pushed: steps exactly Pause, Sleep,
   WakeWeights, OpenVerifierSession, AwaitPush, EndSession, OpenDraftSession, AwaitPush, EndSession,
   Resume; digests equal the files'; greedy output token-identical to the same bytes loaded by path
   (A: the fresh server's own load, B: ``rolloutfleet_load``).
3. ``abandon``: a trainer that never sends: after ``--push-deadline`` seconds the planner says
   AbandonSession; the verifier is then destroyed and the planner says RestartPod (never Resume). The
   server is restarted (the pod recreated).
4. ``wrong_shape``: the draft session receives a transposed tensor: the trainer's ``/update_weights``
   answers 500, the state reports the session's error, EndSession fails with ``failed``, the draft is
   destroyed, and the planner says RestartPod (never Resume).
5. ``dead_sender`` (NCCL): the trainer tells the engine of every verifier tensor and broadcasts half, then
   goes silent (a trainer that died mid-broadcast): vLLM blocks in the broadcast, the engine stops
   answering, and after the push deadline the planner says RestartPod, never Resume.
6. ``recover``: on the restarted server, a new transfer group (a new epoch) and a full push of both
   targets: digests equal the files' (the next revision recovers the pod).

Run on the lent H200 (docs/gpu.md, ../shared/gpu/README.md). Here, once: ``scripts/gpu/run-device-suite.sh
prepare`` (builds ``.device-carry/``). Then, the second call within 30 s of the first:

1. ``run`` carry ``[".device-carry/1"]``, command ``bash scripts/gpu/run-device-suite.sh stage1``
2. ``run`` carry ``[".device-carry/2"]``, command ``python3 scripts/gpu/push_proof.py --out $OUT``
   (~4-6 min: it unpacks the vLLM carry into /tmp/site if needed and re-executes itself with it on
   ``PYTHONPATH``; two server starts of 40-80 s each). On a warm machine the second call alone suffices.

``--parts stale,cycles`` (no restart) or ``--parts abandon,wrong_shape`` split it over two calls. Exit
status 0 when every check passed; each check is listed in the JSON with what was seen.
"""

# A device-only test rig, like bench/ and tests/ (their lint exemptions are in pyproject.toml): fixed
# paths under /tmp for the carry, a throwaway token, loopback HTTP, a re-exec, blocking file I/O in main.
# ruff: noqa: S105, S108, S606, ASYNC240

from __future__ import annotations

import argparse
import asyncio
import base64
import dataclasses
import importlib.util
import json
import os
import pathlib
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any

REPO = pathlib.Path(__file__).resolve().parents[2]
SITE = pathlib.Path("/tmp/site")
PARTS = ("stale", "cycles", "abandon", "wrong_shape", "dead_sender", "recover")
IPC_PARTS = ("stale", "cycles", "abandon", "wrong_shape")
TOKEN = "push-proof-token"
# NCCL on one GPU (module docstring): loopback sockets, no InfiniBand, no NVLink multicast (device KINDS.md),
# and a host identity per process.
NCCL_COMMON = {"NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1", "NCCL_NVLS_ENABLE": "0"}
ENGINE_NCCL = {**NCCL_COMMON, "NCCL_HOSTID": "rolloutfleet-push-proof-engine"}
TRAINER_NCCL = {**NCCL_COMMON, "NCCL_HOSTID": "rolloutfleet-push-proof-trainer"}
GROUP_SIZE = 2  # the trainer (rank 0) and the one engine's one worker (TP 1)
SLEEP_PUSH_STEPS = [
    "Pause",
    "Sleep",
    "WakeWeights",
    "OpenVerifierSession",
    "AwaitPush",
    "EndSession",
    "OpenDraftSession",
    "AwaitPush",
    "EndSession",
    "Resume",
]


# -- bootstrap: the vLLM carry on PYTHONPATH (stdlib only up to here) ----------------------------------


def bootstrap() -> None:
    """Re-execute with the unpacked vLLM 0.26 carry on ``PYTHONPATH`` unless vLLM is importable already."""
    if importlib.util.find_spec("vllm") is not None:
        return
    if os.environ.get("PUSH_PROOF_REEXEC"):
        raise SystemExit("vllm is still not importable with the carry on PYTHONPATH")
    if not (SITE / "vllm").is_dir():
        carry = REPO / ".device-carry" / "2"
        if not carry.is_dir():
            raise SystemExit("no vLLM: pass carry .device-carry/2 (after stage1), or run where vLLM is installed")
        vc = pathlib.Path("/tmp/vc")
        vc.mkdir(parents=True, exist_ok=True)
        SITE.mkdir(parents=True, exist_ok=True)
        for f in carry.iterdir():
            shutil.copy(f, vc / f.name)
        script = (
            "cat vllm026-site.tar.xz.part-? > vllm026-site.tar.xz && sha256sum -c vllm026-site.sha256 && "
            f"xz -dc vllm026-site.tar.xz | tar -x -C {SITE}"
        )
        subprocess.run(["bash", "-c", script], cwd=vc, check=True)
    paths = [str(SITE), *(str(REPO / d) for d in ("operator", "worker_image", "digest", "tests/gpu"))]
    env = {
        **os.environ,
        "PYTHONPATH": ":".join([*paths, os.environ.get("PYTHONPATH", "")]).rstrip(":"),
        "PUSH_PROOF_REEXEC": "1",
    }
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


# -- the vLLM server -----------------------------------------------------------------------------------


def start_server(root: pathlib.Path, log: pathlib.Path, verifier: str, draft: str, backend: str) -> Any:
    """``vllm serve`` from the command line the operator renders for a fleet with this weight-transfer
    backend (``weightTransfer: {backend: ...}``: the flag, and for IPC VLLM_ALLOW_INSECURE_SERIALIZATION,
    come from the rendering, as in a pod); waits for /health."""
    import gpu_support

    root.mkdir(parents=True, exist_ok=True)
    first: list[str] = []
    if importlib.util.find_spec("ray") is None:
        # vLLM 0.26's ipc_engine imports ray at module level; only its ray sender uses it (shared/gpu).
        stub = root / "stubs"
        stub.mkdir(exist_ok=True)
        (stub / "ray.py").write_text("")
        first.append(str(stub))
    server = gpu_support.start_server(
        verifier,
        draft,
        root,
        log,
        gpu_memory_utilization=0.25,
        token=TOKEN,
        transfer_backend=backend,
        python_path=first,
        env=ENGINE_NCCL if backend == "nccl" else None,
    )
    server.started_s = round(server.started_s, 1)
    return server


# -- the trainer ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class Trainer:
    """Sends a target's tensors into the open session it is shown, then marks the goal (its annotation).

    ``sources``: revision -> {"verifier": dir, "draft": dir} (the checkpoint whose tensors it holds);
    ``silent``: never sends (a trainer that died); ``wrong_shape``: the draft tensor to send transposed;
    ``sender``: NCCL only, the push client's ``NcclSender`` of this server's group; ``partial``: NCCL only,
    announce every tensor, broadcast half, then go silent (a trainer that died mid-broadcast).
    """

    url: str
    sources: dict[int, dict[str, str]]
    silent: bool = False
    wrong_shape: str | None = None
    sender: Any = None
    partial: bool = False
    sends: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    served: set[tuple[str, int]] = dataclasses.field(default_factory=set)
    joins: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    background: list[Any] = dataclasses.field(default_factory=list)

    async def serve(self, goal: Any, session: Any) -> Any:
        from rolloutfleet.api.engine import Target

        if goal.push.group_epoch is not None and goal.push.rendezvous is None:
            return self.join(goal)
        if self.silent or session is None or session.error is not None:
            return goal
        target = str(session.target)
        if (target, session.epoch) in self.served:
            return goal  # sent once per session, as the trainer does (then it waits for the operator)
        self.served.add((target, session.epoch))
        directory = self.sources[goal.revision][target]
        tensors = load_tensors(directory)
        if target == "draft" and self.wrong_shape is not None:
            tensors = [(n, t.t().contiguous() if n == self.wrong_shape else t) for n, t in tensors]
        started = time.monotonic()
        if self.sender is None:
            status, body = await post_update(self.url, tensors)
        else:
            status, body = await self.broadcast(target, tensors)
        took = time.monotonic() - started
        self.sends.append(
            {
                "target": target,
                "epoch": session.epoch,
                "revision": goal.revision,
                "tensors": len(tensors),
                "bytes": sum(t.numel() * t.element_size() for _, t in tensors),
                "status": status,
                "body": body[:300],
                "seconds": round(took, 4),
            }
        )
        del tensors  # every engine answered: the IPC handles may go
        if status is None:
            return goal  # died mid-broadcast: nothing marked, nothing annotated
        if status != 200:
            marks = dataclasses.replace(goal.push, error=f"/update_weights answered {status}")
        elif session.target == Target.VERIFIER:
            marks = dataclasses.replace(goal.push, verifier_epoch=session.epoch)
        else:
            marks = dataclasses.replace(goal.push, draft_epoch=session.epoch)
        return dataclasses.replace(goal, push=marks)

    def join(self, goal: Any) -> Any:
        """The operator waits for a rendezvous: be rank 0 of the goal's group (what the push client's
        ``_join`` does), or say where this sender already is rank 0 of it."""
        epoch = goal.push.group_epoch
        if self.sender.group_epoch == epoch:
            address = self.sender.rendezvous_address()
        else:
            address = self.sender.join_group(epoch, GROUP_SIZE)
            self.joins.append({"epoch": epoch, "address": address, "at": round(time.monotonic(), 3)})
        return dataclasses.replace(goal, push=dataclasses.replace(goal.push, rendezvous=address))

    async def broadcast(self, target: str, tensors: list[tuple[str, Any]]) -> tuple[int | None, str]:
        """NCCL: the session's tensors by ``senders.deliver`` (this engine's post and the group's broadcast
        at once); ``(None, "")`` when ``partial`` left it in the background."""
        from rolloutfleet.trainer.senders import deliver

        address = self.url.removeprefix("http://")
        prepared = self.sender.prepare(tensors, target)
        if self.partial:
            # The engine is told of every tensor; the broadcast carries half. Left running: the engine waits
            # for the rest inside NCCL, and this "dead" trainer never answers for it.
            prepared.keepalive = prepared.keepalive[: len(prepared.keepalive) // 2]
            self.background.append(
                asyncio.create_task(asyncio.to_thread(deliver, self.sender, [address], TOKEN, prepared, 30.0, 1))
            )
            return None, ""
        (error,) = await asyncio.to_thread(deliver, self.sender, [address], TOKEN, prepared, 120.0, 1)
        self.sender.release(prepared)
        if error is None:
            return 200, ""
        head = error.split(":", 1)[0].split()
        return (int(head[1]) if len(head) == 2 and head[0] == "HTTP" and head[1].isdigit() else 0), error


def load_tensors(directory: str) -> list[tuple[str, Any]]:
    """The checkpoint's tensors on the GPU, in file then name order: what a trainer holding them sends."""
    from safetensors.torch import load_file

    out: list[tuple[str, Any]] = []
    for f in sorted(pathlib.Path(directory).glob("*.safetensors")):
        out.extend(sorted(load_file(str(f), device="cuda:0").items()))
    return out


def ipc_update_info(tensors: list[tuple[str, Any]]) -> dict[str, Any]:
    """vLLM's IPC ``update_info`` over HTTP: one ``{gpu_uuid: rebuild args}`` per tensor, pickled."""
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    uuid = str(torch.cuda.get_device_properties(0).uuid)
    handles = [{uuid: reduce_tensor(t)[1]} for _, t in tensors]
    return {
        "names": [n for n, _ in tensors],
        "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in tensors],
        "shapes": [list(t.shape) for _, t in tensors],
        "ipc_handles_pickled": base64.b64encode(pickle.dumps(handles)).decode(),
    }


async def post_update(url: str, tensors: list[tuple[str, Any]]) -> tuple[int, str]:
    import aiohttp
    import torch

    torch.cuda.synchronize()  # the bytes are in place before the engine reads them
    body = {"update_info": ipc_update_info(tensors)}
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s,
        s.post(url + "/update_weights", json=body, headers=headers) as resp,
    ):
        return resp.status, await resp.text()


# -- the operator's per-pod loop -----------------------------------------------------------------------


class Epochs:
    """One new epoch per opened session (the operator keeps this counter in the revision's status)."""

    def __init__(self) -> None:
        self.last = 0

    def next(self) -> int:
        self.last += 1
        return self.last


@dataclasses.dataclass
class Run:
    steps: list[str] = dataclasses.field(default_factory=list)
    decisions: list[list[str]] = dataclasses.field(default_factory=list)
    errors: list[dict[str, str]] = dataclasses.field(default_factory=list)
    final: str = ""
    goal: Any = None
    seconds: float = 0.0

    def summary(self, decisions: int) -> dict[str, Any]:
        """What a part records of a run: its steps, its last ``decisions`` decisions, errors, verdict, time."""
        keep = {"decisions": self.decisions[-decisions:], "errors": self.errors}
        return {"steps": self.steps, **keep, "final": self.final, "seconds": self.seconds}


async def drive(
    client: Any,
    goal: Any,
    trainer: Trainer | None,
    epochs: Epochs,
    *,
    stop_at: tuple[str, ...] = ("Done", "RestartPod"),
    max_decisions: int = 200,
    poll: float = 0.25,
    spec: Any = None,
) -> Run:
    """observe → next_step → execute (the trainer serving AwaitPush) until a verdict in ``stop_at``.

    ``spec``: NCCL only, the fleet spec whose ``init_info`` a JoinGroup sends (``reconcile.push.init_info``,
    the engine being ranks 1.. of a group of ``GROUP_SIZE``). An engine unreachable during a push for the
    goal's push deadline is RestartPod, as ``reconcile.rollout_pass`` decides it (a blocked transfer only
    ends with the process)."""
    from rolloutfleet.api.engine import GroupMembership
    from rolloutfleet.api.fleet import StepTimeouts
    from rolloutfleet.planning import transaction
    from rolloutfleet.reconcile import executor
    from rolloutfleet.reconcile import push as push_rules

    timeouts = StepTimeouts()
    run = Run(goal=goal)
    started = time.monotonic()
    epoch = 0
    unreachable_since: float | None = None
    for _ in range(max_decisions):
        state = await client.observe()
        decision = transaction.next_step(run.goal, state)
        step = decision.step
        run.decisions.append([step.value, decision.reason[:300]])
        if step == transaction.Step.UNREACHABLE and run.goal.pushed:
            now = time.monotonic()
            unreachable_since = now if unreachable_since is None else unreachable_since
            if now - unreachable_since >= run.goal.push.deadline_s:
                run.decisions.append(["RestartPod", f"unreachable for {now - unreachable_since:.0f}s during a push"])
                run.final = "RestartPod"
                break
            await asyncio.sleep(poll)
            continue
        unreachable_since = None
        if step.value in stop_at:
            run.final = step.value
            break
        if step == transaction.Step.AWAIT_PUSH:
            if not run.steps or run.steps[-1] != "AwaitPush":
                run.steps.append("AwaitPush")
            served = await trainer.serve(run.goal, state.session) if trainer is not None else run.goal
            if served is run.goal:
                await asyncio.sleep(poll)
            run.goal = served
            continue
        if step not in transaction.ACTIONS or step == transaction.Step.RESTART_POD:
            run.final = step.value
            break
        if step in (transaction.Step.OPEN_VERIFIER_SESSION, transaction.Step.OPEN_DRAFT_SESSION):
            epoch = epochs.next()
        member = init_info = None
        if step == transaction.Step.JOIN_GROUP:
            member = GroupMembership(epoch=run.goal.push.group_epoch, rank_offset=1, world_size=GROUP_SIZE)
            init_info = push_rules.init_info(spec, member, run.goal.push.rendezvous)
        # ``known``: the state this decision was made on, as the pass hands it (the resume's guard and stamp).
        ctx = executor.SessionContext(
            epoch=epoch, session=state.session, init_info=init_info, why=decision.reason, group=member, known=state
        )
        run.steps.append(step.value)
        try:
            await executor.execute(client, step, run.goal, timeouts, ctx)
        except executor.StepError as exc:
            run.errors.append({"step": step.value, "reason": exc.reason, "message": str(exc)[:400]})
    else:
        run.final = "TooManyDecisions"
    run.seconds = round(time.monotonic() - started, 3)
    return run


def push_goal(
    revision: int, digests: dict[str, str], verifier: str, draft: str | None, ctx: dict[str, Any], **kw: Any
) -> Any:
    """The goal the operator derives from a pushed WeightRevision (digests pinned by the trainer); over
    NCCL it names the server's transfer group (``ctx["group_epoch"]``)."""
    from rolloutfleet.planning import transaction

    if ctx.get("group_epoch") is not None:
        sender = ctx["sender"]
        # The trainer annotates each revision with its rendezvous once it is rank 0 of the group (push._join):
        # a later revision starts with it; the first waits for the trainer to join.
        known = sender.rendezvous_address() if sender.group_epoch == ctx["group_epoch"] else None
        kw["push"] = transaction.PushMarks(group_epoch=ctx["group_epoch"], rendezvous=known)
    return transaction.Goal(
        revision=revision,
        verifier_path=None,
        verifier_pushed=True,
        verifier_digest=digests[verifier],
        draft_pushed=draft is not None,
        draft_digest=digests[draft] if draft is not None else None,
        draft_method="draft_model" if draft is not None else None,
        **kw,
    )


async def push_run(
    ctx: dict[str, Any],
    trainer: Trainer,
    revision: int,
    verifier: str,
    draft: str | None,
    *,
    deadline: float | None = None,
    **kw: Any,
) -> Run:
    """``drive`` a pushed revision of ``verifier`` and ``draft`` (directories) on the server of ``ctx``;
    ``deadline``: how long its sessions wait for the trainer (the goal's default otherwise)."""
    goal = push_goal(revision, ctx["digests"], verifier, draft, ctx, **kw)
    if deadline is not None:
        goal = dataclasses.replace(goal, push=dataclasses.replace(goal.push, deadline_s=deadline))
    return await drive(ctx["client"], goal, trainer, ctx["epochs"], spec=ctx["spec"])


def path_goal(revision: int, digests: dict[str, str], verifier: str, draft: str, *, sleep_mode: bool) -> Any:
    from rolloutfleet.planning import transaction

    return transaction.Goal(
        revision=revision,
        verifier_path=verifier,
        verifier_digest=digests[verifier],
        draft_path=draft,
        draft_digest=digests[draft],
        draft_method="draft_model",
        sleep_mode=sleep_mode,
    )


# -- the experiments -----------------------------------------------------------------------------------


class Checks:
    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []

    def __call__(self, name: str, ok: bool, seen: Any = None) -> bool:
        self.items.append({"check": name, "ok": bool(ok), "seen": seen})
        print(("PASS " if ok else "FAIL ") + name + ("" if ok else f": {seen!r}"[:400]), flush=True)
        return bool(ok)

    @property
    def passed(self) -> bool:
        return all(i["ok"] for i in self.items)


def state_summary(state: Any) -> dict[str, Any]:
    d = state.draft
    s = state.session
    return {
        "paused": state.paused,
        "resident": state.resident,
        "shared_tensors": list(state.shared_tensors),
        "verifier": [state.verifier.revision, state.verifier.digest, state.verifier.destroyed],
        "draft": None if d is None else [d.revision, d.digest, d.destroyed],
        "session": None if s is None else dataclasses.asdict(s) | {"target": str(s.target)},
        "error": state.error,
    }


async def stale(ctx: dict[str, Any], checks: Checks) -> dict[str, Any]:
    import gpu_support

    client, revs, digests, url, epochs = ctx["client"], ctx["revs"], ctx["digests"], ctx["url"], ctx["epochs"]
    batch = gpu_support.prompts(4)
    out: dict[str, Any] = {}
    run = await drive(client, path_goal(100, digests, revs.verifier_a, revs.draft_a, sleep_mode=False), None, epochs)
    out["path_a"] = {"steps": run.steps, "final": run.final, "errors": run.errors}
    out["acceptance_a"] = await gpu_support.acceptance(url, batch)

    trainer = Trainer(url, {101: {"verifier": revs.verifier_b, "draft": revs.draft_b}}, sender=ctx["sender"])
    run = await push_run(ctx, trainer, 101, revs.verifier_b, None, sleep_mode=False)
    state = await client.observe()
    out["verifier_only_push"] = {"steps": run.steps, "final": run.final, "errors": run.errors, "sends": trainer.sends}
    checks("stale: verifier-only push runs its session and resumes", run.steps[-1:] == ["Resume"], run.steps)
    if ctx.get("group_epoch") is not None:
        out["joins"] = trainer.joins
        checks(
            "stale: the engine joined the trainer's transfer group (JoinGroup) before its first session",
            run.steps.index("JoinGroup") < run.steps.index("OpenVerifierSession")
            and state.group is not None
            and state.group.epoch == ctx["group_epoch"],
            [run.steps, state_summary(state), trainer.joins],
        )
    checks(
        "stale: the pushed verifier's digest is the files'",
        state.verifier.digest == digests[revs.verifier_b],
        state_summary(state),
    )
    out["acceptance_stale"] = await gpu_support.acceptance(url, batch)

    trainer.sends.clear()
    run = await push_run(ctx, trainer, 101, revs.verifier_b, revs.draft_b, sleep_mode=False)
    state = await client.observe()
    out["draft_push"] = {"steps": run.steps, "final": run.final, "errors": run.errors, "sends": trainer.sends}
    checks(
        "stale: the draft session alone follows (the verifier is kept)",
        run.steps == ["Pause", "OpenDraftSession", "AwaitPush", "EndSession", "Resume"],
        run.steps,
    )
    checks(
        "stale: both digests are the files'",
        state.verifier.digest == digests[revs.verifier_b]
        and state.draft is not None
        and state.draft.digest == digests[revs.draft_b],
        state_summary(state),
    )
    out["acceptance_fixed"] = await gpu_support.acceptance(url, batch)
    rates = [out[k]["rate"] for k in ("acceptance_a", "acceptance_stale", "acceptance_fixed")]
    checks("stale: acceptance ~1 -> ~0 -> ~1", rates[0] > 0.9 and rates[1] < 0.2 and rates[2] > 0.9, rates)
    return out


async def cycles(ctx: dict[str, Any], checks: Checks, count: int) -> dict[str, Any]:
    import gpu_support

    client, revs, digests, url, epochs = ctx["client"], ctx["revs"], ctx["digests"], ctx["url"], ctx["epochs"]
    batch = gpu_support.prompts()
    expected_a = ctx["fresh_outputs_a"]  # the fresh server's own load of the A pair
    run = await drive(client, path_goal(199, digests, revs.verifier_b, revs.draft_b, sleep_mode=False), None, epochs)
    expected_b = await gpu_support.generate(url, batch)
    out: dict[str, Any] = {"path_b_steps": run.steps, "cycles": []}
    checks("cycles: A and B differ (the comparison means something)", expected_a != expected_b)
    sources = {}
    for k in range(count):  # the engine holds B after the path load: start with A
        v, d = (revs.verifier_b, revs.draft_b) if k % 2 else (revs.verifier_a, revs.draft_a)
        sources[300 + k] = {"verifier": v, "draft": d}
    trainer = Trainer(url, sources, sender=ctx["sender"])
    for k in range(count):
        revision = 300 + k
        v, d = sources[revision]["verifier"], sources[revision]["draft"]
        trainer.sends.clear()
        run = await push_run(ctx, trainer, revision, v, d, sleep_mode=True)
        state = await client.observe()
        outputs = await gpu_support.generate(url, batch)
        pair = "B" if v == revs.verifier_b else "A"
        same = outputs == (expected_b if pair == "B" else expected_a)
        digests_ok = (
            state.verifier.digest == digests[v] and state.draft is not None and state.draft.digest == digests[d]
        )
        out["cycles"].append(
            {
                "revision": revision,
                "pair": pair,
                "steps": run.steps,
                "seconds": run.seconds,
                "errors": run.errors,
                "sends": list(trainer.sends),
                "digests_equal_files": digests_ok,
                "tokens_equal_path_load": same,
            }
        )
        checks(f"cycles[{k}] {pair}: steps", run.steps == SLEEP_PUSH_STEPS and run.final == "Done", run.steps)
        checks(f"cycles[{k}] {pair}: digests equal the files'", digests_ok, state_summary(state))
        checks(f"cycles[{k}] {pair}: output token-identical to the path load", same, outputs[0][:8])
    return out


async def abandon(ctx: dict[str, Any], checks: Checks, deadline: float) -> dict[str, Any]:
    from rolloutfleet.planning import transaction

    client, revs, url = ctx["client"], ctx["revs"], ctx["url"]
    trainer = Trainer(url, {400: {"verifier": revs.verifier_b}}, silent=True, sender=ctx["sender"])
    run = await push_run(ctx, trainer, 400, revs.verifier_b, None, deadline=deadline, sleep_mode=False)
    state = await client.observe()
    later = [transaction.next_step(run.goal, await client.observe()).step.value for _ in range(3)]
    out = {**run.summary(6), "state": state_summary(state), "later_decisions": later}
    checks("abandon: the session is abandoned after the deadline", "AbandonSession" in run.steps, run.steps)
    checks(
        "abandon: the abandon step fails PushAbandoned",
        any(e["reason"] == "PushAbandoned" for e in run.errors),
        run.errors,
    )
    checks("abandon: the verifier reads destroyed", state.verifier.destroyed and state.destroyed, state_summary(state))
    checks(
        "abandon: the planner says RestartPod, never Resume", run.final == "RestartPod" and "Resume" not in later, later
    )
    return out


async def wrong_shape(ctx: dict[str, Any], checks: Checks) -> dict[str, Any]:
    from rolloutfleet.planning import transaction

    client, revs, url = ctx["client"], ctx["revs"], ctx["url"]
    trainer = Trainer(
        url,
        {500: {"verifier": revs.verifier_b, "draft": revs.draft_b}},
        wrong_shape="model.layers.0.mlp.down_proj.weight",
        sender=ctx["sender"],
    )
    run = await push_run(ctx, trainer, 500, revs.verifier_b, revs.draft_b, sleep_mode=False)
    state = await client.observe()
    later = [transaction.next_step(run.goal, await client.observe()).step.value for _ in range(3)]
    statuses = [s["status"] for s in trainer.sends]
    out = {
        "steps": run.steps,
        "decisions": run.decisions,
        "errors": run.errors,
        "sends": trainer.sends,
        "final": run.final,
        "state": state_summary(state),
        "later_decisions": later,
    }
    checks("wrong_shape: the verifier session succeeded, the draft send got 500", statuses == [200, 500], trainer.sends)
    checks(
        "wrong_shape: the state reported the session's error before it ended",
        any("failed" in r for _, r in run.decisions),
        run.decisions,
    )
    checks(
        "wrong_shape: EndSession fails with the extension's `failed`",
        any(e["step"] == "EndSession" and e["reason"] == "ExtensionFailed" for e in run.errors),
        run.errors,
    )
    checks(
        "wrong_shape: the draft reads destroyed, the verifier not",
        state.draft is not None and state.draft.destroyed and not state.verifier.destroyed,
        state_summary(state),
    )
    checks(
        "wrong_shape: the planner says RestartPod, never Resume",
        run.final == "RestartPod" and "Resume" not in later,
        later,
    )
    return out


async def dead_sender(ctx: dict[str, Any], checks: Checks, deadline: float) -> dict[str, Any]:
    revs, url = ctx["revs"], ctx["url"]
    trainer = Trainer(url, {600: {"verifier": revs.verifier_b}}, sender=ctx["sender"], partial=True)
    run = await push_run(ctx, trainer, 600, revs.verifier_b, None, deadline=deadline, sleep_mode=False)
    out = {**run.summary(8), "joins": trainer.joins}
    decided = [d for d, _ in run.decisions]
    checks("dead_sender: the engine stopped answering inside the broadcast", "Unreachable" in decided, run.decisions)
    checks(
        "dead_sender: after the push deadline the planner says RestartPod, never Resume",
        run.final == "RestartPod" and "Resume" not in run.steps,
        [run.final, run.steps],
    )
    return out


async def recover(ctx: dict[str, Any], checks: Checks) -> dict[str, Any]:
    client, revs, digests, url = ctx["client"], ctx["revs"], ctx["digests"], ctx["url"]
    trainer = Trainer(url, {700: {"verifier": revs.verifier_b, "draft": revs.draft_b}}, sender=ctx["sender"])
    run = await push_run(ctx, trainer, 700, revs.verifier_b, revs.draft_b, sleep_mode=True)
    state = await client.observe()
    out = {"steps": run.steps, "final": run.final, "errors": run.errors, "sends": trainer.sends, "joins": trainer.joins}
    checks("recover: the restarted engine runs the whole push and resumes", run.final == "Done", run.steps)
    if ctx.get("group_epoch") is not None:
        checks(
            "recover: a new transfer group (new epoch) was formed for the new process",
            "JoinGroup" in run.steps and state.group is not None and state.group.epoch == ctx["group_epoch"],
            [run.steps, state_summary(state)],
        )
    checks(
        "recover: both digests are the files'",
        state.verifier.digest == digests[revs.verifier_b]
        and state.draft is not None
        and state.draft.digest == digests[revs.draft_b]
        and not state.destroyed,
        state_summary(state),
    )
    return out


# -- main ----------------------------------------------------------------------------------------------


async def main(args: argparse.Namespace) -> int:
    import gpu_support
    import torch
    import vllm

    from rolloutfleet.adapters.engine import EnginePool, ResetPolicy, RetryPolicy
    from rolloutfleet_digest import digest_directory

    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = pathlib.Path(tempfile.mkdtemp(prefix="push-proof-"))
    torch.cuda.set_device(0)
    revs = gpu_support.make_tiny_revisions(work / "weights")
    digests = {p: digest_directory(p) for p in (revs.verifier_a, revs.verifier_b, revs.draft_a, revs.draft_b)}
    checks = Checks()
    result: dict[str, Any] = {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0),
        "digests": {pathlib.Path(p).name: d for p, d in digests.items()},
        "servers": [],
    }
    parts = [p for p in (args.parts or ",".join(PARTS if args.backend == "nccl" else IPC_PARTS)).split(",") if p]
    result["backend"] = args.backend
    if args.backend == "nccl":
        os.environ.update(TRAINER_NCCL)  # read by NCCL when this process's first communicator forms
        result["nccl_env"] = {"trainer": TRAINER_NCCL, "engine": ENGINE_NCCL}
    spec = gpu_support.fleet_spec(
        revs.verifier_a, revs.draft_a, gpu_memory_utilization=0.25, transfer_backend=args.backend
    )
    epochs = Epochs()
    server = None
    started = 0

    def fresh_server() -> Any:
        nonlocal started
        started += 1
        log = out_dir / f"vllm-push-{args.backend}-{started}.log"
        srv = start_server(work / f"server-{started}", log, revs.verifier_a, revs.draft_a, args.backend)
        result["servers"].append({"log": log.name, "start_s": srv.started_s})
        return srv

    try:
        async with EnginePool(
            token=TOKEN, retry=RetryPolicy(attempts=2, base_delay=0.05), reset=ResetPolicy(attempts=50)
        ) as pool:
            fresh_outputs: list[list[int]] = []
            sender: Any = None
            for part in parts:
                if server is None:
                    server = fresh_server()
                    if args.backend == "nccl":
                        # One group per engine process (a restarted pod gets a new epoch), one rank 0 each.
                        from rolloutfleet.trainer import NcclSender

                        sender = NcclSender("127.0.0.1", packed=False, join_timeout=120.0)
                    # What the fresh server serves with the A pair it loaded itself: the A reference.
                    fresh_outputs = await gpu_support.generate(server.url, gpu_support.prompts())
                ctx = {
                    "client": pool.client(server.url),
                    "revs": revs,
                    "digests": digests,
                    "url": server.url,
                    "epochs": epochs,
                    "spec": spec,
                    "sender": sender,
                    "group_epoch": started if args.backend == "nccl" else None,
                }
                ctx["fresh_outputs_a"] = fresh_outputs
                print(f"== {part}", flush=True)
                try:
                    if part == "stale":
                        result[part] = await stale(ctx, checks)
                    elif part == "cycles":
                        result[part] = await cycles(ctx, checks, args.cycles)
                    elif part == "abandon":
                        result[part] = await abandon(ctx, checks, args.push_deadline)
                    elif part == "wrong_shape":
                        result[part] = await wrong_shape(ctx, checks)
                    elif part == "dead_sender":
                        result[part] = await dead_sender(ctx, checks, args.push_deadline * 5)
                    elif part == "recover":
                        result[part] = await recover(ctx, checks)
                    else:
                        raise SystemExit(f"unknown part {part!r} (parts: {', '.join(PARTS)})")
                except Exception as exc:  # record and go on with the next part
                    checks(f"{part}: ran without an exception", False, traceback.format_exc()[-2000:])
                    result[part] = {"exception": f"{type(exc).__name__}: {exc}"}
                if part in ("abandon", "wrong_shape", "dead_sender"):
                    # RestartPod: the operator deletes the pod; the StatefulSet recreates it on its initial weights.
                    server.stop()
                    server = None
    finally:
        if server is not None:
            server.stop()
        result["checks"] = checks.items
        result["passed"] = checks.passed
        for log in sorted(out_dir.glob(f"vllm-push-{args.backend}-*.log")):
            text = log.read_text(errors="replace")
            lines = [line for line in text.splitlines() if "rolloutfleet:" in line]
            result.setdefault("extension_log", {})[log.name] = lines[-60:]
        (out_dir / f"push-proof-{args.backend}.json").write_text(json.dumps(result, indent=1, default=str))
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    passed = sum(i["ok"] for i in checks.items)
    print(f"{passed}/{len(checks.items)} checks passed; {out_dir / f'push-proof-{args.backend}.json'}")
    return 0 if checks.passed else 1


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "bench" / "results" / "push-proof"))
    parser.add_argument("--backend", choices=("ipc", "nccl"), default="ipc", help="the fleet's weight transfer")
    parser.add_argument(
        "--parts", default="", help=f"comma-separated, from {', '.join(PARTS)} (default: all the backend has)"
    )
    parser.add_argument("--cycles", type=int, default=10)
    parser.add_argument("--push-deadline", type=float, default=3.0, help="seconds a session waits (abandon part)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (checkpoints, token)")
    return parser.parse_args()


if __name__ == "__main__":
    arguments = parse()
    bootstrap()
    sys.path[:0] = [str(REPO / d) for d in ("operator", "worker_image", "digest", "tests/gpu")]
    sys.exit(asyncio.run(main(arguments)))
