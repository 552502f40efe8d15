"""``rolloutfleet sim serve``: run simulated vLLM engines (GPU-free) on loopback addresses until stopped.

Called through ``rolloutfleet.cli`` by the sandbox demo, by hand and by the benchmarks. Examples::

    rolloutfleet sim serve --ip 127.1.0.5 --ip 127.1.0.6 --token-file token --admin-port 9900
    rolloutfleet sim serve --range 127.1.0.1-127.1.3.232 --port 8000 --config sim.json

``--config`` is JSON (see ``rolloutfleet.sim.config``): ``defaults`` (an ``EngineSpec``), ``weights``
(``WeightsConfig``: the synthetic root and model sizes), ``latencies`` and ``faults`` (each optionally
narrowed to one engine with ``"engine": "IP:PORT"``). One line of JSON on stdout says when every engine
listens: ``{"ready": true, "engines": N, "admin": URL}``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import pathlib
import signal
import sys
from typing import Any, NamedTuple

from rolloutfleet.sim.config import EngineSpec, FaultRule, Latencies, WeightsConfig
from rolloutfleet.sim.fleet import SimulatedFleet


def register(parser: argparse.ArgumentParser) -> None:
    """Add ``sim``'s arguments (one verb today: ``serve``)."""
    sub = parser.add_subparsers(dest="sim_command", metavar="VERB", required=True)
    serve = sub.add_parser("serve", help="serve simulated engines until interrupted")
    serve.add_argument("--ip", action="append", default=[], help="a loopback address to serve (repeatable)")
    serve.add_argument("--range", dest="ip_range", help="an inclusive loopback range, e.g. 127.1.0.1-127.1.3.232")
    serve.add_argument("--port", type=int, default=8000, help="the port of every engine (default 8000)")
    serve.add_argument("--token-file", help="file holding the control bearer token (default: no auth)")
    serve.add_argument("--config", help="JSON file: defaults, weights, latencies, faults")
    serve.add_argument("--admin-port", type=int, default=None, help="serve the admin API on 127.0.0.1:PORT")


def expand_range(text: str) -> list[str]:
    """``A-B`` (inclusive) as a list of addresses; both ends must be loopback."""
    first, _, last = text.partition("-")
    lo, hi = ipaddress.IPv4Address(first.strip()), ipaddress.IPv4Address((last or first).strip())
    if not (lo.is_loopback and hi.is_loopback) or hi < lo:
        raise ValueError(f"not a loopback range: {text}")
    return [str(ipaddress.IPv4Address(i)) for i in range(int(lo), int(hi) + 1)]


class ServePlan(NamedTuple):
    fleet: SimulatedFleet
    addresses: list[tuple[str, int]]
    faults: list[tuple[str | None, FaultRule]]  # (engine key or None for all, rule)


def build(args: argparse.Namespace) -> ServePlan:
    """The fleet, addresses and faults ``args`` describe (nothing listens yet)."""
    config: dict[str, Any] = json.loads(pathlib.Path(args.config).read_text()) if args.config else {}
    token = pathlib.Path(args.token_file).read_text().strip() if args.token_file else None
    fleet = SimulatedFleet(
        token=token or None,
        spec=EngineSpec.from_dict(config.get("defaults")),
        weights=WeightsConfig.from_dict(config.get("weights")),
        latencies=Latencies.from_dict(config.get("latencies")),
        admin_port=args.admin_port,
    )
    ips = list(args.ip) + (expand_range(args.ip_range) if args.ip_range else [])
    if not ips:
        raise ValueError("give --ip or --range")
    faults = [(f.get("engine"), FaultRule.from_dict(f)) for f in config.get("faults") or []]
    return ServePlan(fleet, [(ip, args.port) for ip in ips], faults)


async def _serve(plan: ServePlan) -> None:
    fleet = plan.fleet
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    async with fleet:
        await fleet.add_many(plan.addresses)
        for key, rule in plan.faults:
            fleet.add_fault(rule, key=key)
        print(json.dumps({"ready": True, "engines": len(fleet.engines), "admin": fleet.admin_url}), flush=True)
        await stop.wait()


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM; exit 2 on a bad configuration, 1 when an address cannot be bound."""
    try:
        plan = build(args)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"rolloutfleet sim: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_serve(plan))
    except OSError as exc:
        print(f"rolloutfleet sim: cannot listen: {exc}", file=sys.stderr)
        return 1
    return 0
